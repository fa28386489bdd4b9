"""How serving ends: stop signals that unwind like Ctrl-C, the drain that lets requests in
flight finish, and the teardown of a deployment on Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable


def drain_and_tear_down(name: str, controller, grace_s: float) -> None:
    """How a deployment on Ray stops, from `serve` or `stop`: its front door drains for up to
    ``grace_s`` (a second Ctrl-C ends that), then every replica and the controller go."""
    from cluster.deploy import drain_front_door, teardown

    finish_in_flight(lambda: drain_front_door(name, grace_s), grace_s)
    teardown(controller, name)


@contextlib.contextmanager
def interrupted_by_termination():
    """SIGTERM and SIGHUP (a service manager's stop, a closed terminal) raise KeyboardInterrupt
    inside, as Ctrl-C does. ``deploy`` tears its detached controller down on any exception; killed
    by the default handlers instead, a deployment still starting stayed on the cluster, and the next
    ``serve`` found its name taken. A signal the process was started ignoring stays ignored: the
    `ray up` configs start `serve --detach` under nohup, to outlive the SSH session that starts it,
    and its SIGHUP would have torn the deployment down (a review's find)."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
              if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def wait_for_stop(gone: Callable[[], bool] = lambda: False, every_s: float = 2.0,
                  each_tick: Callable[[], None] = lambda: None) -> bool:
    """Until Ctrl-C, SIGTERM or SIGHUP, each ending serving alike: the caller then tears the
    deployment down (a closed terminal used to kill the process before that, leaving it running).
    False where ``gone()`` said first that the deployment was stopped from elsewhere (``mirrorspec
    stop``): nothing is left to tear down, and a ``serve`` left waiting would never end.
    ``each_tick`` runs every ``every_s`` meanwhile (``ReplicaEvents.print_new``)."""
    import threading

    tick = threading.Event()
    try:
        with interrupted_by_termination():
            while not gone():
                each_tick()
                tick.wait(every_s)
    except KeyboardInterrupt:
        return True
    return False


def finish_in_flight(drain: Callable[[], None], grace_s: float) -> None:
    """After the first stop signal, ``drain``: the front door refuses new requests and lets those in
    flight finish, for up to ``grace_s``, before the replicas stop (they used to be cut off at once,
    UNAVAILABLE mid-stream). A second signal ends the wait."""
    if grace_s <= 0:
        return
    print(f"mirrorspec: stopping: no new requests; those in flight have up to {grace_s:g} s to finish "
          "(Ctrl-C again stops at once)", flush=True)
    try:
        with interrupted_by_termination():
            drain()
    except KeyboardInterrupt:
        print("mirrorspec: stopping at once", flush=True)


def stopped_elsewhere(name: str) -> bool:
    """Whether deployment ``name`` is gone from its Ray; not where Ray cannot say just now (a head
    that is restarting must not end a `serve` that should tear its deployment down later)."""
    from cluster.deploy import deployed

    try:
        return not deployed(name)
    except Exception:  # noqa: BLE001 - a GCS hiccup: ask again at the next tick
        return False


class ReplicaEvents:
    """What a deployment's controller noted of its replicas (down and being replaced, serving,
    failed to start), printed by the `serve` that waits on it: those lines went to Ray's worker
    logs alone, and an operator watching `serve` saw a replica die and come back without a word
    (a review). ``fetch(seen)`` is the controller's ``events_since``; the events before this
    object was made (the replicas' first start, which `serve` reported) are not printed."""

    def __init__(self, fetch: Callable[[int], tuple[int, list[str]]]):
        self.fetch = fetch
        self.seen = self._fetched(0)[0]

    def _fetched(self, seen: int) -> tuple[int, list[str]]:
        try:
            return self.fetch(seen)
        except Exception:  # noqa: BLE001 - a controller restarting: asked again at the next tick
            return seen, []

    def print_new(self) -> None:
        self.seen, new = self._fetched(self.seen)
        for event in new:
            print(f"mirrorspec: {event}", flush=True)
