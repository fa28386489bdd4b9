"""Finding the Ray to use: a local one of its own for `serve`, and that one again for `status`
and `scale`, whatever else runs on the machine."""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

import psutil
import pytest
import ray
from support import wait_until

from cluster.deploy import LOCAL_ROLE_SLOTS, connect
from cluster.local_ray import announced_local_ray, local_ray_file, use_announced_ray

pytestmark = pytest.mark.slow


def test_serve_starts_a_local_ray_of_its_own_where_another_is_announced_and_status_finds_it(monkeypatch, tmp_path):
    """With RAY_ADDRESS set (or `ray start` run on the machine), ray.init joined that cluster and
    refused num_cpus: `mirrorspec serve` died with a ValueError traceback. And `status` with its
    default --address auto took whichever Ray it found running, not the deployment's."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing there: joining it would fail
    monkeypatch.setenv("MIRRORSPEC_CACHE", str(tmp_path))
    assert not ray.is_initialized()
    connect(num_cpus=1)
    try:
        assert ray.cluster_resources()["CPU"] == 1
        # each replica (each target rank) takes one of its role's slots: a local Ray's slots were its
        # CPUs, so --num-cpus 2 --replica-cpus 0.25 placed 2 of 3 drafters, and scale blamed the CPUs
        assert ray.cluster_resources()["drafter"] == ray.cluster_resources()["target"] == LOCAL_ROLE_SLOTS > 256 * 8
        gcs = ray.get_runtime_context().gcs_address
        assert use_announced_ray("auto", "mine") == "auto" and os.environ["RAY_ADDRESS"] == "127.0.0.1:1"
        with announced_local_ray("mine", gcs):
            assert use_announced_ray("auto", "theirs") == "auto" and os.environ["RAY_ADDRESS"] == "127.0.0.1:1"
            assert use_announced_ray("10.0.0.1:6379", "mine") == "10.0.0.1:6379"  # named explicitly
            assert os.environ["RAY_ADDRESS"] == "127.0.0.1:1"
            assert use_announced_ray("auto", "mine") == "auto" and os.environ["RAY_ADDRESS"] == gcs
        assert not local_ray_file("mine").exists()  # gone with the serve
        with announced_local_ray("killed", "127.0.0.1:1"):  # a serve killed before it took it back
            monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:2")
            assert use_announced_ray("auto", "killed") == "auto" and os.environ["RAY_ADDRESS"] == "127.0.0.1:2"
            assert not local_ray_file("killed").exists()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("failure, tries", [
    (Exception("The current node timed out during startup. This could happen because some of the raylet "
               "failed to startup or the GCS has become overloaded."), 2),
    (RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_1f"), 2),
    (ValueError("num_cpus must be a non-negative integer"), 1),
], ids=["raylet late", "gcs late", "other"])
def test_a_local_ray_whose_raylet_missed_its_startup_window_is_started_again(monkeypatch, failure, tries):
    """Ray gives a raylet 30 s to register, and its GCS 30 s to write its port file; on a loaded
    machine each missed that once in CI (stops 55 and 61), failing a benchmark's start. Those
    failures are tried again; others are raised at once.
    Either way, what the failed start launched is stopped: Ray fails it after starting its GCS
    and raylet (here, a process with a child of its own) and before ``ray.shutdown`` knows them,
    so they ran on beside the second Ray (review of stop 55)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    calls, launched = [], []
    start = ray.init

    def first_fails(*args, **kwargs):
        calls.append(kwargs.get("address"))
        if len(calls) == 1:
            sleep = "import time; time.sleep(600)"
            parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
            launched.append(psutil.Process(subprocess.Popen([sys.executable, "-c", parent]).pid))
            launched.extend(wait_until(lambda: launched[0].children()))  # its own child, as a raylet's workers
            raise failure
        return start(*args, **kwargs)

    monkeypatch.setattr(ray, "init", first_fails)
    assert not ray.is_initialized()
    try:
        if tries == 1:
            with pytest.raises(type(failure)):
                connect(num_cpus=1)
        else:
            connect(num_cpus=1)
            assert ray.cluster_resources()["CPU"] == 1
        assert calls == ["local"] * tries
        assert len(launched) == 2 and not [p for p in launched if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        ray.shutdown()
        for process in launched:  # were they left behind
            if process.is_running():
                process.kill()


def test_a_second_local_serve_of_a_running_name_is_refused_and_takes_no_announcement_over(monkeypatch, tmp_path):
    """Two local-Ray serves of one --name both started: the second wrote over the first's
    announcement, and its exit removed it, so `status` and `stop` reached different Rays while the
    first served on, unreachable by name (review 28 of stop 49)."""
    import json

    from cluster.local_ray import check_name_free
    from mirrorspec.config import InvalidRequest

    monkeypatch.setenv("MIRRORSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    connect(num_cpus=1)
    try:
        gcs = ray.get_runtime_context().gcs_address
        check_name_free("mine")
        with announced_local_ray("mine", gcs):
            with pytest.raises(InvalidRequest, match=f"a deployment named 'mine' already runs on a local Ray on this "
                                                     f"machine \\(its Ray at {gcs}\\); stop it first") as err:
                check_name_free("mine")
            assert err.value.field == "name"
            check_name_free("theirs")
            theirs = json.dumps({"address": "127.0.0.1:9", "auth_mode": None})
            local_ray_file("mine").write_text(theirs)  # another serve's, written meanwhile
        assert local_ray_file("mine").read_text() == theirs  # left to the serve that wrote it
        local_ray_file("mine").write_text("{not json")  # damaged: nothing announced
        check_name_free("mine")
        local_ray_file("mine").write_text(json.dumps({"address": gcs, "auth_mode": None}))
    finally:
        ray.shutdown()
    check_name_free("mine")  # its Ray gone (a serve killed before it took it back): free again
    assert not local_ray_file("mine").exists()


def test_a_serve_of_the_same_name_that_wins_the_race_leaves_the_other_a_name_error(monkeypatch):
    """Two `serve --address auto --name same` started together: both found no controller, and the
    loser's creation raised Ray's ActorAlreadyExistsError traceback (review 28 of stop 49)."""
    from cluster.deploy import deploy
    from cluster.spec import CONTROLLER_NAMESPACE, StackSpec
    from mirrorspec.config import InvalidRequest

    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    @ray.remote(num_cpus=0)
    class Winner:
        pass

    connect(num_cpus=1)
    try:
        winner = Winner.options(name="same-controller", namespace=CONTROLLER_NAMESPACE).remote()  # held: it lives
        real_get_actor, looks = ray.get_actor, []

        def not_there_at_first_look(*args, **kwargs):  # deploy's own look; Ray's, at creation, sees it
            looks.append(args)
            if len(looks) == 1:
                raise ValueError("not yet")
            return real_get_actor(*args, **kwargs)

        monkeypatch.setattr(ray, "get_actor", not_there_at_first_look)
        with pytest.raises(InvalidRequest, match="a deployment named 'same' already runs on this cluster") as err:
            deploy(StackSpec(name="same"), timeout_s=30)
        assert err.value.field == "name" and len(looks) == 2
        monkeypatch.setattr(ray, "get_actor", real_get_actor)
        assert ray.get_actor("same-controller", namespace=CONTROLLER_NAMESPACE)._actor_id == winner._actor_id
    finally:
        ray.shutdown()


def test_two_teardowns_at_once_and_a_call_a_stop_overtakes_end_without_tracebacks(monkeypatch):
    """`mirrorspec stop` while `serve` got its own signal ran two teardowns at once, and the one
    whose controller the other killed raised ActorDiedError (serve exited 1); a `scale` that a stop
    overtook printed the same traceback (both found in review)."""
    import threading
    import time

    from cluster.deploy import ask_controller, drain_front_door, teardown
    from cluster.spec import CONTROLLER_NAMESPACE
    from mirrorspec.config import InvalidRequest

    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    @ray.remote(num_cpus=0, max_concurrency=4)
    class SlowController:
        def shutdown(self):
            time.sleep(1.0)

        def scale(self):
            time.sleep(30.0)

    connect(num_cpus=1)
    try:
        controller = SlowController.options(name="t-controller", namespace=CONTROLLER_NAMESPACE).remote()
        errors = []

        def tear():
            try:
                teardown(controller, "t")
            except Exception as err:  # noqa: BLE001
                errors.append(err)

        scaling = threading.Thread(target=lambda: errors.append(
            pytest.raises(InvalidRequest, ask_controller, "t", lambda c: c.scale.remote())))
        scaling.start()
        time.sleep(0.5)
        tearing = [threading.Thread(target=tear) for _ in range(2)]
        for thread in tearing:  # the second's shutdown still runs when the first kills the controller
            thread.start()
            time.sleep(0.5)
        for thread in (*tearing, scaling):
            thread.join(timeout=60)
        [overtaken] = errors  # neither teardown raised
        assert "deployment 't' was stopped meanwhile" in str(overtaken.value)
        drain_front_door("t", 1.0)  # nothing left to drain: returns
    finally:
        ray.shutdown()


def test_a_controller_that_does_not_stop_is_killed_and_its_replicas_are_stopped_by_name(monkeypatch):
    """A controller wedged on a huge scale-up answered `stop` with a GetTimeoutError traceback,
    after a kill that left its detached replicas and placement groups running (review 17 of stop 48)."""
    import time

    from ray.util.placement_group import placement_group, placement_group_table

    from cluster.deploy import teardown
    from cluster.spec import CONTROLLER_NAMESPACE

    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    @ray.remote(num_cpus=0)
    class Wedged:
        def shutdown(self):
            time.sleep(60.0)

        def ping(self):
            return True

    connect(num_cpus=1)
    try:
        controller = Wedged.options(name="w-controller", namespace=CONTROLLER_NAMESPACE).remote()
        group = placement_group([{"CPU": 0.01}], name="w-drafter-1", lifetime="detached")
        replica = Wedged.options(name="w-drafter-1-rank0", namespace=CONTROLLER_NAMESPACE,
                                 lifetime="detached").remote()
        other = Wedged.options(name="x-drafter-1-rank0", namespace=CONTROLLER_NAMESPACE).remote()  # another's
        assert ray.get([replica.ping.remote(), other.ping.remote()]) == [True, True]
        ray.get(group.ready(), timeout=30)
        teardown(controller, "w", timeout_s=1.0)
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert "w-drafter-1-rank0" not in names and "w-controller" not in names
        assert ray.get(other.ping.remote())  # only the deployment's own replicas go
        states = {info["name"]: info["state"] for info in placement_group_table().values()}
        assert states["w-drafter-1"] == "REMOVED"
    finally:
        ray.shutdown()


def test_a_ray_head_that_wants_a_token_is_joined_with_ray_auth_mode_token_and_the_refusal_says_so(monkeypatch):
    """`ray start --head` turns token authentication on where a token is kept (any local ray.init
    writes one), and Ray sends a token to a named address only with RAY_AUTH_MODE=token: `serve
    --address HOST:6379` spent 20 s on InvalidAuthToken, then said no Ray ran there (a review's
    find). The refusal names the setting; with it, the head is joined."""
    from ray._private.authentication.authentication_token_setup import _get_default_token_path, generate_and_save_token
    from support import free_port

    if not _get_default_token_path().exists():
        generate_and_save_token()  # what any local ray.init does
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    port = free_port()
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    # a Ray directory of its own: the head writes its address there ("ray_current_cluster"), which in
    # Ray's shared one sent later `--address auto` lookups to this head once it was gone
    private = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}, "RAY_TMPDIR": private}
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=120)
    try:  # each in a process of its own: Ray reads RAY_AUTH_MODE once a process, and a local ray.init sets it
        refused = subprocess.run([sys.executable, "-m", "mirrorspec", "status", "--address", f"127.0.0.1:{port}"],
                                 env=env, capture_output=True, text=True, timeout=180)
        assert refused.returncode == 2 and "error: --address: cannot join the Ray cluster" in refused.stderr
        assert "run with RAY_AUTH_MODE=token" in refused.stderr
        joined = subprocess.run([sys.executable, "-c", f"from cluster.deploy import connect; import ray; "
                                 f"connect('127.0.0.1:{port}'); print(ray.cluster_resources()['CPU'])"],
                                env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0 and joined.stdout.split()[-1] == "1.0", joined.stderr[-2000:]
    finally:
        stop_ray_on_port(port)
        shutil.rmtree(private, ignore_errors=True)


def stop_ray_on_port(port: int) -> None:
    """The processes of the Ray that `ray start --head --port=PORT` left running, and theirs (not
    `ray stop`, which stops every Ray of this user on the machine)."""
    marks = (f":{port}", f"={port}")
    heads = [p for p in psutil.process_iter(["cmdline"])
             if any(mark in arg for arg in p.info["cmdline"] or () for mark in marks)]
    procs = {p.pid: p for head in heads for p in [head, *head.children(recursive=True)]}.values()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(procs), timeout=30)
