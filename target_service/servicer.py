"""TargetService: a thin async servicer over the core's ``TargetVerifier``."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial

from mirrorspec.adaptive import AdaptiveK
from mirrorspec.config import (
    DEFAULT_PREFILL_CHUNK,
    DRAFT_HUNG_AFTER_S,
    HINT_LENSES,
    MAX_BRANCHES,
    InvalidRequest,
    OutOfRange,
    ReplicaConfig,
    SamplingParams,
    check_address,
    check_prefill_chunk,
)
from mirrorspec.drafting import Proposal
from mirrorspec.drafting.draft_model import hint_vocabulary
from mirrorspec.engine import TargetVerifier, capped_k, runner_up_to_offer, validate_prompt, window_tokens
from mirrorspec.mirror import BranchHistory
from mirrorspec.models import KVSession, LoadedModel, LogitSession, load_causal_lm
from mirrorspec.models.early_exit import EarlyExitProbe
from mirrorspec.models.lens import LensRecipe, TunedLens, tuned_lens
from mirrorspec.models.loading import try_load_tokenizer
from mirrorspec.sampling import WindowVerdict
from mirrorspec.serving.convert import (
    TOKEN_KIND_TO_PROTO,
    adaptive_from_proto,
    check_token_ids,
    describe_model,
    hint_to_proto,
    params_from_proto,
    proposal_from_proto,
)
from mirrorspec.serving.server import ComputeLane, Service, start_grpc_server
from mirrorspec.serving.sessions import SequenceState, SessionStore, orphaned_after, orphaned_at_end
from mirrorspec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.run_windows import Branching, DraftCallFailed, DrafterLinks, DraftStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetConfig(ReplicaConfig):
    model: str = "demo-target"
    hint_layer: int | None = None  # send early-exit hints read off this layer (mirror mode); None = none
    hint_top_k: int = 4  # tokens per window position in a hint
    # score hints over the sub-vocabulary this draft declares (e.g. "demo-draft"): a fraction of
    # the full head's cost on the verify's critical path; None = the whole vocabulary
    hint_vocab: str | None = None
    # "tuned": read hints through a tuned lens fitted to this target (once, cached; see
    # mirrorspec.models.lens); "logit": the final norm and head on the layer as it is
    hint_lens: str = "tuned"
    # a prompt longer than this is prefilled this many tokens per compute-lane job, so the other
    # sessions' windows run between its chunks (vLLM's chunked prefill)
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK

    def __post_init__(self) -> None:
        super().__post_init__()
        check_prefill_chunk(self.prefill_chunk_tokens)
        if self.hint_lens not in HINT_LENSES:
            raise InvalidRequest(f"hint_lens must be one of {', '.join(HINT_LENSES)}, got {self.hint_lens!r}",
                                 field="hint_lens")


@dataclass
class TargetSession:
    sequence: SequenceState
    verifier: TargetVerifier
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    prefill_deferred: bool = False  # opened without its prefill: the first window brings it
    closed: bool = False  # its close is on the lane: no more work for it (ComputeLane.run_for)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """``new_session`` makes one sequence's KV-cache session: a plain ``KVSession``, or a
    tensor-parallel one whose every step the other ranks replay."""

    def __init__(self, loaded: LoadedModel, config: TargetConfig,
                 new_session: Callable[[], LogitSession] | None = None, lane: ComputeLane | None = None,
                 lens: TunedLens | None = None):
        self.loaded = loaded
        self.config = config
        self.vocab_size = int(loaded.model.config.vocab_size)
        if config.hint_layer is not None and new_session is not None:
            raise InvalidRequest("early-exit hints need an unsharded target (tp=1): a hint read on rank 0 "
                                 "alone would stall the other ranks' collectives", field="hint_layer")
        self.probe = None
        if config.hint_layer is not None:
            vocab_ids = hint_vocabulary(config.hint_vocab) if config.hint_vocab is not None else None
            self.probe = EarlyExitProbe(loaded.model, config.hint_layer, config.hint_top_k, vocab_ids, lens)
        self.new_session = new_session or (lambda: KVSession(loaded.model))
        self.sessions: SessionStore[TargetSession] = SessionStore(
            config.max_sessions, config.session_ttl_s,
            on_evict=lambda s: self.lane.close_later(s, s.verifier.session.close),
            orphan_ttl_s=config.orphaned_session_ttl_s)
        self.lane = lane or ComputeLane("target-compute")
        self.drafters = DrafterLinks()  # for RunWindows
        self.branch_history = BranchHistory()  # what runs' branch policies learnt here, for the next ones

    def close(self) -> None:
        """After the server stopped: the compute lane's thread."""
        self.lane.shutdown()

    async def aclose(self) -> None:
        """After the server stopped, on its event loop: the channels to drafters."""
        await self.drafters.close()

    async def OpenSession(self, request, context):
        # max_new_tokens only feeds the context check here; unset means "the prompt must fit"
        params = params_from_proto(request.params, default_max_new_tokens=1)
        prompt = validate_prompt(request.prompt_ids, self.vocab_size, self.loaded.max_context, params,
                                 field="prompt_ids")
        session = TargetSession(SequenceState(prompt, params, int(request.seed)),
                                TargetVerifier(self.new_session(), self.probe, runner_up=True))
        session_id = self.sessions.open(session, request.session_id)
        if request.defer_prefill:  # the first Verify scores the prompt (its last chunk) with its window, in one pass
            session.prefill_deferred = True
            self.sessions.orphan(session_id)  # until its first call (SessionStore)
            return target_pb2.OpenTargetSessionResponse(session_id=session_id)
        started = time.perf_counter()
        try:
            await self._prefill_all_but_the_last_chunk(session, prompt)
            await self.lane.run_for(session, session.verifier.session.logits_for, prompt, 1)  # the last chunk
        except BaseException:
            self.sessions.close(session_id)
            raise
        self.sessions.orphan(session_id)  # prefilled: from now until its first call (SessionStore)
        return target_pb2.OpenTargetSessionResponse(session_id=session_id,
                                                    prefill_time_s=time.perf_counter() - started)

    async def _prefill_all_but_the_last_chunk(self, session: TargetSession, context: list[int]) -> None:
        """Feed a fresh session's cache ``context`` up to its last chunk, one compute-lane job per
        chunk: the lane is first come first served, so another session's window waits for one
        chunk of a long prompt, not for all of it (which on CPU, 8k tokens of the demo target,
        took longer than a window's deadline, and its session was taken for hung). The caller's
        own pass scores the last 1 to ``prefill_chunk_tokens`` tokens. The cache holds the same
        keys and values as after one pass: the chunks only split the work."""
        step = self.config.prefill_chunk_tokens
        for end in range(step, len(context), step):
            await self.lane.run_for(session, session.verifier.session.logits_for, context[:end], 1)

    async def Verify(self, request, context):
        with orphaned_after(self.sessions, request.session_id):
            async for response in self._verify(request):
                yield response

    async def _verify(self, request):
        async with self._window(request) as (session, seq, proposal):
            started = time.perf_counter()
            if request.hints and self.probe is not None:
                hints: asyncio.Queue = asyncio.Queue()
                loop = asyncio.get_running_loop()
                on_hint = lambda hint: loop.call_soon_threadsafe(hints.put_nowait, hint)  # noqa: E731
                verifying = asyncio.ensure_future(self.lane.run_for(
                    session, partial(session.verifier.verify, on_hint=on_hint), list(seq.context), proposal,
                    seq.params, seq.seed))
                try:
                    async for hint in _until_done(hints, verifying):
                        yield target_pb2.VerifyResponse(hint=hint_to_proto(hint))
                    verdict = verifying.result()
                finally:  # a caller gone before its verdict: a verify not yet on the lane never runs there
                    verifying.cancel()
            else:  # no queue and no extra task per window
                verdict = await self.lane.run_for(session, session.verifier.verify, list(seq.context), proposal,
                                                  seq.params, seq.seed)
        yield target_pb2.VerifyResponse(verdict=_verdict_to_proto(verdict, time.perf_counter() - started))

    async def VerifyWindow(self, request, context):
        with orphaned_after(self.sessions, request.session_id):
            return await self._verify_window(request)

    async def _verify_window(self, request) -> target_pb2.Verdict:
        async with self._window(request) as (session, seq, proposal):
            started = time.perf_counter()
            # a copy: a cancelled call's verify may still run on the lane as the next call commits
            verdict = await self.lane.run_for(session, session.verifier.verify, list(seq.context), proposal,
                                              seq.params, seq.seed)
        return _verdict_to_proto(verdict, time.perf_counter() - started)

    async def VerifyWindows(self, requests, context):
        """Window after window of one caller on one stream, each answered as VerifyWindow would."""
        with orphaned_at_end(self.sessions) as streamed:
            async for request in requests:
                streamed.carry(request.session_id)
                yield await self._verify_window(request)

    async def RunWindows(self, request, context):
        """The session's windows, each drafted by the request's drafter session (run_windows)."""
        session = self.sessions.get(request.session_id)
        if not 1 <= request.k <= self.config.max_speculative_tokens:
            raise OutOfRange(f"k must be in [1, {self.config.max_speculative_tokens}] (this target's "
                             f"max_speculative_tokens), got {request.k}", field="k")
        if request.max_new_tokens < 1:
            raise OutOfRange("max_new_tokens must be at least 1: the tokens this run may commit", field="max_new_tokens")
        room = self.loaded.max_context - request.context_length
        if room < 1:
            raise OutOfRange(f"context_length {request.context_length} leaves no room for a token in the context "
                             f"window of {self.loaded.max_context}: the answer has reached the model's context; end "
                             f"the request", field="context_length")
        if request.max_new_tokens > room:  # refused up front: the run used to stop when the context was full
            raise OutOfRange(f"max_new_tokens={request.max_new_tokens} would pass the context window of "
                             f"{self.loaded.max_context} after the context's {request.context_length} tokens: "
                             f"at most {room}", field="max_new_tokens")
        address = check_address(request.drafter_address, "drafter_address")
        if not request.drafter_session_id:
            raise InvalidRequest("drafter_session_id is empty; open a session on the drafter first",
                                 field="drafter_session_id")
        if not 0 < request.drafter_context_length <= request.context_length:
            raise OutOfRange(f"drafter_context_length must be in [1, context_length={request.context_length}], "
                             f"got {request.drafter_context_length}", field="drafter_context_length")
        if not (request.draft_timeout_s >= 0 and math.isfinite(request.draft_timeout_s)):
            raise InvalidRequest(f"draft_timeout_s must be a finite number of seconds > 0 (0 = the default, "
                                 f"{DRAFT_HUNG_AFTER_S:g} s), got {request.draft_timeout_s}", field="draft_timeout_s")
        if request.max_branches > MAX_BRANCHES:
            raise OutOfRange(f"max_branches must be in [0, {MAX_BRANCHES}], got {request.max_branches}",
                             field="max_branches")
        if request.draft_vocab_size > self.vocab_size:
            raise OutOfRange(f"draft_vocab_size must be at most this target's vocabulary ({self.vocab_size}; 0 = "
                             f"not sent), got {request.draft_vocab_size}", field="draft_vocab_size")
        policy = adaptive_from_proto(request.adaptive, request.k) if request.HasField("adaptive") else None
        commit = check_token_ids(request.commit_tokens, self.vocab_size, "commit_tokens")
        drafts = DraftStream(await self.drafters.acquire(address), request.drafter_session_id,
                             request.drafter_context_length, self.vocab_size,
                             request.draft_timeout_s or DRAFT_HUNG_AFTER_S, request.draft_vocab_size or 1)
        try:
            with orphaned_at_end(self.sessions) as streamed:
                streamed.carry(request.session_id)
                async with session.lock:
                    seq = session.sequence
                    seq.commit(commit, int(request.context_length))
                    if session.prefill_deferred:
                        await self._prefill_all_but_the_last_chunk(session, seq.context)
                        session.prefill_deferred = False
                    async with aclosing(self._run_windows(session, request, drafts, policy)) as results:
                        async for result in results:  # closed here, not by the loop later, if the call ends
                            yield result
        finally:
            drafts.close()
            self.drafters.release(address)

    async def _run_windows(self, session: TargetSession, request, drafts: DraftStream, policy: AdaptiveK | None):
        """``policy``: the request's adaptive K, carried on from where its caller left it; None = K each window."""
        branching = Branching(request.max_branches, request.branch_alternatives, request.branch_every_window,
                              self.branch_history)
        try:
            async with aclosing(self._windows(session, request, drafts, policy, branching)) as results:
                async for result in results:
                    yield result
        finally:
            branching.keep()  # what its policy learnt, for the next run here

    async def _windows(self, session: TargetSession, request, drafts: DraftStream, policy: AdaptiveK | None,
                       branching: Branching):
        seq = session.sequence
        stop = set(seq.params.stop_token_ids)
        produced = 0
        while True:
            self.sessions.get(request.session_id)  # in use: its TTL starts again, as at each window call
            if self.loaded.max_context - len(seq.context) - 1 < 0:
                raise OutOfRange(f"the window would pass the context window of {self.loaded.max_context}",
                                 field="max_new_tokens")
            k = self._run_k(request, policy.next_k() if policy else request.k, seq.params, len(seq.context), produced)
            proposal, draft_s, call_s = Proposal.empty(), 0.0, 0.0
            ready = branching.take(k)  # drafted beside the last verify, for the verdict it gave
            if ready is not None:
                proposal = ready
            elif k > 0:
                try:
                    proposal, draft_s, call_s = await drafts.draft(seq.context, k)
                except DraftCallFailed as err:
                    yield target_pb2.WindowResult(drafter_error=str(err), context_length=len(seq.context))
                    return
                branching.observe_fresh_draft(call_s)
            # the verifier scores the proposal's alternatives as a runner-up: the drafter's own, only where asked
            runner_up = runner_up_to_offer(request.runner_up, proposal)
            offered = (with_runner_up(proposal, runner_up, self.vocab_size) if runner_up is not None
                       else replace(proposal, alternatives=(), alternative_probs=()))
            started = time.perf_counter()
            verifying = asyncio.ensure_future(self.lane.run_for(session, session.verifier.verify, list(seq.context),
                                                                offered, seq.params, seq.seed))
            branches = None
            try:
                branches = branching.start(drafts, seq.context, proposal, runner_up,
                                           lambda j: self._run_k(request, policy.peek(len(offered), j) if policy
                                                                 else request.k, seq.params, len(seq.context) + j + 1,
                                                                 produced + j + 1))
                verdict = await verifying
            except BaseException:
                verifying.cancel()  # where branching failed to start, or the caller went: not left on the lane
                branching.cancel(branches)
                raise
            verify_s = time.perf_counter() - started
            drafted, branch_s = await branching.finish(branches, verify_s)
            tokens, finish = window_tokens(verdict, offered, stop, produced, request.max_new_tokens)
            yield target_pb2.WindowResult(verdict=_verdict_to_proto(verdict, verify_s), tokens=tokens,
                                          num_drafted=len(offered), draft_time_s=draft_s, draft_call_s=call_s,
                                          context_length=len(seq.context), branches_drafted=drafted,
                                          branch_hit=ready is not None, branch_time_s=branch_s)
            if finish:
                return
            branching.observe(verdict, len(offered))
            if policy:
                policy.observe(len(offered), verdict.drafts_accepted)
            produced += len(tokens)
            seq.commit(tokens, len(seq.context) + len(tokens))

    def _run_k(self, request, k: int, params: SamplingParams, context_length: int, produced: int) -> int:
        """A run's K for a window after ``produced`` tokens, where ``k`` is asked: no drafts past the
        run's last token, nor past the context window."""
        room = self.loaded.max_context - context_length - 1
        return max(min(capped_k(k, replace(params, max_new_tokens=request.max_new_tokens), produced), room), 0)

    @asynccontextmanager
    async def _window(self, request) -> AsyncIterator[tuple[TargetSession, SequenceState, Proposal]]:
        """A Verify's checks and commit, with its session held until the verdict is in."""
        session = self.sessions.get(request.session_id)
        if len(request.draft_tokens) > self.config.max_speculative_tokens:
            raise OutOfRange(f"{len(request.draft_tokens)} draft tokens exceed this target's "
                             f"max_speculative_tokens ({self.config.max_speculative_tokens}); lower K",
                             field="draft_tokens")
        commit = check_token_ids(request.commit_tokens, self.vocab_size, "commit_tokens")
        proposal = proposal_from_proto(request.draft_tokens, request.q, self.vocab_size)
        if request.HasField("runner_up"):
            proposal = with_runner_up(proposal, request.runner_up, self.vocab_size)
        async with session.lock:
            seq = session.sequence
            room = self.loaded.max_context - len(seq.context) - len(commit) - 1  # for drafts, past the next token
            if room < 0:
                raise OutOfRange(f"committing {len(commit)} tokens to the session's {len(seq.context)} leaves no room "
                                 f"for a next token in the context window of {self.loaded.max_context}: the answer "
                                 f"has reached the model's context; end the request", field="commit_tokens")
            if len(proposal) > room:
                raise OutOfRange(f"{len(proposal)} draft tokens would pass the context window of "
                                 f"{self.loaded.max_context}: send at most {room} after this commit",
                                 field="draft_tokens")
            seq.commit(commit, int(request.context_length))
            if session.prefill_deferred:
                await self._prefill_all_but_the_last_chunk(session, seq.context)
                session.prefill_deferred = False
            yield session, seq, proposal

    async def CloseSession(self, request, context):
        return common_pb2.CloseSessionResponse(existed=self.sessions.close(request.session_id))

    async def Info(self, request, context):
        self.sessions.evict_expired()
        return target_pb2.TargetInfo(model=describe_model(self.loaded), open_sessions=len(self.sessions),
                                     max_sessions=self.config.max_sessions,
                                     max_speculative_tokens=self.config.max_speculative_tokens,
                                     hint_layer=self.probe.layer if self.probe else 0, runs_adaptive_k=True)


