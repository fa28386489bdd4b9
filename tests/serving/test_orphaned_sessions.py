"""A front door that dies mid-request takes its window streams with it; the sessions they served
are evicted after ``orphaned_session_ttl_s``, not the ten-minute TTL, so a front door restarted
in its place finds room on its replicas. Over real loopback gRPC, the caller a real process."""

import queue
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from mirrorspec.models import load_causal_lm
from mirrorspec.serving.server import BackgroundServer
from mirrorspec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.servicer import TargetConfig, serve

ORPHAN_TTL_S = 1.0

CALLER = textwrap.dedent("""
    import queue, sys, time
    import grpc
    from mirrorspec.v1 import common_pb2, target_pb2, target_pb2_grpc
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(sys.argv[1]))
    params = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=50)
    session = stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[3, 1, 4], params=params)).session_id
    windows = queue.SimpleQueue()
    verdicts = stub.VerifyWindows(iter(windows.get, None))
    windows.put(target_pb2.VerifyRequest(session_id=session, context_length=3))
    next(verdicts)
    print(session, flush=True)
    time.sleep(600)  # mid-request, stream open, until killed
""")


@pytest.fixture
def target(tiny_dir):
    """A target that pings its callers every 0.5 s (a live caller answers; ``keepalive_s``)."""
    config = TargetConfig(model=str(tiny_dir["target16"]), orphaned_session_ttl_s=ORPHAN_TTL_S, keepalive_s=0.5)
    loaded = load_causal_lm(str(tiny_dir["target16"]), tokenizer=False)
    server = BackgroundServer(lambda: serve(config, loaded)).start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


def open_sessions(stub) -> int:
    return stub.Info(common_pb2.InfoRequest()).open_sessions  # Info evicts what has expired


def until_no_sessions(stub, within_s: float) -> int:
    """Open sessions once none are left, or ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while open_sessions(stub) and time.monotonic() < deadline:
        time.sleep(0.1)
    return open_sessions(stub)


def test_the_sessions_of_a_killed_caller_are_evicted_after_the_orphan_ttl(target):
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(target))
    caller = subprocess.Popen([sys.executable, "-c", CALLER, target], stdout=subprocess.PIPE, text=True)
    try:
        session = caller.stdout.readline().strip()
        assert session and open_sessions(stub) == 1
        time.sleep(2 * ORPHAN_TTL_S)
        assert open_sessions(stub) == 1  # a live caller's idle stream keeps its session
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait(timeout=30)
    assert until_no_sessions(stub, within_s=10) == 0
    with pytest.raises(grpc.RpcError) as gone:
        stub.VerifyWindow(target_pb2.VerifyRequest(session_id=session, context_length=3))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def cancelled_after_one_window(stub, session: str) -> None:
    """A window stream that the caller cancels once its first window is answered (what the front
    door's watchdog does to a window past its deadline)."""
    windows = queue.SimpleQueue()
    stream = stub.VerifyWindows(iter(windows.get, None))
    windows.put(target_pb2.VerifyRequest(session_id=session, context_length=3))
    next(stream)
    stream.cancel()
    windows.put(None)  # as WindowStream.close does: gRPC's thread feeding the stream waited on the queue for good


def test_a_session_outlives_its_ended_stream_only_by_another_call(target):
    """gRPC shows a servicer a caller's cancel as the same end of its request stream as a
    half-close, so either end leaves the session orphaned; the caller's next call keeps it."""
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(target))
    params = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=50)
    closed, cancelled, abandoned, never_called = (stub.OpenSession(target_pb2.OpenTargetSessionRequest(
        prompt_ids=[3, 1, 4], params=params)).session_id for _ in range(4))
    for session in (closed, abandoned):
        assert len(list(stub.VerifyWindows(iter([target_pb2.VerifyRequest(session_id=session,
                                                                          context_length=3)])))) == 1
    cancelled_after_one_window(stub, cancelled)
    time.sleep(ORPHAN_TTL_S / 2)
    for session in (closed, cancelled):  # their callers are back (a unary call orphans its session as it ends)
        stub.VerifyWindow(target_pb2.VerifyRequest(session_id=session, context_length=3))
    time.sleep(0.7 * ORPHAN_TTL_S)
    assert open_sessions(stub) == 2
    for session in (abandoned, never_called):  # a caller that died before its first window leaves one too
        with pytest.raises(grpc.RpcError) as gone:
            stub.VerifyWindow(target_pb2.VerifyRequest(session_id=session, context_length=3))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_drafter_session_whose_stream_ended_or_that_was_never_called_goes_too():
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter
    from mirrorspec.v1 import drafter_pb2, drafter_pb2_grpc

    server = BackgroundServer(lambda: serve_drafter(DrafterConfig(orphaned_session_ttl_s=ORPHAN_TTL_S))).start()
    try:
        stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        params = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=50)
        # never_called: opened while the front door's speculation was paused, say, and then it died
        kept, abandoned, never_called = (stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(
            prompt_ids=[3, 1, 4, 3, 1], params=params)).session_id for _ in range(3))
        for session in (kept, abandoned):
            assert len(list(stub.DraftWindows(iter([drafter_pb2.DraftRequest(session_id=session, context_length=5,
                                                                             k=2)])))) == 1
        time.sleep(ORPHAN_TTL_S / 2)
        stub.Draft(drafter_pb2.DraftRequest(session_id=kept, context_length=5, k=2))  # its caller is back
        time.sleep(0.7 * ORPHAN_TTL_S)
        assert stub.Info(common_pb2.InfoRequest()).open_sessions == 1  # kept alone, by its unary call
    finally:
        server.stop()


