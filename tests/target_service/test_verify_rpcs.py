"""VerifyWindows (a stream of windows) and VerifyWindow (unary) against Verify (server streaming):
the same verdicts, and callers that fall back a step on a target built before either, over real
loopback gRPC servers."""

import queue
import random

import grpc
import pytest

from mirrorspec import SamplingParams, SpeculationConfig
from mirrorspec.drafting import DraftModelDrafter
from mirrorspec.engine import GenerationStats, decode_windows
from mirrorspec.models import load_causal_lm
from mirrorspec.serving.server import BackgroundServer, Service, start_grpc_server
from mirrorspec.v1 import common_pb2, target_pb2, target_pb2_grpc
from orchestrator.pool import ReplicaPool
from orchestrator.remote import RemoteVerifier
from support import load
from target_service.servicer import TargetConfig, TargetServicer


def sparse_q(tokens):
    """q for drafts drawn with certainty: one row per token, all its mass on that token."""
    from mirrorspec.codec import encode_tensor
    import torch

    q = common_pb2.ProposalDistribution(probs=common_pb2.TensorFrame(frame=encode_tensor(torch.ones(len(tokens), 1))))
    q.ids.frame = encode_tensor(torch.tensor([[t] for t in tokens], dtype=torch.int32))
    return q


class _HandlerRecorder:
    """Stands in for a server to read the method handlers a generated add_*_to_server registers."""

    def add_generic_rpc_handlers(self, handlers):
        pass

    def add_registered_method_handlers(self, service, handlers):
        self.handlers = handlers


def target_without(*methods):
    """How a target built before ``methods`` registers: callers of them get UNIMPLEMENTED."""
    def add_to_server(servicer, server):
        recorder = _HandlerRecorder()
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, recorder)
        handlers = {name: h for name, h in recorder.handlers.items() if name not in methods}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("mirrorspec.v1.TargetService",
                                                                              handlers),))
    return add_to_server


VINTAGES = {"current": (), "before VerifyWindows": ("VerifyWindows",),
            "before VerifyWindow": ("VerifyWindows", "VerifyWindow")}


@pytest.fixture(scope="module")
def targets(tiny_dir):
    """A current target, and targets that predate the window stream and the unary verify, on
    the same model."""
    config = TargetConfig(model=str(tiny_dir["target16"]))
    loaded = load_causal_lm(str(tiny_dir["target16"]), tokenizer=False)
    servers = {vintage: BackgroundServer(lambda missing=missing: start_grpc_server(
        [Service(target_without(*missing), TargetServicer(loaded, config), "mirrorspec.v1.TargetService")],
        "127.0.0.1", 0)).start() for vintage, missing in VINTAGES.items()}
    yield {vintage: f"127.0.0.1:{server.port}" for vintage, server in servers.items()}
    for server in servers.values():
        server.stop()


def test_every_way_to_verify_gives_the_same_verdicts(targets):
    """Triplet sessions with the same seed, each verified window by window through one RPC (the
    stream's windows all on one stream), sampled: every verdict (accepted count, next token and
    its kind) is the same."""
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(targets["current"]))
    params = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=100)
    prompt = [3, 1, 4]
    streamed, unary, windowed = (stub.OpenSession(target_pb2.OpenTargetSessionRequest(
        prompt_ids=prompt, params=params, seed=5)).session_id for _ in range(3))
    windows = queue.SimpleQueue()
    window_verdicts = stub.VerifyWindows(iter(windows.get, None))
    rng = random.Random(0)
    context, commit, kinds = list(prompt), [], set()
    for _ in range(25):
        drafts = [rng.randrange(16) for _ in range(rng.randrange(4))]
        fields = dict(commit_tokens=commit, context_length=len(context) + len(commit), draft_tokens=drafts)
        if drafts:
            fields["q"] = sparse_q(drafts)
        (event,) = stub.Verify(target_pb2.VerifyRequest(session_id=streamed, **fields))
        verdict = stub.VerifyWindow(target_pb2.VerifyRequest(session_id=unary, **fields))
        windows.put(target_pb2.VerifyRequest(session_id=windowed, **fields))
        on_stream = next(window_verdicts)
        assert (verdict.num_accepted, verdict.next_token, verdict.next_kind) == (
            event.verdict.num_accepted, event.verdict.next_token, event.verdict.next_kind) == (
            on_stream.num_accepted, on_stream.next_token, on_stream.next_kind)
        kinds.add(verdict.next_kind)
        context += commit
        commit = drafts[:verdict.num_accepted] + [verdict.next_token]
    assert len(kinds) >= 2  # windows ended both ways: a recovered token and a bonus one (or a plain step)
    windows.put(None)
    assert list(window_verdicts) == []  # the stream ends once the caller half-closes
    for sid in (streamed, unary, windowed):
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid))


