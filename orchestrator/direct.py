"""Windows run on the target (``TargetService.RunWindows``), read here off its stream.

The target asks the drafter for each window itself, so a window costs one round trip instead of
two through here (``target_service.run_windows`` says why that matters). This side still keeps
the token log: each result updates it, what both sessions hold and the request's statistics,
as ``decode_windows`` would for the same window. Where the run cannot go on, the loop comes back
here, window by window, from the log: the target's draft call failed (the windows stay here a
while, drafting from here, which blames the drafter where it is down: ``TargetReach``), the
target went away or hung (its session moves, as a failed window's does), or the target predates
``RunWindows``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, replace

import grpc

from mirrorspec.adaptive import AdaptiveK
from mirrorspec.config import MirrorConfig, SamplingParams, SpeculationConfig
from mirrorspec.drafting import Drafter
from mirrorspec.engine import GenerationStats, WindowEvent, chosen_k, cut_at_stop, decode_windows, window_policy
from mirrorspec.models import common_prefix_length
from mirrorspec.serving.convert import adaptive_to_proto, verdict_from_proto
from mirrorspec.v1 import target_pb2
from orchestrator.remote import _COMPUTE_FAILED, _REPLICA_GONE, _SESSION_GONE, RemoteDrafter, RemoteVerifier, backoff_s
from orchestrator.window_stream import StreamStatus, Watchdog

log = logging.getLogger(__name__)


def windows_on_target(remote: RemoteDrafter, drafter: Drafter, verifier: RemoteVerifier, prompt: Sequence[int],
                      params: SamplingParams, spec: SpeculationConfig, seed: int, stats: GenerationStats,
                      runner_up: bool, client_deadline: float | None = None,
                      mirror: MirrorConfig | None = None, reach: TargetReach | None = None) -> Iterator[WindowEvent]:
    """The request's windows: run on the target while it can, else here (``decode_windows``
    with ``drafter``, the front door's face of ``remote``), window by window, until the target can
    run them again: the drafter is back (a failed one reopens after its cooldown), or the session
    moved. ``client_deadline`` (``time.monotonic()``), where the client set one, is the runs';
    each window keeps a deadline of its own, as here. With ``mirror``, the target has the drafter
    draft branches of each next window beside each verify (``target_service.run_windows.Branching``);
    windows that come back here are serial. With adaptive K (``spec.adaptive``), one policy follows
    the request's windows wherever they run: each run is sent its state, and it follows the run's
    windows here, so each window's K is the one the in-process engine would choose. Where the
    target cannot get drafts from the drafter, the windows stay here a while (``reach``: the front
    door's ``TargetReach``, which its other requests on the same replicas heed too)."""
    context = list(prompt)
    policy = window_policy(spec, drafter)
    reach = reach or TargetReach(verifier.pool.cooldown_s)

    def rest() -> SamplingParams:
        return replace(params, max_new_tokens=params.max_new_tokens - (len(context) - len(prompt)))

    def reachable() -> bool:
        return reach.back(run_pair(remote, verifier))

    while True:
        if reachable() and (yield from _run(remote, verifier, context, rest(), spec.num_speculative_tokens, stats,
                                            runner_up, client_deadline, mirror, policy, reach)):
            return
        for event in decode_windows(drafter, verifier, context, rest(), spec, seed, stats, policy=policy):
            context += event.tokens
            yield event
            if event.finish_reason:
                return
            if verifier.runs_windows and remote.failure is None and reachable():
                break  # the decode_windows generator is dropped: it holds nothing


@dataclass
class _PairReach:
    failures_in_a_row: int = 0
    retry_at: float = 0.0


class TargetReach:
    """Whether a target replica gets drafts from a drafter replica, for every request of a front
    door. A draft call the target made that failed shows only that the target could not reach the
    drafter: this side may still reach it (the two pools partitioned from each other, or a drafter
    address that names another host from the target's side). So the next windows of every request
    on that pair run here, drafting from here, and the drafter is blamed only where those draft
    calls fail too. The pair's windows go back to the target after the pool's cooldown, doubled for
    each run in a row that failed so (at most a minute). Kept per front door, not per request: each
    new request on a pair that fails paid a failed run before (a black-holed drafter address costs
    the draft deadline, up to gRPC's connect timeout). Thread-safe: the requests' workers share it."""

    # a pair not failing for this long is forgotten: replacements come on new ports
    FORGET_AFTER_S = 600.0

    def __init__(self, cooldown_s: float):
        self.cooldown_s = cooldown_s
        self._pairs: dict[tuple[str, str], _PairReach] = {}
        self._lock = threading.Lock()

    def back(self, pair: tuple[str, str] | None) -> bool:
        """Whether runs on ``pair`` (target address, drafter address) may go to the target now."""
        with self._lock:
            reach = self._pairs.get(pair)
            return reach is None or time.monotonic() >= reach.retry_at

    def lost(self, pair: tuple[str, str]) -> float:
        """A run's draft call failed: how long the pair's windows now stay here. Runs that were
        already under way when an earlier one failed fail for the same cause: they do not double
        the wait again."""
        now = time.monotonic()
        with self._lock:
            self._forget_old(now)
            reach = self._pairs.setdefault(pair, _PairReach())
            if now < reach.retry_at:
                return reach.retry_at - now
            wait = backoff_s(self.cooldown_s, reach.failures_in_a_row)
            reach.failures_in_a_row += 1
            reach.retry_at = now + wait
            return wait

    def held(self, pair: tuple[str, str]) -> None:
        """A run on ``pair`` got its drafts."""
        with self._lock:
            self._pairs.pop(pair, None)

    def _forget_old(self, now: float) -> None:
        for pair in [p for p, r in self._pairs.items() if now - r.retry_at > self.FORGET_AFTER_S]:
            del self._pairs[pair]


def run_pair(remote: RemoteDrafter, verifier: RemoteVerifier) -> tuple[str, str] | None:
    """The (target, drafter) replicas a run would go between now, where both sessions are open."""
    target, drafter = verifier.replica, remote.session.replica
    return None if target is None or drafter is None else (target.address, drafter.address)


def _run(remote: RemoteDrafter, verifier: RemoteVerifier, context: list[int], params: SamplingParams, k: int,
         stats: GenerationStats, runner_up: bool, client_deadline: float | None,
         mirror: MirrorConfig | None, policy: AdaptiveK | None,
         reach: TargetReach) -> Generator[WindowEvent, None, bool]:
    """Windows off one RunWindows stream, appending to ``context``; True once the request finished.
    ``policy`` (adaptive K) goes with the run as it stands, and takes each window in as the run's
    copy does: its choice of K, then the verdict. A window that failed its draft call is not taken
    in: it is done again here, where its K is chosen again."""
    drafts = remote.session
    if not (verifier.runs_windows and remote.drafting(k, context)):
        return False
    target = verifier.replica
    pair = run_pair(remote, verifier)
    # the target waits this long for a draft before it answers drafter_error
    draft_timeout_s = drafts.timeout_s or RemoteDrafter.HUNG_AFTER_S
    request = target_pb2.RunWindowsRequest(
        session_id=verifier.session_id, commit_tokens=context[len(verifier.held):], context_length=len(context),
        drafter_address=drafts.replica.address, drafter_session_id=drafts.session_id,
        drafter_context_length=common_prefix_length(drafts.held, context), k=k,
        max_new_tokens=params.max_new_tokens, runner_up=runner_up, draft_timeout_s=draft_timeout_s,
        max_branches=mirror.max_branches if mirror else 0, branch_alternatives=mirror.alternatives if mirror else 0,
        branch_every_window=bool(mirror and not mirror.stop_at_verdict),
        adaptive=adaptive_to_proto(policy) if policy else None, draft_vocab_size=remote.draft_vocab)
    # the whole run has the client's deadline only: a long generation outlives any one call's
    call = target.stub.RunWindows(request, timeout=None if client_deadline is None
                                  else max(client_deadline - time.monotonic(), 0.001))
    stop, produced = set(params.stop_token_ids), 0
    try:
        # a window's result may wait for a draft call too: the target gives up on the drafter first
        window_timeout_s = verifier.window_timeout_s and verifier.window_timeout_s + draft_timeout_s
        for result in _each_in_time(call, verifier.pool.watchdog, window_timeout_s):
            if result.drafter_error:
                verifier.held = context[:result.context_length]
                drafts.may_hold_more = True  # it may have taken a commit before it failed
                if result.drafter_error.startswith("DEADLINE_EXCEEDED"):
                    remote.suspected()
                log.warning("target replica %s got no drafts from drafter replica %s (%s); windows between the two "
                            "run at the front door for %.3g s", target.address, drafts.replica.address,
                            result.drafter_error, reach.lost(pair))
                return False
            if result.draft_call_s > 0:  # a window that made no draft call (K=0) shows nothing of the pair
                reach.held(pair)
            verifier.held = list(context)  # as of this window's verify
            if result.draft_call_s > 0:  # and its draft call, where it made one
                drafts.held = list(context)
            if result.branches_drafted:  # the drafter holds the window's drafts its branches forked after
                drafts.may_hold_more = True
                stats.mirror_windows += 1
                stats.branches_drafted += result.branches_drafted
                stats.draft_time_off_path_s += result.branch_time_s
            stats.branch_hits += result.branch_hit
            tokens, finish = cut_at_stop(list(result.tokens), stop, produced, params.max_new_tokens)
            verdict = verdict_from_proto(result.verdict)
            if policy:
                chosen_k(policy, stats)  # the K the run chose for this window: the copy here follows it
                policy.observe(result.num_drafted, verdict.drafts_accepted)
            stats.draft_time_s += result.draft_call_s
            stats.record_window(result.num_drafted, verdict, len(tokens), result.verdict.verify_time_s)
            stats.windows_on_target += 1
            drafts.times.call_s += result.draft_call_s
            drafts.times.server_s += result.draft_time_s
            # the verify's own result travels off the next window's path: no network time on it
            verifier.times.call_s += result.verdict.verify_time_s
            verifier.times.server_s += result.verdict.verify_time_s
            produced += len(tokens)
            context += tokens
            yield WindowEvent(tokens, result.num_drafted, verdict.num_accepted, verdict.next_kind, finish)
            if finish:
                return True
            if not verifier.pool.is_member(target):  # drained: a run held its session to the request's end
                call.cancel()
                drafts.may_hold_more = True  # the target may have asked it for the next window's drafts
                verifier.move_if_drained(context)
                return False
        raise StreamStatus(grpc.StatusCode.UNAVAILABLE, "the target ended its window run unfinished")
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # a target from before RunWindows ran nothing
            verifier.runs_windows = False
            return False
        hung = isinstance(err, StreamStatus) and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if verifier.pool.closed:
            raise
        if hung or err.code() in _REPLICA_GONE:
            log.warning("target replica %s is %s during a window run; replaying the session elsewhere",
                        target.address, "hung" if hung else "unreachable")
            verifier.pool.report_failure(target)
        elif err.code() == _SESSION_GONE:  # closed or expired, the replica serving: as a window here would
            log.info("target session %s is gone during a window run; reopening it from the token log",
                     verifier.session_id)
        elif not (err.code() in _COMPUTE_FAILED and verifier.elsewhere_after(target, err)):
            raise
        drafts.may_hold_more = True
        verifier.move(context)
        return False
    finally:
        call.cancel()


def _each_in_time(call, watchdog: Watchdog, timeout_s: float | None) -> Iterator[target_pb2.WindowResult]:
    """The run's results, each within ``timeout_s`` of the last (else DEADLINE_EXCEEDED: hung)."""
    while True:
        armed = watchdog.arm(timeout_s, call) if timeout_s else None
        try:
            result = next(call)
        except StopIteration:
            return
        except grpc.RpcError:
            if armed is not None and watchdog.disarm(armed):
                raise StreamStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "no window result within the window deadline") from None
            raise
        if armed is not None and watchdog.disarm(armed):
            raise StreamStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "no window result within the window deadline")
        yield result

