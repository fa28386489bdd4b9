"""Pooled sessions when replicas fail: a RemoteDrafter turns drafting off for a while, then
reopens a session from the token log, in the background, on whichever replica the pool offers
by then; an open on a replica that stopped answering goes elsewhere."""

import asyncio
import threading
import time

import pytest

from drafter_service.servicer import DrafterConfig
from drafter_service.servicer import serve as serve_drafter
from mirrorspec.client import Client
from mirrorspec.config import SamplingParams
from mirrorspec.serving.server import BackgroundServer, Service, start_grpc_server
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from orchestrator.pool import ReplicaPool
from mirrorspec.drafting import Proposal
from mirrorspec.v1 import target_pb2_grpc
from orchestrator.remote import PooledSession, RemoteDrafter, RemoteVerifier
from served_stack import start_stack, targets_held
from support import load, wait_until
from test_generation_service import target_only

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=60)  # sampled drafts: the seed must carry over


def drafter_server(tiny_dir) -> BackgroundServer:
    return BackgroundServer(lambda: serve_drafter(DrafterConfig(strategy="draft-model", model=str(tiny_dir["draft16"]),
                                                                proposal_top_k=4))).start()


def address(server: BackgroundServer) -> str:
    return f"127.0.0.1:{server.port}"


def open_sessions(server: BackgroundServer) -> int:
    return len(server.servicer.sessions)


def test_a_request_whose_drafter_died_drafts_again_on_its_replacement_exactly_as_a_fresh_session(tiny_dir):
    first, replacement = drafter_server(tiny_dir), None
    pool = ReplicaPool("drafter", [address(first)], drafter_pb2_grpc.DrafterServiceStub, failure_cooldown_s=0.3)
    prompt = [1, 4, 4]
    try:
        remote = RemoteDrafter(pool, prompt, PARAMS, 7, 16, timeout_s=30)
        assert len(remote.propose(prompt, 3, PARAMS, 7).tokens) == 3
        first.stop(grace=0)
        context = [*prompt, 5, 6]
        assert remote.propose(context, 3, PARAMS, 7).tokens == () and remote.fell_back
        replacement = drafter_server(tiny_dir)
        pool.set_members([address(replacement)])
        assert remote.propose(context, 3, PARAMS, 7).tokens == ()  # off until the cooldown has passed
        assert open_sessions(replacement) == 0
        assert wait_until(lambda: remote.propose(context, 3, PARAMS, 7).tokens != (), timeout=10, every=0.05)
        later = [*context, 2, 9, 11]
        revived = remote.propose(later, 3, PARAMS, 7)
        fresh_remote = RemoteDrafter(pool, later, PARAMS, 7, 16, timeout_s=30)
        fresh = fresh_remote.propose(later, 3, PARAMS, 7)
        assert revived.tokens == fresh.tokens and len(fresh.tokens) == 3
        assert revived.q.dense(16).tolist() == fresh.q.dense(16).tolist()
        assert remote.fallbacks == 1 and remote.failure is None
        remote.release()
        fresh_remote.release()
        assert wait_until(lambda: open_sessions(replacement) == 0)
    finally:
        pool.close()
        first.stop()
        if replacement is not None:
            replacement.stop()


def test_while_no_drafter_answers_the_tries_to_reopen_back_off(tiny_dir):
    """A pool with no replica at all: each try fails at once. The waits double from the pool's
    cooldown (0.1, 0.2, 0.4, 0.8 s), so in 1.2 s there are at most three tries after the first
    open, not one per window."""
    pool = ReplicaPool("drafter", [], drafter_pb2_grpc.DrafterServiceStub, failure_cooldown_s=0.1)
    tries = []
    acquire = pool.acquire
    pool.acquire = lambda *args, **kwargs: tries.append(time.monotonic()) or acquire(*args, **kwargs)
    try:
        remote = RemoteDrafter(pool, [1, 4, 4], PARAMS, 0, 16, timeout_s=30)
        started = time.monotonic()
        while time.monotonic() - started < 1.2:
            assert remote.propose([1, 4, 4], 3, PARAMS, 0).tokens == ()
            time.sleep(0.005)
        assert 2 <= len(tries) <= 4, tries
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        assert all(later > earlier for earlier, later in zip(gaps, gaps[1:])), gaps
        assert remote.fallbacks == 1
    finally:
        pool.close()


class SlowOpeningDrafter(drafter_pb2_grpc.DrafterServiceServicer):
    """Its first open fails; the next ones answer once ``opening`` is set."""

    def __init__(self):
        self.opening = threading.Event()
        self.opens = 0
        self.closed: list[str] = []
        self.asked: list[str] = []  # the ids the caller opened with

    async def OpenSession(self, request, context):
        self.opens += 1
        self.asked.append(request.session_id)
        if self.opens == 1:
            raise RuntimeError("the first open fails")
        while not self.opening.is_set():
            await asyncio.sleep(0.01)
        return drafter_pb2.OpenDraftSessionResponse(session_id=f"s{self.opens}")

    async def CloseSession(self, request, context):
        self.closed.append(request.session_id)
        return common_pb2.CloseSessionResponse()