def decode_through(address, tiny_dir, params):
    """Tokens of one request decoded with an in-process draft and the target at ``address``, and
    whether its verifier still verifies on a stream, and by VerifyWindow, at the end."""
    prompt = [2, 7, 7]
    with ReplicaPool("target", [address], target_pb2_grpc.TargetServiceStub) as pool:
        verifier = RemoteVerifier(pool, prompt, params, 9, 16, timeout_s=30)
        drafter = DraftModelDrafter(load(tiny_dir["draft16"]))
        tokens = [t for event in decode_windows(drafter, verifier, prompt, params,
                                                SpeculationConfig(num_speculative_tokens=3), 9, GenerationStats())
                  for t in event.tokens]
        verifier.release()
    return tokens, (verifier.streams, verifier._unary)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_older_target_is_verified_the_way_it_knows(targets, tiny_dir, temperature):
    params = SamplingParams(max_new_tokens=40, temperature=temperature)
    decoded = {vintage: decode_through(address, tiny_dir, params) for vintage, address in targets.items()}
    assert all(tokens == decoded["current"][0] for tokens, _ in decoded.values())
    assert len(decoded["current"][0]) == 40
    assert {vintage: ways for vintage, (_, ways) in decoded.items()} == {
        "current": (True, True), "before VerifyWindows": (False, True), "before VerifyWindow": (False, False)}


def test_runner_up_windows_over_the_wire_decode_what_the_target_alone_does(targets, tiny_dir):
    """A front door's RemoteVerifier offering the draft's runner-up (what ``serve`` does by default):
    greedy output equals target-only decoding, a seeded sampled request equals the same window
    loop verified in process (the target server runs the same second round at the same uniforms),
    and runner-ups do win windows on the wire, greedy and sampled."""
    import torch

    from mirrorspec import generate
    from mirrorspec.engine import TargetVerifier
    from mirrorspec.models import KVSession

    target, draft = load(tiny_dir["target16"]), load(tiny_dir["target16"])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the target with seeded noise: it agrees at about a third of positions
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.5 * weight.std())
    pool = ReplicaPool("target", [targets["current"]], target_pb2_grpc.TargetServiceStub)

    def decode(verifier, prompt, params, stats):
        config = SpeculationConfig(num_speculative_tokens=3)
        return [t for event in decode_windows(DraftModelDrafter(draft), verifier, prompt, params, config, 9, stats)
                for t in event.tokens]

    hits = {"greedy": 0, "sampled": 0}
    for prompt in ([2, 7, 7], [5, 1], [9, 3, 3, 12], [0, 14, 6]):
        for kind, params in (("greedy", SamplingParams(max_new_tokens=30)),
                             ("sampled", SamplingParams(temperature=1.0, max_new_tokens=30))):
            verifier = RemoteVerifier(pool, prompt, params, 9, 16, timeout_s=30, runner_up=True)
            stats = GenerationStats()
            tokens = decode(verifier, prompt, params, stats)
            verifier.release()
            if kind == "greedy":
                assert tokens == generate(target, None, prompt, params).token_ids
            else:
                assert tokens == decode(TargetVerifier(KVSession(target), runner_up=True), prompt, params,
                                        GenerationStats())
            hits[kind] += stats.runner_up_hits
    pool.close()
    assert all(hits.values()), hits


