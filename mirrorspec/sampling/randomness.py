"""Counter-based randomness: every random draw is a pure function of (seed, position, stream, branch).

Why not a stateful ``torch.Generator``? Because the draw for absolute position ``j`` must not
depend on how many windows, rejections or retries happened before it. With counter-based uniforms
a seeded request is reproducible across processes, devices, K, network replays and failover, and
the draft side and the target side never share a stream, which exactness needs (the proposal's
randomness must be independent of the acceptance test's).

A draw consumed for a draft token that was later discarded (beyond a rejection) may be consumed
again at that position in a later window. That is safe: the emitted tokens never depended on it.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


class Stream(enum.IntEnum):
    DRAFT = 1  # draft side: sampling the proposal from q
    ACCEPT = 2  # target side: the accept/reject coin of each draft token
    NEXT = 3  # target side: the recovered or bonus token (and plain target-only sampling)
    RUNNER_UP = 4  # target side: the accept coin of a window's runner-up, where its first draft lost


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: Stream, branch: int = 0) -> float:
    """A uniform in [0, 1) with 53 random bits, fixed by its coordinates."""
    h = _splitmix64(seed & _MASK64)
    for part in (position, int(stream), branch):
        h = _splitmix64(h ^ (part & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def uniforms(seed: int, positions: Sequence[int], stream: Stream, branch: int = 0) -> torch.Tensor:
    """Uniforms for several positions, as float64 (so no draw rounds up to 1.0)."""
    return torch.tensor([uniform(seed, p, stream, branch) for p in positions], dtype=torch.float64)


def fresh_seed() -> int:
    """A seed for requests that gave none; it is reported back so the run can be replayed."""
    return int.from_bytes(os.urandom(8), "little") >> 1
