"""The draft side's proposal distribution q, and sampling by an exponential race from explicit uniforms.

Rejection sampling is exact for *any* q, provided q is the distribution each draft token was
really drawn from. So the drafter may restrict itself to a sparse q (its own top-m tokens,
renormalised) or a one-hot q (greedy drafter, n-gram lookup): exactness holds, and q travels as
m ids + m probabilities per position instead of a full vocabulary row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mirrorspec.config import SamplingParams
from mirrorspec.sampling.distributions import target_probs
from mirrorspec.sampling.randomness import race_noise


@dataclass(frozen=True)
class ProposalRows:
    """q for each drafted position, sparse (ids + probs) or dense (probs over the vocabulary).

    sparse: ids  # [k, m] int64, probs # [k, m] float32
    dense:  ids is None,           probs # [k, vocab] float32
    """

    probs: torch.Tensor
    ids: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.probs.shape[0])

    @property
    def is_sparse(self) -> bool:
        return self.ids is not None

    def first(self, n: int) -> ProposalRows:
        """The rows of the first ``n`` drafts."""
        return ProposalRows(self.probs[:n], None if self.ids is None else self.ids[:n])

    def dense(self, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """# -> [k, vocab] float32"""
        probs = self.widened(vocab_size).probs.to(device=device, dtype=torch.float32)
        if self.ids is None:
            return probs
        out = torch.zeros(probs.shape[0], vocab_size, dtype=torch.float32, device=probs.device)
        return out.scatter_add_(-1, self.ids.to(probs.device), probs)  # padding may repeat an id at 0

    def widened(self, vocab_size: int) -> ProposalRows:
        """These rows over a ``vocab_size``-id vocabulary. Dense rows narrower than that come from
        a draft whose table is narrower than the target's (the same tokenizer padded to fewer
        rows): they give the ids past it no mass."""
        width = self.probs.shape[-1]
        if self.ids is not None or width == vocab_size:
            return self
        if width > vocab_size:
            raise ValueError(f"dense q has {width} columns, more than the vocabulary's {vocab_size}")
        return ProposalRows(probs=_pad(self.probs, vocab_size, 0.0))

    @staticmethod
    def stack(rows: list[ProposalRows]) -> ProposalRows:
        """Rows drafted one position at a time, joined into one [k, ...] proposal.

        Rows may sit on different devices: a lookup's one-hot rows are built on the CPU, a draft
        model's on its GPU. The joined rows go where the first model row is (the verifier moves
        them to the target's device anyway)."""
        device = next((r.probs.device for r in rows if r.probs.device.type != "cpu"), rows[0].probs.device)
        dense = [r for r in rows if r.ids is None]
        if dense:  # mixed rows (a one-hot lookup row beside a dense model row): all dense
            vocab_size = max(r.probs.shape[-1] if r.ids is None else int(r.ids.max()) + 1 for r in rows)
            return ProposalRows(probs=torch.cat([r.dense(vocab_size, device) for r in rows]))
        width = max(r.ids.shape[-1] for r in rows)
        probs = torch.cat([_pad(r.probs.to(device), width, 0.0) for r in rows])
        return ProposalRows(probs=probs, ids=torch.cat([_pad(r.ids.to(device), width, 0) for r in rows]))

    @staticmethod
    def one_hot(token_ids: list[int]) -> ProposalRows:
        """q for deterministic proposals (n-gram lookup): all mass on the proposed token."""
        ids = torch.tensor(token_ids, dtype=torch.int64).unsqueeze(-1)
        return ProposalRows(probs=torch.ones(len(token_ids), 1, dtype=torch.float32), ids=ids)


def _pad(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=value)


def proposal_distribution(draft_logits: torch.Tensor, params: SamplingParams, top_m: int = 0) -> ProposalRows:
    """q for one position from the drafter's logits.  # [1, vocab] -> rows of width m or vocab

    The drafter shapes its logits with the request's own sampling parameters (the closer q is to
    p, the more is accepted); greedy requests get a one-hot q at the drafter's argmax.
    """
    probs = target_probs(draft_logits, params)  # [1, vocab]
    if params.greedy:
        return ProposalRows(probs=torch.ones(1, 1, device=probs.device), ids=probs.argmax(-1, keepdim=True))
    if top_m <= 0 or top_m >= probs.shape[-1]:
        return ProposalRows(probs=probs)
    top = probs.topk(top_m, dim=-1)  # [1, m]
    return ProposalRows(probs=top.values / top.values.sum(-1, keepdim=True), ids=top.indices)


def sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs``, drawn by an exponential race keyed by the row's uniform.
    # [n, m], [n] -> [n]

    Each column j gets its own Exp(1) noise E_j, a pure function of (u, j), and the draw is
    argmax_j probs_j / E_j: exactly a draw from the row (normalised or not), as vLLM samples.
    Why not inverse CDF: there the draw is wherever u lands in a cumulative sum, and in the long
    tail of a 49k-token distribution, where thousands of tokens each hold a sliver of mass, a
    last-bit change in the probabilities (the same positions computed in another grouping of
    forward passes: a served target's separate prefill, a replica replaying a session) moves it
    to a neighbouring token. A race only changes its winner where two tokens' ratios agree to
    the last bits. Zero-probability columns never win (unless the whole row is zero: column 0).
    """
    noise = race_noise(u, probs.shape[-1]).to(probs.device)  # [n, m] float64
    return (probs.to(torch.float64) / noise).argmax(dim=-1)


def sample_proposal(rows: ProposalRows, u: torch.Tensor) -> torch.Tensor:
    """Draw one token id per row of q.  # [k], [k] -> [k] int64"""
    idx = sample_categorical(rows.probs, u)
    if rows.ids is None:
        return idx
    return rows.ids.gather(-1, idx.unsqueeze(-1).to(rows.ids.device)).squeeze(-1)


