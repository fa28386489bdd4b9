import pytest
import torch

from mirrorspec import SamplingParams
from mirrorspec.config import InvalidRequest
from mirrorspec.drafting import DraftModelDrafter, HybridDrafter, NgramDrafter
from mirrorspec.engine import make_drafter

SAMPLED = SamplingParams(temperature=1.0)


class CountingDrafter(DraftModelDrafter):
    """The draft model, counting the windows it was asked to draft."""

    calls = 0

    def propose(self, context, k, params, seed):
        self.calls += 1
        return super().propose(context, k, params, seed)


def test_a_repeated_context_is_drafted_by_lookup_without_the_model(tiny_draft):
    model = CountingDrafter(tiny_draft)
    context = [0, 3, 5, 2, 6, 1, 3, 5]  # "3 5" occurred before, followed by 2 6 1
    proposal = HybridDrafter(model, min_match=2).propose(context, 3, SAMPLED, seed=0)
    assert proposal.tokens == (2, 6, 1)
    assert proposal.q.dense(8).tolist() == torch.eye(8)[[2, 6, 1]].tolist()  # one-hot: drawn deterministically
    assert model.calls == 0


def test_a_context_without_repeats_is_drafted_by_the_model_as_it_alone_would(tiny_draft):
    context = [0, 3, 5, 2, 6, 1, 5]  # "1 5" is new; a one-token match (5) is below min_match
    hybrid = HybridDrafter(DraftModelDrafter(tiny_draft), min_match=2).propose(context, 4, SAMPLED, seed=7)
    alone = DraftModelDrafter(tiny_draft).propose(context, 4, SAMPLED, seed=7)
    assert hybrid.tokens == alone.tokens
    assert torch.equal(hybrid.q.dense(8), alone.q.dense(8))
    assert hybrid.alternatives == alone.alternatives


def test_min_match_one_looks_up_single_tokens(tiny_draft):
    context = [0, 3, 5, 2, 6, 1, 5]
    proposal = HybridDrafter(DraftModelDrafter(tiny_draft), min_match=1).propose(context, 2, SAMPLED, seed=7)
    assert proposal.tokens == (2, 6)


@pytest.mark.parametrize("proposal_top_k", [0, 3], ids=["dense-q", "sparse-q"])
def test_a_short_match_is_topped_up_by_the_model_with_each_rows_own_q(tiny_draft, proposal_top_k):
    context = [0, 3, 5, 3, 5]  # "3 5" occurred at the start: the lookup can offer only "3 5"
    hybrid = HybridDrafter(DraftModelDrafter(tiny_draft, proposal_top_k=proposal_top_k), min_match=2)
    proposal = hybrid.propose(context, 4, SAMPLED, seed=3)
    rest = DraftModelDrafter(tiny_draft, proposal_top_k=proposal_top_k).propose([*context, 3, 5], 2, SAMPLED, seed=3)
    assert proposal.tokens == (3, 5, *rest.tokens)
    q = proposal.q.dense(8)  # [4, 8]
    assert q[:2].tolist() == torch.eye(8)[[3, 5]].tolist()
    assert torch.allclose(q[2:], rest.q.dense(8))
    assert len(proposal.alternatives) == len(proposal.tokens)
    # probabilities stay aligned with their rows: none for the looked-up tokens, the model's for the rest
    assert proposal.alternative_probs == ((), (), *rest.alternative_probs)
    assert proposal.ranked().probs_at(0) is None and proposal.ranked().probs_at(2) == rest.alternative_probs[0]


def test_branches_are_the_proposals_made_one_by_one(tiny_draft):
    hybrid = HybridDrafter(DraftModelDrafter(tiny_draft), min_match=2)
    head = [0, 3, 5, 2, 6, 1, 3]
    branches = hybrid.propose_branches(head, [5, 7], 3, SAMPLED, seed=4)  # "3 5" repeats, "3 7" does not
    assert [b.tokens for b in branches] == [hybrid.propose([*head, c], 3, SAMPLED, seed=4).tokens for c in (5, 7)]
    assert branches[0].tokens == (2, 6, 1)