def test_a_session_reopened_after_the_request_ended_is_closed(tiny_dir):
    """The request ends while its drafter session reopens in the background: the reopen finishes
    later, and nothing but the reopen itself is left to close that session."""
    servicer = SlowOpeningDrafter()
    server = BackgroundServer(lambda: start_grpc_server([Service(drafter_pb2_grpc.add_DrafterServiceServicer_to_server,
                                                                 servicer, "mirrorspec.v1.DrafterService")],
                                                        "127.0.0.1", 0)).start()
    pool = ReplicaPool("drafter", [address(server)], drafter_pb2_grpc.DrafterServiceStub, failure_cooldown_s=0.05)
    try:
        remote = RemoteDrafter(pool, [1, 4, 4], PARAMS, 0, 16, timeout_s=30)
        assert remote.fell_back
        # an open that failed with an error of the replica's own may have opened all the same: closed
        assert wait_until(lambda: servicer.closed == servicer.asked[:1]) and len(servicer.asked[0]) == 32
        time.sleep(0.1)
        assert remote.propose([1, 4, 4, 2], 3, PARAMS, 0).tokens == ()  # starts the reopen
        assert wait_until(lambda: servicer.opens == 2)
        remote.release()
        assert servicer.closed == servicer.asked[:1] and pool.load() == {address(server): 1}
        servicer.opening.set()
        assert wait_until(lambda: servicer.closed == [servicer.asked[0], "s2"] and pool.load() == {address(server): 0})
    finally:
        pool.close()
        server.stop()


class SlowClosingDrafter(drafter_pb2_grpc.DrafterServiceServicer):
    """Its close takes effect a while after the call arrives (as a close queued behind another
    request's forward on a busy compute lane does), and not at all where the call is cancelled."""

    def __init__(self):
        self.closed: list[str] = []

    async def OpenSession(self, request, context):
        return drafter_pb2.OpenDraftSessionResponse(session_id="s1")

    async def CloseSession(self, request, context):
        await asyncio.sleep(0.3)
        self.closed.append(request.session_id)
        return common_pb2.CloseSessionResponse()


@pytest.mark.parametrize("wait", [True, False], ids=["request end", "without waiting"])
def test_a_session_let_go_on_a_drained_replica_is_closed_there(wait):
    """A drained replica's channel closes when its last user lets it go, and that cancels a close
    still on its way, leaving the session there until the replica's TTL (and a drain waiting on it
    for its whole timeout). So the replica is let go only once the close is answered: at a
    request's end (released at once in 4672599; the drain test caught it 4 runs in 6), and where
    drafting turns off after a failure and lets its session go without waiting (the replica may
    hang), which released at once until this test."""
    servicer = SlowClosingDrafter()
    server = BackgroundServer(lambda: start_grpc_server([Service(drafter_pb2_grpc.add_DrafterServiceServicer_to_server,
                                                                 servicer, "mirrorspec.v1.DrafterService")],
                                                        "127.0.0.1", 0)).start()
    pool = ReplicaPool("drafter", [address(server)], drafter_pb2_grpc.DrafterServiceStub)
    try:
        remote = RemoteDrafter(pool, [1, 4, 4], PARAMS, 0, 16, timeout_s=30)
        assert not remote.fell_back
        pool.set_members([])  # drained: retired, its channel kept while the session is held
        replica = remote.session.replica
        remote.session.let_go(wait=wait)
        assert wait_until(lambda: servicer.closed == ["s1"], timeout=5)
        assert wait_until(lambda: replica.sessions == 0, timeout=5)  # then, and only then, let go
    finally:
        pool.close()
        server.stop()


@pytest.mark.parametrize("mirror", [False, True], ids=["serial", "mirror"])
def test_a_drafter_that_fails_a_call_mid_request_drafts_again_and_changes_nothing(tiny_dir, monkeypatch, mirror):
    """Its second answer fails (INTERNAL): the request goes on target-only, and drafts again once
    the cooldown has passed; the output is target-only's."""
    import drafter_service.servicer as drafter_module

    honest, answers, failed = drafter_module._draft_response, [], threading.Event()

    def fails_once(proposal):
        answers.append(time.monotonic())
        if len(answers) == 2:
            failed.set()
            raise RuntimeError("the drafter's second answer fails")
        return honest(proposal)

    monkeypatch.setattr(drafter_module, "_draft_response", fails_once)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, failure_cooldown_s=0.05)
    try:
        with Client(s.address) as client:
            stream = client.stream([0, 7, 3], max_tokens=120, mirror=mirror)
            first = next(stream)
            assert failed.wait(10)
            with targets_held(s):  # the request stays in flight past the cooldown
                time.sleep(0.2)
            failed_at = answers[1]
            rest = list(stream)
        tokens = list(first.token_ids) + [t for c in rest for t in c.token_ids]
        assert tokens == target_only(load(tiny_dir["target16"]), [0, 7, 3], 120)
        stats = rest[-1].stats
        assert stats.drafter_fallback and any(at > failed_at for at in answers[2:])  # drafted again
        assert wait_until(lambda: open_sessions(s.drafters[0]) == 0)
    finally:
        s.stop()


