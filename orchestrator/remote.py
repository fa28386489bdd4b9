"""The core's ``Drafter`` and ``Verifier`` interfaces, implemented over gRPC replica pools.

With these, the orchestrator runs the very same ``decode_windows`` loop as the in-process engine.
Both send only what was committed since their last call. The orchestrator's context is the
authoritative token log, so a session can be reopened from it at any time, on any replica: when
its session expired, when its replica was drained out of the pool, or when the replica died.
Randomness is addressed by (seed, position), so a replayed session draws exactly what the lost
one would have: moving never changes the output.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import grpc

from mirrorspec.config import DRAFT_HUNG_AFTER_S, InvalidRequest, SamplingParams
from mirrorspec.drafting import Drafter, NgramDrafter, Proposal, RankedTokens
from mirrorspec.drafting.base import fork_points_or_end
from mirrorspec.engine import runner_up_to_offer
from mirrorspec.models import common_prefix_length
from mirrorspec.models.early_exit import EarlyExitHint
from mirrorspec.sampling import WindowVerdict
from mirrorspec.serving.errors import BACKEND_COMPUTE_FAILED, SessionLimitReached
from mirrorspec.serving.convert import (
    hint_from_proto,
    params_to_proto,
    proposal_from_proto,
    proposal_to_proto,
    ranked_from_proto,
    verdict_from_proto,
)
from mirrorspec.v1 import drafter_pb2, target_pb2
from orchestrator.pool import NoReplicaAvailable, Replica, ReplicaPool, settle, start_close
from orchestrator.window_stream import WindowStream

log = logging.getLogger(__name__)

# Statuses after which the session goes to another replica: the replica is gone or its session is.
# A stopping server cancels the calls it has not finished, and which of CANCELLED and UNAVAILABLE
# reaches the caller first is a race; this client never cancels its own backend calls, so either
# means the replica went away.
_REPLICA_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
_SESSION_GONE = grpc.StatusCode.NOT_FOUND
ROOM_POLL_S = 0.25  # how often a moving session asks full replicas again
# a call whose deadline was the client's may fail a moment before this process's clock reaches it
CLOCK_SLACK_S = 0.05


def client_deadline_passed(deadline: float | None) -> bool:
    """Whether a client's deadline (``time.monotonic()``; None: it set none) has passed, give or take
    the ``CLOCK_SLACK_S`` by which a call that ran out with it may beat this process's clock."""
    return deadline is not None and time.monotonic() >= deadline - CLOCK_SLACK_S


# the replica's compute raised: the replica's fault (a CUDA error, out of memory) or the request's
_COMPUTE_FAILED = BACKEND_COMPUTE_FAILED
# an open's answers that say the replica opened nothing: any other failure may come after it did
_REFUSED_BEFORE_OPENING = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                                     grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED,
                                     grpc.StatusCode.ALREADY_EXISTS})


@dataclass
class CallTimes:
    """Client-side call time and the server-side compute time inside it; the gap is network."""

    call_s: float = 0.0
    server_s: float = 0.0

    @property
    def network_s(self) -> float:
        return max(self.call_s - self.server_s, 0.0)


