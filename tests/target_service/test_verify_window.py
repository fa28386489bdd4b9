"""VerifyWindow (unary) against Verify (server streaming): the same verdicts, and callers that
fall back to Verify on a target built before VerifyWindow, over real loopback gRPC servers."""

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
from target_service.servicer import serve as serve_target


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


def add_target_without_verify_window(servicer, server):
    """How a target built before VerifyWindow registers: callers of it get UNIMPLEMENTED."""
    recorder = _HandlerRecorder()
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, recorder)
    handlers = {name: h for name, h in recorder.handlers.items() if name != "VerifyWindow"}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("mirrorspec.v1.TargetService",
                                                                          handlers),))


@pytest.fixture(scope="module")
def targets(tiny_dir):
    """A current target and one that predates VerifyWindow, on the same model."""
    current = BackgroundServer(lambda: serve_target(TargetConfig(model=str(tiny_dir["target16"])))).start()
    config = TargetConfig(model=str(tiny_dir["target16"]))
    old_servicer = TargetServicer(load_causal_lm(str(tiny_dir["target16"]), tokenizer=False), config)
    old = BackgroundServer(lambda: start_grpc_server(
        [Service(add_target_without_verify_window, old_servicer, "mirrorspec.v1.TargetService")],
        "127.0.0.1", 0)).start()
    yield {"current": f"127.0.0.1:{current.port}", "old": f"127.0.0.1:{old.port}"}
    old.stop()
    current.stop()


def test_verify_window_gives_the_verdicts_verify_gives(targets):
    """Twin sessions with the same seed, one verified window by window through each RPC, sampled:
    every verdict (accepted count, next token and its kind) is the same."""
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(targets["current"]))
    params = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=100)
    prompt = [3, 1, 4]
    streamed, unary = (stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=prompt, params=params,
                                                                              seed=5)).session_id for _ in range(2))
    rng = random.Random(0)
    context, commit, kinds = list(prompt), [], set()
    for _ in range(25):
        drafts = [rng.randrange(16) for _ in range(rng.randrange(4))]
        fields = dict(commit_tokens=commit, context_length=len(context) + len(commit), draft_tokens=drafts)
        if drafts:
            fields["q"] = sparse_q(drafts)
        (event,) = stub.Verify(target_pb2.VerifyRequest(session_id=streamed, **fields))
        verdict = stub.VerifyWindow(target_pb2.VerifyRequest(session_id=unary, **fields))
        assert (verdict.num_accepted, verdict.next_token, verdict.next_kind) == (
            event.verdict.num_accepted, event.verdict.next_token, event.verdict.next_kind)
        kinds.add(verdict.next_kind)
        context += commit
        commit = drafts[:verdict.num_accepted] + [verdict.next_token]
    assert len(kinds) >= 2  # windows ended both ways: a recovered token and a bonus one (or a plain step)
    for sid in (streamed, unary):
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid))


def decode_through(address, tiny_dir, params):
    """Tokens of one request decoded with an in-process draft and the target at ``address``, and
    whether its verifier still verifies by VerifyWindow at the end."""
    pool = ReplicaPool("target", [address], target_pb2_grpc.TargetServiceStub)
    prompt = [2, 7, 7]
    verifier = RemoteVerifier(pool, prompt, params, 9, 16, timeout_s=30)
    drafter = DraftModelDrafter(load(tiny_dir["draft16"]))
    tokens = [t for event in decode_windows(drafter, verifier, prompt, params,
                                            SpeculationConfig(num_speculative_tokens=3), 9, GenerationStats())
              for t in event.tokens]
    verifier.release()
    return tokens, verifier._unary


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_target_without_verify_window_is_verified_by_verify_instead(targets, tiny_dir, temperature):
    params = SamplingParams(max_new_tokens=40, temperature=temperature)
    on_current, unary_on_current = decode_through(targets["current"], tiny_dir, params)
    on_old, unary_on_old = decode_through(targets["old"], tiny_dir, params)
    assert on_old == on_current and len(on_old) == 40
    assert unary_on_current and not unary_on_old
