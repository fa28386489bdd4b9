"""Window calls as messages on one stream: the same answers as unary calls, a per-window
deadline, and a stream that reopens after an error, over real loopback gRPC servers."""

import asyncio
import threading
import time

import grpc
import pytest

from drafter_service.servicer import DrafterConfig
from drafter_service.servicer import serve as serve_drafter
from mirrorspec import SamplingParams
from mirrorspec.drafting import Proposal
from mirrorspec.serving.server import BackgroundServer, Service, start_grpc_server
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, target_pb2, target_pb2_grpc
from orchestrator.pool import ReplicaPool
from orchestrator.remote import RemoteVerifier
from orchestrator.window_stream import Watchdog, WindowStream
from target_service.servicer import TargetConfig
from target_service.servicer import serve as serve_target


class FakeCall:
    def __init__(self):
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()


def test_the_watchdog_cancels_only_the_calls_whose_deadline_passed():
    watchdog = Watchdog("test-deadlines")
    late, answered, pending = FakeCall(), FakeCall(), FakeCall()
    try:
        armed_late = watchdog.arm(0.2, late)
        armed_answered = watchdog.arm(0.2, answered)
        assert watchdog.disarm(armed_answered) is False  # answered in time
        armed_pending = watchdog.arm(600, pending)
        assert late.cancelled.wait(30)
        assert watchdog.disarm(armed_late) is True
        assert not answered.cancelled.is_set() and not pending.cancelled.is_set()
        assert watchdog.disarm(armed_pending) is False
    finally:
        watchdog.stop()


class SlowAnswers:
    """A stream that answers each request after ``delay_s``, whether or not it was cancelled
    meanwhile: the answer and the watchdog's cancel cross."""

    def __init__(self, requests, delay_s: float):
        self.requests, self.delay_s = requests, delay_s
        self.cancelled = threading.Event()

    def __next__(self):
        request = next(self.requests)
        time.sleep(self.delay_s)
        return request

    def cancel(self):
        self.cancelled.set()


def test_a_deadline_that_fires_as_the_answer_comes_leaves_the_next_window_a_new_stream():
    """The answer is returned; the stream the watchdog cancelled is not used again (the next
    window would read CANCELLED from it and take a healthy replica for gone)."""
    opened: list[SlowAnswers] = []

    def open_stream(requests):
        opened.append(SlowAnswers(requests, delay_s=0.2))
        return opened[-1]

    watchdog = Watchdog("test-deadlines")
    stream = WindowStream(open_stream, watchdog)
    try:
        assert stream.call("first", timeout_s=0.01) == "first"
        assert opened[0].cancelled.is_set()  # the deadline fired before the answer came
        assert stream.call("second", timeout_s=30) == "second"
        assert len(opened) == 2 and not opened[1].cancelled.is_set()
    finally:
        stream.close()
        watchdog.stop()


@pytest.fixture(scope="module")
def target(tiny_dir):
    server = BackgroundServer(lambda: serve_target(TargetConfig(model=str(tiny_dir["target16"])))).start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


def test_an_error_ends_the_stream_and_the_next_window_opens_another(target):
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(target))
    params = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=10)
    sid = stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[1, 2], params=params)).session_id
    watchdog = Watchdog("test-deadlines")
    stream = WindowStream(stub.VerifyWindows, watchdog)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stream.call(target_pb2.VerifyRequest(session_id="nope", context_length=2), timeout_s=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "OpenSession" in err.value.details()
        first = stream.call(target_pb2.VerifyRequest(session_id=sid, context_length=2), timeout_s=30)
        second = stream.call(target_pb2.VerifyRequest(session_id=sid, commit_tokens=[first.next_token],
                                                      context_length=3), timeout_s=30)
        assert second.next_kind == common_pb2.TOKEN_KIND_BONUS
    finally:
        stream.close()
        watchdog.stop()


class HangingTarget(target_pb2_grpc.TargetServiceServicer):
    """Opens sessions, then never answers a window: a replica that is up but stuck."""

    async def OpenSession(self, request, context):
        return target_pb2.OpenTargetSessionResponse(session_id="stuck")

    async def CloseSession(self, request, context):
        return common_pb2.CloseSessionResponse()

    async def VerifyWindows(self, requests, context):
        async for _ in requests:
            await asyncio.sleep(3600)
            yield target_pb2.Verdict()


def test_a_window_on_a_stream_has_its_deadline_like_a_unary_call():
    server = BackgroundServer(lambda: start_grpc_server(
        [Service(target_pb2_grpc.add_TargetServiceServicer_to_server, HangingTarget(),
                 "mirrorspec.v1.TargetService")], "127.0.0.1", 0)).start()
    pool = ReplicaPool("target", [f"127.0.0.1:{server.port}"], target_pb2_grpc.TargetServiceStub)
    params = SamplingParams(max_new_tokens=10)
    try:
        verifier = RemoteVerifier(pool, [1, 2], params, 0, 16, timeout_s=0.5)
        with pytest.raises(grpc.RpcError) as err:
            verifier.verify([1, 2], Proposal.empty(), params, 0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "0.5 s" in err.value.details()
        verifier.release()
    finally:
        pool.close()
        server.stop(grace=0)


def test_drafts_on_a_stream_are_the_drafts_of_unary_calls(tiny_dir):
    """Twin sessions with one seed, sampled, one drafted by Draft calls and one by messages on
    DraftWindows: the same tokens and q, window after window."""
    server = BackgroundServer(lambda: serve_drafter(DrafterConfig(
        strategy="draft-model", model=str(tiny_dir["draft16"]), proposal_top_k=4))).start()
    stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    params = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=60)
    unary, streamed = (stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=[3, 1], params=params,
                                                                           seed=7)).session_id for _ in range(2))
    watchdog = Watchdog("test-deadlines")
    stream = WindowStream(stub.DraftWindows, watchdog)
    try:
        context, commit = [3, 1], []
        for window in range(8):
            fields = dict(commit_tokens=commit, context_length=len(context) + len(commit), k=3)
            one = stub.Draft(drafter_pb2.DraftRequest(session_id=unary, **fields))
            other = stream.call(drafter_pb2.DraftRequest(session_id=streamed, **fields), timeout_s=30)
            assert list(one.tokens) == list(other.tokens) and len(one.tokens) == 3
            assert one.q == other.q
            context += commit
            commit = list(one.tokens[:window % 3]) + [window % 16]  # accept a few, then a token of "the target"
    finally:
        stream.close()
        watchdog.stop()
        server.stop()