@pytest.mark.parametrize("forks", [None, [7, 7, 5]], ids=["one-fork-point", "two-fork-points"])
def test_branches_that_do_not_repeat_are_batched_beside_those_that_do(tiny_draft, forks):
    """A group that mixes both: the model drafts the non-repeating branches in one batch (one
    DraftBranches call when the model is remote), wherever they fork, and every branch is still
    ``propose`` on its own context."""
    model = DraftModelDrafter(tiny_draft)
    batches = []
    batched_draft = model.propose_branches

    def counted(head, next_tokens, *args):
        batches.append(list(next_tokens))
        return batched_draft(head, next_tokens, *args)

    model.propose_branches = counted
    hybrid = HybridDrafter(model, min_match=2)
    head = [0, 3, 5, 2, 6, 1, 3]
    branches = hybrid.propose_branches(head, [7, 5, 4], 3, SAMPLED, seed=4, fork_points=forks)  # "3 5" repeats
    assert batches == [[7, 4]]
    fresh = HybridDrafter(DraftModelDrafter(tiny_draft), min_match=2)
    for branch, c, fork in zip(branches, [7, 5, 4], forks or [len(head)] * 3):
        alone = fresh.propose([*head[:fork], c], 3, SAMPLED, seed=4)
        assert branch.tokens == alone.tokens
        assert torch.allclose(branch.q.dense(8), alone.q.dense(8), atol=1e-6)


def test_no_repeat_in_any_branch_drafts_them_in_one_batch(tiny_draft):
    hybrid = HybridDrafter(DraftModelDrafter(tiny_draft), min_match=2)
    head = [0, 3, 5, 2]
    batched = hybrid.propose_branches(head, [6, 7], 3, SAMPLED, seed=4)
    assert [b.tokens for b in batched] == [b.tokens for b in
                                           DraftModelDrafter(tiny_draft).propose_branches(head, [6, 7], 3, SAMPLED, 4)]


def test_make_drafter_puts_lookup_in_front_of_a_model_only_when_asked(tiny_draft):
    assert type(make_drafter(tiny_draft)) is DraftModelDrafter
    hybrid = make_drafter(tiny_draft, proposal_top_k=3, prompt_lookup=2)
    assert isinstance(hybrid, HybridDrafter) and hybrid.lookup.min_ngram == 2
    assert hybrid.model.proposal_top_k == 3
    assert type(make_drafter("ngram", prompt_lookup=2)) is NgramDrafter


@pytest.mark.parametrize("bad", [-1, 9, 1.5])
def test_prompt_lookup_out_of_range_says_what_is_allowed(bad):
    from mirrorspec.config import SpeculationConfig

    with pytest.raises(InvalidRequest, match=r"prompt_lookup must be an int in \[0, 8\]") as err:
        SpeculationConfig(prompt_lookup=bad)
    assert err.value.field == "prompt_lookup"


def test_looked_up_tokens_get_the_models_alternatives_for_mirror_guesses(tiny_draft):
    context = [0, 3, 5, 2, 6, 1, 3, 5]
    hybrid = HybridDrafter(DraftModelDrafter(tiny_draft), min_match=2)
    looked_up = hybrid.propose(context, 3, SAMPLED, seed=0)
    tops = hybrid.alternatives_for(context, looked_up.tokens)
    # what the model itself ranks first at each position, had it drafted there
    model = DraftModelDrafter(tiny_draft)
    for i, token in enumerate(looked_up.tokens):
        alone = model.propose([*context, *looked_up.tokens[:i]], 1, SamplingParams(), seed=0)
        assert tops.ids[i] == alone.alternatives[0]
        assert tops.probs[i] == pytest.approx(alone.alternative_probs[0], abs=1e-6)
    assert not NgramDrafter().alternatives_for(context, looked_up.tokens)  # no model: no opinion
