"""A session's window loop run on its target, which asks the drafter for each window itself.

Through the orchestrator a window is two round trips, orchestrator to drafter and orchestrator to
target. On the 2-core CI VM a message on an open gRPC stream costs 0.35-0.45 ms there and back
(the wake-ups of gRPC's threads and event loops; a bare socket takes under 0.1 ms), so the
network path of a window could not get under ~1 ms. Here a window is one round trip, target to
drafter, and the orchestrator reads each window's result off a stream while the next is already
being drafted. The orchestrator still keeps the token log, and takes the loop back window by
window (``orchestrator.direct``) where a draft call fails or this target goes away.

Only the drafter's protos are used here: target_service does not import drafter_service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from mirrorspec.adaptive import posterior_alpha
from mirrorspec.config import AdaptiveKConfig, InvalidRequest, MirrorConfig
from mirrorspec.drafting import Proposal
from mirrorspec.mirror import BranchHistory, BranchPolicy, guesses
from mirrorspec.sampling import WindowVerdict
from mirrorspec.serving.convert import proposal_from_proto
from mirrorspec.serving.server import BACKEND_CHANNEL_OPTIONS
from mirrorspec.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)


def branch_guesses(proposal: Proposal, alpha: float, runner_up: int | None, max_branches: int,
                   alternatives: int) -> list[tuple[int, int | None]]:
    """The likeliest verdicts (j, c) of this window that a branch can be drafted for: the core's
    ranking (``mirror.guesses``) of where the target rejects and what it says there, from the
    drafter's runner-ups, and "all accepted" (j = K, c None: the drafter's own next token after the
    window, which it finds itself, ``own_token_branch``). Left out: the runner-up offered beside
    the first draft: where the target picks it, it wins the slot, a verdict of another key."""
    ranked = guesses(proposal, alpha, alternatives)
    return [(j, c) for _, j, c in ranked if not (j == 0 and c == runner_up)][:max_branches]


class Branching:
    """Mirror on the target, one run's worth: while this target verifies a window, its drafter
    drafts branches of the next one beside it (``DraftStream.branches``), and the branch the
    verdict names is the next window's drafts, with no draft call on its path. Exact for the
    reason mirror is (``mirrorspec.mirror``): a branch is taken by the verdict's key alone, and
    holds the very drafts a fresh call would make from the same context (drafts are drawn from
    (seed, position) randomness), so the output is the serial run's, token for token.

    Whether a window branches is the front door's mirror policy (``BranchPolicy.should_branch``)
    on this run's timings, starting from the last run's on this target (``BranchHistory``):
    drafting beside a verify slows the verify where the two share cores or memory bandwidth (+4%
    per pass on the 2-core CI VM), so a run branches only while its hits save more than that, and
    probes the other choice now and then."""

    def __init__(self, max_branches: int, alternatives: int, every_window: bool = False,
                 history: BranchHistory | None = None):
        self.max_branches = max_branches
        self.alternatives = alternatives
        # earlier runs' policy state on this target, to start from and add to (a run of its own: none)
        self.history = history if history is not None else BranchHistory()
        self.policy: BranchPolicy | None = None
        if max_branches:
            self.policy = self.history.policy(MirrorConfig(max_branches=max_branches, alternatives=alternatives,
                                                           stop_at_verdict=not every_window))
        self.passed = self.failed = 0  # draft tests so far: the ranking's acceptance estimate
        self._branches: dict[tuple[int, int], Proposal] = {}
        self._branched = False  # whether the window being verified branched
        self._k = 0  # the K the branches were drafted with
        self._key: tuple[int, int] | None = None  # the last verdict's, where a branch can hold it

    def keep(self) -> None:
        """At the run's end: what its policy learnt, for the next run here."""
        if self.policy is not None:
            self.history.keep(self.policy)

    def start(self, drafts: DraftStream, context: list[int], proposal: Proposal, runner_up: int | None,
              k_after: Callable[[int], int]) -> asyncio.Task | None:
        """The branches' call for this window, running; None where this window does not branch.
        ``k_after(j)``: the next window's K after a verdict that keeps j drafts."""
        self._branches, self._branched = {}, False
        if self.policy is None or not len(proposal) or not self.policy.should_branch():
            return None
        alpha = posterior_alpha(self.passed, self.failed, AdaptiveKConfig())
        guessed = branch_guesses(proposal, alpha, runner_up, self.max_branches, self.alternatives)
        if not guessed or (k := k_after(guessed[0][0])) <= 0:
            return None
        self._k = k  # a branch is only any use drafted with the K its window will ask for
        guessed = [(j, c) for j, c in guessed if k_after(j) == k]
        if all(c is None for _, c in guessed) and not drafts.own_token_alone:
            return None
        self._branched = True
        return asyncio.ensure_future(drafts.branches(list(context), proposal.tokens, guessed, k))

    async def finish(self, call: asyncio.Task | None, verify_s: float) -> tuple[int, float]:
        """After the verify: (branches drafted, the call's time). A failed call drafted none: the
        next window drafts afresh, and that call reports a drafter that is really gone."""
        if self.policy is not None:
            self.policy.observe_verify(verify_s, self._branched)
        if call is None:
            return 0, 0.0
        waited = time.perf_counter()
        try:
            self._branches, seconds = await call
        except DraftCallFailed as err:
            log.info("branch drafting failed (%s); the next window is drafted afresh", err)
            return 0, 0.0
        self.policy.observe_group(seconds, time.perf_counter() - waited)  # and what the next window waited past the verdict
        return len(self._branches), seconds

    @staticmethod
    def cancel(call: asyncio.Task | None) -> None:
        if call is not None:
            call.cancel()

    def observe(self, verdict: WindowVerdict, num_drafted: int) -> None:
        self.passed += verdict.drafts_accepted
        self.failed += verdict.drafts_accepted < num_drafted
        # a runner-up's win leaves a context no chain branch was drafted for
        self._key = (verdict.num_accepted, verdict.next_token) if verdict.runner_up is None else None

    def observe_fresh_draft(self, seconds: float) -> None:
        """A window drafted by a call on its path: what a hit saves."""
        if self.policy is not None:
            self.policy.observe_fresh_draft(seconds)

    def take(self, k: int) -> Proposal | None:
        """The branch the last verdict names, by its key alone, drafted with this window's K; None on a miss."""
        branches, self._branches = self._branches, {}
        branched, self._branched = self._branched, False
        hit = branches.get(self._key) if self._key is not None and k == self._k else None
        if branched:
            self.policy.observe_hit(hit is not None)
        return hit