def test_a_caller_that_stops_answering_is_dropped_by_keepalive_and_its_session_goes(target):
    """A caller's host that dies or is cut off sends no FIN, so its connection stayed open and its
    session lived on; a stopped process stands in for it here (it answers no HTTP/2 ping)."""
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(target))
    caller = subprocess.Popen([sys.executable, "-c", CALLER, target], stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout.readline().strip() and open_sessions(stub) == 1
        time.sleep(3)
        assert open_sessions(stub) == 1  # alive: it answers the pings
        caller.send_signal(signal.SIGSTOP)
        assert until_no_sessions(stub, within_s=20) == 0
    finally:
        caller.kill()
        caller.wait(timeout=30)


def replica(tiny_dir, service: str) -> BackgroundServer:
    """A started target (tiny vocab-16 model) or n-gram drafter with the short orphan TTL."""
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter

    if service == "target":
        config = TargetConfig(model=str(tiny_dir["target16"]), orphaned_session_ttl_s=ORPHAN_TTL_S)
        server = BackgroundServer(lambda: serve(config, load_causal_lm(str(tiny_dir["target16"]), tokenizer=False)))
    else:
        server = BackgroundServer(lambda: serve_drafter(DrafterConfig(orphaned_session_ttl_s=ORPHAN_TTL_S)))
    return server.start()


def opened(server: BackgroundServer, service: str, count: int) -> tuple:
    """(the replica's stub, ``count`` sessions opened on it: prompt [3, 1, 4] on a target, [3, 1, 4, 3, 1] on a drafter)."""
    from mirrorspec.v1 import drafter_pb2, drafter_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    params = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=50)
    if service == "target":
        stub = target_pb2_grpc.TargetServiceStub(channel)
        request = target_pb2.OpenTargetSessionRequest(prompt_ids=[3, 1, 4], params=params)
    else:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        request = drafter_pb2.OpenDraftSessionRequest(prompt_ids=[3, 1, 4, 3, 1], params=params)
    return stub, [stub.OpenSession(request).session_id for _ in range(count)]


@pytest.mark.parametrize("service", ["target", "drafter"])
def test_a_session_whose_last_call_was_unary_goes_after_the_orphan_ttl_too(tiny_dir, service):
    """Mirror windows with hints (Verify) and branch drafts (DraftBranches) are unary calls: a
    front door that died after one left its sessions for the ten-minute TTL. Each unary window call
    orphans its session as it ends; the next call (milliseconds later from a live caller) keeps it."""
    from mirrorspec.v1 import drafter_pb2

    server = replica(tiny_dir, service)
    try:
        stub, sessions = opened(server, service, 3)
        if service == "target":
            window = lambda s: target_pb2.VerifyRequest(session_id=s, context_length=3, hints=True)  # noqa: E731
            calls = [lambda s: list(stub.Verify(window(s))), lambda s: stub.VerifyWindow(window(s))]
        else:
            calls = [lambda s: stub.DraftBranches(drafter_pb2.DraftRequest(session_id=s, context_length=5, k=2,
                                                                           branch_tokens=[3])),
                     lambda s: stub.RankTokens(drafter_pb2.DraftRequest(session_id=s, context_length=5, k=2))]
        for session, call in zip(sessions, calls):
            call(session)
        # the third session is a live caller's: unary calls keep coming, each within the orphan TTL
        for _ in range(4):
            calls[0](sessions[2])
            time.sleep(ORPHAN_TTL_S / 2)
        assert stub.Info(common_pb2.InfoRequest()).open_sessions == 1
    finally:
        server.stop()


