"""GenerationService: the client-facing front door.

Each request opens a session on a drafter and on a target, then runs the core's
``decode_windows`` loop over gRPC in a worker thread (the loop is synchronous and written once),
streaming every window's tokens back to the event loop. The orchestrator owns the token log, so
a drafter failure only turns speculation off for that request until a drafter session reopens
from the log, and a lost target session is reopened from the log. Cancellation and deadlines stop the loop and close both sessions.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import grpc

from mirrorspec.config import (DEFAULT_K, DEFAULT_MAX_CONCURRENT_REQUESTS, AdaptiveKConfig, InvalidRequest,
                               MirrorConfig, OutOfRange, SamplingParams, SpeculationConfig, check_address,
                               check_max_concurrent_requests, check_port, check_shared_vocabulary, default_k)
from mirrorspec.drafting import Drafter, Proposal
from mirrorspec.engine import GenerationStats, decode_windows, first_window_k, validate_prompt
from mirrorspec.mirror import BranchHistory, MirrorPipeline
from mirrorspec.models import encode_chat, encode_prompt
from mirrorspec.models.loading import same_tokenizer, try_load_tokenizer
from mirrorspec.models.detokenize import IncrementalDetokenizer, decode_text
from mirrorspec.sampling import fresh_seed
from mirrorspec.serving.convert import params_from_proto
from mirrorspec.serving.errors import StoppedBeforeDone, status_for
from mirrorspec.serving.server import BACKEND_CHANNEL_OPTIONS, Service, start_grpc_server
from mirrorspec.v1 import (
    common_pb2,
    drafter_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    target_pb2_grpc,
)
from orchestrator.direct import TargetReach, windows_on_target
from orchestrator.lookup import FrontDoorNgram, front_door_drafter, looks_up_whole_window
from orchestrator.metrics import SpecDecodeMetrics
from orchestrator.pool import NoReplicaAvailable, ReplicaPool, parse_addresses
from orchestrator.remote import (RemoteDrafter, RemoteVerifier, client_deadline_passed, release_together,
                                 replica_step_cost)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OrchestratorConfig:
    target: str  # host:port of a TargetService, or several, comma-separated (a pool)
    drafter: str | None  # host:port of a DrafterService, or several; None = target-only
    host: str = "127.0.0.1"
    port: int = 50051
    tokenizer: str | None = None  # default: the target's own model source, if it has a tokenizer
    # requests' default K; None = what `mirrorspec serve` picks for the drafter pool it finds
    # (config.default_k: 8 for an n-gram pool or a draft model with a confidence cut, else 4)
    num_speculative_tokens: int | None = None
    max_speculative_tokens: int = 16
    default_max_new_tokens: int = 128
    # requests decoding at once here (vLLM's --max-num-seqs): each holds a request thread and a
    # session on a target replica; the rest wait their turn, first come first served, and are counted
    # by the mirrorspec_requests_waiting gauge
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    backend_timeout_s: float = 120.0
    # a drafter call's deadline (at most half the request's own): drafts are optional, so a drafter
    # that hangs costs a request this long before it goes on target-only, not its whole budget
    drafter_timeout_s: float = 30.0
    # a target window's deadline (at most the request's): a verify of K + 1 tokens takes well under
    # a second on a replica that works, queued behind its other sessions' windows included. A
    # replica that answers none within it is taken for hung: reported failed, and the session
    # replays on another one. Opens, and windows that carry a prefill (a deferred one included),
    # keep the request's deadline. A window queued behind another session's prefill waits for one
    # chunk of it (TargetConfig.prefill_chunk_tokens); a chunk longer than this (a very slow
    # target) would have it taken for hung: its session replays, the request goes on.
    window_timeout_s: float = 30.0
    replacement_wait_s: float = 60.0  # how long a request waits for a target replica to (re)appear
    # how long new sessions keep off a replica found gone or hung; a request whose drafter failed
    # tries to reopen one after it, then twice as long after each failed try (up to a minute)
    failure_cooldown_s: float = 5.0
    metrics_port: int | None = None  # Prometheus text endpoint on host:metrics_port
    adaptive: AdaptiveKConfig | None = None  # K per window in [0, requested K]; None = fixed K
    # draft the next window's branches while the target verifies (a request's `mirror` overrides)
    mirror: MirrorConfig | None = None
    # draft only while at most this many requests are in flight here (vLLM's
    # speculative_disable_by_batch_size): past it the targets are saturated, and the extra tokens a
    # verify scores cost more than speculation saves. None = always draft. A paused window is a
    # K = 0 window: a seeded sampled request's tokens then depend on the load it met.
    speculation_off_above: int | None = None
    # run the drafter replicas' prompt lookup here, on the token log (orchestrator.lookup): a
    # looked-up window then makes no drafter call; an n-gram pool, lookup alone, is never called.
    # False leaves lookup to the replicas.
    front_door_lookup: bool = True
    # windows also offer the targets the drafter's runner-up for their first draft, in the same
    # pass (TargetVerifier); mirror requests too (a runner-up's win has branches of its own)
    runner_up: bool = False
    # windows run on the target, which asks the drafter for each window's drafts itself: one round
    # trip per window instead of two through here (orchestrator.direct); mirror ones too, with the
    # target having the drafter draft branches, and adaptive K ones. Hinted mirror, timelines and a
    # speculation_off_above limit keep their windows here. The drafter replicas then run their own
    # prompt lookup (front_door_lookup applies to n-gram pools only).
    windows_on_target: bool = False

    def __post_init__(self) -> None:
        check_port(self.port)
        check_port(self.metrics_port, "metrics_port")
        # K and its ceiling checked as every request's are: with K left to the drafters, a ceiling
        # of 0 started a front door whose every request then failed (review of stop 55)
        k = self.num_speculative_tokens
        SpeculationConfig(num_speculative_tokens=0 if k is None else k,
                          max_speculative_tokens=self.max_speculative_tokens)
        check_max_concurrent_requests(self.max_concurrent_requests)
        if self.speculation_off_above is not None and self.speculation_off_above < 0:
            raise InvalidRequest(f"must be >= 0, got {self.speculation_off_above}", field="speculation_off_above")
        for field_name in ("target", "drafter"):
            for address in parse_addresses(getattr(self, field_name)):
                check_address(address, field_name)
        for field_name in ("backend_timeout_s", "drafter_timeout_s", "window_timeout_s", "failure_cooldown_s"):
            if not getattr(self, field_name) > 0:  # nan too
                raise InvalidRequest(f"must be > 0 seconds, got {getattr(self, field_name)}", field=field_name)


@dataclass
class PreparedRequest:
    prompt: list[int]
    params: SamplingParams
    spec: SpeculationConfig
    seed: int
    stop_strings: tuple[str, ...]
    mirror: MirrorConfig | None = None
    timeline: bool = False
    k_named: bool = True  # False: K is the drafter pool's default, settled once the pool has described itself


@dataclass
class RequestOutcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    stats: GenerationStats = field(default_factory=GenerationStats)
    drafter_fallback: bool = False
    target_moves: int = 0
    drafter_moves: int = 0
    paused_windows: int = 0  # windows sent without drafts because the targets were saturated
    network_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


@dataclass(frozen=True)
class OpenedDrafter:
    remote: RemoteDrafter | FrontDoorNgram  # the pool session (or an n-gram pool's strategy run here):
    # its failure, moves, pauses and call times
    drafter: Drafter  # what the window loop drafts with: lookup here in front of ``remote``, or it alone
    drafted_ahead: tuple[int, Proposal] | None  # (k, the first window), drafted while the target prefilled


_DONE = object()
# A text or chat prompt longer than this many characters per position of the context window is
# refused before it is tokenized: a 20 MB prompt held a request thread for ~20 s of tokenizing
# before the context window refused it (a review). Real text runs ~4 characters a token; a
# prompt of stranger text fits as token_ids, which are not tokenized here.
MAX_PROMPT_CHARS_PER_TOKEN = 64


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, config: OrchestratorConfig, target_info, drafter_info, tokenizer, metrics: SpecDecodeMetrics):
        self.config = config
        self.target_info = target_info
        self.drafter_info = drafter_info
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.vocab_size = int(target_info.model.vocab_size)
        self.max_context = int(target_info.model.max_context)
        self.targets = ReplicaPool("target", parse_addresses(config.target), target_pb2_grpc.TargetServiceStub,
                                   failure_cooldown_s=config.failure_cooldown_s)
        self.drafters = ReplicaPool("drafter", parse_addresses(config.drafter), drafter_pb2_grpc.DrafterServiceStub,
                                    failure_cooldown_s=config.failure_cooldown_s)
        # which target replicas got no drafts from which drafter replicas of late: every request heeds it
        self.reach = TargetReach(config.failure_cooldown_s)
        # what mirror requests learnt of whether branching pays here, for the next ones to start from
        self.branch_history = BranchHistory()
        self._workers = ThreadPoolExecutor(max_workers=config.max_concurrent_requests,
                                           thread_name_prefix="request")
        # a request's drafter session opens here while its worker opens the target session
        self._openers = ThreadPoolExecutor(max_workers=config.max_concurrent_requests,
                                           thread_name_prefix="drafter-open")
        # requests are tokenized here, off the event loop: a 2.8k-token chat prompt took 14.5 ms of the
        # demo tokenizer, which every other stream's next window waited out
        self._preparers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")
        # the target's own (its generation config's and tokenizer's) and this tokenizer's; an EOS id
        # past the model's vocabulary can never be sampled (and requests are refused stop ids there)
        eos = {*target_info.model.stop_token_ids, *_eos_ids(tokenizer)}
        self.eos_ids = tuple(sorted(t for t in eos if t < self.vocab_size))
        self.in_flight = 0  # requests running now (read by workers, changed on the event loop)
        self.draining = False  # stopping: new requests are refused, those in flight finish
        # stopped with requests still in flight (the drain's grace ran out): why, for each of them
        self.ended: str | None = None
        self._answer_queues: set[asyncio.Queue] = set()  # of the requests in ``_run``, on the event loop

    def unready(self) -> str | None:
        """Why this front door cannot serve a request now, if it cannot (its health check then
        answers NOT_SERVING): it is stopping, or has no target replica it could open a session on."""
        return "this front door is stopping" if self.draining else self.targets.unusable()

    def start_draining(self) -> None:
        """Refuse new requests, with a status that says why, while those in flight finish
        (``RunningServer.stop``): the port stays open meanwhile, where a plain graceful stop
        closes it and a client sees only "connection refused"."""
        self.draining = True

    def busy(self) -> bool:
        return self.in_flight > 0

    def end_in_flight(self, grace_s: float) -> None:
        """The drain's grace ran out (``RunningServer._drain``): each request still in flight, queued
        for a worker or running, ends now with a status that says why, rather than gRPC's
        "Cancelling all calls" as the server stops (a soak review). Its worker stops as a cancelled
        one does, closing its sessions. On the event loop."""
        self.ended = (f"this front door stopped before the request finished: its shutdown grace ({grace_s:g} s) "
                      f"ran out; send the request again, to another front door or once this one is back")
        for queue in self._answer_queues:
            queue.put_nowait(StoppedBeforeDone(self.ended))

    @contextmanager
    def _counted(self):
        """A request is in flight until its handler has handed gRPC its last message: counted only
        while its windows ran, a drain that ended as they did stopped the server before the
        answer went out, and the client got UNAVAILABLE "Cancelling all calls" for a finished
        request (CI of stop 51)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def _refuse_while_draining(self) -> None:
        if self.draining:
            raise NoReplicaAvailable("this front door is stopping (its requests in flight are finishing); send the "
                                     "request to another front door, or retry once it is back")

    def close(self) -> None:
        """After the server stopped (its RPCs cancelled): the request threads, the channels to the
        backends with their deadline watchdogs, and the metrics endpoint."""
        for pool in (self._workers, self._openers, self._preparers):
            pool.shutdown(wait=False, cancel_futures=True)
        self.targets.close()
        self.drafters.close()
        self.metrics.close()

    # ---- RPCs -------------------------------------------------------------------------------
    async def Generate(self, request, context):
        with self._counted():  # from its admission on: a drain that began while it was tokenized waits for it
            outcome = RequestOutcome()
            prepared = await self._admit(request, context, outcome)
            async for _ in self._run(prepared, outcome, context):
                pass
            return generation_pb2.GenerateResponse(
                text=self._text(outcome.tokens), token_ids=outcome.tokens,
                finish_reason=outcome.finish_reason, seed=prepared.seed, stats=self._stats(outcome),
                prompt_tokens=len(prepared.prompt))

    async def GenerateStream(self, request, context):
        with self._counted():
            outcome = RequestOutcome()
            prepared = await self._admit(request, context, outcome)
            detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
            async for tokens in self._run(prepared, outcome, context):
                yield generation_pb2.GenerateStreamResponse(token_ids=tokens, text=detok.push(tokens) if detok else "",
                                                            seed=prepared.seed)
            yield generation_pb2.GenerateStreamResponse(
                text=detok.flush() if detok else "", finish_reason=outcome.finish_reason,
                stats=self._stats(outcome), seed=prepared.seed)

    async def ModelInfo(self, request, context):
        await asyncio.to_thread(self._describe_drafters)  # a pool given since the last request says what it is
        info = generation_pb2.ModelInfoResponse(
            target=self.target_info.model, drafter_strategy=self.drafter_info.strategy if self.drafter_info else "none",
            default_num_speculative_tokens=drafters_default_k(self.config, self.drafter_info),
            max_speculative_tokens=self.config.max_speculative_tokens)
        if self.drafter_info is not None and self.drafter_info.HasField("model"):
            info.draft.CopyFrom(self.drafter_info.model)
        return info

    # ---- request preparation ----------------------------------------------------------------
    def refused(self, code: grpc.StatusCode) -> None:
        """A request answered before it reached a handler (one that does not parse) is refused too."""
        self.metrics.refuse(code.name)

    async def _admit(self, request, context, outcome: RequestOutcome) -> PreparedRequest:
        """The request prepared, or refused before it runs and counted so: refusals (bad input, a
        front door that is stopping) reached no metric, and an operator saw none of them. One its
        client left while it was tokenized is counted as one that left. ``outcome`` is made on
        arrival, so latency and time to first token count tokenizing and the wait for a preparer
        thread, as vLLM's count from arrival (they started after it: a review's find)."""
        try:
            self._refuse_while_draining()
            return await asyncio.get_running_loop().run_in_executor(self._preparers, self.prepare, request)
        except asyncio.CancelledError:
            remaining = context.time_remaining() if context is not None else None
            outcome.finish_reason = "deadline_exceeded" if remaining is not None and remaining <= 0 else "cancelled"
            self.metrics.observe(outcome)
            raise
        except Exception as err:
            self.refused(status_for(err))
            raise

    def prepare(self, request) -> PreparedRequest:
        params = params_from_proto(request.params, default_max_new_tokens=self.config.default_max_new_tokens)
        eos_ids = () if request.ignore_eos else self.eos_ids
        params = replace(params, stop_token_ids=tuple(sorted(set(params.stop_token_ids) | set(eos_ids))))
        k_named = request.HasField("num_speculative_tokens")
        k = request.num_speculative_tokens if k_named else drafters_default_k(self.config, self.drafter_info)
        spec = SpeculationConfig(num_speculative_tokens=int(k), max_speculative_tokens=self.config.max_speculative_tokens,
                                 adaptive=self.config.adaptive)
        if any(not s for s in request.stop):
            raise InvalidRequest("stop strings must be non-empty", field="stop")
        if request.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this deployment has none (send stop_token_ids "
                                 "instead, or start the front door with a tokenizer)", field="stop")
        kind, prompt = self._prompt_ids(request)
        if not request.params.max_new_tokens:  # unset: the default, where the context window has room for it
            params = replace(params, max_new_tokens=max(min(params.max_new_tokens, self.max_context - len(prompt)), 1))
        prompt = validate_prompt(prompt, self.vocab_size, self.max_context, params, field=kind)
        seed = request.seed if request.HasField("seed") else fresh_seed()
        mirror = self.config.mirror
        if request.HasField("mirror"):
            mirror = (mirror or MirrorConfig()) if request.mirror else None
            if request.mirror and not spec.num_speculative_tokens:  # it ran target-only, silently (a review)
                whose = "" if k_named else " (this deployment's default)"
                raise InvalidRequest("mirror=true drafts the next window while the target verifies this one, and "
                                     f"num_speculative_tokens=0{whose} drafts none: send num_speculative_tokens "
                                     ">= 1, or leave mirror unset", field="mirror")
        return PreparedRequest(prompt, params, spec, int(seed), tuple(request.stop), mirror, request.timeline,
                               k_named=k_named)

    def _prompt_ids(self, request) -> tuple[str, list[int]]:
        """(which input field was set, its token ids); ``validate_prompt`` checks the ids."""
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequest("the request has no input; set one of text, chat, raw_text or token_ids",
                                 field="input")
        if kind == "token_ids":
            return kind, list(request.token_ids.ids)
        if self.tokenizer is None:
            raise InvalidRequest(f"this deployment has no tokenizer; send token_ids instead of {kind}", field=kind)
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages or not any(m["content"] for m in messages):
                raise InvalidRequest("chat has no non-empty message", field="chat")
            self._refuse_past_any_context(kind, sum(len(m["content"]) for m in messages))
            return kind, encode_chat(self.tokenizer, messages)
        self._refuse_past_any_context(kind, len(getattr(request, kind)))
        return kind, encode_prompt(self.tokenizer, getattr(request, kind), chat=kind == "text")

    def _refuse_past_any_context(self, kind: str, chars: int) -> None:
        limit = self.max_context * MAX_PROMPT_CHARS_PER_TOKEN
        if chars > limit:
            raise OutOfRange(f"{kind} holds {chars:,} characters, more than the context window of {self.max_context} "
                             f"tokens is taken to hold ({limit:,}: {MAX_PROMPT_CHARS_PER_TOKEN} a token); shorten it, "
                             "or send it as token_ids", field=kind)

    # ---- the loop -----------------------------------------------------------------------------
    async def _run(self, prepared: PreparedRequest, outcome: RequestOutcome, context) -> AsyncIterator[list[int]]:
        """Runs the window loop in a worker thread, yielding each window's committed tokens."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        remaining = context.time_remaining() if context is not None else None
        budget = RequestBudget.of(self.config.backend_timeout_s, remaining)

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            """Every request is counted in the metrics, cancelled and failed ones too, and before
            its answer goes out (so a client that reads the metrics next sees it)."""
            self.metrics.waiting.dec()
            with self.metrics.running.track_inprogress():
                answer = run_and_count()
            if answer is not None:
                emit(answer)

        def run_and_count():
            answer = None  # nobody waits for one where the client left (or its deadline passed) while this queued
            if cancelled.is_set():
                outcome.finish_reason = "cancelled"
            else:
                try:
                    self._drive(prepared, outcome, budget, cancelled, emit)
                    answer = _DONE
                except BaseException as err:  # noqa: BLE001 - handed to the event loop, mapped to a status there
                    # the client's deadline passing is the client leaving, not a failure of the service
                    outcome.finish_reason = "cancelled" if cancelled.is_set() or budget.client_gone() else "error"
                    answer = err
            if outcome.finish_reason == "cancelled" and budget.client_gone():  # for the metrics: no answer goes out
                outcome.finish_reason = "deadline_exceeded"
            if outcome.finish_reason == "error":
                self.metrics.fail(status_for(answer).name)
            self.metrics.observe(outcome)
            return answer

        if self.ended is not None:  # admitted as the grace ran out
            self.refused(grpc.StatusCode.UNAVAILABLE)
            raise StoppedBeforeDone(self.ended)
        try:
            self._answer_queues.add(queue)
            self.metrics.waiting.inc()
            loop.run_in_executor(self._workers, work)
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._answer_queues.discard(queue)
            cancelled.set()  # client went away, deadline passed, or done: the worker stops and closes sessions

    def _drive(self, prepared: PreparedRequest, outcome: RequestOutcome, budget: RequestBudget,
               cancelled: threading.Event, emit) -> None:
        timeout = budget.timeout_s
        prepared = self._with_pool_k(prepared)
        if prepared.timeline:
            outcome.stats.timeline = []
        # the drafter opens its session and drafts the first window while the target prefills; where
        # that window is ready at once, the first verify does the prefill, in the same pass
        defer_prefill = self._first_window_ready_at_once(prepared)
        drafting = self._openers.submit(self._open_drafter, prepared, budget)
        try:
            verifier = RemoteVerifier(self.targets, prepared.prompt, prepared.params, prepared.seed, self.vocab_size,
                                      timeout_s=timeout,
                                      replacement_wait_s=min(timeout, self.config.replacement_wait_s),
                                      gives_hints=self.target_info.hint_layer > 0, defer_prefill=defer_prefill,
                                      runner_up=self.config.runner_up, window_timeout_s=self.config.window_timeout_s,
                                      ended=cancelled, client_deadline=budget.client_deadline)
        except BaseException:
            if (opened := drafting.result()) is not None:
                opened.remote.release()
            raise
        remote = pipeline = events = None
        try:  # from here on the sessions are released whatever happens
            opened = drafting.result()
            remote, drafter = (opened.remote, opened.drafter) if opened is not None else (None, None)
            stop_check = _StopStrings(self.tokenizer, prepared.stop_strings) if prepared.stop_strings else None
            # the verify RPC runs in the pipeline's thread while this one sends the branches' Draft RPCs
            pipeline = (MirrorPipeline(prepared.mirror, self.branch_history)
                        if prepared.mirror is not None and drafter is not None else None)
            if cancelled.is_set():  # the client left during the prefill
                outcome.finish_reason = "cancelled"
                return
            if self._on_target(prepared) and opened is not None:
                events = windows_on_target(remote, drafter, verifier, prepared.prompt, prepared.params, prepared.spec,
                                           prepared.seed, outcome.stats, self.config.runner_up, budget.client_deadline,
                                           prepared.mirror, self.reach)
            else:
                events = decode_windows(drafter, verifier, prepared.prompt, prepared.params, prepared.spec,
                                        prepared.seed, outcome.stats, pipeline,
                                        opened.drafted_ahead if opened is not None else None)
            for event in events:
                if cancelled.is_set():
                    outcome.finish_reason = "cancelled"
                    return
                tokens, finish = event.tokens, event.finish_reason
                if stop_check is not None:
                    tokens, hit = stop_check.cut(tokens)
                    outcome.stats.committed -= len(event.tokens) - len(tokens)  # counts what is sent
                    finish = "stop" if hit else finish
                outcome.tokens += tokens
                if tokens:
                    if outcome.first_token_at is None:
                        outcome.first_token_at = time.perf_counter()
                    emit(tokens)
                if finish:
                    outcome.finish_reason = finish
                    return
        finally:
            outcome.drafter_fallback = remote is not None and remote.fell_back
            outcome.target_moves = verifier.moves
            outcome.drafter_moves = remote.moves if remote is not None else 0
            outcome.paused_windows = remote.paused_windows if remote is not None else 0
            outcome.network_s = verifier.times.network_s + (remote.times.network_s if remote else 0.0)
            if pipeline is not None:
                pipeline.close()
            try:  # a run on the target ends before its sessions close: it went on drafting for them
                if events is not None:
                    events.close()
            finally:  # both close at once: the answer waits one round trip for them, not two
                release_together(verifier, remote)

    def _with_pool_k(self, prepared: PreparedRequest) -> PreparedRequest:
        """The request's K where it named none: its drafter pool's default, asked here, in its
        worker thread, after the pool has described itself. ``prepare`` runs on the event loop,
        which must not wait on a replica's Info, so there it took the default of what was known:
        the first request after a pool was given to a front door that had none drafted 4 where
        the pool drafts 8 (review of stop 55)."""
        if prepared.k_named:
            return prepared
        self._describe_drafters()
        k = drafters_default_k(self.config, self.drafter_info)
        return replace(prepared, spec=replace(prepared.spec, num_speculative_tokens=k))

    def _open_drafter(self, prepared: PreparedRequest, budget: RequestBudget) -> OpenedDrafter | None:
        """The request's drafter session, and its first window drafted ahead: this runs while the
        target prefills the prompt, which takes far longer than the drafter's prefill and first
        draft together, so the first Verify can go out as soon as the prefill is done."""
        if prepared.spec.num_speculative_tokens <= 0 or self._describe_drafters() is None:
            return None
        if self._ngram_here():
            ngram = FrontDoorNgram(paused=self._saturated)
            return OpenedDrafter(ngram, ngram, self._draft_ahead(prepared, ngram))
        timeout = min(self.config.drafter_timeout_s, budget.timeout_s / 2)
        remote = RemoteDrafter(self.drafters, prepared.prompt, prepared.params, prepared.seed, self.vocab_size,
                               draft_vocab=drafter_vocabulary(self.drafter_info, self.vocab_size),
                               timeout_s=timeout, step_cost=replica_step_cost(self.drafter_info),
                               paused=self._saturated, caller_lookup=self._lookup_here(prepared),
                               client_deadline=budget.client_deadline)
        drafter = front_door_drafter(remote)
        # windows on the target draft there: nothing to draft ahead here
        return OpenedDrafter(remote, drafter, None if self._on_target(prepared) else self._draft_ahead(prepared, drafter))

    @staticmethod
    def _draft_ahead(prepared: PreparedRequest, drafter: Drafter) -> tuple[int, Proposal] | None:
        k = first_window_k(prepared.spec, prepared.params, drafter)
        return (k, drafter.propose(prepared.prompt, k, prepared.params, prepared.seed)) if k > 0 else None

    def _ngram_here(self) -> bool:
        """An n-gram pool's strategy is lookup alone, which the front door runs on its token log."""
        return self.config.front_door_lookup and self.drafter_info.strategy == "ngram"

    def _lookup_here(self, prepared: PreparedRequest) -> int:
        """The min match of the prompt lookup this front door runs for its draft-model replicas
        (their own ``prompt_lookup``); 0 where it runs none."""
        lookup_here = (self.config.front_door_lookup and self.drafter_info.strategy == "draft-model"
                       and not self._on_target(prepared))
        return self.drafter_info.prompt_lookup if lookup_here else 0

    def _on_target(self, prepared: PreparedRequest) -> bool:
        """Whether the request's windows run on the target (``windows_on_target``): windows of a
        draft-model pool, serial or mirror (unless the targets' early-exit hints are to steer its
        branches, which happens here), adaptive K where the targets choose K themselves (one
        built before ignores the policy: its windows would all take the largest K), with no
        saturation limit to pause drafting."""
        return (self.config.windows_on_target and prepared.spec.num_speculative_tokens > 0
                and (prepared.mirror is None or not (prepared.mirror.use_hints and self.target_info.hint_layer))
                and (not prepared.spec.adaptive or self.target_info.runs_adaptive_k)
                and not prepared.timeline
                and self.config.speculation_off_above is None and self._describe_drafters() is not None
                and not self._ngram_here())

    def _first_window_ready_at_once(self, prepared: PreparedRequest) -> bool:
        """Whether the first window needs no drafter call: it has no drafts (no speculation, no
        drafter, drafting paused, or no room left after the first token), or lookup here fills it
        from the prompt. Then nothing is gained by prefilling while the drafter works, and the
        target saves a pass by scoring prompt and window together. (With adaptive K the first
        window's K comes from the drafter's cost model: not guessed here.)"""
        spec = prepared.spec
        if (spec.num_speculative_tokens <= 0 or self._describe_drafters() is None or self._saturated()
                or self._ngram_here()):
            return True
        if spec.adaptive:
            return False
        k = first_window_k(spec, prepared.params, None)
        min_match = self._lookup_here(prepared)
        return k <= 0 or (min_match > 0 and looks_up_whole_window(min_match, prepared.prompt, k))

    def _saturated(self) -> bool:
        limit = self.config.speculation_off_above
        return limit is not None and self.in_flight > limit

    def _describe_drafters(self):
        """The drafter pool's Info, asked of its replicas in turn once one exists: a deployment
        started with no drafter starts drafting as soon as the pool is scaled up. A replica that
        does not answer, or drafts another vocabulary, is reported failed and the next one asked:
        each request would otherwise ask that same replica again, and go without drafts."""
        tried: set[str] = set()
        while self.drafter_info is None and self.drafters.addresses:
            try:
                replica = self.drafters.acquire(avoid=tried)
            except NoReplicaAvailable:  # it emptied, or every member failed or was tried: no drafting for now
                return None
            tried.add(replica.address)
            try:
                info = replica.stub.Info(common_pb2.InfoRequest(), timeout=10)
                check_drafter_vocabulary(info, self.vocab_size, self.tokenizer)
                self.drafter_info = info
            except (grpc.RpcError, InvalidRequest) as err:
                why = err.code().name if isinstance(err, grpc.RpcError) else str(err)
                log.warning("drafter %s cannot draft for this front door (%s); asking another", replica.address, why)
                self.drafters.report_failure(replica)
            finally:
                self.drafters.release(replica)
        return self.drafter_info

    # ---- responses ----------------------------------------------------------------------------
    def _text(self, tokens: list[int]) -> str:
        return decode_text(self.tokenizer, tokens) if self.tokenizer else ""

    def _stats(self, outcome: RequestOutcome) -> generation_pb2.RequestStats:
        s = outcome.stats
        ttft = (outcome.first_token_at - outcome.started) if outcome.first_token_at else 0.0
        return generation_pb2.RequestStats(
            windows=s.windows, drafted=s.drafted, accepted=s.accepted, rejected=s.rejected,
            acceptance_rate=s.acceptance_rate, token_acceptance_rate=s.token_acceptance_rate,
            mean_accepted_length=s.mean_accepted_length, per_position_acceptance=s.per_position_acceptance,
            draft_time_s=s.draft_time_s, verify_time_s=s.verify_time_s, network_time_s=outcome.network_s,
            drafter_fallback=outcome.drafter_fallback, time_to_first_token_s=ttft,
            target_moves=outcome.target_moves, drafter_moves=outcome.drafter_moves,
            mirror_windows=s.mirror_windows, branches_drafted=s.branches_drafted, branch_hits=s.branch_hits,
            branch_hit_rate=s.branch_hit_rate, draft_time_off_path_s=s.draft_time_off_path_s,
            mean_k=s.drafted / s.windows if s.windows else 0.0, speculation_paused_windows=outcome.paused_windows,
            runner_up_hits=s.runner_up_hits, windows_on_target=s.windows_on_target,
            first_verify_time_s=s.first_verify_time_s, adaptive_off_windows=s.adaptive_off_windows,
            timeline=[generation_pb2.TimelineSpan(what=what, start_s=start - outcome.started,
                                                  end_s=end - outcome.started) for what, start, end in s.timeline or ()],
            total_time_s=time.perf_counter() - outcome.started)


