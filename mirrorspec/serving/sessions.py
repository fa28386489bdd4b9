"""A small session store: bounded, TTL-evicted, explicitly closable.

Sessions hold KV caches, the scarcest thing a replica has, so the store refuses new sessions past
its bound (RESOURCE_EXHAUSTED, so callers can go elsewhere) and evicts idle ones after a TTL.
Losing a session is never fatal: the orchestrator keeps the token log and can reopen it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from mirrorspec.config import InvalidRequest, SamplingParams
from mirrorspec.serving.errors import ContextMismatch, SessionLimitReached, SessionNotFound

S = TypeVar("S")


@dataclass
class _Entry(Generic[S]):
    state: S
    last_used: float
    ttl_s: float


class SessionStore(Generic[S]):
    """``orphan_ttl_s``: how long a session stays without a call once it is opened, once a unary
    call for it ended (``orphaned_after``), and once its window stream ended (its caller closed or
    cancelled it, or the caller's process died and took the connection); an open window stream
    keeps it. A live caller calls at its next window, within milliseconds, or closes the
    session; a front door that crashed never will, and its sessions held their slots for the whole
    ``ttl_s`` (ten minutes), so a restarted front door found its replicas full. A live caller's
    session evicted all the same (one idle longer, e.g. a drafter's while speculation is paused)
    costs a reopen: the caller replays it from its token log on NOT_FOUND."""

    def __init__(self, max_sessions: int = 64, ttl_s: float = 600.0,
                 on_evict: Callable[[S], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 orphan_ttl_s: float = 60.0):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.orphan_ttl_s = orphan_ttl_s
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
        self._entries[session_id] = _Entry(state, self._clock(), self.ttl_s)
        return session_id

    def get(self, session_id: str) -> S:
        entry = self._entries.get(session_id)
        if entry is None:
            raise SessionNotFound(session_id)
        entry.last_used, entry.ttl_s = self._clock(), self.ttl_s  # called again: not orphaned
        return entry.state

    def orphan(self, session_id: str) -> None:
        """The session was just opened, or its window stream ended: unless a call comes for it within
        ``orphan_ttl_s``, it is evicted (a session already closed is left alone)."""
        entry = self._entries.get(session_id)
        if entry is not None:
            entry.last_used, entry.ttl_s = self._clock(), min(entry.ttl_s, self.orphan_ttl_s)

    def close(self, session_id: str) -> bool:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._on_evict(entry.state)
        return entry is not None

    def evict_expired(self) -> int:
        now = self._clock()
        stale = [sid for sid, e in self._entries.items() if now - e.last_used > e.ttl_s]
        for sid in stale:
            self.close(sid)
        return len(stale)


@dataclass
class StreamedSession:
    session_id: str | None = None  # the session whose windows a stream carries

    def carry(self, session_id: str) -> None:
        """A window for ``session_id``. A stream carries one session's windows: one that went on
        to another session's left the first on the ten-minute TTL as it ended, not orphaned."""
        if self.session_id is not None and session_id != self.session_id:
            raise InvalidRequest(f"this window stream carries session {self.session_id!r}, not {session_id!r}: "
                                 "open one stream per session", field="session_id")
        self.session_id = session_id


@contextmanager
def orphaned_after(sessions: SessionStore, session_id: str) -> Iterator[None]:
    """Around a unary call for a session (mirror mode's hinted Verify and DraftBranches, among
    others): once it ends, the session is ``orphan``ed, as once a window stream ends. A front door
    that died between two such calls never makes the next; its session went after ten minutes."""
    try:
        yield
    finally:
        sessions.orphan(session_id)


@contextmanager
def orphaned_at_end(sessions: SessionStore) -> Iterator[StreamedSession]:
    """Around a window stream's servicer loop: when the stream ends, its session is ``orphan``ed.
    However it ended: gRPC hands the servicer a caller's cancel, and a caller's process dying, as
    the same end of its request stream as a half-close. A live caller's session outlives its
    stream only by a call at its next window (which un-orphans it), or goes by ``CloseSession``."""
    streamed = StreamedSession()
    try:
        yield streamed
    finally:
        if streamed.session_id is not None:
            sessions.orphan(streamed.session_id)


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
