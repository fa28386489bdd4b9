import torch

from mirrorspec import SamplingParams
from mirrorspec.drafting import DraftModelDrafter


def test_greedy_drafts_follow_the_draft_models_argmax(tiny_draft):
    proposal = DraftModelDrafter(tiny_draft).propose([0, 3, 5], 4, SamplingParams(), seed=0)
    context = [0, 3, 5]
    for token in proposal.tokens:
        with torch.inference_mode():
            assert token == int(tiny_draft(torch.tensor([context])).logits[0, -1].argmax())
        context.append(token)
    assert proposal.q.dense(8).max(-1).values.tolist() == [1.0] * 4


def test_sparse_q_has_top_k_support_and_contains_the_draft(tiny_draft):
    params = SamplingParams(temperature=1.0)
    proposal = DraftModelDrafter(tiny_draft, proposal_top_k=3).propose([0, 3, 5], 5, params, seed=11)
    assert proposal.q.ids.shape == (5, 3)
    for token, ids, probs in zip(proposal.tokens, proposal.q.ids, proposal.q.probs):
        assert token in ids.tolist()
        assert abs(float(probs.sum()) - 1.0) < 1e-6


def test_same_seed_same_drafts_whatever_the_cache_state(tiny_draft):
    params = SamplingParams(temperature=1.0)
    drafter = DraftModelDrafter(tiny_draft)
    first = drafter.propose([0, 3, 5], 4, params, seed=5)
    drafter.propose([0, 1, 1, 1, 1], 4, params, seed=9)  # leave a different cache behind
    assert drafter.propose([0, 3, 5], 4, params, seed=5).tokens == first.tokens
