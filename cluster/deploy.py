"""Launching and finding a deployment: what ``mirrorspec serve``, ``scale`` and ``status`` call."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable

import psutil
import ray

from ray.exceptions import ActorAlreadyExistsError, AuthenticationError
from ray.experimental import internal_kv

from cluster.controller import Controller, checkpoint_key, named_actor, own_error, stop_replicas_by_name
from cluster.local_ray import why_silent
from cluster.spec import CONTROLLER_NAMESPACE, POOLS, StackSpec
from mirrorspec.config import InvalidRequest

# how long a replica may stay unplaced before `serve` says why it waits
UNPLACED_NOTICE_AFTER_S = 10.0


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a local one sized for this machine that
    advertises both roles (every replica fits on it, as on a one-node cluster)."""
    if ray.is_initialized():
        return
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, namespace=CONTROLLER_NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
        except AuthenticationError as err:  # it runs, and wants a token: Ray's message says where to put it
            raise InvalidRequest(f"the Ray cluster at {address!r} refused this machine's credentials: {err}",
                                 field="address") from None
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise InvalidRequest(f"cannot join the Ray cluster at {address!r} ({err}); is one running? "
                                 f"`mirrorspec serve` starts a local one, `ray start --head` or "
                                 f"`ray up cluster/<config>.yaml` a real one{_token_hint()}", field="address") from None
        return
    _start_local_ray(num_cpus or len(os.sched_getaffinity(0)))


def _token_hint() -> str:
    """A head that `ray start --head` started where a token was kept (any local ``ray.init`` writes
    one) wants it, and Ray sends a token to a named address only where RAY_AUTH_MODE=token says so
    (deliberately: a mistyped host would get it). Refused, it retried for 20 s and failed as if no
    Ray ran there (a review's find)."""
    if os.environ.get("RAY_AUTH_MODE") or not os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        return ""
    return ("; if it runs with token authentication, send this machine's token (~/.ray/auth_token, "
            "the cluster's own): run with RAY_AUTH_MODE=token")


LOCAL_RAY_TRIES = 2
# how Ray says a start was late on a loaded machine, not wrong: the raylet's 30 s to register, and
# the GCS's 30 s to write its port file (RAY_gcs_server_port_wait_time_s; CI of stop 61 met it)
LATE_START_MESSAGES = ("timed out during startup", "Timed out waiting for file")
# a local Ray's slots per role (each replica, each target rank takes one): more than any deployment
# asks, so its CPUs are its one limit, as `serve` checks and `scale` says. They were its CPUs: with
# --num-cpus 2 --replica-cpus 0.25, a third drafter waited for good (a review's find).
LOCAL_ROLE_SLOTS = 100_000


def _start_local_ray(cpus: int) -> None:
    """"local": a Ray of our own even where RAY_ADDRESS is set or `ray start` runs one here (ray.init
    would join that one, and refuse num_cpus with a traceback). Ray gives a new node's raylet a
    fixed 30 s to register, and its GCS 30 s to write its port, and then fails the start; on a
    loaded 2-core machine each once missed that (CI of stops 55 and 61), so one more start, on
    fresh ports, is tried before the user sees it. Any other failure is raised at once."""
    for attempt in range(1, LOCAL_RAY_TRIES + 1):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            ray.init(address="local", num_cpus=cpus, resources={pool: LOCAL_ROLE_SLOTS for pool in POOLS},
                     include_dashboard=False, namespace=CONTROLLER_NAMESPACE, log_to_driver=False,
                     logging_level=logging.ERROR)
            return
        except Exception as err:
            ray.shutdown()
            _stop_processes_started_since(before)
            if attempt == LOCAL_RAY_TRIES or not any(late in str(err) for late in LATE_START_MESSAGES):
                raise
            logging.getLogger(__name__).warning("the local Ray did not start (%s); starting it again", err)


def _stop_processes_started_since(before: set[int], grace_s: float = 5.0) -> None:
    """Stop what a failed ``ray.init`` started. Ray fails a start whose raylet was late after it
    has launched its GCS and raylet but before it records the node, so ``ray.shutdown`` does not
    know them: they ran on beside the retry's Ray, on the machine whose load made the raylet
    late, as long as the process that started them (review of stop 55)."""
    started = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    for child in started:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(started, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=grace_s)


class AutoFindsASilentRay(InvalidRequest):
    """``--address auto`` took a Ray that does not answer: the fix is there (RAY_ADDRESS, a stale
    Ray), even where the user gave no --address."""


def _check_reachable(address: str) -> None:
    """ray.init retries an address that does not answer for minutes; say so in seconds instead.
    ``auto`` is probed where Ray would take it: RAY_ADDRESS, the last `ray start`'s record, or a
    ``gcs_server`` process on this machine, one in another network namespace included. A stale one
    of those hung `status` and `stop` for minutes behind Ray's own retry logs."""
    found = _where_auto_points() if address == "auto" else address
    if found is None or found.startswith("ray://"):
        return  # none found: ray.init says so at once, and connect() names the flag
    err = why_silent(found, timeout_s=5)
    if err is None:
        return
    if found != address:
        raise AutoFindsASilentRay(f"nothing answers at {found}, where 'auto' finds a Ray ({_auto_source()}); "
                                  f"{err}", field="address")
    raise InvalidRequest(f"nothing answers at {address!r} ({err}); pass the head's host:port "
                         f"(`ray start --head` prints it), 'auto' on a cluster node, or leave out --address "
                         f"to run a local Ray", field="address")


