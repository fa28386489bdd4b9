"""Drafting with a small causal LM that shares the target's tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mirrorspec.config import (DRAFT_MODEL_STEP_COST, INT8_DRAFT_MODEL_STEP_COST, InvalidRequest, SamplingParams,
                               check_draft_confidence)
from mirrorspec.drafting.base import Drafter, Proposal, RankedTokens, fork_points_or_end
from mirrorspec.models.demo_draft import shipped_vocabulary
from mirrorspec.models.loading import DRAFT_VOCAB_KEY, check_sub_vocabulary, draft_weights, read_config
from mirrorspec.models.quantize import is_quantized
from mirrorspec.models.session import KVSession, LogitSession
from mirrorspec.sampling import ProposalRows, Stream, proposal_distribution, sample_proposal, uniforms


def _config_vocabulary(config) -> torch.Tensor | None:
    ids = getattr(config, DRAFT_VOCAB_KEY, None)
    if ids is None:
        return None
    check_sub_vocabulary(config)  # one set on a loaded model's config, as tests and callers may
    return torch.tensor(ids, dtype=torch.int64)


def draft_vocabulary(model: torch.nn.Module) -> torch.Tensor | None:
    """The sub-vocabulary a trained draft declares in its config, or None (whole vocabulary)."""
    return _config_vocabulary(getattr(model, "config", None))


def declared_vocabulary(source: str) -> torch.Tensor | None:
    """The sub-vocabulary the model at ``source`` declares, read from its config alone."""
    weights = draft_weights(source)
    if weights is not None:
        return shipped_vocabulary(weights)
    return _config_vocabulary(read_config(source))


def hint_vocabulary(source: str) -> torch.Tensor:
    """The sub-vocabulary early-exit hints are scored over, from the draft ``source`` names; a
    missing draft, or one that declares none, is an error about ``hint_vocab``."""
    try:
        ids = declared_vocabulary(source)
    except InvalidRequest as e:  # a missing path: say which setting named it
        raise InvalidRequest(str(e), field="hint_vocab") from None
    if ids is None:
        raise InvalidRequest(f"{source} declares no sub-vocabulary ({DRAFT_VOCAB_KEY} in its config) to score "
                             "hints over; name a draft that does (e.g. demo-draft), or score them over the whole "
                             "vocabulary (hint_vocab unset; --hint-vocab full)", field="hint_vocab")
    return ids


class DraftStep(NamedTuple):
    token: int
    q: ProposalRows  # one row
    alternatives: tuple[int, ...]
    alternative_probs: tuple[float, ...]  # the draft's own probability of each (temperature 1)
    confidence: float  # the draft's own probability of ``token`` (temperature 1)


def draft_model_step_cost(model: torch.nn.Module) -> float:
    """One draft step of ``model`` over one target step, as adaptive K prices it: int8 steps cost
    about half (measured on the demo pair), so adaptive K drafts further for the same alpha."""
    return INT8_DRAFT_MODEL_STEP_COST if is_quantized(model) else DRAFT_MODEL_STEP_COST


def _proposal(steps: list[DraftStep]) -> Proposal:
    return Proposal(tokens=tuple(s.token for s in steps), q=ProposalRows.stack([s.q for s in steps]),
                    alternatives=tuple(s.alternatives for s in steps),
                    alternative_probs=tuple(s.alternative_probs for s in steps))


class DraftModelDrafter(Drafter):
    """Autoregressive drafting, one cached forward per draft token.

    ``proposal_top_k`` > 0 restricts q to the drafter's top tokens (sparse q): the proposal is
    then cheap to ship over the network and rejection sampling stays exact. A draft whose config
    declares a sub-vocabulary (``mirrorspec_draft_vocab``) scores and proposes only those ids:
    its head shrinks by the same factor, and q, being the distribution the token was really
    drawn from, keeps rejection sampling exact.

    ``confidence`` > 0 ends a window early, after the first token the draft itself gives less
    than that probability (temperature 1, as transformers' ``assistant_confidence_threshold``):
    the drafts after an unsure one are likely rejected, and each costs a draft forward. Exact,
    because whether position i + 1 is drafted depends only on the tokens up to i, which are the
    output's own wherever position i + 1 is reached: a window length chosen by the context alone.
    """

    name = "draft-model"

    def __init__(self, model: torch.nn.Module | LogitSession, proposal_top_k: int = 0, num_alternatives: int = 8,
                 confidence: float = 0.0):
        check_draft_confidence(confidence)
        self.vocab_ids = draft_vocabulary(model) if isinstance(model, torch.nn.Module) else None  # [m] or None
        self.session = KVSession(model, self.vocab_ids) if isinstance(model, torch.nn.Module) else model
        if isinstance(model, torch.nn.Module):
            self.step_cost = draft_model_step_cost(model)
        # a draft's window may be shorter than its target's: it drafts up to the end of its own
        self.max_context = int(getattr(getattr(model, "config", None), "max_position_embeddings", 1 << 30))
        self.proposal_top_k = proposal_top_k
        self.num_alternatives = num_alternatives  # top tokens kept per position, for mirror branch guesses
        self.confidence = confidence

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal:
        k = min(k, self.max_context - len(context))
        if k <= 0:
            return Proposal.empty()
        start = len(context)
        u = uniforms(seed, range(start, start + k), Stream.DRAFT)  # [k]
        sequence = list(context)
        steps: list[DraftStep] = []
        for i in range(k):
            steps.append(self._draw(self.session.logits_for(sequence, 1), params, u[i:i + 1]))  # [1, vocab]
            if self._unsure(steps[-1]):
                break
            sequence.append(steps[-1].token)
        return _proposal(steps)

    def propose_branches(self, head: Sequence[int], next_tokens: Sequence[int], k: int, params: SamplingParams,
                         seed: int, fork_points: Sequence[int] | None = None) -> list[Proposal]:
        """Every branch in one batched forward per step, whichever point of ``head`` it forks at.
        Each row draws from its own q with the uniforms of its own positions, so each branch is the
        proposal ``propose([*head[:fork], c], k)`` would make (up to float rounding between batched
        and single forwards)."""
        k = min(k, self.max_context - len(head) - 1)  # the last fork's window, the one that ends latest
        # a row forking early is masked off the cache past its fork, and a sliding window counts
        # those masked slots too: past its reach, branches go one by one, as ``propose`` drafts them
        reach = getattr(self.session, "reach", None)
        past_reach = reach is not None and len(head) + 1 + k > reach
        if k <= 0 or len(next_tokens) < 2 or not isinstance(self.session, KVSession) or past_reach:
            return super().propose_branches(head, next_tokens, k, params, seed, fork_points)
        forks = fork_points_or_end(head, next_tokens, fork_points)
        # row b drafts at positions fork_b + 1 ... fork_b + k
        u = torch.stack([uniforms(seed, range(f + 1, f + 1 + k), Stream.DRAFT) for f in forks])  # [B, k]
        batch = self.session.fork(head, next_tokens, forks)
        branches: list[list[DraftStep]] = [[] for _ in next_tokens]
        drafting = [True] * len(branches)  # a branch stops after its first unsure token, as in propose
        for i in range(k):
            logits = batch.step()  # [B, vocab or m]
            for b, steps in enumerate(branches):
                if drafting[b]:
                    steps.append(self._draw(logits[b:b + 1], params, u[b, i:i + 1]))
                    drafting[b] = not self._unsure(steps[-1])
            if not any(drafting):
                break
            batch.feed([steps[-1].token for steps in branches])  # stopped rows run on, unread
        return [_proposal(steps) for steps in branches]

    def alternatives_for(self, context: Sequence[int], tokens: Sequence[int]) -> RankedTokens:
        """One forward over ``tokens``: the cache catches up on them now, not in the next draft."""
        if not tokens or len(context) + len(tokens) > self.max_context:
            return RankedTokens()
        logits = self.session.logits_for([*context, *tokens[:-1]], len(tokens))  # [len(tokens), vocab or m]
        tops = [self._top(logits[i].float().softmax(-1)) for i in range(len(tokens))]
        return RankedTokens(tuple(ids for ids, _ in tops), tuple(probs for _, probs in tops))

    def _draw(self, logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> DraftStep:
        """One drafted position from its logits (# [1, vocab or m]) and its uniform (# [1])."""
        q = proposal_distribution(logits, params, self.proposal_top_k)  # over logits' columns
        column = int(sample_proposal(q, u).item())
        own = logits[0].float().softmax(-1)  # [vocab or m], temperature 1: the draft's own belief
        ids, probs = self._top(own)
        return DraftStep(self._id_of(column), self._in_vocabulary_ids(q), ids, probs, float(own[column]))

    def _unsure(self, step: DraftStep) -> bool:
        return step.confidence < self.confidence

    def _id_of(self, column: int) -> int:
        return column if self.vocab_ids is None else int(self.vocab_ids[column])

    def _top(self, probs: torch.Tensor) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The ``num_alternatives`` likeliest ids in ``probs`` (# [vocab or m]) and their probabilities."""
        top = probs.topk(min(self.num_alternatives, probs.shape[-1]))  # [n]
        ids = top.indices if self.vocab_ids is None else self.vocab_ids.to(top.indices.device)[top.indices]
        return tuple(ids.tolist()), tuple(top.values.tolist())

    def _in_vocabulary_ids(self, q: ProposalRows) -> ProposalRows:
        """q over sub-vocabulary columns, re-addressed to vocabulary ids."""
        if self.vocab_ids is None:
            return q
        columns = q.ids if q.ids is not None else torch.arange(q.probs.shape[-1], device=q.probs.device).expand_as(q.probs)
        return ProposalRows(probs=q.probs, ids=self.vocab_ids.to(columns.device)[columns])

    def release(self) -> None:
        self.session.rollback(0)
