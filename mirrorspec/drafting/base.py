"""The drafting interface: one small class per strategy, in the spirit of transformers'
``CandidateGenerator``.

A drafter is handed the full committed context on every call. Stateful drafters (a draft model
with a KV cache) work out for themselves which of it is new; stateless ones (n-gram lookup) just
read it. That keeps "commit verified tokens, then draft" a single call for local and remote use.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from mirrorspec.config import DRAFT_MODEL_STEP_COST, InvalidRequest, SamplingParams
from mirrorspec.sampling import ProposalRows


@dataclass(frozen=True)
class Proposal:
    """K draft tokens and the distribution q each was drawn from (``q.num_rows == len(tokens)``)."""

    tokens: tuple[int, ...]
    q: ProposalRows | None
    # the drafter's most likely tokens at each drafted position, best first (may include the
    # drafted token itself): guesses of the target's token where it rejects, for mirror branches
    alternatives: tuple[tuple[int, ...], ...] = ()
    # the drafter's own probability (temperature 1) of each of them; a row is () where it has none
    # (a looked-up token), and the whole is () for drafters that send none
    alternative_probs: tuple[tuple[float, ...], ...] = ()

    @staticmethod
    def empty() -> Proposal:
        return Proposal(tokens=(), q=None)

    def __len__(self) -> int:
        return len(self.tokens)

    def widened(self, vocab_size: int) -> Proposal:
        """This proposal with q over ``vocab_size`` ids (``ProposalRows.widened``)."""
        return self if self.q is None else replace(self, q=self.q.widened(vocab_size))

    def first(self, n: int) -> Proposal:
        """The first ``n`` drafts, with their q rows and alternatives."""
        q = None if self.q is None else self.q.first(n)
        return Proposal(self.tokens[:n], q, self.alternatives[:n], self.alternative_probs[:n])

    def token_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """# -> [1, k] int64"""
        return torch.tensor([self.tokens], dtype=torch.int64, device=device)

    def ranked(self) -> RankedTokens:
        return RankedTokens(self.alternatives, self.alternative_probs)

    def runner_up(self) -> int | None:
        """The drafter's likeliest token other than the first draft, at the first position, if any."""
        if not (self.tokens and self.alternatives):
            return None
        return next((t for t in self.alternatives[0] if t != self.tokens[0]), None)


@dataclass(frozen=True)
class RankedTokens:
    """A drafter's most likely tokens at each position of a window, best first, with its own
    probability of each (temperature 1; a row of ``probs`` is () where it has none). Mirror weighs
    its guesses of the target's token by them: a runner-up the drafter gives 0.3 is a far better
    guess than one it gives 0.01, which rank alone cannot tell."""

    ids: tuple[tuple[int, ...], ...] = ()
    probs: tuple[tuple[float, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.ids)

    def probs_at(self, position: int) -> tuple[float, ...] | None:
        """The row of probabilities at ``position``, None where the drafter gave none for it."""
        row = self.probs[position] if position < len(self.probs) else ()
        return row if row and len(row) == len(self.ids[position]) else None


def fork_points_or_end(head: Sequence[int], next_tokens: Sequence[int],
                       fork_points: Sequence[int] | None) -> list[int]:
    """Where each branch of ``propose_branches`` forks: as given, or all at the end of ``head``."""
    return list(fork_points) if fork_points is not None else [len(head)] * len(next_tokens)


class Drafter(ABC):
    """Proposes up to ``k`` tokens that continue ``context``.

    It may return fewer (even none) when it has nothing worth proposing; the engine then verifies
    what there is, and a window with no drafts is a plain target step. Random draws must come
    from ``Stream.DRAFT`` uniforms at the drafted token's absolute position, so that a seeded
    request is reproducible.
    """

    name: str = "drafter"
    # one drafted token's cost over one target step: adaptive K weighs drafting with it
    step_cost: float = DRAFT_MODEL_STEP_COST
    # the ids it proposes from, where it keeps to a sub-vocabulary (early-exit hints are then
    # scored over them); None = the whole vocabulary
    vocab_ids: torch.Tensor | None = None

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal: ...

    def propose_branches(self, head: Sequence[int], next_tokens: Sequence[int], k: int, params: SamplingParams,
                         seed: int, fork_points: Sequence[int] | None = None) -> list[Proposal]:
        """``propose([*head[:fork], c], k, ...)`` for each next token c and its fork point (default:
        all of ``head``): mirror branches, each a guess of where the target rejects and what it
        says there. Strategies that can draft them together (one batched forward) override this."""
        forks = fork_points_or_end(head, next_tokens, fork_points)
        return [self.propose([*head[:f], c], k, params, seed) for f, c in zip(forks, next_tokens)]

    def alternatives_for(self, context: Sequence[int], tokens: Sequence[int]) -> RankedTokens:
        """The drafter's own most likely tokens, best first, at each position of ``tokens`` continuing
        ``context``: mirror's guesses of the target's token where it rejects, for proposals that came
        without them (looked-up tokens). Called during the verify, off the critical path, so a
        strategy that has to run its model for them costs the window nothing. Empty = no opinion."""
        return RankedTokens()

    @contextmanager
    def serving_one_request(self) -> Iterator[None]:
        """A drafter holds one sequence's state (its KV cache): two requests drafting with it at once
        corrupted each other's caches, and failed inside torch or drafted other tokens. The second
        is refused instead, naming the draft."""
        busy = self.__dict__.setdefault("_serving", threading.Lock())  # atomic: subclasses need no __init__ call
        if not busy.acquire(blocking=False):
            raise InvalidRequest(f"this {type(self).__name__} is drafting for another request right now (it holds "
                                 f"one sequence's KV cache): give each concurrent generate() a Drafter of its own, "
                                 f"or pass the draft model, which gets one per call", field="draft")
        try:
            yield
        finally:
            busy.release()

    def release(self) -> None:
        """Drop per-sequence state (KV caches) once the request is over."""
