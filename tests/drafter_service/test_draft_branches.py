"""DraftBranches with fork points: guesses at every rejection point of a window in one call, each
the draft a fresh session on its own context gives; replicas built before fork points are asked
one fork point at a time."""

import grpc
import pytest
import torch

from drafter_service.servicer import DrafterConfig, DrafterServicer
from mirrorspec import SamplingParams
from mirrorspec.drafting import DraftModelDrafter
from mirrorspec.models import load_causal_lm
from mirrorspec.serving.convert import proposal_from_proto
from mirrorspec.serving.server import BackgroundServer, Service, start_grpc_server
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from orchestrator.pool import ReplicaPool
from orchestrator.remote import RemoteDrafter
from support import load

TOP_K = 4


class CountingDrafter(DrafterServicer):
    """A real drafter that counts its DraftBranches calls; ``honours_forks=False`` makes it one
    built before branch_forks, which does not know the field and drafts every branch at the end."""

    def __init__(self, *args, honours_forks: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.honours_forks = honours_forks
        self.branch_calls = 0

    async def DraftBranches(self, request, context):
        self.branch_calls += 1
        if not self.honours_forks:
            del request.branch_forks[:]
        return await super().DraftBranches(request, context)


@pytest.fixture(scope="module")
def drafters(tiny_dir):
    config = DrafterConfig(strategy="draft-model", model=str(tiny_dir["draft16"]), proposal_top_k=TOP_K)
    loaded = load_causal_lm(str(tiny_dir["draft16"]), tokenizer=False)
    servicers = {honours: CountingDrafter(config, loaded, honours_forks=honours) for honours in (True, False)}
    servers = {honours: BackgroundServer(lambda s=servicer: start_grpc_server(
        [Service(drafter_pb2_grpc.add_DrafterServiceServicer_to_server, s, "mirrorspec.v1.DrafterService")],
        "127.0.0.1", 0)).start() for honours, servicer in servicers.items()}
    yield {honours: (f"127.0.0.1:{server.port}", servicers[honours]) for honours, server in servers.items()}
    for server in servers.values():
        server.stop()


def assert_same_draft(got, want):
    assert got.tokens == want.tokens
    assert torch.allclose(got.q.dense(16), want.q.dense(16), atol=1e-5)
    # the drafter's runner-ups and its probabilities of them cross the wire too (mirror ranks by them)
    assert got.alternatives == want.alternatives
    assert len(got.alternative_probs) == len(want.alternative_probs) == len(want.tokens)
    for row, expected in zip(got.alternative_probs, want.alternative_probs):
        assert row == pytest.approx(expected, abs=1e-5)


def test_branches_at_every_fork_point_come_from_one_call(drafters, tiny_dir):
    address, servicer = drafters[True]
    stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(address))
    params = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=8)
    sid = stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=[0, 1], params=params, seed=5)).session_id
    head, tokens, forks = [0, 1, 2, 9, 4], [9, 3, 11, 6], [5, 2, 3, 4]
    calls = servicer.branch_calls
    response = stub.DraftBranches(drafter_pb2.DraftRequest(session_id=sid, commit_tokens=head[2:], context_length=5,
                                                           k=3, branch_tokens=tokens, branch_forks=forks))
    assert response.forked and servicer.branch_calls == calls + 1
    local = DraftModelDrafter(load(tiny_dir["draft16"]), proposal_top_k=TOP_K)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8)
    for fork, token, draft in zip(forks, tokens, response.drafts):
        assert_same_draft(proposal_from_proto(draft.tokens, draft.q, 16, draft.alternatives),
                          local.propose([*head[:fork], token], 3, sampled, seed=5))
    bad = {"2 fork points for 4": [5, 2], "branch_forks[3]=6 is outside": [5, 2, 3, 6],
           "branch_forks[0]=0 is outside": [0, 2, 3, 4]}
    for needle, forks in bad.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.DraftBranches(drafter_pb2.DraftRequest(session_id=sid, context_length=5, k=2, branch_tokens=tokens,
                                                        branch_forks=forks))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "branch_forks" in err.value.details() and needle in err.value.details()
    assert stub.Draft(drafter_pb2.DraftRequest(session_id=sid, context_length=5, k=2)).tokens  # still serving


def test_a_branch_after_the_drafter_s_own_next_token_comes_last_and_names_it(drafters, tiny_dir):
    address, _ = drafters[True]
    stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(address))
    params = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=8)
    sid = stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=[0, 1], params=params, seed=5)).session_id
    local = DraftModelDrafter(load(tiny_dir["draft16"]), proposal_top_k=TOP_K)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8)
    head = [0, 1, 2, 9, 4]
    own = local.propose(head, 1, SamplingParams(max_new_tokens=1), seed=5).tokens[0]
    for tokens, forks in (([9, 3], [5, 2]), ([], [])):  # beside named branches, or alone
        response = stub.DraftBranches(drafter_pb2.DraftRequest(
            session_id=sid, commit_tokens=head[2:], context_length=5, k=3, branch_tokens=tokens, branch_forks=forks,
            own_token_branch=True, keep=2))
        assert response.HasField("own_token") and response.own_token == own
        assert len(response.drafts) == len(tokens) + 1
        last = response.drafts[-1]
        assert_same_draft(proposal_from_proto(last.tokens, last.q, 16, last.alternatives),
                          local.propose([*head, own], 3, sampled, seed=5))
    # without it, no own_token; with 16 named branches there is no room for it
    plain = stub.DraftBranches(drafter_pb2.DraftRequest(session_id=sid, context_length=5, k=2, branch_tokens=[3]))
    assert not plain.HasField("own_token") and len(plain.drafts) == 1
    with pytest.raises(grpc.RpcError) as err:
        stub.DraftBranches(drafter_pb2.DraftRequest(session_id=sid, context_length=5, k=2, branch_tokens=[3] * 16,
                                                    own_token_branch=True))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "1 to 16 branches" in err.value.details()


@pytest.mark.parametrize("honours_forks", [True, False], ids=["current", "before-branch-forks"])
def test_a_remote_drafter_gets_the_same_branches_from_either_vintage(drafters, tiny_dir, honours_forks, request):
    address, servicer = drafters[honours_forks]
    pool = ReplicaPool("drafter", [address], drafter_pb2_grpc.DrafterServiceStub)
    request.addfinalizer(pool.close)
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    prompt, window = [0, 1, 2], [5, 3, 9]
    remote = RemoteDrafter(pool, prompt, params, 7, 16, timeout_s=30)
    local = DraftModelDrafter(load(tiny_dir["draft16"]), proposal_top_k=TOP_K)
    head, tokens, forks = [*prompt, *window], [4, 11, 6, 4], [6, 3, 4, 5]
    calls = servicer.branch_calls
    for _ in range(2):  # a replica found not to honour fork points is asked one point at a time from then on
        for fork, token, branch in zip(forks, tokens, remote.propose_branches(head, tokens, 3, params, 7, forks)):
            assert_same_draft(branch, local.propose([*head[:fork], token], 3, params, seed=7))
    assert servicer.branch_calls - calls == (2 if honours_forks else 1 + 4 + 4)
    assert remote.failure is None
    remote.release()
