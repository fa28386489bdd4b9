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
_GOLDEN_INT, _MIX1_INT, _MIX2_INT = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_GOLDEN, _MIX1, _MIX2 = np.uint64(_GOLDEN_INT), np.uint64(_MIX1_INT), np.uint64(_MIX2_INT)


class Stream(enum.IntEnum):
    DRAFT = 1  # draft side: sampling the proposal from q
    ACCEPT = 2  # target side: the accept/reject coin of each draft token
    NEXT = 3  # target side: the recovered or bonus token (and plain target-only sampling)
    RUNNER_UP = 4  # target side: the accept coin of a window's runner-up, where its first draft lost


# Below this many hashes a draw is computed on Python ints: numpy's per-call cost (~1 us an
# operation, nine operations a hash) outweighs its speed on a handful of elements, and the
# engine draws a handful at a time (a window's K uniforms, a tiny vocabulary's race). Both paths
# give the same bits (``tests/sampling/test_randomness.py`` holds them to it).
SCALAR_HASHES = 64


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 arrays (numpy wraps uint64 arithmetic);
    in place after the first add, so a vocabulary-wide race makes one array, not nine."""
    x = x + _GOLDEN
    x ^= x >> np.uint64(30)
    x *= _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return x


def splitmix64_int(x: int) -> int:
    """``splitmix64`` on one Python int's low 64 bits."""
    x = (x + _GOLDEN_INT) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1_INT) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2_INT) & _MASK64
    return x ^ (x >> 31)


def _words(values: Sequence[int]) -> np.ndarray:
    """Python ints (negative or past 2**63 too) as their low 64 bits."""
    return np.array([v & _MASK64 for v in values], dtype=np.uint64)


def _unit(bits: np.ndarray) -> np.ndarray:
    """The top 53 bits as a float64 in [0, 1)."""
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _unit_int(bits: int) -> float:
    """``_unit`` of one hash (an int below 2**53 converts to float64 exactly)."""
    return (bits >> 11) * 2.0**-53


def uniforms(seed: int, positions: Sequence[int], stream: Stream, branch: int = 0) -> torch.Tensor:
    """Uniforms in [0, 1) with 53 random bits, one per position, each fixed by its coordinates;
    float64, so no draw rounds up to 1.0."""
    if len(positions) <= SCALAR_HASHES:
        return torch.tensor(_uniform_ints(seed, positions, stream, branch), dtype=torch.float64)
    h = splitmix64(splitmix64(_words([seed])) ^ _words(positions))  # [n]
    for part in (int(stream), branch):
        h = splitmix64(h ^ _words([part]))
    return torch.from_numpy(_unit(h))


def _uniform_ints(seed: int, positions: Sequence[int], stream: Stream, branch: int) -> list[float]:
    seeded, stream_word, branch_word = splitmix64_int(seed & _MASK64), int(stream), branch & _MASK64
    return [_unit_int(splitmix64_int(splitmix64_int(splitmix64_int(seeded ^ (p & _MASK64)) ^ stream_word)
                                     ^ branch_word))
            for p in positions]


def uniform(seed: int, position: int, stream: Stream, branch: int = 0) -> float:
    return float(uniforms(seed, [position], stream, branch)[0])


def race_noise(u: torch.Tensor, width: int) -> torch.Tensor:
    """Exp(1) noise for ``width`` columns per uniform, a pure function of (u, column), on the CPU
    whatever the device (so draws agree across devices).  # [n] -> [n, width] float64"""
    u = u.detach().to("cpu", torch.float64)  # [n]
    if u.numel() * width <= SCALAR_HASHES:
        rows = [splitmix64_int(int(x * 2.0**53)) for x in u.tolist()]  # exact: each key is below 2**53
        units = np.array([[_unit_int(splitmix64_int(row ^ j)) for j in range(width)] for row in rows],
                         dtype=np.float64).reshape(len(rows), width)
    else:
        keys = (u * 2.0**53).to(torch.int64).numpy().astype(np.uint64)  # [n]
        units = _unit(splitmix64(splitmix64(keys)[:, None] ^ np.arange(width, dtype=np.uint64)[None, :]))  # [n, width]
    # the uniform lies in (0, 1), but for 53 one-bits it rounds to 1.0, and its noise to -0.0: a
    # zero-probability column then won (0 / -0.0 is NaN, which argmax takes)
    return torch.from_numpy(np.maximum(-np.log(units + 2.0**-54), 2.0**-60))


def fresh_seed() -> int:
    """A seed for requests that gave none; it is reported back so the run can be replayed."""
    return int.from_bytes(os.urandom(8), "little") >> 1
