"""mirrorspec on a real local Ray cluster (loopback only): replicas as actors on their pool's
resources, scaling under load, killed actors, and a tp=2 target, all compared token for token
with target-only decoding."""

import random
import threading
import time

import pytest
import ray

from ray.util.placement_group import placement_group, remove_placement_group

from cluster.controller import Controller, ReplicaRecord
from cluster.deploy import deploy, find_controller, teardown
from cluster.spec import CONTROLLER_NAMESPACE, PoolResources, StackSpec
from mirrorspec import SamplingParams, generate
from mirrorspec.client import Client
from mirrorspec.config import InvalidRequest
from support import free_port, load, load_as_served_draft, wait_until

pytestmark = pytest.mark.slow

DRAFTER_SLOTS = 3  # the cluster's "drafter" resource: a 4th drafter replica cannot be placed


@pytest.fixture(scope="module")
def cluster_ray():
    ray.init(num_cpus=4, resources={"drafter": DRAFTER_SLOTS, "target": 4}, include_dashboard=False,
             namespace=CONTROLLER_NAMESPACE, log_to_driver=False)
    yield
    ray.shutdown()


def small_spec(tiny_dir, **overrides) -> StackSpec:
    fields = dict(target=str(tiny_dir["target16"]), draft=str(tiny_dir["draft16"]), port=0,
                  num_speculative_tokens=3, proposal_top_k=4, drain_timeout_s=30,
                  drafter_resources=PoolResources(cpus=0.25), target_resources=PoolResources(cpus=0.25))
    return StackSpec(**{**fields, **overrides})


@pytest.fixture(scope="module")
def deployment(cluster_ray, tiny_dir):
    controller, address = deploy(small_spec(tiny_dir))
    yield controller, address
    teardown(controller, "mirrorspec")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    model = load(tiny_dir["target16"])
    return lambda prompt, n: generate(model, None, prompt, SamplingParams(max_new_tokens=n)).token_ids


def rows(controller, pool=None):
    return [r for r in ray.get(controller.status.remote()) if pool is None or r["pool"] == pool]


def front_door_routes_current_membership(controller) -> bool:
    (front,) = rows(controller, "orchestrator")
    return front["membership"] == "current"


def front_door_drafters(front) -> set[str]:
    """The drafter addresses the front door actor's own pool routes to."""
    return set(ray.get(front.stats.remote(), timeout=30)["load"]["drafter"])


def replaced(controller, pool: str, victim: str) -> list[dict]:
    """``pool``'s rows where it is back to one serving replica, not ``victim`` (else none): read
    from one status call. Two calls (the states from one, the names from the next) let the first
    still see the victim serving and the second see it forgotten with its replacement not launched
    yet (CI of stop 54)."""
    now = rows(controller, pool)
    return now if [r["state"] for r in now] == ["serving"] and victim not in {r["replica"] for r in now} else []


def test_greedy_output_through_ray_actors_is_identical_to_target_only(deployment, reference):
    _, address = deployment
    with Client(address) as client:
        for prompt in ([0, 7, 3], [5, 5, 1, 9], [2]):
            assert client.generate(prompt, max_tokens=30).token_ids == reference(prompt, 30)


def test_seeded_samples_through_ray_actors_are_the_in_process_engine_s(deployment, tiny_dir):
    """The in-process engine's sampled output is tested against exact enumerated distributions;
    requests served by replicas in Ray actors draw its tokens, seed for seed, with temperature,
    top-k and top-p on the wire, so the Ray path keeps the target's distribution too (only greedy
    output was checked through Ray: a review of stop 62). A client that dropped top-p fails here."""
    _, address = deployment
    target, draft = load(tiny_dir["target16"]), load_as_served_draft(tiny_dir["draft16"])
    filters = dict(temperature=1.3, top_k=6, top_p=0.7)
    with Client(address) as client:
        for seed, prompt in enumerate(([0, 7, 3], [5, 5, 1, 9], [2], [4, 8])):
            served = client.generate(prompt, max_tokens=24, seed=seed, **filters)
            local = generate(target, draft, prompt, SamplingParams(max_new_tokens=24, **filters),
                             num_speculative_tokens=3, seed=seed, proposal_top_k=4)
            assert served.stats.drafted > 0  # the drafter pool drafted: not the target alone
            assert served.token_ids == local.token_ids, (seed, prompt)