@dataclass(frozen=True)
class RequestBudget:
    """The time a request's backend calls get: the backend timeout, or less where the client's
    own deadline leaves less; and when that deadline passes, after which a failed call is the
    client having left, not a failure of the service."""

    timeout_s: float
    client_deadline: float | None  # time.monotonic() at which the client's deadline passes

    @classmethod
    def of(cls, backend_timeout_s: float, client_remaining_s: float | None) -> RequestBudget:
        """``client_remaining_s``: None without a deadline; 0 once it passed (as grpc.aio's
        ``time_remaining()`` says it), which was read as none: such a request got the whole
        backend budget and was never taken for one whose client had gone (a load review)."""
        if client_remaining_s is None:
            return cls(backend_timeout_s, None)
        remaining = max(client_remaining_s, 0.0)
        return cls(min(backend_timeout_s, remaining), time.monotonic() + remaining)

    def client_gone(self) -> bool:
        return client_deadline_passed(self.client_deadline)


class _StopStrings:
    """Stop strings are matched on decoded text; the window's tokens are cut at the first token
    whose text completes a match. A match the new tokens complete ends in their text, so only
    that text and the last characters before it (one fewer than the longest stop) are searched:
    decoding the whole output again for each new token cost O(n^2), 5.3 s on a 4k-token answer."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.text = IncrementalDetokenizer(tokenizer)  # prepare() refuses stop strings where there is none
        self.stops = stops
        self.reach = max(len(stop) for stop in stops) - 1
        self.tail = ""  # the last `reach` characters of the text handed out so far

    def cut(self, tokens: list[int]) -> tuple[list[int], bool]:
        """The tokens up to the one that completes a stop string, and whether one did."""
        for i in range(1, len(tokens) + 1):
            seen = self.tail + self.text.unread_text(tokens[:i])
            if any(stop in seen for stop in self.stops):
                return tokens[:i], True
        seen = self.tail + self.text.push(tokens)
        self.tail = seen[-self.reach:] if self.reach else ""  # [len(seen) - reach:] wrapped round while short
        return tokens, False


def _channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=BACKEND_CHANNEL_OPTIONS)


def _eos_ids(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []


INFO_POLL_S = 0.05  # how often a starting front door looks for its pools' first answers


async def _backend_info(pool: str, addresses: list[str], make_stub, wait_s: float = 60.0):
    """The first Info a pool's replicas answer, all asked at once, each waited for up to ``wait_s``
    (launchers start all the servers at once). Every replica of a pool serves the same model, and
    one that is down must not keep the front door from starting: only the first was asked, so
    a front door restarted with a membership that still listed a lost replica first refused to
    start (a failure-injection review). None answering, or each as something else, is the
    setting's fault."""
    channels = [_channel(address) for address in addresses]
    calls = [make_stub(channel).Info.future(common_pb2.InfoRequest(), timeout=wait_s, wait_for_ready=True)
             for channel in channels]
    try:
        while True:
            answered = next((call for call in calls if call.done() and call.exception() is None), None)
            if answered is not None:
                if silent := [a for a, call in zip(addresses, calls) if not call.done()]:  # said nothing (a review)
                    log.warning("%s %s %s not answered yet (starting, or down); sessions go to the %s replicas that "
                                "answer, and to these once they do", pool, ", ".join(silent),
                                "has" if len(silent) == 1 else "have", pool)
                return answered.result()
            if all(call.done() for call in calls):
                break
            await asyncio.sleep(INFO_POLL_S)
        why = "; ".join(f"{address}: {call.exception().code().name}: {call.exception().details()}"
                        for address, call in zip(addresses, calls))
        raise InvalidRequest(f"no {pool} server answered Info at {', '.join(addresses)} within {wait_s:.0f} s "
                             f"({why}); start one there (python -m {pool}_service) or fix the address", field=pool)
    finally:
        for call, channel in zip(calls, channels):
            call.cancel()
            channel.close()