class PooledSession:
    """One request's session on some replica of a pool, replayed elsewhere when it has to move."""

    max_moves_per_call = 4
    waits_for_room_to_move = True  # a session that must move waits for a full replica's room
    # an open still running after this long has its replica's health asked, and again as often:
    # an open prefills, which takes as long as the prompt is, so its deadline cannot tell a long
    # prompt from a replica that stopped (a frozen process held a replayed session its whole budget)
    probe_open_after_s = 5.0
    probe_timeout_s = 5.0
    # a window call committing more tokens than this carries a prefill (a deferred one, or a long
    # stretch of the log): it may take as long as an open, and keeps the request's deadline
    prefill_free_tokens = 64

    def __init__(self, pool: ReplicaPool, prompt: Sequence[int], params: SamplingParams, seed: int,
                 timeout_s: float | None, replacement_wait_s: float, window_timeout_s: float | None = None,
                 ended: threading.Event | None = None, client_deadline: float | None = None):
        self.pool = pool
        self.ended = ended  # set once the request is over (cancelled, past its deadline): stop waiting
        self.client_deadline = client_deadline  # time.monotonic() at which the client's own deadline passes
        self.prompt_length = len(prompt)
        self.params = params
        self.seed = seed
        self.timeout_s = timeout_s  # an open's deadline (it prefills), and a window's by default
        # a window's own, where shorter: a replica that takes longer is taken for hung, and left
        self.window_timeout_s = window_timeout_s if timeout_s is None else min(window_timeout_s or timeout_s, timeout_s)
        self.call_timeout_s = timeout_s  # the deadline of the call ``call`` is making
        self.prefill_pending = False  # opened with its prefill deferred to the first window call
        self.replacement_wait_s = replacement_wait_s
        self.times = CallTimes()
        self.replica: Replica | None = None
        self.session_id: str | None = None
        self.held: list[int] = []  # the context the remote session holds
        self.moves = 0  # reopenings after the first open that opened (the stats' target/drafter_moves)
        self.move_attempts = 0  # those begun: one whose open failed (no replica left) replayed nothing
        self.failed_on: set[str] = set()  # the replica whose compute raised on this session (one at most)
        # the session may hold tokens past ``held`` (a target running the windows sent it more than
        # it reported before its run broke off): the next call says how many to keep
        self.may_hold_more = False
        self.streams = True  # window calls go as messages on a stream (until a replica predates that)
        self._stream: WindowStream | None = None  # on ``self.replica``; a move closes it

    def open_request(self, context: Sequence[int], params: SamplingParams):
        raise NotImplementedError

    def open(self, context: Sequence[int]) -> None:
        """Open on the least-loaded replica, trying others while replicas refuse or are down, for
        up to ``replacement_wait_s``. A replica that is down is kept off for the pool's failure
        cooldown only, not for the rest of the request: one restarted at its own address (a
        single-target deployment) serves the session again."""
        tried = set(self.failed_on)  # replicas that failed it, refused (full), or were down when time ran out
        deadline = time.monotonic() + self.replacement_wait_s
        # the budget left to this request, so a replayed (longer) prompt passes the context check
        params = replace(self.params, max_new_tokens=max(self.params.max_new_tokens
                                                         - (len(context) - self.prompt_length), 1))
        full: set[str] = set()
        while True:
            try:  # wait for a replacement replica only if none refused for being full
                replica = self.pool.acquire(tried, wait_s=0.0 if full else max(deadline - time.monotonic(), 0.0),
                                            stop=self.ended)
            except NoReplicaAvailable:
                if full and self._room_may_come(deadline):  # a move: others' sessions end meanwhile
                    tried -= full
                    full.clear()
                    continue
                if full:
                    raise SessionLimitReached(
                        f"every {self.pool.name} replica that answered is at its session limit "
                        f"({', '.join(sorted(full))}); retry later, scale the {self.pool.name} pool up, or raise the "
                        f"replicas' --max-sessions") from None
                raise
            try:
                response = self._open_on(replica, self.open_request(context, params), session_id=uuid.uuid4().hex)
            except _Unresponsive:
                log.warning("%s replica %s stopped answering during an open; opening elsewhere", self.pool.name,
                            replica.address)
                self.pool.release(replica)
                self.pool.report_failure(replica)  # kept off for the cooldown: another first, or this one later
                continue
            except grpc.RpcError as err:
                self.pool.release(replica)
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not self.client_left():
                    self.pool.report_slow(replica)  # hung, or busy: others first for a while
                if err.code() in _REPLICA_GONE:
                    self.pool.report_failure(replica)
                    if time.monotonic() >= deadline:  # out of time: not this one again
                        tried.add(replica.address)
                    continue
                if err.code() in _COMPUTE_FAILED and self.elsewhere_after(replica, err):
                    tried.add(replica.address)
                    continue
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                full.add(replica.address)
                tried.add(replica.address)
                continue
            self.replica, self.session_id, self.held = replica, response.session_id, list(context)
            self.pool.holds(replica, response.session_id)
            return

    def client_left(self) -> bool:
        """Whether the client's own deadline has passed: a call that ran out of time with it says
        nothing of the replica. A client that gave up 0.5 s into a busy moment marked a healthy
        target slow, and for the cooldown every new request went to the other one, however loaded
        (a load review). A call's own shorter deadline (a drafter's, half the client's) still does."""
        return client_deadline_passed(self.client_deadline)

    def _room_may_come(self, deadline: float) -> bool:
        """After a short wait, whether a session moving off a replica (gone, drained, failing) tries
        the full ones again: it had streamed tokens, and failed at once with RESOURCE_EXHAUSTED where
        the survivors were full for a moment (a failure-injection review). A request's first open
        still fails fast (admission control), and so does a drafter's: it goes on target-only."""
        if not (self.move_attempts and self.waits_for_room_to_move) or time.monotonic() >= deadline:
            return False
        ended = self.ended or threading.Event()  # a request that cannot end: a plain sleep
        return not ended.wait(min(ROOM_POLL_S, max(deadline - time.monotonic(), 0.0)))

    def _open_on(self, replica: Replica, request, session_id: str):
        """``OpenSession`` on ``replica`` as ``session_id``, for up to the request's deadline while
        the replica answers its health check SERVING (asked each ``probe_open_after_s`` the open
        runs); ``_Unresponsive`` once it does not. An open that fails where the replica may have
        opened the session all the same (a deadline that passed as it did) has that id closed."""
        request.session_id = session_id
        call = replica.stub.OpenSession.future(request, timeout=self.timeout_s)
        try:
            while True:
                try:
                    return call.result(timeout=self.probe_open_after_s)
                except grpc.FutureTimeoutError:
                    if not replica.answers_serving(self.probe_timeout_s):
                        call.cancel()
                        raise _Unresponsive(replica.address) from None
        except (grpc.RpcError, _Unresponsive) as err:
            if not (isinstance(err, grpc.RpcError) and err.code() in _REFUSED_BEFORE_OPENING):
                with contextlib.suppress(ValueError):  # the front door stopped: its channel is closed
                    start_close(replica.stub, session_id, self.probe_timeout_s)
            raise

    def call(self, context: Sequence[int], rpc: Callable[[Replica, str, int, list[int]], object],
             window_timeout_s: float | None = None):
        """``rpc(replica, session_id, keep, commit_tokens)``: the session keeps its first ``keep``
        tokens (fewer than it holds only where ``context`` forks from them: mirror branches),
        then commits the rest of ``context``. The session moves first if its replica left the
        pool, and again (at most ``max_moves_per_call`` times) if the call finds the replica or
        the session gone. ``window_timeout_s``: a shorter window deadline for this call only."""
        if window_timeout_s is not None:
            window_timeout_s = min(window_timeout_s, self.window_timeout_s or window_timeout_s)
        else:
            window_timeout_s = self.window_timeout_s
        for _ in range(self.max_moves_per_call):
            self.move_if_drained(context)
            try:
                keep = common_prefix_length(self.held, context)
                commit = list(context[keep:])
                prefills = self.prefill_pending or len(commit) > self.prefill_free_tokens
                self.call_timeout_s = self.timeout_s if prefills else window_timeout_s
                result = rpc(self.replica, self.session_id, keep, commit)
                self.prefill_pending = self.may_hold_more = False
            except grpc.RpcError as err:
                if self.pool.closed:  # the front door stopped, cancelling its calls: no replica failed
                    raise
                if err.code() in _REPLICA_GONE or self._hung(err):
                    log.warning("%s replica %s is %s; replaying the session elsewhere", self.pool.name,
                                self.replica.address, "unreachable" if err.code() in _REPLICA_GONE else "hung")
                    self.pool.report_failure(self.replica)  # kept off for the cooldown: another first
                    self.move(context)
                elif err.code() == _SESSION_GONE:
                    log.info("%s session %s is gone; reopening it from the token log", self.pool.name, self.session_id)
                    self.move(context)
                elif err.code() in _COMPUTE_FAILED and self.elsewhere_after(self.replica, err):
                    self.move(context)
                else:
                    raise
                continue
            self.held = list(context)
            return result
        raise NoReplicaAvailable(f"the {self.pool.name} session moved {self.max_moves_per_call} times in one "
                                 f"window without an answer; the {self.pool.name} pool is unhealthy")

    def elsewhere_after(self, replica: Replica, err: grpc.RpcError) -> bool:
        """Whether the session goes to another replica after ``replica``'s compute raised on it.
        A replica that raises (out of memory, a device error) still answers its health check, so
        it lost its requests and drew every new one that tied onto it (a review's find): the
        session moves, once, and the replica is kept off for the cooldown. The same failure on a
        second replica is the request's own, and is raised: a request that fails everywhere must
        not put every replica of the pool off. Nor does it move where no other replica could take
        it now (a pool of one, the rest failed of late): it would wait for one, and lose the error."""
        if self.failed_on or not self.pool.takes_sessions_besides(replica.address):
            return False
        log.warning("%s replica %s failed a call (%s: %s); replaying the session elsewhere", self.pool.name,
                    replica.address, err.code().name, err.details())
        self.failed_on.add(replica.address)
        self.pool.report_failure(replica)
        return True

    def _hung(self, err: grpc.RpcError) -> bool:
        """A window past its own deadline, shorter than the request's: the replica hangs (a stuck
        compute lane, a stopped process) while the request still has time to go elsewhere."""
        return (err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.call_timeout_s is not None
                and (self.timeout_s is None or self.call_timeout_s < self.timeout_s))

    def stream_call(self, replica: Replica, method: str, request):
        """``request`` as the next message on this session's ``method`` stream to ``replica``
        (opened on first use, and again after an error or a move); None where the replica predates
        ``method``, and from then on: the caller makes the unary call instead. UNIMPLEMENTED
        means no handler ran, so that retry is safe."""
        if not self.streams:
            return None
        if self._stream is None:
            self._stream = WindowStream(getattr(replica.stub, method), self.pool.watchdog)
        try:
            return self._stream.call(request, self.call_timeout_s)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.streams = False
            return None

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._stream = None

    def move_if_drained(self, context: Sequence[int]) -> None:
        """Moves the session where its replica left the pool (drained, or scaled away)."""
        if not self.pool.is_member(self.replica):
            log.info("%s replica %s left the pool; moving its session", self.pool.name, self.replica.address)
            self.move(context)

    def move(self, context: Sequence[int]) -> None:
        # the session reopens at once: a replica left because it hangs answers no close either,
        # and waiting out the close's deadline cost the request 5 s more (review of stop 55)
        self.let_go(wait=False)
        self.move_attempts += 1
        self.prefill_pending = self.may_hold_more = False  # a reopened session prefills in its open
        self.open(context)
        self.moves += 1  # counted once it opened: a drafter that fell back said it had moved (a review)

    def let_go(self, wait: bool = True) -> None:
        """Close the session on its replica (without waiting for the answer, unless ``wait``) and
        hold none; ``open`` starts another."""
        closing = self.start_letting_go()
        if closing is None:
            return
        if wait:
            finish_closing(closing)
        else:  # the replica stays in use until the answer: a thread of its own waits for it, not
            # the call's done-callback, which runs on the channel's own thread and would close
            # that channel from it where the replica is retired
            threading.Thread(target=finish_closing, args=(closing,), name="session-close", daemon=True).start()

    def start_letting_go(self) -> SessionClose | None:
        """``let_go`` without the wait: the close, under way (None where no session is held). The
        replica stays in use until ``finish_closing`` has its answer."""
        if self.replica is None:
            return None
        self._close_stream()
        self.pool.let_go(self.replica, self.session_id)
        # drained: closing still frees its KV cache so the drain can finish
        call = start_close(self.replica.stub, self.session_id, 5 if self.pool.is_member(self.replica) else 1)
        closing = SessionClose(call, self.pool, self.replica)
        self.replica = self.session_id = None
        return closing

    def release(self) -> None:
        self.let_go()

    start_release = start_letting_go  # the request is over: ``finish_closing`` waits for several at once