@pytest.mark.parametrize("service", ["target", "drafter"])
def test_a_window_stream_carries_one_session_and_refuses_a_second(tiny_dir, service):
    """A stream that went on to another session's windows orphaned only the last as it ended: the
    first kept the ten-minute TTL (review 2 of stop 43). The second is refused, naming the field,
    and the first is orphaned as the refused stream ends."""
    from mirrorspec.v1 import drafter_pb2

    server = replica(tiny_dir, service)
    try:
        stub, (first, second) = opened(server, service, 2)
        if service == "target":
            stream = stub.VerifyWindows(iter([target_pb2.VerifyRequest(session_id=s, context_length=3)
                                              for s in (first, second)]))
        else:
            stream = stub.DraftWindows(iter([drafter_pb2.DraftRequest(session_id=s, context_length=5, k=2)
                                             for s in (first, second)]))
        answered = []
        with pytest.raises(grpc.RpcError) as refused:
            for answer in stream:
                answered.append(answer)
        assert len(answered) == 1 and refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "one stream per session" in refused.value.details() and second in refused.value.details()
        time.sleep(1.5 * ORPHAN_TTL_S)
        assert stub.Info(common_pb2.InfoRequest()).open_sessions == 0  # the first orphaned, the second never called
    finally:
        server.stop()


def test_an_open_the_front_door_gave_up_on_is_closed_where_it_opened_late(tiny_dir, monkeypatch):
    """A drafter busy past a request's deadline opened its session after the front door had given
    up on the open: the answer naming the session was dropped, and the session held a slot for the
    orphan TTL (a review's 1-59 ms deadlines left one behind in 4 of 40 requests; on a target at
    its --max-sessions, valid requests were refused for a minute). The front door chooses the id
    it opens with, and closes that id when an open fails."""
    from drafter_service.servicer import DrafterServicer
    from mirrorspec.client import Client
    from mirrorspec.v1 import drafter_pb2_grpc
    from served_stack import start_stack

    opened = []
    open_session = DrafterServicer.OpenSession

    async def busy_then_open(self, request, context):
        time.sleep(1.0)  # the drafter's event loop busy (no await between): the deadline passes meanwhile
        opened.append(await open_session(self, request, context))
        return opened[-1]

    monkeypatch.setattr(DrafterServicer, "OpenSession", busy_then_open)
    stack = start_stack(tiny_dir["target16"], tiny_dir["draft16"])
    try:
        with Client(stack.address, timeout_s=0.5) as client:  # target-only once the drafter's open fails
            assert len(client.generate([3, 1, 4, 1, 5], max_tokens=8).token_ids) == 8
        drafter = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.drafter.port}"))
        assert until_no_sessions(drafter, within_s=10) == 0 and len(opened) == 1 and opened[0].session_id
    finally:
        stack.stop()


def test_an_orphan_on_a_replica_no_call_comes_to_is_evicted_all_the_same(tiny_dir, monkeypatch):
    """Stores evicted only as a session opened or Info came: on an idle replica a crashed front
    door's sessions kept their KV caches until the next call, not for the orphan TTL."""
    import target_service.servicer as target_servicer
    from mirrorspec.models import KVSession

    closed: list[int] = []

    class Recorded(KVSession):
        def close(self):
            closed.append(len(self.tokens))
            super().close()

    monkeypatch.setattr(target_servicer, "KVSession", Recorded)
    config = TargetConfig(model=str(tiny_dir["target16"]), orphaned_session_ttl_s=ORPHAN_TTL_S)
    server = BackgroundServer(lambda: serve(config)).start()
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[3, 1, 4],
                                                             params=common_pb2.SamplingParams(max_new_tokens=4)))
        deadline = time.monotonic() + ORPHAN_TTL_S + 10
        while not closed and time.monotonic() < deadline:  # no call: Info would evict it itself
            time.sleep(0.1)
        assert closed == [3]
        assert server.call(lambda: len(server.servicer.sessions)) == 0
    finally:
        server.stop()
