"""Replica pools: least-loaded routing, membership changes, and sessions that move without
changing a single token (drain, replica death), over real loopback gRPC servers."""

import threading
from contextlib import contextmanager
import time

import grpc
import pytest

from mirrorspec.client import Client
from mirrorspec.config import SamplingParams
from mirrorspec.serving.server import BackgroundServer, Service, start_grpc_server
from mirrorspec.drafting import Proposal
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, target_pb2, target_pb2_grpc
from mirrorspec.serving.errors import NoReplicaAvailable
from orchestrator.pool import ReplicaPool, parse_addresses
from orchestrator.remote import RemoteDrafter, RemoteVerifier
from served_stack import start_stack, targets_held
from support import load
from test_generation_service import target_only


def stub_pool(*addresses, cooldown=5.0):
    return ReplicaPool("target", addresses, make_stub=lambda channel: object(), failure_cooldown_s=cooldown)


def test_parse_addresses_drops_blanks_and_repeats():
    assert parse_addresses(" a:1, ,b:2,a:1 ") == ["a:1", "b:2"]
    assert parse_addresses(None) == [] and parse_addresses(["x:1"]) == ["x:1"]


def test_acquire_is_least_loaded_and_release_gives_back():
    pool = stub_pool("a:1", "b:2")
    first, second = pool.acquire(), pool.acquire()
    assert {first.address, second.address} == {"a:1", "b:2"}
    pool.release(first)
    assert pool.acquire().address == first.address
    assert pool.load() == {"a:1": 1, "b:2": 1}


def test_a_replica_that_leaves_is_no_longer_a_member_and_gets_no_new_sessions():
    pool = stub_pool("a:1", "b:2")
    held = pool.acquire(avoid={"b:2"})
    pool.set_members(["b:2"])
    assert not pool.is_member(held)
    assert pool.acquire().address == "b:2"
    pool.set_members(["a:1", "b:2"])  # rejoining is a new member: the old handle stays retired
    assert not pool.is_member(held)


def test_failed_replicas_cool_down_and_an_empty_pool_says_how_to_fix_it():
    pool = stub_pool("a:1", cooldown=60)
    pool.report_failure(pool.acquire())
    with pytest.raises(NoReplicaAvailable, match=r"failed in the last 60 s .* tried again in (59\.\d|60\.0) s, .*"
                                                 r"mirrorspec scale target N"):
        pool.acquire()
    with pytest.raises(NoReplicaAvailable, match=r"tried already by this request \(b:2\); retry it$"):
        stub_pool("b:2").acquire(avoid={"b:2"})
    with pytest.raises(NoReplicaAvailable, match="mirrorspec scale target 1"):
        stub_pool().acquire()


def test_among_equally_loaded_replicas_the_one_that_failed_longest_ago_is_picked():
    """Ties went to the first member: a replica that hung (its sessions moved, so it idles) was
    every new session's first pick again once its cooldown ended, and each waited out a window."""
    pool = stub_pool("a:1", "b:2", "c:3", cooldown=0.05)
    first = pool.acquire()
    assert first.address == "a:1"
    pool.release(first)
    pool.report_failure(first)
    time.sleep(0.1)  # past the cooldown
    second = pool.acquire(avoid={"a:1", "c:3"})
    pool.release(second)
    pool.report_failure(second)  # b:2 fails later than a:1
    time.sleep(0.1)
    picks = [pool.acquire() for _ in range(3)]
    assert [r.address for r in picks] == ["c:3", "a:1", "b:2"]