@dataclass
class SessionClose:
    """A session's close under way. Its replica stays in use until the close is answered: a
    retired replica's channel closes once its last user lets go, and would cancel the close."""

    call: grpc.Future
    pool: ReplicaPool
    replica: Replica


def finish_closing(*closes: SessionClose | None) -> None:
    """Waits for closes under way, all at once (several sessions cost one round trip, not one
    each), then lets their replicas go."""
    under_way = [c for c in closes if c is not None]
    settle(*(c.call for c in under_way))
    for closing in under_way:
        closing.pool.release(closing.replica)


def release_together(*holders) -> None:
    """A request's sessions (each holder's ``start_release``) closed at once and then let go. One
    whose close cannot even start (its channel closed as the front door stops) is raised after
    the others' are settled: started in turn as arguments, it left the close already sent
    unawaited and its replica held for good (review of stop 55)."""
    closes, failure = [], None
    for holder in holders:
        if holder is None:
            continue
        try:
            closes.append(holder.start_release())
        except Exception as err:  # noqa: BLE001 - raised below, once the others are let go
            failure = failure or err
    finish_closing(*closes)
    if failure is not None:
        raise failure


class PauseGate:
    """Whether a draft call may draft while the targets are saturated (``paused()``); each call it
    refuses is counted."""

    def __init__(self, paused: Callable[[], bool] | None):
        self.paused = paused
        self.refused = 0

    def allows(self) -> bool:
        if self.paused is not None and self.paused():
            self.refused += 1
            return False
        return True