def check_drafter_vocabulary(drafter_info, target_vocab: int, tokenizer) -> None:
    """A drafter pool's model drafts for this target (``check_shared_vocabulary``): a narrower
    table needs its tokenizer, read from where the drafter loaded it, to be the front door's."""
    if not drafter_info.HasField("model"):  # n-gram drafters have no model: they propose context ids
        return
    vocab = int(drafter_info.model.vocab_size)
    check_shared_vocabulary(vocab, target_vocab, field="drafter", same_tokenizer=lambda: same_tokenizer(
        try_load_tokenizer(drafter_info.model.source), tokenizer, vocab))


def drafters_default_k(config: OrchestratorConfig, drafter_info) -> int:
    """The K a request that names none drafts: the config's, or where it names none, the one
    `mirrorspec serve` gives the same drafters, so a front door started on its own
    (``python -m orchestrator``, a Ray stack) drafts as long a window as the CLI's would: an
    n-gram pool drafts 8, not 4. Asked per request, not settled at start: a front door started
    with no drafter (a Ray stack scaled up from none) kept 4 for the pool it was given later."""
    if config.num_speculative_tokens is not None:
        return config.num_speculative_tokens
    k = DEFAULT_K if drafter_info is None else default_k(drafter_info.strategy == "draft-model",
                                                         drafter_info.draft_confidence)
    return min(k, config.max_speculative_tokens)