def with_runner_up(proposal: Proposal, runner_up: int, vocab_size: int) -> Proposal:
    """The proposal as the verifier takes a runner-up: the only alternative at its first draft
    (the verifier scores it there, greedy or sampled: ``TargetVerifier``)."""
    if not proposal.tokens:
        raise InvalidRequest("runner_up needs at least one draft token: it competes with the first",
                             field="runner_up")
    check_token_ids([runner_up], vocab_size, "runner_up")
    if runner_up == proposal.tokens[0]:
        raise InvalidRequest(f"runner_up {runner_up} is the first draft token itself; send another candidate "
                             "or none", field="runner_up")
    return replace(proposal, alternatives=((runner_up,),), alternative_probs=())


def _verdict_to_proto(verdict: WindowVerdict, verify_time_s: float) -> target_pb2.Verdict:
    return target_pb2.Verdict(num_accepted=verdict.num_accepted, next_token=verdict.next_token,
                              next_kind=TOKEN_KIND_TO_PROTO[verdict.next_kind], verify_time_s=verify_time_s,
                              runner_up=verdict.runner_up)


async def _until_done(queue: asyncio.Queue, task: asyncio.Future) -> AsyncIterator:
    """Items put on ``queue`` until ``task`` is done, then those still queued. The compute thread
    puts a hint before it returns, so every hint is queued ahead of the task's completion."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        try:
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # asyncio.wait cancels nothing it waits on, a caller's cancel included
            if not getter.done():
                getter.cancel()
        if getter not in done:
            break
        yield getter.result()
    while not queue.empty():
        yield queue.get_nowait()


def hint_lens(loaded: LoadedModel, config: TargetConfig) -> TunedLens | None:
    """The tuned lens the config's hints read through (fitted on first use, then cached), or None
    for plain early exits. The fit wants the target's tokenizer, to have it answer chat prompts; a
    target without one answers random token prompts."""
    if config.hint_layer is None or config.hint_lens != "tuned":
        return None
    if loaded.tokenizer is None:
        loaded = replace(loaded, tokenizer=try_load_tokenizer(config.model))
    return tuned_lens(loaded, LensRecipe(layer=config.hint_layer), log=logger.info)


async def serve(config: TargetConfig, loaded: LoadedModel | None = None,
                new_session: Callable[[], LogitSession] | None = None):
    """Load the target (unless given) and start its gRPC server."""
    lane = ComputeLane("target-compute")  # loads on the thread that will run it (see ComputeLane)
    if loaded is None:
        loaded = await lane.run(partial(load_causal_lm, config.model, dtype=config.dtype, device=config.device,
                                        tokenizer=False))
    lens = await lane.run(hint_lens, loaded, config) if new_session is None else None
    servicer = TargetServicer(loaded, config, new_session, lane, lens)
    service = Service(target_pb2_grpc.add_TargetServiceServicer_to_server, servicer,
                      target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name)
    return await start_grpc_server([service], config.host, config.port, stall_timeout_s=config.stall_timeout_s,
                                   keepalive_s=config.keepalive_s)
