"""What a replica actor answers the controller's pings, checked on the actor classes themselves
(no Ray needed): an actor that answers is not a replica that serves."""

import pytest
import torch

from cluster.replicas import DrafterReplica, TargetFollower
from cluster.spec import StackSpec


def spec(tiny_dir, **overrides) -> StackSpec:
    # the classes set the process's torch threads: keep the test process's own count
    return StackSpec(target=str(tiny_dir["target16"]), draft=str(tiny_dir["draft16"]), replica_host="127.0.0.1",
                     threads=torch.get_num_threads(), **overrides)


def test_a_replica_pings_through_its_servers_health_check_and_fails_once_the_server_stopped(tiny_dir):
    replica = DrafterReplica(spec(tiny_dir))
    replica.start()
    try:
        assert replica.ping()
    finally:
        replica.stop()
    with pytest.raises(RuntimeError, match="the replica's server is not running"):
        replica.ping()


def test_a_replica_counts_its_sessions_on_its_servers_event_loop(tiny_dir):
    """The store takes no lock: counted from the actor's thread, its sessions changed under the
    count as the server opened and closed them ("dictionary changed size during iteration")."""
    import threading

    import grpc

    from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

    replica = DrafterReplica(spec(tiny_dir))
    replica.start()
    try:
        store, threads = replica.server.servicer.sessions, []
        evict = store.evict_expired
        store.evict_expired = lambda: (threads.append(threading.current_thread()), evict())[1]
        stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(replica.address()))
        stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=[1, 2, 3],
                                                             params=common_pb2.SamplingParams(max_new_tokens=4)))
        threads.clear()
        assert replica.sessions() == 1
        assert threads and threads[-1] is replica.server._thread
    finally:
        replica.stop()


def test_a_follower_whose_loop_failed_fails_its_ping_with_the_reason(tiny_dir, monkeypatch):
    """Its process lives on, so only the ping can tell the controller that rank 0 now waits in a
    collective that will never complete. (The loop's failure is planted: a real one would leave
    this process's torch.distributed state half set up for the tests after it.)"""
    from mirrorspec.models import tensor_parallel

    def broken_collective(*args, **kwargs):
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(tensor_parallel, "run_follower", broken_collective)
    follower = TargetFollower(spec(tiny_dir, tp=2), rank=1)
    assert follower.ping()
    with pytest.raises(RuntimeError, match="connection reset"):
        follower.follow("tcp://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="rank 1's follower loop failed: RuntimeError: connection reset by peer"):
        follower.ping()


def test_a_target_replica_prefills_in_the_chunks_its_spec_asks_for(tiny_dir):
    from cluster.replicas import TargetReplica

    replica = TargetReplica(spec(tiny_dir, prefill_chunk_tokens=7))
    replica.start()
    try:
        assert replica.server.servicer.config.prefill_chunk_tokens == 7
    finally:
        replica.stop()


def test_a_spec_refuses_a_prefill_chunk_below_one_token(tiny_dir):
    from mirrorspec.config import InvalidRequest

    with pytest.raises(InvalidRequest, match="prefill_chunk_tokens must be a whole number") as err:
        spec(tiny_dir, prefill_chunk_tokens=0)
    assert err.value.field == "prefill_chunk_tokens"


def test_a_front_door_bound_to_every_interface_is_shown_at_its_nodes_address(monkeypatch):
    """The clusters' front doors listen on 0.0.0.0, and the banner and `status` gave that as the
    address to dial (a review's find)."""
    import ray

    from cluster.replicas import dialable

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    assert [dialable(h) for h in ("0.0.0.0", "::", "127.0.0.1", "head.example")] == [
        "10.0.0.7", "10.0.0.7", "127.0.0.1", "head.example"]
