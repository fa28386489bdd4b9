"""The exact sampling core: pure tensor functions, no I/O, no model code."""

from mirrorspec.sampling.distributions import NonFiniteLogits, finite_logits, one_hot_argmax, target_probs
from mirrorspec.sampling.proposal import (
    ProposalRows,
    proposal_distribution,
    sample_categorical,
    sample_proposal,
)
from mirrorspec.sampling.randomness import Stream, fresh_seed, uniform, uniforms
from mirrorspec.sampling.rejection import (
    TokenKind,
    WindowVerdict,
    greedy_verify,
    next_kind,
    recovery_distribution,
    rejection_sample,
    runner_up_sample,
)

__all__ = [
    "NonFiniteLogits",
    "ProposalRows",
    "Stream",
    "TokenKind",
    "WindowVerdict",
    "finite_logits",
    "fresh_seed",
    "greedy_verify",
    "next_kind",
    "one_hot_argmax",
    "proposal_distribution",
    "recovery_distribution",
    "rejection_sample",
    "runner_up_sample",
    "sample_categorical",
    "sample_proposal",
    "target_probs",
    "uniform",
    "uniforms",
]