def drafter_vocabulary(drafter_info, target_vocab: int) -> int:
    """The ids a drafter pool's q rows span: its model's table, or the target's (n-gram)."""
    return int(drafter_info.model.vocab_size) if drafter_info.HasField("model") else target_vocab


async def serve(config: OrchestratorConfig):
    """Connect to the backends, then start the front door."""
    targets = parse_addresses(config.target)
    if not targets:
        raise InvalidRequest("the orchestrator needs at least one target address (host:port)", field="target")
    target_info = await _backend_info("target", targets, target_pb2_grpc.TargetServiceStub)
    drafter_info = None
    if config.drafter:
        drafter_info = await _backend_info("drafter", parse_addresses(config.drafter),
                                           drafter_pb2_grpc.DrafterServiceStub)
    tokenizer = await asyncio.to_thread(try_load_tokenizer, config.tokenizer or target_info.model.source)
    if drafter_info is not None:
        await asyncio.to_thread(check_drafter_vocabulary, drafter_info, int(target_info.model.vocab_size), tokenizer)
    metrics = SpecDecodeMetrics()
    if config.metrics_port is not None:
        metrics.serve(config.host, config.metrics_port)
        log.info("metrics: http://%s:%d/metrics", config.host, metrics.port)
    servicer = GenerationServicer(config, target_info, drafter_info, tokenizer, metrics)
    service = Service(generation_pb2_grpc.add_GenerationServiceServicer_to_server, servicer,
                      generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name)
    return await start_grpc_server([service], config.host, config.port)