def test_replicas_are_placed_on_their_pool_resource(deployment):
    controller, _ = deployment
    assert find_controller("mirrorspec") is not None
    serving = {r["pool"]: r for r in rows(controller) if r["state"] == "serving"}
    assert "drafter 1" in serving["drafter"]["resources"] and "target 1" in serving["target"]["resources"]
    ray.get(controller.scale.remote("drafter", DRAFTER_SLOTS + 1), timeout=300)
    # three fit; the fourth waits for a "drafter" resource (on a real cluster: the autoscaler's cue)
    assert wait_until(lambda: sorted(r["state"] for r in rows(controller, "drafter"))
                      == ["pending"] + ["serving"] * DRAFTER_SLOTS, timeout=120, every=0.25)
    ray.get(controller.scale.remote("drafter", 1), timeout=300)
    assert [r["state"] for r in rows(controller, "drafter")] == ["serving"]


def test_a_starting_replica_whose_group_is_placed_shows_starting_every_time(cluster_ray):
    """A fresh ``group.ready()`` polled with no wait is not resolved even for a group placed long
    ago: placed replicas flapped to "pending", and `scale` on a local Ray read that as "cannot be
    placed" (a Ray review)."""
    placed = placement_group([{"CPU": 0.01}], name="placed-for-the-test")
    unplaceable = placement_group([{"CPU": 64}], name="unplaceable-for-the-test")
    try:
        ray.get(placed.ready(), timeout=60)
        shown = [Controller._shown_state(ReplicaRecord("drafter", "d", None, None, group=group))
                 for group in [placed] * 5 + [unplaceable]]
        assert shown == ["starting"] * 5 + ["pending"]
    finally:
        remove_placement_group(placed)
        remove_placement_group(unplaceable)


def test_a_serve_whose_replicas_no_node_can_hold_says_why_and_names_the_setting(cluster_ray, tiny_dir, capsys):
    """Replicas asking for more CPUs than any node has waited out --start-timeout and were blamed
    on it as "still starting" (a Ray review): now said while waiting, and in the refusal."""
    spec = small_spec(tiny_dir, name="too-big", drafter_resources=PoolResources(cpus=8))
    with pytest.raises(InvalidRequest) as refused:
        deploy(spec, timeout_s=20)
    assert refused.value.field == "replica_cpus", refused.value
    assert "drafter-1 is pending" in str(refused.value) and "the largest has CPU 4" in str(refused.value)
    assert "waiting: drafter-1 is pending" in capsys.readouterr().err
    assert wait_until(lambda: not any(a["name"].startswith("too-big")
                                      for a in ray.util.list_named_actors(all_namespaces=True)), timeout=30)


def test_scaling_up_returns_once_the_front_door_routes_to_the_new_replica(deployment):
    """``scale`` waited for the replica to serve, not for the front door's long poll to bring it
    into routing: here that poll is held back 2 s, so a scale that returned early is seen."""
    def hold_back_membership_updates(door) -> None:  # nested: pickled by value into the actor
        pool = door.server.servicer.drafters
        apply = pool.set_members

        def late(addresses):
            time.sleep(2.0)
            apply(addresses)
        pool.set_members = late

    controller, _ = deployment
    front = ray.get_actor("mirrorspec-front-door", namespace=CONTROLLER_NAMESPACE)
    ray.get(front.__ray_call__.remote(hold_back_membership_updates), timeout=30)
    try:
        after = ray.get(controller.scale.remote("drafter", 2, 120), timeout=300)
        serving = {r["address"] for r in after if r["pool"] == "drafter" and r["state"] == "serving"}
        assert len(serving) == 2
        assert [r["membership"] for r in after if r["pool"] == "orchestrator"] == ["current"]
        assert front_door_drafters(front) == serving
    finally:
        ray.get(front.__ray_call__.remote(lambda door: delattr(door.server.servicer.drafters, "set_members")))
        ray.get(controller.scale.remote("drafter", 1), timeout=300)