def _where_auto_points() -> str | None:
    """The host:port Ray's ``auto`` would join, or None where it finds none (or where Ray's private
    helper moved: then ray.init is left to find it, as before)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address("auto")
    except Exception:  # noqa: BLE001 - ConnectionError where no Ray runs; anything else is Ray's to say
        return None


def _auto_source() -> str:
    if os.environ.get("RAY_ADDRESS"):
        return "RAY_ADDRESS is set to it; unset it or point it at a running head"
    return ("a Ray process on this machine, perhaps one in another network namespace, or the last "
            "`ray start`'s record; stop that Ray, or pass --address host:port")


def deploy(spec: StackSpec, timeout_s: float = 600.0):
    """Start the detached controller and wait for its front door; returns (controller, address)."""
    taken = InvalidRequest(f"a deployment named {spec.name!r} already runs on this cluster; scale it with "
                           f"`mirrorspec scale`, or pick another --name", field="name")
    if deployed(spec.name):
        raise taken
    # restarted by Ray if its process dies, with the calls it was running retried (each is safe to
    # repeat); the new one adopts the replicas from its checkpoint (controller.py)
    try:
        controller = ray.remote(Controller).options(
            name=spec.controller_name, namespace=CONTROLLER_NAMESPACE, lifetime="detached", num_cpus=0,
            max_concurrency=32, max_restarts=-1, max_task_retries=-1).remote(spec)
    except ActorAlreadyExistsError:  # a serve of the same name started between the check and here
        raise taken from None
    node = ray.get_runtime_context().get_node_id()
    try:
        address = _started(controller, controller.start.remote(node, timeout_s))
    except BaseException as err:
        teardown(controller, spec.name)
        cause = own_error(err)  # e.g. the front door's port in use, without Ray's tracebacks around it
        if isinstance(cause, (InvalidRequest, TimeoutError)):
            raise cause from None
        raise
    return controller, address


def _started(controller, start, notice_after_s: float = UNPLACED_NOTICE_AFTER_S) -> str:
    """The front door's address once ``start`` returns. Meanwhile a replica that no node there is
    could hold is said once, on stderr: an autoscaler may add the node, or there may be none to
    add, and `serve` stood silent for all of --start-timeout (a Ray review)."""
    said: set[str] = set()
    while not ray.wait([start], timeout=notice_after_s)[0]:
        for line in ray.get(controller.unplaced.remote(), timeout=60):
            if line not in said:
                said.add(line)
                print(f"mirrorspec: waiting: {line} (an autoscaler may add such a node; Ctrl-C stops)",
                      file=sys.stderr, flush=True)
    return ray.get(start)


def find_controller(name: str = "mirrorspec"):
    try:
        return ray.get_actor(f"{name}-controller", namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        raise InvalidRequest(f"no mirrorspec deployment named {name!r} runs on this Ray cluster; start one "
                             f"with `mirrorspec serve`", field="name") from None


def deployed(name: str) -> bool:
    """Whether deployment ``name``'s controller still lives on this Ray (``teardown`` kills it last)."""
    try:
        find_controller(name)
    except InvalidRequest:
        return False
    return True


def drain_front_door(name: str, grace_s: float) -> None:
    """Deployment ``name``'s front door refuses new requests and lets those in flight finish, for up
    to ``grace_s``; ``teardown`` then stops the rest."""
    try:
        front = ray.get_actor(f"{name}-front-door", namespace=CONTROLLER_NAMESPACE)
        ray.get(front.drain.remote(grace_s), timeout=grace_s + 30)
    except (ValueError, ray.exceptions.RayActorError):  # gone: another stop tore the deployment down
        return


def teardown(controller, name: str, timeout_s: float = 60.0) -> None:
    """Stop every replica, then the controller. Two at once (a `mirrorspec stop` while `serve`
    gets its own signal) both end well: the one whose controller the other killed finds it done.
    A controller that does not answer within ``timeout_s`` is killed, and what it ran is stopped by
    name (it was killed with its replicas left running, detached, and `stop` ended in a traceback)."""
    wedged = False
    try:
        ray.get(controller.shutdown.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pass  # killed by the other teardown, after its shutdown
    except ray.exceptions.GetTimeoutError:
        wedged = True
    finally:
        ray.kill(controller, no_restart=True)
    if wedged:
        logging.getLogger(__name__).warning("deployment %r's controller did not stop within %g s; its replicas "
                                            "are stopped by name", name, timeout_s)
        if (front := named_actor(f"{name}-front-door")) is not None:
            ray.kill(front, no_restart=True)
        stop_replicas_by_name(name)
        internal_kv._internal_kv_del(checkpoint_key(name), namespace=CONTROLLER_NAMESPACE)


def ask_controller(name: str, call: Callable):
    """``call(controller)``'s result, for deployment ``name``; a deployment stopped meanwhile is
    named as such, not as a Ray traceback (a `scale` that a `mirrorspec stop` overtook)."""
    try:
        return ray.get(call(find_controller(name)))
    except ray.exceptions.RayActorError:
        raise InvalidRequest(f"deployment {name!r} was stopped meanwhile (`mirrorspec stop`)", field="name") from None