@pytest.fixture()
def frozen_target(tiny_dir):
    """A target server process, stopped (SIGSTOP) once it listens: it accepts connections (the
    kernel does) and answers nothing, as a frozen or swapped-out process does."""
    import signal
    import subprocess
    import sys
    import tempfile

    from benchmarks.data_plane import _listening_port

    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(tiny_dir["target16"]),
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        address = f"127.0.0.1:{_listening_port(proc, log)}"
        proc.send_signal(signal.SIGSTOP)
        yield address
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture()
def quick_probes(monkeypatch):
    monkeypatch.setattr(PooledSession, "probe_open_after_s", 0.3)
    monkeypatch.setattr(PooledSession, "probe_timeout_s", 0.5)


def test_an_open_on_a_frozen_replica_goes_elsewhere_before_its_deadline(stack, frozen_target, tiny_dir,
                                                                        quick_probes):
    """A replayed session's open hung on a frozen target for the request's whole budget (120 s),
    and the request failed with DEADLINE_EXCEEDED while another target served."""
    healthy = stack.front.servicer.targets.addresses[0]
    prompt, params = [1, 4, 4], SamplingParams(max_new_tokens=20)
    with ReplicaPool("target", [frozen_target, healthy], target_pb2_grpc.TargetServiceStub) as pool:
        started = time.monotonic()
        verifier = RemoteVerifier(pool, prompt, params, 0, 16, timeout_s=20)
        assert verifier.replica.address == healthy and time.monotonic() - started < 10
        assert verifier.verify(prompt, Proposal.empty(), params, 0).next_token == target_only(
            load(tiny_dir["target16"]), prompt, 1)[0]
        assert pool.acquire().address == healthy  # the frozen one is kept off for the cooldown
        verifier.release()


def test_an_open_on_a_busy_replica_waits_for_it(stack, tiny_dir, quick_probes):
    """A long prefill (here: a lane held for 2 s) is not a frozen replica: its health check
    answers, so the open waits, and nothing is reported."""
    address = stack.front.servicer.targets.addresses[0]
    prompt, params = [1, 4, 4], SamplingParams(max_new_tokens=20)
    with ReplicaPool("target", [address], target_pb2_grpc.TargetServiceStub, failure_cooldown_s=60) as pool:
        with targets_held(stack):
            opening = threading.Thread(target=lambda: opened.append(RemoteVerifier(pool, prompt, params, 0, 16,
                                                                                 timeout_s=20)))
            opened: list = []
            opening.start()
            time.sleep(2.0)
        opening.join(20)
        assert opened and opened[0].replica.address == address and opened[0].moves == 0
        assert pool.acquire().address == address  # not kept off
        opened[0].release()


def test_while_the_drafter_is_off_the_front_doors_lookup_goes_on_alone(tiny_dir, monkeypatch):
    """Every drafter answer fails, so drafting is off for the request (a minute's cooldown); the
    front door's prompt lookup needs no drafter, and its windows are as exact as any."""
    import drafter_service.servicer as drafter_module

    def fails(proposal):
        raise RuntimeError("this drafter fails every answer")

    monkeypatch.setattr(drafter_module, "_draft_response", fails)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, prompt_lookup=2, failure_cooldown_s=60)
    try:
        with Client(s.address) as client:
            served = client.generate([2, 9, 4], max_tokens=100)  # nothing to look up at first: the drafter is asked
        assert list(served.token_ids) == target_only(load(tiny_dir["target16"]), [2, 9, 4], 100)
        assert served.stats.drafter_fallback and served.stats.drafted > 0 and served.stats.accepted > 0
    finally:
        s.stop()


def test_a_reopen_that_fails_unexpectedly_is_tried_again_later(tiny_dir):
    """Any error in the background reopen, not only a gRPC one: it left the reopen marked running
    for good, and the request target-only (review 3)."""
    server = drafter_server(tiny_dir)
    pool = ReplicaPool("drafter", [address(server)], drafter_pb2_grpc.DrafterServiceStub, failure_cooldown_s=0.05)
    prompt = [1, 4, 4]
    try:
        remote = RemoteDrafter(pool, prompt, PARAMS, 7, 16, timeout_s=30)
        remote._turn_off("planted")
        opens = []
        honest = remote.session.open
        remote.session.open = lambda context: opens.append(context) or (
            honest(context) if len(opens) > 1 else (_ for _ in ()).throw(ValueError("not a gRPC error")))
        assert wait_until(lambda: remote.propose(prompt, 3, PARAMS, 7).tokens != (), timeout=10, every=0.02)
        assert len(opens) == 2 and remote.fallbacks == 1
        remote.release()
    finally:
        pool.close()
        server.stop()
