"""Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023), batched over windows.

For each window of K draft tokens x_1..x_K drawn from q_1..q_K:
  * accepted:  x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the
               first rejection;
  * recovered: at the first rejection i, the next token is drawn from norm(max(0, p_i - q_i));
  * bonus:     if all K are kept, one more token is drawn from p_{K+1}.
The emitted tokens are then distributed exactly as sampling from p one token at a time.

A window may also carry a runner-up for its first slot: where the first draft is rejected, it
gets a second round before the recovered token is drawn (``runner_up_sample``).

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
    # runner-up windows: the drafter's runner-up, taken in place of the first draft (then
    # num_accepted is 1 and next_token is the target's token after it)
    runner_up: int | None = None

    @property
    def drafts_accepted(self) -> int:
        """The chain's drafts that passed their test, what acceptance statistics and adaptive K
        count: none where the runner-up took the first slot, since the first draft failed there
        (the drafter's token kept is counted apart, as a runner-up win)."""
        return 0 if self.runner_up is not None else self.num_accepted

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
    # NaN too (a draft whose logits overflowed: its q is NaN, and every test against it rejects):
    # then the draw is from p, which is exact, where a NaN row drew column 0 every time
    degenerate = ~(mass > RESIDUAL_EPS)
    return torch.where(degenerate, p, residual / mass.clamp_min(RESIDUAL_EPS))


def runner_up_sample(
    p_first: torch.Tensor,  # [batch, vocab] float32, the target's distribution at the first draft's slot
    q_first: torch.Tensor,  # [batch, vocab] float32, what the first draft was drawn from
    runner_up: torch.Tensor,  # [batch] int64, a second candidate for that slot, chosen without the target
    u_runner_up: torch.Tensor,  # [batch] uniforms for its accept test
    u_next: torch.Tensor,  # [batch] uniforms for the recovered token where it is rejected too
) -> tuple[torch.Tensor, torch.Tensor]:
    """A second round of rejection sampling at a window's first slot, once its first draft is rejected
    (recursive rejection sampling, Jeon et al. 2024, with one-hot second proposals).

    After the rejection the target still owes one draw from r = norm(max(0, p - q)). The runner-up
    b is a draw from the one-hot proposal delta_b, which may depend on the context and on the
    first draft but not on the target, so the same rule applies again: keep b with probability
    min(1, r(b) / 1), and otherwise draw from norm(max(0, r - delta_b)), which is r without b.
    Either way the slot's token follows r, hence the window's first token follows p, exactly.

    Returns (taken [batch] bool: the runner-up is kept, recovered [batch] int64: the token where not).
    """
    index = runner_up.unsqueeze(-1)  # [batch, 1]
    residual = recovery_distribution(p_first.float(), q_first.float())  # [batch, vocab]
    taken = u_runner_up.to(residual.device, torch.float64) < residual.gather(-1, index).squeeze(-1).double()
    runner_up_q = torch.zeros_like(residual).scatter_(-1, index, 1.0)  # [batch, vocab]
    recovered = sample_categorical(recovery_distribution(residual, runner_up_q), u_next.to(residual.device))
    return taken, recovered


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
