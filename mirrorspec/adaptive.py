"""Adaptive K: choose each window's draft length from the acceptance seen so far.

With per-token acceptance alpha, a window of K drafts commits (1 - alpha^(K+1)) / (1 - alpha)
tokens on average and costs K draft steps plus one target pass over K+1 tokens. The policy picks
the K in [0, max] with the most expected tokens per unit of time; K = 0 is plain target decoding
(speculation switched off), from which it probes again every ``probe_every`` windows so that a
stretch of easy text turns it back on.

Costs come from configuration (``draft_cost``: one draft step over one target step, by default
the drafter's own ``step_cost``; ``pass_costs``: a target pass over K drafts, in one-token steps,
measured ~1.1-1.2 on a 2-core CPU for the demo target with prepacked weights, and ~1 on a GPU), not from wall-clock timings: K is then a function of the
request's own history only, so a seeded request stays reproducible. Exactness does not depend on
K at all: every window is exact for whatever K it was given, as long as K is chosen before the
window's random draws are looked at, which it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mirrorspec.config import DRAFT_MODEL_STEP_COST, AdaptiveKConfig


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per window] for K drafts each accepted i.i.d. with ``alpha``, bonus included."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def posterior_alpha(accepted: float, rejected: float, config: AdaptiveKConfig) -> float:
    """Posterior mean of alpha from (possibly decayed) counts of passed and failed draft tests,
    under the config's Beta prior."""
    a0, r0 = config.prior_accepted, config.prior_rejected
    return (accepted + a0) / (accepted + rejected + a0 + r0)


def pass_cost(k: int, config: AdaptiveKConfig) -> float:
    """A target pass over K drafts in one-token steps: the measured table, then linear."""
    if k == 0:
        return 1.0
    table = config.pass_costs
    if k <= len(table):
        return table[k - 1]
    return (table[-1] if table else 1.0) + (k - len(table)) * config.pass_cost_per_token


def window_cost(k: int, config: AdaptiveKConfig, draft_cost: float = DRAFT_MODEL_STEP_COST) -> float:
    """Time of a window in target-step units: K draft steps plus a (K+1)-token target pass.
    ``draft_cost`` is used where the config leaves it to the drafter."""
    step = draft_cost if config.draft_cost is None else config.draft_cost
    return k * step + pass_cost(k, config)


def best_k(alpha: float, max_k: int, config: AdaptiveKConfig, draft_cost: float = DRAFT_MODEL_STEP_COST) -> int:
    """The K with the most expected tokens per unit time (0 = don't speculate)."""
    return max(range(max_k + 1),
               key=lambda k: (expected_tokens(alpha, k) / window_cost(k, config, draft_cost), -k))


@dataclass
class AdaptiveK:
    """Per-request state: a decayed count of accepted and rejected draft tests."""

    config: AdaptiveKConfig
    max_k: int
    draft_cost: float = DRAFT_MODEL_STEP_COST  # the drafter's step_cost, unless the config sets one
    accepted: float = 0.0
    rejected: float = 0.0
    windows_off: int = 0

    @property
    def alpha(self) -> float:
        """Posterior mean of alpha, recent windows weighing most."""
        return posterior_alpha(self.accepted, self.rejected, self.config)

    def next_k(self) -> int:
        k = best_k(self.alpha, self.max_k, self.config, self.draft_cost)
        if k == 0:
            self.windows_off += 1
            if self.windows_off >= self.config.probe_every:  # look again: text may have become easy
                self.windows_off = 0
                return self.probe_k()
        return k

    def probe_k(self) -> int:
        """K of a probe window: the configured one, else the K whose window costs least."""
        if self.config.probe_k is not None:
            return min(self.config.probe_k, self.max_k)
        return min(range(1, self.max_k + 1), key=lambda k: window_cost(k, self.config, self.draft_cost))

    def peek(self, num_drafted: int, num_accepted: int) -> int:
        """The K ``next_k`` would give after observing this window, leaving this state alone
        (mirror branches are drafted with the K their window will really ask for)."""
        future = dataclasses.replace(self)
        future.observe(num_drafted, num_accepted)
        return future.next_k()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        decay = self.config.decay
        self.accepted = self.accepted * decay + num_accepted
        self.rejected = self.rejected * decay + int(num_accepted < num_drafted)
