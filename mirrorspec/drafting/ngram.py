"""Prompt-lookup (n-gram) drafting: no model, and strong wherever output copies its input.

Finds the most recent earlier occurrence of the context's last n tokens (longest n first) and
proposes the tokens that followed it. The proposal is deterministic, so q is one-hot, which
rejection sampling handles exactly: the draft is kept with probability p(x).
"""

from __future__ import annotations

from collections.abc import Sequence

from mirrorspec.config import InvalidRequest, SamplingParams
from mirrorspec.drafting.base import Drafter, Proposal
from mirrorspec.sampling import ProposalRows


class NgramDrafter(Drafter):
    name = "ngram"
    step_cost = 0.0  # a list scan: free next to a forward pass

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, lookback: int = 4096):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidRequest(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}",
                                 field="ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.lookback = lookback

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal:
        tokens = self.lookup(context, k)
        if not tokens:
            return Proposal.empty()
        return Proposal(tokens=tuple(tokens), q=ProposalRows.one_hot(tokens))

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        window = list(context[-self.lookback:])
        for n in range(min(self.max_ngram, len(window) - 1), self.min_ngram - 1, -1):
            suffix = window[-n:]
            # scan right to left for the latest earlier match that has a continuation
            for start in range(len(window) - n - 1, -1, -1):
                if window[start:start + n] == suffix:
                    return window[start + n:start + n + k]
        return []