def replica_step_cost(info: drafter_pb2.DrafterInfo) -> float:
    """A draft step on a pool's replicas over one target step, for adaptive K: what the replica
    reports (``DrafterInfo.step_cost``, its quantization included). A replica from before that
    field reports 0 for any strategy; its draft model is then priced at the plain default."""
    if info.strategy == "ngram":
        return NgramDrafter.step_cost
    return info.step_cost or Drafter.step_cost


MAX_RETRY_AFTER_S = 60.0  # the longest a drafter stays off between tries, however often it failed


def backoff_s(cooldown_s: float, failures_in_a_row: int) -> float:
    """How long to stay off after a failure: the pool's cooldown, doubled for each failure in a
    row before it, up to ``MAX_RETRY_AFTER_S``."""
    return min(cooldown_s * 2 ** failures_in_a_row, MAX_RETRY_AFTER_S)


class RemoteDrafter(Drafter):
    """A drafter session on a DrafterService pool. If no drafter can serve it, it turns off for a
    while: windows then carry no drafts, i.e. the request goes on target-only, unharmed. It then
    opens a new session from the token log, on whichever replica the pool offers by then (one
    restarted, or scaled up), after the pool's failure cooldown, doubling while it keeps failing:
    a long request outlives a drafter's restart, and must not stay target-only for the rest of it.
    While ``paused()`` holds (the targets are saturated) it drafts nothing either, and picks up
    again when it clears."""

    name = "remote"
    HUNG_AFTER_S = DRAFT_HUNG_AFTER_S

    def __init__(self, pool: ReplicaPool, prompt: Sequence[int], params: SamplingParams, seed: int, vocab_size: int,
                 draft_vocab: int | None = None, timeout_s: float | None = None, step_cost: float = Drafter.step_cost,
                 paused: Callable[[], bool] | None = None, caller_lookup: int = 0,
                 client_deadline: float | None = None):
        self.step_cost = step_cost  # of the replica's strategy, for adaptive K
        # the replicas' prompt lookup (its min match), run by the caller in front of this drafter
        # (orchestrator.lookup); 0: the replicas look up themselves, if they do
        self.caller_lookup = caller_lookup
        self.gate = PauseGate(paused)
        self.vocab_size = vocab_size
        # the width of the replicas' dense q rows: a draft table narrower than the target's is widened
        # here (sparse rows hold target ids: a replica's own lookup copies any from the context)
        self.draft_vocab = draft_vocab or vocab_size
        self.failure: str | None = None  # why drafting is off, while it is
        self.fallbacks = 0  # how often it turned off
        self._failures_in_a_row = 0
        self._retry_at = 0.0  # monotonic time from which it tries again
        self._lock = threading.Lock()  # between the request's thread and a reopen in the background
        self._reopening: threading.Thread | None = None
        self._ended = False
        self._ranks = True  # the replicas answer RankTokens (mirror guesses for looked-up windows)
        self._forks = True  # the replicas honour DraftBranches' branch_forks
        self._suspected = False  # the next window's call gets HUNG_AFTER_S at most (``suspected``)
        # drafts are optional: never wait for a drafter to come up, go on target-only instead
        self.session = _DraftSession(pool, prompt, params, seed, timeout_s, replacement_wait_s=0.0,
                                     client_deadline=client_deadline, caller_looks_up=caller_lookup > 0,
                                     target_vocab=vocab_size if self.draft_vocab < vocab_size else 0)
        self._guard(lambda: self.session.open(prompt))

    @property
    def fell_back(self) -> bool:
        """Whether any window of the request went without drafts because the drafter failed."""
        return self.fallbacks > 0

    @property
    def times(self) -> CallTimes:
        return self.session.times

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal:
        if not self.drafting(k, context):
            return Proposal.empty()
        return self._guard(lambda: self._draft(context, k)[0][0]) or Proposal.empty()

    def propose_branches(self, head: Sequence[int], next_tokens: Sequence[int], k: int, params: SamplingParams,
                         seed: int, fork_points: Sequence[int] | None = None) -> list[Proposal]:
        """All of them in one DraftBranches call (one batched forward per step on the replica),
        whichever point of ``head`` each forks at; on a replica built before fork points, one call
        per fork point."""
        none = [Proposal.empty() for _ in next_tokens]
        if not self.drafting(k, head):
            return none
        forks = fork_points_or_end(head, next_tokens, fork_points)
        return self._guard(lambda: self._draft_branches(head, list(next_tokens), forks, k)) or none

    def _draft_branches(self, head: Sequence[int], tokens: list[int], forks: list[int], k: int) -> list[Proposal]:
        if self._forks and len(set(forks)) > 1:
            drafts, forked = self._draft(head, k, tokens, forks)
            if forked:
                return drafts
            self._forks = False  # it drafted every branch at the end of head: unusable; ask a point at a time
        by_fork: dict[int, Proposal] = {}
        for point in dict.fromkeys(forks):
            at = [b for b, f in enumerate(forks) if f == point]
            drafts, _ = self._draft(head[:point], k, [tokens[b] for b in at])
            by_fork.update(zip(at, drafts))
        return [by_fork[b] for b in range(len(tokens))]

    def drafting(self, k: int, context: Sequence[int]) -> bool:
        """Whether a call for ``k`` drafts after ``context`` gets any: not while off after a
        failure, nor while paused. Each refused call while paused is counted: once per window
        when drafting serially, once per branch group in mirror mode."""
        return k > 0 and self._up(context) and self.gate.allows()

    def _up(self, context: Sequence[int]) -> bool:
        """Whether drafting is on. Once a failure's retry time has come, a new session is opened
        on ``context`` in the background, and drafting is on again once it is open: the request
        goes on target-only meanwhile, however long a replica that hangs takes to refuse."""
        if self.failure is None:
            return True
        with self._lock:
            if self._reopening is None and not self._ended and time.monotonic() >= self._retry_at:
                self._reopening = threading.Thread(target=self._reopen, args=(list(context),),
                                                   name="drafter-reopen", daemon=True)
                self._reopening.start()
        return False

    def _reopen(self, context: list[int]) -> None:
        try:
            self.session.open(context)
            why = None
        except Exception as err:  # noqa: BLE001 - whatever it was, the request goes on and tries again later
            why = _describe(err)
        with self._lock:
            self._reopening = None
            if self._ended:  # the request ended meanwhile: nothing will close it otherwise
                self.session.let_go(wait=False)
            elif why is None:
                log.info("drafter session reopened on %s; drafting again", self.session.replica.address)
                self.failure = None
            else:
                log.info("drafter session could not reopen (%s); next try in %.3g s", why, self._retry_later(why))

    @property
    def paused_windows(self) -> int:
        return self.gate.refused

    def alternatives_for(self, context: Sequence[int], tokens: Sequence[int]) -> RankedTokens:
        """RankTokens on the replica (which commits ``tokens`` there, as a branch head would be).
        A replica that predates RankTokens answers UNIMPLEMENTED, and a model-free one answers
        none: then no more asking for the rest of the request, and the drafter goes on drafting."""
        if not tokens or not self._ranks or not self._up(context):
            return RankedTokens()

        def rank() -> RankedTokens:
            try:
                response = self._call("RankTokens", [*context, *tokens], len(tokens))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._ranks = False
                return RankedTokens()
            ranked = ranked_from_proto(response.alternatives)
            if not ranked:  # a model-free strategy (n-gram): it will have no opinion next time either
                self._ranks = False
            return ranked if len(ranked) == len(tokens) else RankedTokens()

        return self._guard(rank) or RankedTokens()

    def _draft(self, context: Sequence[int], k: int, branch_tokens: list[int] | None = None,
               fork_points: list[int] | None = None) -> tuple[list[Proposal], bool]:
        """Draft after ``context`` (one proposal), or after each of ``branch_tokens`` (at its fork
        point); with whether the replica honoured the fork points."""
        response = self._call("DraftBranches" if branch_tokens else "Draft", context, k, branch_tokens, fork_points)
        drafts = list(response.drafts) if branch_tokens else [response]
        if branch_tokens and len(drafts) != len(branch_tokens):
            raise InvalidRequest(f"the drafter answered {len(drafts)} branches for {len(branch_tokens)} asked",
                                 field="branch_tokens")
        forked = bool(fork_points) and response.forked
        proposals = [proposal_from_proto(d.tokens, d.q, self.vocab_size, d.alternatives,
                                         min_dense_width=self.draft_vocab)
                     .widened(self.vocab_size) for d in drafts]
        if any(len(p) > k for p in proposals):  # the target would refuse the window: fall back instead
            raise InvalidRequest(f"the drafter answered {max(len(p) for p in proposals)} drafts for k={k}",
                                 field="k")
        return proposals, forked

    def _call(self, method: str, context: Sequence[int], k: int, branch_tokens: list[int] | None = None,
              fork_points: list[int] | None = None):
        """One DrafterService call that commits (or forks to) ``context`` first; timed."""
        def rpc(replica: Replica, session_id: str, keep: int, commit: list[int]):
            request = drafter_pb2.DraftRequest(session_id=session_id, commit_tokens=commit,
                                               context_length=len(context), k=k, branch_tokens=branch_tokens or (),
                                               branch_forks=fork_points or ())
            if keep < len(self.session.held) or self.session.may_hold_more:
                request.keep = keep
            if method == "Draft":
                response = self.session.stream_call(replica, "DraftWindows", request)
                if response is not None:
                    return response
            return getattr(replica.stub, method)(request, timeout=self.session.timeout_s)

        started = time.perf_counter()
        suspected, self._suspected = self._suspected, False
        response = self.session.call(context, rpc, self.HUNG_AFTER_S if suspected else None)
        self.times.call_s += time.perf_counter() - started
        self.times.server_s += response.draft_time_s
        self._failures_in_a_row = 0
        return response

    def _guard(self, fn: Callable):
        try:
            return fn()
        except (grpc.RpcError, InvalidRequest, NoReplicaAvailable, SessionLimitReached) as err:
            self.failed(_describe(err), isinstance(err, grpc.RpcError)
                        and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
            return None

    def suspected(self) -> None:
        """A draft call a target made here ran out of time: the drafter may hang, or the target
        may not reach it. The next window's call from here settles which, within ``HUNG_AFTER_S``
        rather than the session's whole deadline (30 s by default): a hung drafter then costs the
        request one short wait more, not a second full one."""
        self._suspected = True

    def failed(self, detail: str, timed_out: bool) -> None:
        """A draft call from here failed: drafting turns off. (One a target running the windows
        made only says the target got no drafts: ``orchestrator.direct.TargetReach``.)"""
        if timed_out and self.session.replica is not None:
            self._report_timeout(self.session.replica)
        retry_after = self._turn_off(detail)
        log.warning("drafter failed (%s); continuing target-only, drafting again in %.3g s", detail, retry_after)

    def _turn_off(self, why: str) -> float:
        """Drafting off until the retry time. The session is let go now, without waiting for a
        replica that may hang, so its KV cache is freed there: a new one replays the token log.
        Returns the wait."""
        self.fallbacks += 1
        self.session.let_go(wait=False)
        return self._retry_later(why)

    def _retry_later(self, why: str) -> float:
        """The wait: the pool's cooldown (after which a replica reported failed is offered again),
        doubled for each failure in a row."""
        retry_after = backoff_s(self.session.pool.cooldown_s, self._failures_in_a_row)
        self.failure = why
        self._failures_in_a_row += 1
        self._retry_at = time.monotonic() + retry_after
        return retry_after

    def _report_timeout(self, replica: Replica) -> None:
        """A drafter that had ``HUNG_AFTER_S`` to draft a window and did not is hung or swamped:
        it is kept off for the cooldown, since drafts are optional and going target-only costs a
        request little, where waiting on it again costs every request its drafter timeout. A
        shorter deadline only marks it slow, and the client's own deadline passing not even that
        (``PooledSession.client_left``)."""
        if self.session.client_left():
            return
        if self.session.timeout_s is not None and self.session.timeout_s >= self.HUNG_AFTER_S:
            self.session.pool.report_failure(replica)
        else:
            self.session.pool.report_slow(replica)

    @property
    def moves(self) -> int:
        return self.session.moves

    def release(self) -> None:
        finish_closing(self.start_release())

    def start_release(self) -> SessionClose | None:
        """The request is over: its session closes (``finish_closing`` waits for several at once), or,
        where a reopen is under way, the reopen lets it go when it ends."""
        with self._lock:
            self._ended = True
            return self.session.start_release() if self._reopening is None else None


class _DraftSession(PooledSession):
    waits_for_room_to_move = False  # drafts are optional: the request goes on target-only at once

    def __init__(self, *args, caller_looks_up: bool = False, target_vocab: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.caller_looks_up = caller_looks_up  # the replica's prompt lookup runs in the orchestrator
        self.target_vocab = target_vocab  # where wider than the draft's table: ids the session must take

    def open_request(self, context: Sequence[int], params: SamplingParams):
        return drafter_pb2.OpenDraftSessionRequest(prompt_ids=list(context), params=params_to_proto(params),
                                                   seed=self.seed, caller_looks_up=self.caller_looks_up,
                                                   target_vocab_size=self.target_vocab)


class RemoteVerifier(PooledSession):
    """A target session on a TargetService pool. Wherever the session moves, the window is
    retried there; the request fails only if no target replica comes back in time.
    ``gives_hints``: the pool's targets stream early-exit hints when asked. ``defer_prefill``:
    the first Verify prefills the prompt with its window, in one pass (for a caller whose first
    window is ready at once); a session that moves later is prefilled where it reopens."""

    def __init__(self, pool: ReplicaPool, prompt: Sequence[int], params: SamplingParams, seed: int, vocab_size: int,
                 timeout_s: float | None = None, replacement_wait_s: float = 60.0, gives_hints: bool = False,
                 defer_prefill: bool = False, runner_up: bool = False, window_timeout_s: float | None = None,
                 ended: threading.Event | None = None, client_deadline: float | None = None):
        super().__init__(pool, prompt, params, seed, timeout_s, replacement_wait_s, window_timeout_s, ended,
                         client_deadline)
        self.vocab_size = vocab_size
        self.gives_hints = gives_hints
        self.defer_prefill = defer_prefill
        self.runner_up = runner_up  # offer the drafter's runner-up for windows' first drafts
        self._unary = True  # windows without hints go by VerifyWindow (until a replica lacks it)
        self.runs_windows = True  # the replicas take RunWindows (orchestrator.direct; until one lacks it)
        self.open(prompt)
        self.prefill_pending, self.defer_prefill = defer_prefill, False

    def open_request(self, context: Sequence[int], params: SamplingParams):
        return target_pb2.OpenTargetSessionRequest(prompt_ids=list(context), params=params_to_proto(params),
                                                   seed=self.seed, defer_prefill=self.defer_prefill)

    def verify(self, context: Sequence[int], proposal: Proposal, params: SamplingParams, seed: int,
               on_hint: Callable[[EarlyExitHint], None] | None = None) -> WindowVerdict:
        def rpc(replica: Replica, session_id: str, keep: int, commit: list[int]):
            if keep < len(self.held):  # a target's context only grows: verdicts are final
                raise RuntimeError(f"verify on a context that forks from the target session at {keep}")
            request = target_pb2.VerifyRequest(session_id=session_id, commit_tokens=commit,
                                               context_length=len(context), draft_tokens=proposal.tokens,
                                               hints=on_hint is not None, runner_up=runner_up)
            if proposal.tokens:
                request.q.CopyFrom(proposal_to_proto(proposal.q))
            if on_hint is None:
                verdict = self.stream_call(replica, "VerifyWindows", request)
                if verdict is not None:
                    return verdict
                if self._unary:
                    try:
                        return replica.stub.VerifyWindow(request, timeout=self.call_timeout_s)
                    except grpc.RpcError as err:  # a replica that predates VerifyWindow never ran it
                        if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                            raise
                        self._unary = False
            return _verdict_of(replica.stub.Verify(request, timeout=self.call_timeout_s), on_hint)

        runner_up = self.offered_runner_up(proposal)
        started = time.perf_counter()
        verdict = self.call(context, rpc)
        self.times.call_s += time.perf_counter() - started
        self.times.server_s += verdict.verify_time_s
        return verdict_from_proto(verdict)

    def offered_runner_up(self, proposal: Proposal) -> int | None:
        return runner_up_to_offer(self.runner_up, proposal)


def _verdict_of(events, on_hint: Callable[[EarlyExitHint], None] | None) -> target_pb2.Verdict:
    verdict = None
    for event in events:
        if event.HasField("verdict"):
            verdict = event.verdict
        elif event.HasField("hint") and on_hint is not None:
            on_hint(hint_from_proto(event.hint))
    if verdict is None:
        raise RuntimeError("the target's Verify stream ended without a verdict")
    return verdict


class _Unresponsive(Exception):
    """A replica's open ran past ``probe_open_after_s`` and its health check went unanswered."""


def _describe(err: Exception) -> str:
    return f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else str(err)