def test_a_window_or_run_past_the_context_window_is_refused_up_front_naming_what_to_lower(targets):
    """A window whose commit fills the context was blamed on draft_tokens (there were none), and a
    RunWindows asking for more tokens than the context holds ran until it was full, then failed
    with its tokens committed (a review's hostile client)."""
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(targets["current"]))
    params = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=1)
    session = stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[3, 1, 4], params=params)).session_id
    cases = [  # the tiny target's context window: 128
        (dict(commit_tokens=[1] * 125, context_length=128), "commit_tokens", "leaves no room for a next token"),
        (dict(commit_tokens=[1] * 124, context_length=127, draft_tokens=[2], q=sparse_q([2])), "draft_tokens",
         "1 draft tokens would pass the context window of 128: send at most 0"),
    ]
    for fields, field, says in cases:
        with pytest.raises(grpc.RpcError) as refused:
            stub.VerifyWindow(target_pb2.VerifyRequest(session_id=session, **fields))
        assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE and says in refused.value.details()
        assert dict(refused.value.trailing_metadata())["mirrorspec-field"] == field
    with pytest.raises(grpc.RpcError) as refused:
        next(stub.RunWindows(target_pb2.RunWindowsRequest(
            session_id=session, context_length=3, drafter_address="127.0.0.1:1", drafter_session_id="d",
            drafter_context_length=3, k=2, max_new_tokens=2**32 - 1)))
    assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "max_new_tokens=4294967295 would pass the context window of 128 after the context's 3 tokens: at most " \
           "125" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:  # told "at most 0" before, which the check above refuses
        next(stub.RunWindows(target_pb2.RunWindowsRequest(
            session_id=session, context_length=128, drafter_address="127.0.0.1:1", drafter_session_id="d",
            drafter_context_length=3, k=2, max_new_tokens=1)))
    assert "context_length 128 leaves no room for a token" in refused.value.details()
    assert dict(refused.value.trailing_metadata())["mirrorspec-field"] == "context_length"
    # the session was left as it was: a window that fits is verified
    assert stub.VerifyWindow(target_pb2.VerifyRequest(session_id=session, context_length=3)).next_token < 16


@pytest.mark.parametrize("hints", [True, False])
def test_a_verify_whose_caller_gave_up_before_the_lane_reached_it_never_runs(tiny_dir, monkeypatch, hints):
    """A hinted Verify left its verify queued when its caller went: asyncio.wait cancels nothing it
    waits on, so the forward ran later on a session whose lock was let go (a review's find)."""
    import threading
    import time

    import torch

    import target_service.servicer as target_servicer
    from mirrorspec.models import KVSession
    from mirrorspec.sampling.proposal import ProposalRows
    from mirrorspec.serving.convert import proposal_to_proto
    from target_service.servicer import serve as serve_target

    forwards: list[int] = []

    class Recorded(KVSession):
        def _extend(self, context, num_positions, runner_up=None):
            forwards.append(len(context))
            return super()._extend(context, num_positions, runner_up)

    monkeypatch.setattr(target_servicer, "KVSession", Recorded)
    server = BackgroundServer(lambda: serve_target(TargetConfig(model=str(tiny_dir["target16"]), hint_layer=1,
                                                                hint_lens="logit"))).start()
    release = threading.Event()
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        session = stub.OpenSession(target_pb2.OpenTargetSessionRequest(
            prompt_ids=[1, 2, 3, 4, 5, 6], params=common_pb2.SamplingParams(max_new_tokens=8))).session_id
        forwards.clear()
        server.servicer.lane._pool.submit(release.wait, 30)  # another session's long forward holds the lane
        q = torch.zeros(2, 16)
        q[0, 3] = q[1, 4] = 1.0
        request = target_pb2.VerifyRequest(session_id=session, context_length=6, draft_tokens=[3, 4], hints=hints,
                                           q=proposal_to_proto(ProposalRows(probs=q)))
        with pytest.raises(grpc.RpcError) as gave_up:
            list(stub.Verify(request, timeout=0.3)) if hints else stub.VerifyWindow(request, timeout=0.3)
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.3)  # the server has seen the caller go
        release.set()
        time.sleep(0.5)
        assert forwards == []
        verdict = stub.VerifyWindow(request, timeout=30)  # the session serves the caller's retry
        assert forwards and verdict.num_accepted <= 2
    finally:
        release.set()
        server.stop()