def test_a_slow_replica_is_picked_only_where_no_other_is_free_until_its_cooldown_ends():
    """A call that ran out of its deadline says "hung or busy or an impatient client": others
    go first for a while, but a pool's only replica is never kept from a request for it."""
    pool = stub_pool("a:1", "b:2", cooldown=0.2)
    slow = pool.acquire()
    pool.release(slow)
    pool.report_slow(slow)
    held = [pool.acquire() for _ in range(3)]  # b:2 first even as it gets busier, then a:1 where b:2 is avoided
    assert [r.address for r in held] == ["b:2", "b:2", "b:2"]
    assert pool.acquire(avoid={"b:2"}).address == "a:1"
    time.sleep(0.3)  # past the cooldown: least loaded again
    assert pool.acquire().address == "a:1"
    alone = stub_pool("a:1", cooldown=60)
    alone.report_slow(alone.acquire())
    assert alone.acquire().address == "a:1"


def test_a_failed_replica_that_left_is_forgotten_and_not_named_among_the_failed():
    """Replacements come on new ports; the failures of replicas long gone used to pile up in the
    pool and be listed as if they were its members."""
    pool = stub_pool("a:1", cooldown=60)
    pool.report_failure(pool.acquire())
    pool.set_members(["b:2"])
    pool.report_failure(pool.acquire())
    with pytest.raises(NoReplicaAvailable, match=r"the only target replica failed in the last 60 s or was tried "
                                                 r"already \(b:2\)"):
        pool.acquire()


def test_acquire_waits_for_a_replacement_to_join():
    pool = stub_pool()
    threading.Timer(0.3, lambda: pool.set_members(["new:1"])).start()
    started = time.monotonic()
    assert pool.acquire(wait_s=10).address == "new:1"
    assert time.monotonic() - started < 5


@pytest.fixture
def pooled(tiny_dir):
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, target_replicas=2, drafter_replicas=2)
    yield s
    s.stop()


def holder(pool) -> str:
    (address,) = [a for a, n in pool.load().items() if n]
    return address


def server_at(servers, address):
    return next(s for s in servers if address.endswith(f":{s.port}"))


def stream_with(stack, prompt, max_tokens, interrupt):
    """Stream one request, call ``interrupt`` after its first window, return (tokens, last chunk)."""
    with Client(stack.address) as client:
        stream = client.stream(prompt, max_tokens=max_tokens)
        first = next(stream)
        interrupt()
        rest = list(stream)
    return list(first.token_ids) + [t for c in rest for t in c.token_ids], rest[-1]


