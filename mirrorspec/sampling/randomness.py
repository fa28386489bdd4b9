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

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class Stream(enum.IntEnum):
    DRAFT = 1  # draft side: sampling the proposal from q
    ACCEPT = 2  # target side: the accept/reject coin of each draft token
    NEXT = 3  # target side: the recovered or bonus token (and plain target-only sampling)
    RUNNER_UP = 4  # target side: the accept coin of a window's runner-up, where its first draft lost


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 arrays (numpy wraps uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def _words(values: Sequence[int]) -> np.ndarray:
    """Python ints (negative or past 2**63 too) as their low 64 bits."""
    return np.array([v & _MASK64 for v in values], dtype=np.uint64)


def _unit(bits: np.ndarray) -> np.ndarray:
    """The top 53 bits as a float64 in [0, 1)."""
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def uniforms(seed: int, positions: Sequence[int], stream: Stream, branch: int = 0) -> torch.Tensor:
    """Uniforms in [0, 1) with 53 random bits, one per position, each fixed by its coordinates;
    float64, so no draw rounds up to 1.0."""
    h = splitmix64(splitmix64(_words([seed])) ^ _words(positions))  # [n]
    for part in (int(stream), branch):
        h = splitmix64(h ^ _words([part]))
    return torch.from_numpy(_unit(h))


def uniform(seed: int, position: int, stream: Stream, branch: int = 0) -> float:
    return float(uniforms(seed, [position], stream, branch)[0])


def race_noise(u: torch.Tensor, width: int) -> torch.Tensor:
    """Exp(1) noise for ``width`` columns per uniform, a pure function of (u, column), on the CPU
    whatever the device (so draws agree across devices).  # [n] -> [n, width] float64"""
    keys = (u.detach().to("cpu", torch.float64) * 2.0**53).to(torch.int64).numpy().astype(np.uint64)  # [n]
    bits = splitmix64(splitmix64(keys)[:, None] ^ np.arange(width, dtype=np.uint64)[None, :])  # [n, width]
    # the uniform lies in (0, 1), but for 53 one-bits it rounds to 1.0, and its noise to -0.0: a
    # zero-probability column then won (0 / -0.0 is NaN, which argmax takes)
    return torch.from_numpy(np.maximum(-np.log(_unit(bits) + 2.0**-54), 2.0**-60))


def fresh_seed() -> int:
    """A seed for requests that gave none; it is reported back so the run can be replayed."""
    return int.from_bytes(os.urandom(8), "little") >> 1