class DraftCallFailed(Exception):
    """A draft call that failed, timed out, or answered something this target cannot verify."""


class DrafterLinks:
    """One channel per drafter address this target was asked to call, shared by its sessions'
    runs (HTTP/2 multiplexes their streams), and closed with the server. As a run starts, channels
    no run uses are kept for the ``max_idle`` addresses used last only: any caller may name any
    address, and a channel kept for each held memory for the server's life (1,500: 11 MB)."""

    def __init__(self, max_idle: int = 16):
        self.max_idle = max_idle
        self._channels: dict[str, grpc.aio.Channel] = {}  # least recently used first
        self._runs: dict[str, int] = {}  # runs using each address now

    async def acquire(self, address: str) -> drafter_pb2_grpc.DrafterServiceStub:
        """The stub for a run's drafter at ``address``; ``release`` it when the run ends."""
        channel = (self._channels.pop(address, None)
                   or grpc.aio.insecure_channel(address, options=BACKEND_CHANNEL_OPTIONS))
        self._channels[address] = channel
        self._runs[address] = self._runs.get(address, 0) + 1
        idle = [a for a in self._channels if a not in self._runs]
        stale = [self._channels.pop(a) for a in idle[:max(len(idle) - self.max_idle, 0)]]  # before any await
        try:
            for old in stale:
                await old.close()
        except BaseException:  # the run was cancelled here: it never gets to release its count
            self.release(address)
            raise
        return drafter_pb2_grpc.DrafterServiceStub(channel)

    def release(self, address: str) -> None:
        self._runs[address] -= 1
        if not self._runs[address]:
            del self._runs[address]

    def __len__(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


class DraftStream:
    """One run's ``DraftWindows`` stream to its drafter session: commit-then-draft calls as
    messages, each sending the tokens committed since the last."""

    def __init__(self, stub: drafter_pb2_grpc.DrafterServiceStub, session_id: str, held: int, vocab_size: int,
                 timeout_s: float, draft_vocab_size: int = 1):
        """``draft_vocab_size``: the drafter's table width, as the front door checked the pair; 1 where
        the caller did not say (any dense width to the vocabulary)."""
        self._stub = stub
        self._session_id = session_id
        self._held = held  # how many tokens of the context the drafter session holds
        self._vocab_size = vocab_size
        self._draft_vocab_size = draft_vocab_size
        self._timeout_s = timeout_s
        self._call = None
        # DraftBranches may ask for the own-token branch alone: a drafter built before
        # own_token_branch refuses a call with no branch_tokens (OUT_OF_RANGE), once per run
        self.own_token_alone = True

    async def draft(self, context: list[int], k: int) -> tuple[Proposal, float, float]:
        """(the proposal, the drafter's compute time, the call's round trip)."""
        request = drafter_pb2.DraftRequest(session_id=self._session_id, commit_tokens=context[self._held:],
                                           context_length=len(context), k=k, keep=self._held)
        started = time.perf_counter()
        try:
            if self._call is None:
                self._call = self._stub.DraftWindows()
            response = await asyncio.wait_for(self._exchange(request), self._timeout_s)
        except grpc.aio.AioRpcError as err:
            raise DraftCallFailed(f"{err.code().name}: {err.details()}") from None
        except asyncio.InvalidStateError:  # the stream ended (its drafter went away) before this write
            raise DraftCallFailed(f"{(await self._call.code()).name}: {await self._call.details()}") from None
        except asyncio.TimeoutError:
            raise DraftCallFailed(f"DEADLINE_EXCEEDED: no draft within {self._timeout_s:g} s") from None
        call_s = time.perf_counter() - started
        if response is grpc.aio.EOF:
            raise DraftCallFailed("UNAVAILABLE: the drafter closed the draft stream without answering")
        self._held = len(context)
        return self._checked(response, k), response.draft_time_s, call_s

    async def branches(self, context: list[int], window: tuple[int, ...], guessed: list[tuple[int, int | None]],
                       k: int) -> tuple[dict[tuple[int, int], Proposal], float]:
        """({(j, c): the drafts after the window's first j drafts and then c}, the call's time): mirror
        branches of the next window, drafted together by one DraftBranches call beside this
        window's verify. A guess (j, None) is the drafter's own next token after the window's
        first j = K drafts, which it reports. The drafter session then holds the window's first
        drafts too; the next draft call forgets them (``keep``), as this side counts only the
        context it committed."""
        named = [(j, c) for j, c in guessed if c is not None]
        own = len(named) < len(guessed)
        head = max(j for j, _ in guessed)
        request = drafter_pb2.DraftRequest(
            session_id=self._session_id, commit_tokens=[*context[self._held:], *window[:head]],
            context_length=len(context) + head, k=k, keep=self._held, own_token_branch=own,
            branch_tokens=[c for _, c in named], branch_forks=[len(context) + j for j, _ in named])
        started = time.perf_counter()
        try:
            response = await self._stub.DraftBranches(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            if not named and err.code() == grpc.StatusCode.OUT_OF_RANGE:
                self.own_token_alone = False
            raise DraftCallFailed(f"{err.code().name}: {err.details()}") from None
        given = response.HasField("own_token")  # unset by a replica that predates own_token_branch
        keys = [*named, *([(head, response.own_token)] if given else [])]
        if ((named and not response.forked) or len(response.drafts) != len(keys) or (given and not own)
                or response.own_token >= self._vocab_size):
            raise DraftCallFailed("INVALID_ARGUMENT: the drafter's branches do not match the guesses (a replica "
                                  "that predates fork points?)")
        branches = {key: self._checked(drafted, k) for key, drafted in zip(keys, response.drafts)}
        return branches, time.perf_counter() - started

    def _checked(self, response: drafter_pb2.DraftResponse, k: int) -> Proposal:
        try:
            # dense rows from the drafter's table width to the vocabulary: the front door's rule
            proposal = proposal_from_proto(response.tokens, response.q, self._vocab_size, response.alternatives,
                                           min_dense_width=self._draft_vocab_size)
        except InvalidRequest as err:
            raise DraftCallFailed(f"INVALID_ARGUMENT: the drafter's answer: {err}") from None
        if len(proposal) > k:
            raise DraftCallFailed(f"INVALID_ARGUMENT: the drafter answered {len(proposal)} drafts for k={k}")
        return proposal

    async def _exchange(self, request: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse:
        await self._call.write(request)
        return await self._call.read()

    def close(self) -> None:
        """Cancels the stream: the drafter keeps the session (orphaned until its caller's next call)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
