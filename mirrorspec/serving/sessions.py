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
from mirrorspec.serving.errors import ContextMismatch, SessionIdTaken, SessionLimitReached, SessionNotFound

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
    costs a reopen: the caller replays it from its token log on NOT_FOUND.

    A caller may choose the id it opens with (``open(state, session_id)``), so a caller whose open
    failed with the session perhaps opened (its deadline passed as this replica opened it: the
    answer was dropped, and the session held a slot for ``orphan_ttl_s``, a review's find) can close
    it all the same. A close for an id not held is remembered for ``orphan_ttl_s``, and an open with
    that id is refused: the close of an abandoned open may overtake the open itself."""

    max_id_chars = 64

    def __init__(self, max_sessions: int = 64, ttl_s: float = 600.0,
                 on_evict: Callable[[S], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 orphan_ttl_s: float = 60.0):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.orphan_ttl_s = orphan_ttl_s
        self._on_evict = on_evict or (lambda state: None)
        self._clock = clock
        self._entries: dict[str, _Entry[S]] = {}
        self._closed_unopened: dict[str, float] = {}  # id -> when a close came for it, held by no session

    def __len__(self) -> int:
        return len(self._entries)

    def open(self, state: S, session_id: str = "") -> str:
        """``session_id``: the caller's choice of id (empty: a fresh one is made here)."""
        self.evict_expired()
        self._check_new_id(session_id)
        if len(self._entries) >= self.max_sessions:
            raise SessionLimitReached(
                f"this replica already holds {self.max_sessions} sessions (its --max-sessions); "
                f"close finished sessions or retry on another replica")
        session_id = session_id or uuid.uuid4().hex
        self._entries[session_id] = _Entry(state, self._clock(), self.ttl_s)
        return session_id

    def _check_new_id(self, session_id: str) -> None:
        if not session_id:
            return
        if not self._well_formed(session_id):
            raise InvalidRequest(f"session_id must be at most {self.max_id_chars} printable ASCII characters "
                                 f"(a random hex id, e.g. uuid4().hex), or empty for the replica to choose one",
                                 field="session_id")
        if session_id in self._entries:
            raise SessionIdTaken(f"session {session_id!r} is already open here; open each session with a fresh "
                                 f"random id")
        if self._closed_unopened.pop(session_id, None) is not None:
            raise SessionIdTaken(f"session {session_id!r} was closed before it opened (its caller gave up on the "
                                 f"open); open with a fresh id")

    def _well_formed(self, session_id: str) -> bool:
        return len(session_id) <= self.max_id_chars and session_id.isascii() and session_id.isprintable()

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
        elif session_id and self._well_formed(session_id):  # its open may be on its way: refuse it
            self._forget_old_closes()
            self._closed_unopened.pop(session_id, None)  # kept in the order of the closes, oldest first
            if len(self._closed_unopened) < self.max_remembered_closes:
                self._closed_unopened[session_id] = self._clock()
        return entry is not None

    @property
    def max_remembered_closes(self) -> int:
        return 16 * self.max_sessions + 1024

    def _forget_old_closes(self) -> None:
        cutoff = self._clock() - self.orphan_ttl_s  # an open later than that left an orphan, evicted as one
        while self._closed_unopened and next(iter(self._closed_unopened.values())) < cutoff:
            del self._closed_unopened[next(iter(self._closed_unopened))]

    def evict_expired(self) -> int:
        now = self._clock()
        stale = [sid for sid, e in self._entries.items() if now - e.last_used > e.ttl_s]
        for sid in stale:
            self.close(sid)
        self._forget_old_closes()
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