class Load:
    """Clients sending greedy requests back to back until stopped; every result is kept."""

    def __init__(self, address, streams=3):
        self.address = address
        self.results, self.errors = [], []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(streams)]

    def _run(self, index):
        rng = random.Random(index)
        with Client(self.address) as client:
            while not self.stopping.is_set():
                prompt = [rng.randrange(16) for _ in range(rng.randint(1, 6))]
                try:
                    self.results.append((prompt, client.generate(prompt, max_tokens=40)))
                except Exception as err:  # noqa: BLE001 - counted, the test fails on any
                    self.errors.append(err)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for t in self.threads:
            t.join()


def test_scaling_both_pools_under_load_loses_and_alters_nothing(deployment, reference):
    controller, address = deployment
    with Load(address) as load_:
        for pool, replicas in (("target", 2), ("drafter", 2), ("target", 1), ("drafter", 1)):
            time.sleep(1.0)
            ray.get(controller.scale.remote(pool, replicas, 120), timeout=300)
            assert len([r for r in rows(controller, pool) if r["state"] == "serving"]) == replicas
        time.sleep(1.0)
    assert not load_.errors, load_.errors[:3]
    assert len(load_.results) >= 6
    for prompt, completion in load_.results:
        assert completion.token_ids == reference(prompt, 40)
    moved = sum(c.stats.target_moves + c.stats.drafter_moves for _, c in load_.results)
    print(f"{len(load_.results)} requests, {moved} session moves")


def kill_holder(controller, pool):
    """Kill the actor of the ``pool`` replica that holds a session right now (as a node failure would)."""
    def busy():
        return [r for r in rows(controller, pool) if r["state"] == "serving" and r["sessions"]]
    holders = wait_until(busy, timeout=30, every=0.05)
    assert holders
    victim = holders[0]["replica"]
    ray.kill(ray.get_actor(f"mirrorspec-{victim}-rank0", namespace=CONTROLLER_NAMESPACE), no_restart=True)
    return victim


@pytest.mark.parametrize("pool", ["drafter", "target"])
def test_killing_a_replica_actor_mid_request_loses_nothing_and_it_is_replaced(deployment, reference, pool):
    controller, address = deployment
    with Client(address) as client:
        results = {}
        worker = threading.Thread(target=lambda: results.update(c=client.generate([3, 1, 4, 1, 5], max_tokens=120)))
        worker.start()
        victim = kill_holder(controller, pool)
        worker.join()
    completion = results["c"]
    assert completion.token_ids == reference([3, 1, 4, 1, 5], 120)
    moves = completion.stats.target_moves if pool == "target" else completion.stats.drafter_moves
    assert moves >= 1 or completion.stats.drafter_fallback
    assert wait_until(lambda: replaced(controller, pool, victim), timeout=120, every=0.25)
    # what `serve` prints of it (``ReplicaEvents``): it was in Ray's worker logs alone before
    _, events = ray.get(controller.events_since.remote(0))
    down = next(i for i, e in enumerate(events) if e.startswith(f"{victim} at ") and "is down" in e)
    assert any(e.startswith(f"{pool}-") and " serves at " in e for e in events[down + 1:])


def test_a_replica_whose_server_stopped_while_its_actor_lives_is_replaced(deployment, reference):
    """The controller pings the server's health check, not the actor: before, an actor that
    answered kept its place in the pool however dead its server was."""
    controller, address = deployment
    (victim,) = [r["replica"] for r in rows(controller, "drafter") if r["state"] == "serving"]
    ray.get(ray.get_actor(f"mirrorspec-{victim}-rank0", namespace=CONTROLLER_NAMESPACE).stop.remote(), timeout=30)
    replacement = wait_until(lambda: replaced(controller, "drafter", victim), timeout=120, every=0.25)
    assert replacement
    # the controller calls the replacement serving a long-poll round trip before the front door
    # routes to it: a request sent in between went without drafts (CI of stop 50). In stop 51 the
    # request still found the front door's drafter pool empty after the controller said it was
    # current, and in stop 54 the addresses read below were a replica still starting: both fit the
    # two-call race ``replaced`` now closes (the wait passed before the replacement served). The
    # front door's own pool is still checked, against the replacement's address
    serving = replacement[0]["address"]
    assert wait_until(lambda: front_door_routes_current_membership(controller), timeout=30, every=0.05)
    front = ray.get_actor("mirrorspec-front-door", namespace=CONTROLLER_NAMESPACE)
    assert wait_until(lambda: front_door_drafters(front) == {serving}, timeout=30, every=0.05), \
        (front_door_drafters(front), serving, rows(controller))
    with Client(address) as client:
        completion = client.generate([3, 1, 4, 1, 5], max_tokens=40)
    assert completion.token_ids == reference([3, 1, 4, 1, 5], 40)
    assert not completion.stats.drafter_fallback


