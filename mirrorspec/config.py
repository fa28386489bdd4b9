"""Typed configuration: one place for every knob and its default.

Validation lives here, in ``__post_init__``, so that every entry point (Python API, CLI, gRPC
servers) rejects the same bad values with the same message, naming the field and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request parameter is out of range or malformed; the message says which and how to fix it.

    Servers map it to INVALID_ARGUMENT (or OUT_OF_RANGE via ``OutOfRange``); the CLI prints it.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class OutOfRange(InvalidRequest):
    """A value is well-formed but exceeds a configured limit (context window, K bound, ...)."""


@dataclass(frozen=True)
class SamplingParams:
    """How the *target* distribution p is formed, and when generation stops.

    temperature == 0 means greedy decoding. top_k == 0 and top_p == 1 switch those filters off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise InvalidRequest("temperature is NaN; use 0 for greedy or a positive value such as 0.7",
                                 field="temperature")
        if self.temperature < 0 or math.isinf(self.temperature):
            raise InvalidRequest(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}",
                                 field="temperature")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}", field="top_k")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1] (1 = off), got {self.top_p}", field="top_p")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}",
                                 field="max_new_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculationConfig:
    """How the draft side proposes.

    proposal_top_k > 0 makes the proposal distribution q sparse: the drafter samples only from the
    top ``proposal_top_k`` tokens of its own distribution, renormalised. Rejection sampling stays
    exact for any q the token was really drawn from, and a sparse q travels in a few KB.
    """

    num_speculative_tokens: int = 4
    max_speculative_tokens: int = 16
    proposal_top_k: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.max_speculative_tokens <= 64:
            raise InvalidRequest(f"max_speculative_tokens must be in [1, 64], got {self.max_speculative_tokens}",
                                 field="max_speculative_tokens")
        if not isinstance(self.num_speculative_tokens, int) or not (
            0 <= self.num_speculative_tokens <= self.max_speculative_tokens
        ):
            raise OutOfRange(
                f"num_speculative_tokens (K) must be in [0, {self.max_speculative_tokens}], "
                f"got {self.num_speculative_tokens}; use 0 for target-only decoding",
                field="num_speculative_tokens",
            )
        if self.proposal_top_k < 0:
            raise InvalidRequest(f"proposal_top_k must be >= 0 (0 = dense q), got {self.proposal_top_k}",
                                 field="proposal_top_k")


@dataclass(frozen=True)
class ModelConfig:
    """Where a model comes from and where it runs.

    ``source`` is a hub id, a local directory, a path to a ``.gguf`` file, or ``demo-target``.
    dtype/device ``auto`` means float32 on CPU and bfloat16 on CUDA.
    """

    source: str
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaConfig:
    """What every model-serving replica (drafter or target) needs: a model, a place, bounds."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    max_speculative_tokens: int = 16
