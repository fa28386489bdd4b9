"""Drafting with a small causal LM that shares the target's tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mirrorspec.config import SamplingParams
from mirrorspec.drafting.base import Drafter, Proposal
from mirrorspec.models.session import KVSession, LogitSession
from mirrorspec.sampling import ProposalRows, Stream, proposal_distribution, sample_proposal, uniforms


class DraftModelDrafter(Drafter):
    """Autoregressive drafting, one cached forward per draft token.

    ``proposal_top_k`` > 0 restricts q to the drafter's top tokens (sparse q): the proposal is
    then cheap to ship over the network and rejection sampling stays exact.
    """

    name = "draft-model"

    def __init__(self, model: torch.nn.Module | LogitSession, proposal_top_k: int = 0):
        self.session = KVSession(model) if isinstance(model, torch.nn.Module) else model
        self.proposal_top_k = proposal_top_k

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal:
        if k <= 0:
            return Proposal.empty()
        start = len(context)
        u = uniforms(seed, range(start, start + k), Stream.DRAFT)  # [k]
        sequence = list(context)
        rows: list[ProposalRows] = []
        for i in range(k):
            logits = self.session.logits_for(sequence, 1)  # [1, vocab]
            q = proposal_distribution(logits, params, self.proposal_top_k)
            token = int(sample_proposal(q, u[i:i + 1]).item())
            rows.append(q)
            sequence.append(token)
        return Proposal(tokens=tuple(sequence[start:]), q=ProposalRows.stack(rows))

    def release(self) -> None:
        self.session.rollback(0)