def test_concurrent_requests_spread_over_target_replicas(pooled):
    opened = {}
    for server in pooled.targets:
        store = server.servicer.sessions
        store.open = (lambda open_, port: lambda *args: opened.setdefault(port, []).append(1) or open_(*args))(
            store.open, server.port)
    with Client(pooled.address) as client:
        threads = [threading.Thread(target=client.generate, args=([i, 3, 1],), kwargs=dict(max_tokens=100))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sum(map(len, opened.values())) == 4 and len(opened) == 2


def test_killing_the_target_replica_mid_request_moves_the_session_and_changes_nothing(pooled, tiny_dir):
    targets = pooled.front.servicer.targets
    # no grace: a stopping server would go on serving its open window streams through the grace
    tokens, last = stream_with(pooled, [0, 7, 3], 60,
                               lambda: server_at(pooled.targets, holder(targets)).stop(grace=0))
    assert tokens == target_only(load(tiny_dir["target16"]), [0, 7, 3], 60)
    assert last.finish_reason == "length" and last.stats.target_moves >= 1


def test_draining_a_target_replica_moves_its_session_and_frees_the_replica(pooled, tiny_dir):
    targets = pooled.front.servicer.targets

    def drain():
        drained = holder(targets)
        targets.set_members([a for a in targets.addresses if a != drained])
        drain.server = server_at(pooled.targets, drained)

    tokens, last = stream_with(pooled, [2, 2, 5], 50, drain)
    assert tokens == target_only(load(tiny_dir["target16"]), [2, 2, 5], 50)
    assert last.stats.target_moves == 1
    assert len(drain.server.servicer.sessions) == 0  # closed on the way out, not left to the TTL


@pytest.mark.parametrize("how", ["killed", "drained"])
def test_a_session_that_must_move_while_the_other_replica_is_full_waits_for_its_room(tiny_dir, how):
    """Its replica gone or drained, a request that had streamed tokens failed at once with
    RESOURCE_EXHAUSTED where the other replica was full for a moment (a failure-injection review):
    a moving session asks the full ones again until ``replacement_wait_s``. Here the other's one
    slot frees a second later, as a request that finishes frees it."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, target_replicas=2, target_max_sessions=1)
    targets = s.front.servicer.targets
    try:
        def lose_the_replica_while_the_other_is_full():
            lost = holder(targets)
            other = next(a for a in targets.addresses if a != lost)
            stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(other))
            slot = stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0, 1])).session_id
            frees = threading.Timer(1.0, stub.CloseSession, [common_pb2.CloseSessionRequest(session_id=slot)])
            frees.start()
            with targets_held(s):
                if how == "killed":
                    server_at(s.targets, lost).stop(grace=0)
                else:
                    targets.set_members([other])
            lose_the_replica_while_the_other_is_full.timer = frees

        tokens, last = stream_with(s, [0, 7, 3], 40, lose_the_replica_while_the_other_is_full)
        lose_the_replica_while_the_other_is_full.timer.join()
        assert tokens == target_only(load(tiny_dir["target16"]), [0, 7, 3], 40)
        assert last.stats.target_moves == 1
    finally:
        s.stop()


def test_killing_a_drafter_replica_moves_drafting_to_another_one(pooled, tiny_dir):
    drafters = pooled.front.servicer.drafters

    def kill_the_drafter_mid_request():
        with targets_held(pooled):
            server_at(pooled.drafters, holder(drafters)).stop(grace=0)

    tokens, last = stream_with(pooled, [1, 4, 4], 60, kill_the_drafter_mid_request)
    assert tokens == target_only(load(tiny_dir["target16"]), [1, 4, 4], 60)
    assert last.stats.drafter_moves >= 1 and not last.stats.drafter_fallback
    assert last.stats.drafted > 0


class CancellingDrafter(drafter_pb2_grpc.DrafterServiceServicer):
    """A replica whose server cancels the calls in flight, as a stopping gRPC server does to the
    calls it has not finished: its caller sees CANCELLED (or UNAVAILABLE, whichever arrives first)."""

    async def OpenSession(self, request, context):
        return drafter_pb2.OpenDraftSessionResponse(session_id="doomed")

    async def CloseSession(self, request, context):
        return common_pb2.CloseSessionResponse()

    async def Draft(self, request, context):
        await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    async def DraftWindows(self, requests, context):
        async for _ in requests:
            await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        yield drafter_pb2.DraftResponse()  # never reached with a request; makes this a stream handler


class CancellingTarget(target_pb2_grpc.TargetServiceServicer):
    """The same, on the target side: without a move, the request itself would fail."""

    async def OpenSession(self, request, context):
        return target_pb2.OpenTargetSessionResponse(session_id="doomed")

    async def CloseSession(self, request, context):
        return common_pb2.CloseSessionResponse()

    async def VerifyWindow(self, request, context):
        await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    async def VerifyWindows(self, requests, context):
        async for _ in requests:
            await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        yield target_pb2.Verdict()  # never reached with a request; makes this a stream handler


CANCELLING = {
    "drafter": (CancellingDrafter, drafter_pb2_grpc.add_DrafterServiceServicer_to_server,
                drafter_pb2_grpc.DrafterServiceStub, "mirrorspec.v1.DrafterService"),
    "target": (CancellingTarget, target_pb2_grpc.add_TargetServiceServicer_to_server,
               target_pb2_grpc.TargetServiceStub, "mirrorspec.v1.TargetService"),
}


@pytest.mark.parametrize("side", ["drafter", "target"])
def test_a_call_its_replica_cancels_is_answered_by_another_replica(pooled, tiny_dir, side):
    servicer, add_to_server, stub, service = CANCELLING[side]
    cancelling = BackgroundServer(lambda: start_grpc_server([Service(add_to_server, servicer(), service)],
                                                            "127.0.0.1", 0)).start()
    healthy = getattr(pooled.front.servicer, f"{side}s").addresses[0]
    pool = ReplicaPool(side, [f"127.0.0.1:{cancelling.port}"], stub)
    params, prompt = SamplingParams(max_new_tokens=20), [1, 4, 4]
    try:
        if side == "drafter":
            remote = RemoteDrafter(pool, prompt, params, 0, 16, timeout_s=30)
            pool.set_members([f"127.0.0.1:{cancelling.port}", healthy])
            assert len(remote.propose(prompt, 3, params, 0).tokens) == 3 and remote.failure is None
        else:
            remote = RemoteVerifier(pool, prompt, params, 0, 16, timeout_s=30)
            pool.set_members([f"127.0.0.1:{cancelling.port}", healthy])
            verdict = remote.verify(prompt, Proposal.empty(), params, 0)
            assert verdict.next_token == target_only(load(tiny_dir["target16"]), prompt, 1)[0]
        session = remote.session if side == "drafter" else remote
        assert remote.moves == 1 and session.replica.address == healthy
        remote.release()
    finally:
        pool.close()
        cancelling.stop()


def test_a_stack_started_without_drafters_drafts_once_one_joins(tiny_dir):
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter

    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, drafter_replicas=0)
    drafter = BackgroundServer(lambda: serve_drafter(DrafterConfig(strategy="draft-model",
                                                                   model=str(tiny_dir["draft16"]),
                                                                   proposal_top_k=4))).start()
    try:
        with Client(s.address) as client:
            assert client.generate([0, 7, 3], max_tokens=20).stats.drafted == 0
            s.front.servicer.drafters.set_members([f"127.0.0.1:{drafter.port}"])
            joined = client.generate([0, 7, 3], max_tokens=20)
        assert joined.stats.drafted > 0
        assert joined.token_ids == target_only(load(tiny_dir["target16"]), [0, 7, 3], 20)
    finally:
        drafter.stop()
        s.stop()


def test_a_clients_short_deadline_marks_no_replica_slow(tiny_dir):
    """A client that gave up 0.5 s into a busy moment (a long prefill ahead of it) marked a healthy
    target slow, and for the cooldown every new request went to the other replica, however loaded
    (a load review: 24 of 24 opens on one). The client's own deadline says nothing of the replica."""
    from support import wait_until

    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, target_replicas=2, drafter_replicas=2)
    front = s.front.servicer
    try:
        with Client(s.address) as client:
            client.generate([0, 1, 2], max_tokens=4)
            with targets_held(s), pytest.raises(grpc.RpcError) as err:
                client.generate([0, 1, 2], max_tokens=8, timeout_s=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert wait_until(lambda: front.in_flight == 0)
            assert front.targets._slow_at == {} and front.drafters._slow_at == {}
    finally:
        s.stop()


@pytest.mark.parametrize("remaining, timeout_s, gone", [
    (None, 120.0, False), (500.0, 120.0, False), (5.0, 5.0, False),
    (0.0, 0.0, True),  # grpc.aio's time_remaining() once the deadline passed: read as none before
    # within the clock slack a call that ran out with the client's deadline may beat this clock by:
    # a request whose call failed so was counted an error, not the client leaving (as sessions read it)
    (0.02, 0.02, True),
])
def test_a_requests_budget_takes_a_deadline_that_passed_for_one(remaining, timeout_s, gone):
    from orchestrator.servicer import RequestBudget

    budget = RequestBudget.of(120.0, remaining)
    assert (budget.timeout_s, budget.client_gone(), budget.client_deadline is None) == (timeout_s, gone,
                                                                                         remaining is None)
