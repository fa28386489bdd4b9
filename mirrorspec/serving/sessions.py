"""A small session store: bounded, TTL-evicted, explicitly closable.

Sessions hold KV caches, the scarcest thing a replica has, so the store refuses new sessions past
its bound (RESOURCE_EXHAUSTED, so callers can go elsewhere) and evicts idle ones after a TTL.
Losing a session is never fatal: the orchestrator keeps the token log and can reopen it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from mirrorspec.config import InvalidRequest, SamplingParams
from mirrorspec.serving.errors import ContextMismatch, SessionLimitReached, SessionNotFound

S = TypeVar("S")


@dataclass
class _Entry(Generic[S]):
    state: S
    last_used: float = field(default_factory=time.monotonic)


class SessionStore(Generic[S]):
    def __init__(self, max_sessions: int = 64, ttl_s: float = 600.0,
                 on_evict: Callable[[S], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._on_evict = on_evict or (lambda state: None)
        self._clock = clock
        self._entries: dict[str, _Entry[S]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def open(self, state: S) -> str:
        self.evict_expired()
        if len(self._entries) >= self.max_sessions:
            raise SessionLimitReached(
                f"this replica already holds {self.max_sessions} sessions (its --max-sessions); "
                f"close finished sessions or retry on another replica")
        session_id = uuid.uuid4().hex
        self._entries[session_id] = _Entry(state, self._clock())
        return session_id

    def get(self, session_id: str) -> S:
        entry = self._entries.get(session_id)
        if entry is None:
            raise SessionNotFound(session_id)
        entry.last_used = self._clock()
        return entry.state

    def close(self, session_id: str) -> bool:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._on_evict(entry.state)
        return entry is not None

    def evict_expired(self) -> int:
        now = self._clock()
        stale = [sid for sid, e in self._entries.items() if now - e.last_used > self.ttl_s]
        for sid in stale:
            self.close(sid)
        return len(stale)


@dataclass
class SequenceState:
    """A session's committed context and the request's sampling setup.

    Callers send only the tokens committed since their last call plus the length they expect
    afterwards; a mismatch means the two sides disagree about the sequence and must resync
    (reopen the session from the orchestrator's log) rather than silently diverge.
    """

    context: list[int]
    params: SamplingParams
    seed: int

    def commit(self, tokens: list[int], expected_length: int, keep: int | None = None) -> None:
        """Append ``tokens``, first forgetting all but ``keep`` tokens where given (mirror branches
        fork from a shorter prefix). Everything is checked before anything changes: a refused call
        leaves the session as it was, and a session never ends up empty (a draft needs a context)."""
        held = len(self.context)
        base = held if keep is None else keep
        if base > held:
            raise ContextMismatch(f"keep={keep} exceeds the {held} tokens this session holds; "
                                  f"reopen the session with the full context")
        if base + len(tokens) != expected_length:
            kept = "" if keep is None else f" keeping {keep}"
            raise ContextMismatch(
                f"session holds {held} tokens;{kept} committing {len(tokens)} gives {base + len(tokens)}, but "
                f"the caller expects {expected_length}; reopen the session with the full context")
        if expected_length < 1:
            raise InvalidRequest("the session would hold no tokens; keep at least the first prompt token",
                                 field="keep")
        del self.context[base:]
        self.context += tokens