def test_a_target_whose_compute_lane_is_wedged_is_replaced_and_its_request_moves(cluster_ray, tiny_dir, reference):
    """The replica's server still answered its health check, so the controller kept it: each
    request routed there waited out the front door's window timeout (30 s) before moving."""
    controller, address = deploy(small_spec(tiny_dir, name="stall", drafters=1, stall_timeout_s=1.0))
    try:
        (victim,) = [r["replica"] for r in rows(controller, "target")]
        actor = ray.get_actor(f"stall-{victim}-rank0", namespace=CONTROLLER_NAMESPACE)
        results = {}
        with Client(address) as client:
            worker = threading.Thread(target=lambda: results.update(c=client.generate([3, 1, 4, 1, 5], max_tokens=120)))
            worker.start()
            assert wait_until(lambda: any(r["sessions"] for r in rows(controller, "target")), timeout=30, every=0.05)
            ray.get(actor.__ray_call__.remote(lambda replica: replica.server.servicer.lane.later(time.sleep, 600)))
            worker.join()
        assert results["c"].token_ids == reference([3, 1, 4, 1, 5], 120)
        assert results["c"].stats.target_moves >= 1
        assert wait_until(lambda: replaced(controller, "target", victim), timeout=120, every=0.25)
    finally:
        teardown(controller, "stall")


def test_a_front_door_whose_process_dies_is_restarted_and_serves_again_at_its_address(cluster_ray, tiny_dir,
                                                                                     reference):
    """Requests it held are lost to their clients (it held their token logs); new ones are served
    at the same address, where before every client got UNAVAILABLE for good and status said
    "serving"."""
    import grpc

    controller, address = deploy(small_spec(tiny_dir, name="front", port=free_port(), drafters=1))

    def serves() -> bool:
        try:
            with Client(address, timeout_s=10) as client:
                return client.generate([0, 7, 3], max_tokens=20).token_ids == reference([0, 7, 3], 20)
        except grpc.RpcError:
            return False

    try:
        assert serves()
        ray.kill(ray.get_actor("front-front-door", namespace=CONTROLLER_NAMESPACE), no_restart=False)
        assert wait_until(serves, timeout=120, every=0.5)
        assert [(r["state"], r["address"]) for r in rows(controller, "orchestrator")] == [("serving", address)]
    finally:
        teardown(controller, "front")


def test_a_tp2_target_replica_on_ray_is_identical_to_tp1(cluster_ray, tiny_dir, reference):
    controller, address = deploy(small_spec(tiny_dir, name="tp", tp=2, drafters=1))
    try:
        (target,) = rows(controller, "target")
        assert target["resources"].startswith("2 x")
        with Client(address) as client:
            for prompt in ([0, 7, 3], [9, 9, 2, 4]):
                assert client.generate(prompt, max_tokens=30).token_ids == reference(prompt, 30)
    finally:
        teardown(controller, "tp")


@pytest.mark.parametrize("pool, flag_field", [("target", "target"), ("drafter", "draft")])
def test_replicas_that_cannot_load_their_model_fail_the_deployment_naming_the_flag(cluster_ray, tiny_dir, tmp_path,
                                                                                    pool, flag_field):
    # every replacement would fail alike, so start gives up after REFUSALS_BEFORE_GIVING_UP
    # refusals with the replica's own error, instead of relaunching until the start timeout
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    broken = {"target" if pool == "target" else "draft": str(not_a_model)}
    with pytest.raises(InvalidRequest, match=f"the {pool} replicas failed to start 2 times in a row: "
                                             f"cannot load a causal LM from {not_a_model}") as err:
        deploy(small_spec(tiny_dir, name=f"broken-{pool}", **broken), timeout_s=600)
    assert err.value.field == flag_field
    with pytest.raises(ValueError):  # torn down: the name is free again
        ray.get_actor(f"broken-{pool}-controller", namespace=CONTROLLER_NAMESPACE)


