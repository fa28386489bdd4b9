"""Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023), batched over windows.

For each window of K draft tokens x_1..x_K drawn from q_1..q_K:
  * accepted:  x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the
               first rejection;
  * recovered: at the first rejection i, the next token is drawn from norm(max(0, p_i - q_i));
  * bonus:     if all K are kept, one more token is drawn from p_{K+1}.
The emitted tokens are then distributed exactly as sampling from p one token at a time.

Pure functions: all randomness comes in as explicit uniforms (see ``randomness``), so the same
inputs give the same verdict on any device, and tests can plant bugs by swapping one function.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mirrorspec.sampling.proposal import sample_categorical

# Below this residual mass p and q are equal up to float error: the rejection that led here had
# probability ~0, and p itself is the right distribution to draw from.
RESIDUAL_EPS = 1e-6


class TokenKind(enum.IntEnum):
    ACCEPTED = 0
    RECOVERED = 1
    BONUS = 2


@dataclass(frozen=True)
class WindowVerdict:
    """What the target decided about one window."""

    num_accepted: int
    next_token: int
    next_kind: TokenKind
    # greedy runner-up windows: the drafter's runner-up, taken in place of the first draft (then
    # num_accepted is 1 and next_token is the target's token after it)
    runner_up: int | None = None

    def accepted_tokens(self, drafts: Sequence[int]) -> list[int]:
        """The drafts this verdict keeps, in order (the runner-up where it won the first slot)."""
        return [self.runner_up] if self.runner_up is not None else list(drafts[:self.num_accepted])


def rejection_sample(
    draft_ids: torch.Tensor,  # [batch, k] int64
    q: torch.Tensor,  # [batch, k, vocab] float32, the distributions the drafts were drawn from
    p: torch.Tensor,  # [batch, k + 1, vocab] float32, target distributions (last row: bonus)
    u_accept: torch.Tensor,  # [batch, k] uniforms for the accept test
    u_next: torch.Tensor,  # [batch, k + 1] uniforms for the recovered / bonus token at each slot
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted [batch] int64, next_token [batch] int64)."""
    batch, k = draft_ids.shape
    p = p.float()
    q = q.float()
    index = draft_ids.unsqueeze(-1)
    p_draft = p[:, :k].gather(-1, index).squeeze(-1).double()  # [batch, k]
    q_draft = q.gather(-1, index).squeeze(-1).double()  # [batch, k]
    accepted = u_accept.to(p.device, torch.float64) * q_draft < p_draft  # u < p/q, without dividing
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]

    rows = torch.arange(batch, device=p.device)
    next_dist = torch.cat([recovery_distribution(p[:, :k], q), p[:, k:]], dim=1)  # [batch, k + 1, vocab]
    chosen = next_dist[rows, num_accepted]  # [batch, vocab]
    u_chosen = u_next.to(p.device)[rows, num_accepted]  # [batch]
    next_token = sample_categorical(chosen, u_chosen)
    return num_accepted, next_token


def recovery_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), falling back to p where the residual mass is ~0.  # [..., vocab]"""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    degenerate = mass <= RESIDUAL_EPS
    return torch.where(degenerate, p, residual / mass.clamp_min(RESIDUAL_EPS))


def greedy_verify(
    draft_ids: torch.Tensor,  # [batch, k] int64
    target_argmax: torch.Tensor,  # [batch, k + 1] int64, argmax of the target at each slot
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: keep drafts while they equal the target's argmax; the next token is the
    target's argmax at the first mismatch (recovered) or after the last draft (bonus)."""
    k = draft_ids.shape[1]
    matches = draft_ids.to(target_argmax.device) == target_argmax[:, :k]
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    next_token = target_argmax.gather(-1, num_accepted.unsqueeze(-1)).squeeze(-1)
    return num_accepted, next_token


def next_kind(num_accepted: int, k: int) -> TokenKind:
    return TokenKind.BONUS if num_accepted == k else TokenKind.RECOVERED
