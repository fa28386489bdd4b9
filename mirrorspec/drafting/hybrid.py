"""Prompt lookup where the text repeats itself, the draft model everywhere else.

The two strategies win in different places: lookup is free and long-reaching where the output
copies its input or itself (code edits, quoted names, repeated phrasing), and a draft model
guesses the rest. Taking the lookup's continuation when the context's last ``min_match``
tokens occurred before, and letting the draft model draft the positions the lookup cannot fill,
gets both.

Exactness: which strategy proposes a position depends only on the context before it, so each
position's q is still the distribution its token was drawn from given that context (one-hot for
looked-up tokens, the model's for drafted ones), which is all rejection sampling needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from mirrorspec.config import SamplingParams
from mirrorspec.drafting.base import Drafter, Proposal, RankedTokens, fork_points_or_end
from mirrorspec.drafting.ngram import NgramDrafter
from mirrorspec.sampling import ProposalRows


class HybridDrafter(Drafter):
    """``model`` drafts where lookup finds nothing: a ``DraftModelDrafter`` in process, or a draft
    model behind gRPC (the orchestrator looks up on its own token log, ``orchestrator.lookup``)."""

    name = "hybrid"

    def __init__(self, model: Drafter, min_match: int = 2, max_match: int = 3):
        self.model = model
        self.lookup = prompt_lookup(min_match, max_match)
        self.step_cost = model.step_cost  # the dearer of the two: adaptive K stays on the safe side

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal:
        looked_up = self.lookup.lookup(context, k) if k > 0 else []
        if not looked_up:
            return self.model.propose(context, k, params, seed)
        found = Proposal(tokens=tuple(looked_up), q=ProposalRows.one_hot(looked_up),
                         alternatives=tuple((t,) for t in looked_up), alternative_probs=tuple(() for _ in looked_up))
        if len(looked_up) == k:
            return found
        # the match ran out (into the end of the context, or a one-token match's short window):
        # the model drafts on from the looked-up tokens
        return _join(found, self.model.propose([*context, *looked_up], k - len(looked_up), params, seed))

    def propose_branches(self, head: Sequence[int], next_tokens: Sequence[int], k: int, params: SamplingParams,
                         seed: int, fork_points: Sequence[int] | None = None) -> list[Proposal]:
        """Branches whose context repeats itself are looked up one by one (and topped up by the
        model where the match runs out); the model drafts all the others together, in one batched
        forward per step (over gRPC: one DraftBranches call). Each is ``propose`` on its context."""
        forks = fork_points_or_end(head, next_tokens, fork_points)
        contexts = [[*head[:f], c] for f, c in zip(forks, next_tokens)]
        repeats = [bool(k > 0 and self.lookup.lookup(context, 1)) for context in contexts]
        drafted = [(f, c) for f, c, repeat in zip(forks, next_tokens, repeats) if not repeat]
        batch = iter(self.model.propose_branches(head, [c for _, c in drafted], k, params, seed,
                                                 [f for f, _ in drafted]) if drafted else ())
        return [self.propose(context, k, params, seed) if repeat else next(batch)
                for context, repeat in zip(contexts, repeats)]

    def alternatives_for(self, context: Sequence[int], tokens: Sequence[int]) -> RankedTokens:
        """The model's view of looked-up tokens: where the target rejects one, its token is likelier
        among the model's top choices than anywhere else the drafter can look."""
        return self.model.alternatives_for(context, tokens)

    @property
    def vocab_ids(self):
        """The draft model's sub-vocabulary (early-exit hints are scored over it), or None."""
        return self.model.vocab_ids

    def release(self) -> None:
        self.model.release()


def prompt_lookup(min_match: int, max_match: int = 3) -> NgramDrafter:
    """The lookup a ``HybridDrafter`` runs first: matches of ``min_match`` to ``max_match`` tokens
    (a one-token match is found almost anywhere and predicts little: ask for more)."""
    return NgramDrafter(max_ngram=max(max_match, min_match), min_ngram=min_match)


def _join(first: Proposal, then: Proposal) -> Proposal:
    if not then.tokens:
        return first
    return Proposal(tokens=first.tokens + then.tokens, q=ProposalRows.stack([first.q, then.q]),
                    alternatives=first.alternatives + then.alternatives,
                    alternative_probs=_probs_rows(first) + _probs_rows(then))


def _probs_rows(proposal: Proposal) -> tuple[tuple[float, ...], ...]:
    """One row per token, () where the proposal has none, so joined rows stay aligned."""
    rows = proposal.alternative_probs
    return tuple(rows[i] if i < len(rows) else () for i in range(len(proposal)))