def named_actors(prefix: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == CONTROLLER_NAMESPACE and a["name"].startswith(prefix)}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_controller_whose_process_dies_comes_back_and_adopts_its_replicas_without_losing_a_request(
        cluster_ray, tiny_dir, reference, tp):
    """Before, the front door and every replica were children of the controller: Ray's fate
    sharing killed them all with it, in-flight requests got UNAVAILABLE, and nothing came back.
    With tp=2 the follower rank, whose loop the dead controller had called, is adopted too."""
    controller, address = deploy(small_spec(tiny_dir, name="ctl", drafters=1, tp=tp))

    def serving() -> dict[str, str]:
        return {r["replica"]: r["address"] for r in rows(controller) if r["state"] == "serving"}

    try:
        before = serving()
        assert sorted(before) == ["drafter-1", "front-door", "target-2"]
        results = {}
        with Client(address) as client:
            worker = threading.Thread(target=lambda: results.update(c=client.generate([3, 1, 4, 1, 5], max_tokens=120)))
            worker.start()
            assert wait_until(lambda: any(r["sessions"] for r in rows(controller, "target")), timeout=30, every=0.05)
            ray.get(controller.scale.remote("drafter", 2, 0))  # drafter-3 is still starting at the crash
            ray.kill(controller, no_restart=False)  # as a crash of its process would
            worker.join()
            assert results["c"].token_ids == reference([3, 1, 4, 1, 5], 120)
            # back, with the same replicas at the same addresses; the one starting is launched afresh
            assert wait_until(lambda: serving().keys() == {*before, "drafter-4"}, timeout=120, every=0.5)
            assert {name: serving()[name] for name in before} == before
            assert "ctl-drafter-3-rank0" not in named_actors("ctl-")
            ray.get(controller.scale.remote("drafter", 1, 0), timeout=300)  # still in charge of them
            assert [r["state"] for r in rows(controller, "drafter")] == ["serving"]
            assert client.generate([0, 7, 3], max_tokens=30).token_ids == reference([0, 7, 3], 30)
    finally:
        teardown(controller, "ctl")
    assert named_actors("ctl-") == set()  # torn down: nothing detached is left behind


def test_calls_a_dying_controller_was_running_are_retried_to_the_same_effect(cluster_ray, tiny_dir, reference):
    """``drain`` and ``shutdown`` run again on the restarted controller. A retried drain failed
    with "no replica" though the drain had worked; a crash during teardown left every replica and
    placement group behind (the checkpoint was gone, so the new controller relaunched the pools
    from replica 1, whose names were taken) and the deployment's name taken for good."""
    controller, address = deploy(small_spec(tiny_dir, name="retry", drafters=1, targets=2))
    try:
        with Client(address) as client:
            worker = threading.Thread(target=lambda: client.generate([3, 1, 4, 1, 5], max_tokens=120))
            worker.start()
            holders = wait_until(lambda: [r["replica"] for r in rows(controller, "target") if r["sessions"]],
                                 timeout=30, every=0.05)
            assert holders
            (busy,) = holders
            drained = controller.drain.remote(busy)
            time.sleep(0.05)
            ray.kill(controller, no_restart=False)
            after = [r["replica"] for r in ray.get(drained, timeout=180)]
            worker.join()
        assert busy not in after and len([r for r in after if r.startswith("target")]) == 2
        stopping = threading.Thread(target=teardown, args=(controller, "retry"))
        stopping.start()
        time.sleep(0.05)
        ray.kill(controller, no_restart=False)
        stopping.join()
    finally:
        if named_actors("retry-controller"):
            teardown(controller, "retry")
    assert named_actors("retry-") == set()
    assert not [g for g in ray.util.placement_group_table().values()
                if g["name"].startswith("retry-") and g["state"] != "REMOVED"]
    controller, _ = deploy(small_spec(tiny_dir, name="retry", drafters=1))  # the name is free again
    teardown(controller, "retry")
