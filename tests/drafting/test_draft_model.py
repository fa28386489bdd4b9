import pytest
import torch

from mirrorspec import SamplingParams
from mirrorspec.drafting import DraftModelDrafter, RankedTokens


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


def own_confidences(model, context, tokens, vocab=None) -> list[float]:
    """The draft's temperature-1 probability of each token after the ones before it, computed
    independently of the drafter (over ``vocab`` where it drafts from a sub-vocabulary)."""
    out = []
    for i, token in enumerate(tokens):
        with torch.inference_mode():
            logits = model(torch.tensor([[*context, *tokens[:i]]])).logits[0, -1].float()
        probs = logits[vocab].softmax(-1) if vocab else logits.softmax(-1)
        out.append(float(probs[vocab.index(token)] if vocab else probs[token]))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_window_ends_after_the_first_token_the_draft_is_unsure_of(tiny_dir, temperature):
    """The unsure token is still proposed (it may pass); the ones after it are not drafted."""
    from support import load

    model, context = load(tiny_dir["draft16"]), [0, 3, 5, 2]
    params = SamplingParams(temperature=temperature, max_new_tokens=16)
    full = DraftModelDrafter(model).propose(context, 8, params, seed=2)
    sure = own_confidences(model, context, list(full.tokens))
    threshold = sorted(sure)[len(sure) // 2]  # about half the drafts are unsure
    first_unsure = next(i for i, c in enumerate(sure) if c < threshold)
    cut = DraftModelDrafter(model, confidence=threshold).propose(context, 8, params, seed=2)
    assert cut.tokens == full.tokens[:first_unsure + 1] and len(cut) < len(full)
    assert torch.equal(cut.q.dense(16), full.q.dense(16)[:first_unsure + 1])


def test_confidence_is_the_drafts_own_over_its_sub_vocabulary(tiny_dir):
    vocab = [1, 2, 4, 8, 9, 12]
    model, context = sub_vocabulary_draft(tiny_dir, vocab), [0, 3, 5]
    full = DraftModelDrafter(model).propose(context, 6, SamplingParams(), seed=0)
    sure = own_confidences(model, context, list(full.tokens), vocab)
    threshold = sorted(sure)[len(sure) // 2]
    first_unsure = next(i for i, c in enumerate(sure) if c < threshold)
    cut = DraftModelDrafter(model, confidence=threshold).propose(context, 6, SamplingParams(), seed=0)
    assert cut.tokens == full.tokens[:first_unsure + 1]


@pytest.mark.parametrize("threshold", [-0.1, 1.0, float("nan"), True])
def test_a_confidence_that_is_not_a_probability_is_refused(tiny_draft, threshold):
    from mirrorspec.config import InvalidRequest

    with pytest.raises(InvalidRequest, match="draft_confidence must be a probability in"):
        DraftModelDrafter(tiny_draft, confidence=threshold)


def sub_vocabulary_draft(tiny_dir, vocab):
    import support
    from mirrorspec.drafting.draft_model import DRAFT_VOCAB_KEY

    model = support.load(tiny_dir["draft16"])
    setattr(model.config, DRAFT_VOCAB_KEY, vocab)
    return model


def test_sub_vocabulary_draft_proposes_only_its_ids_with_matching_q(tiny_dir):
    vocab = [1, 2, 4, 8, 9, 12]
    drafter = DraftModelDrafter(sub_vocabulary_draft(tiny_dir, vocab))
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for seed in range(20):
            proposal = drafter.propose([0, 3, 5], 4, params, seed)
            q = proposal.q.dense(16)  # [4, 16]
            assert set(proposal.tokens) <= set(vocab)
            assert torch.all(q[:, [i for i in range(16) if i not in vocab]] == 0)
            assert torch.allclose(q.sum(-1), torch.ones(4))
            assert all(q[i, t] > 0 for i, t in enumerate(proposal.tokens))


def test_sub_vocabulary_greedy_draft_is_the_argmax_over_its_ids(tiny_dir):
    vocab = [1, 2, 4, 8, 9, 12]
    model = sub_vocabulary_draft(tiny_dir, vocab)
    proposal = DraftModelDrafter(model).propose([0, 3, 5], 3, SamplingParams(), seed=0)
    context = [0, 3, 5]
    for token in proposal.tokens:
        with torch.inference_mode():
            logits = model(torch.tensor([context])).logits[0, -1]
        assert token == vocab[int(logits[vocab].argmax())]
        context.append(token)


@pytest.mark.parametrize("forks", [None, [4, 1, 3, 2]], ids=["one-fork-point", "four-fork-points"])
@pytest.mark.parametrize("stops", [False, True])
@pytest.mark.parametrize("sub_vocabulary", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branches_drafted_together_are_the_branches_drafted_one_by_one(tiny_dir, sub_vocabulary, temperature, stops,
                                                                       forks):
    """One batched forward per step for every branch, wherever in the head it forks: each branch
    is what a fresh draft of its own context gives (stopping where it would stop alone, drawing
    the uniforms of its own positions), and the session goes on as if it had drafted none."""
    from support import load

    model = sub_vocabulary_draft(tiny_dir, [1, 2, 4, 8, 9, 12]) if sub_vocabulary else load(tiny_dir["draft16"])
    params = SamplingParams(temperature=temperature, max_new_tokens=16)
    head, next_tokens, k = [0, 3, 5, 2], [4, 9, 1, 12], 5
    # thresholds at which some branches stop early, at different points (six ids: surer drafts)
    confidence = (0.98 if sub_vocabulary else 0.8) if stops else 0.0
    together = DraftModelDrafter(model, proposal_top_k=4, confidence=confidence)
    together.propose([*head, 7, 7], 2, params, seed=3)  # a cache that holds more than the head
    branches = together.propose_branches(head, next_tokens, k, params, seed=3, fork_points=forks)
    for c, fork, branch in zip(next_tokens, forks or [len(head)] * 4, branches):
        alone = DraftModelDrafter(model, proposal_top_k=4, confidence=confidence).propose([*head[:fork], c], k,
                                                                                          params, seed=3)
        assert branch.tokens == alone.tokens and branch.alternatives == alone.alternatives
        assert torch.allclose(branch.q.dense(16), alone.q.dense(16), atol=1e-6)
    if stops:
        assert len({len(b) for b in branches}) > 1
    after = together.propose([*head, 6], 3, params, seed=3)
    fresh = DraftModelDrafter(model, proposal_top_k=4, confidence=confidence)
    assert after.tokens == fresh.propose([*head, 6], 3, params, seed=3).tokens


def test_a_draft_drafts_up_to_the_end_of_its_own_context_window(tiny_draft):
    """A draft's window may be shorter than its target's: past its end it proposes nothing (it
    drafted on; a model with learned positions fails there), and a drafter server did the same."""
    window = tiny_draft.config.max_position_embeddings
    drafter = DraftModelDrafter(tiny_draft)
    context = [1, 2, 3] * (window // 3)
    context = context[:window - 2]
    assert len(drafter.propose(context, 4, SamplingParams(), seed=0).tokens) == 2
    assert not drafter.propose(context + [1, 2], 4, SamplingParams(), seed=0).tokens
    assert drafter.alternatives_for(context + [1], [2, 3]) == RankedTokens()
    branches = drafter.propose_branches(context, [4, 5], 4, SamplingParams(), seed=0)
    assert [len(b.tokens) for b in branches] == [1, 1]


def test_branches_of_a_sliding_window_draft_past_its_window_are_the_ones_drafted_one_by_one(tmp_path):
    """A row forking early is masked off the cache past its fork, and the sliding window counted
    those masked slots too: its drafts and q differed from ``propose``'s (a seeded sampled request
    then drew other tokens with mirror than without)."""
    from support import load, save_tiny_llama

    path = save_tiny_llama(tmp_path / "draft", seed=3, layers=2, sliding_window=8)
    head, forks, tokens, params = [1, 2, 3, 4, 5, 6, 7, 0] * 2 + [1, 2, 3, 4], [14, 17, 20], [6, 7, 5], \
        SamplingParams(temperature=1.0)
    together = DraftModelDrafter(load(path)).propose_branches(head, tokens, 4, params, seed=11, fork_points=forks)
    for branch, fork, token in zip(together, forks, tokens):
        alone = DraftModelDrafter(load(path)).propose(head[:fork] + [token], 4, params, seed=11)
        assert branch.tokens == alone.tokens
        torch.testing.assert_close(branch.q.dense(8), alone.q.dense(8))
