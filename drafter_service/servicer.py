"""DrafterService: a thin async servicer over the core's drafting strategies."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from functools import partial

from mirrorspec.config import (DEFAULT_DRAFT_QUANTIZE, DEFAULT_PROPOSAL_TOP_K, MAX_BRANCHES, InvalidRequest,
                               OutOfRange, ReplicaConfig, check_draft_confidence, check_prompt_lookup,
                               check_proposal_top_k, check_quantization)
from mirrorspec.drafting import Drafter, NgramDrafter, RankedTokens
from mirrorspec.drafting.draft_model import draft_model_step_cost
from mirrorspec.engine import make_drafter, validate_prompt
from mirrorspec.mirror import own_next_token
from mirrorspec.models import LoadedModel, load_causal_lm
from mirrorspec.serving.convert import (check_token_ids, describe_model, params_from_proto, proposal_to_proto,
                                        ranked_to_proto)
from mirrorspec.serving.server import ComputeLane, Service, start_grpc_server
from mirrorspec.serving.sessions import SequenceState, SessionStore, orphaned_after, orphaned_at_end
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc




@dataclass(frozen=True)
class DrafterConfig(ReplicaConfig):
    strategy: str = "ngram"  # "ngram" | "draft-model" (then `model` names the draft model)
    proposal_top_k: int = DEFAULT_PROPOSAL_TOP_K  # sparse q by default: a few KB per window instead of MBs
    prompt_lookup: int = 0  # draft-model: prompt lookup drafts first on matches this long (HybridDrafter)
    draft_confidence: float = 0.0  # draft-model: a window ends after the model's first token below this
    quantize: str = DEFAULT_DRAFT_QUANTIZE  # draft-model: int8 weights for its linear layers on CPU (models.quantize)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_proposal_top_k(self.proposal_top_k)
        check_prompt_lookup(self.prompt_lookup)
        check_quantization(self.quantize)
        check_draft_confidence(self.draft_confidence)
        if self.strategy not in ("ngram", "draft-model"):
            raise InvalidRequest(f"drafter strategy must be 'ngram' or 'draft-model', got {self.strategy!r}",
                                 field="strategy")
        if self.strategy == "draft-model" and not self.model:
            raise InvalidRequest("strategy 'draft-model' needs a draft model path or hub id", field="model")

    @classmethod
    def for_draft(cls, draft: str, **fields) -> DrafterConfig:
        """The replica for what a user names as the draft: ``ngram``, or a draft model."""
        if draft == "ngram":
            return cls(strategy="ngram", model=None, **fields)
        return cls(strategy="draft-model", model=draft, **fields)


@dataclass
class DraftSession:
    sequence: SequenceState
    drafter: Drafter
    vocab_size: int  # the ids its context may hold
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False  # its release is on the lane: no more work for it (ComputeLane.run_for)


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, config: DrafterConfig, loaded: LoadedModel | None = None, lane: ComputeLane | None = None):
        self.config = config
        self.loaded = loaded
        self.vocab_size = int(loaded.model.config.vocab_size) if loaded else 1 << 31
        self.sessions: SessionStore[DraftSession] = SessionStore(
            config.max_sessions, config.session_ttl_s, on_evict=lambda s: self.lane.close_later(s, s.drafter.release),
            orphan_ttl_s=config.orphaned_session_ttl_s)
        self.lane = lane or ComputeLane("drafter-compute")
        self.step_cost = draft_model_step_cost(loaded.model) if loaded is not None else NgramDrafter.step_cost

    def close(self) -> None:
        """After the server stopped: the compute lane's thread."""
        self.lane.shutdown()

    async def OpenSession(self, request, context):
        params = params_from_proto(request.params, default_max_new_tokens=1)
        vocab_size = max(self.vocab_size, request.target_vocab_size)  # a target's wider table: KVSession.input_ids
        # nothing need fit this drafter's window: the target's bounds the answer, a draft model with
        # a shorter one drafts up to its end (``DraftModelDrafter.max_context``) and no further, and
        # its prompt lookup drafts past it. A prompt past it was refused, and the request ran
        # target-only with a "drafter failed" warning every 5 s (review 20 of stop 48).
        prompt = validate_prompt(request.prompt_ids, vocab_size, 1 << 31, replace(params, max_new_tokens=1),
                                 field="prompt_ids")
        session_id = self.sessions.open(DraftSession(SequenceState(prompt, params, int(request.seed)),
                                                     self._new_drafter(request.caller_looks_up), vocab_size),
                                        request.session_id)
        self.sessions.orphan(session_id)  # until its first call (SessionStore)
        return drafter_pb2.OpenDraftSessionResponse(session_id=session_id)

    def _new_drafter(self, caller_looks_up: bool) -> Drafter:
        """This replica's strategy for one session; without its prompt lookup where the caller runs
        that lookup itself (the orchestrator, on its token log), so the session only models."""
        if self.loaded is None:
            return NgramDrafter()
        lookup = 0 if caller_looks_up else self.config.prompt_lookup
        return make_drafter(self.loaded.model, self.config.proposal_top_k, lookup, self.config.draft_confidence)

    async def Draft(self, request, context):
        with orphaned_after(self.sessions, request.session_id):
            return await self._draft(request)

    async def _draft(self, request) -> drafter_pb2.DraftResponse:
        session = self.sessions.get(request.session_id)
        async with session.lock:
            k = self._commit(session, request)
            started = time.perf_counter()
            seq = session.sequence
            proposal = await self.lane.run_for(session, session.drafter.propose, list(seq.context), k, seq.params,
                                               seq.seed)
        response = _draft_response(proposal)
        response.draft_time_s = time.perf_counter() - started
        return response

    async def DraftWindows(self, requests, context):
        """Draft call after Draft call of one caller on one stream, each answered as Draft would."""
        with orphaned_at_end(self.sessions) as streamed:
            async for request in requests:
                streamed.carry(request.session_id)
                yield await self._draft(request)

    async def DraftBranches(self, request, context):
        with orphaned_after(self.sessions, request.session_id):
            return await self._draft_branches(request)

    async def _draft_branches(self, request) -> drafter_pb2.DraftBranchesResponse:
        session = self.sessions.get(request.session_id)
        branch_tokens = check_token_ids(request.branch_tokens, session.vocab_size, "branch_tokens")
        if not 1 <= len(branch_tokens) + request.own_token_branch <= MAX_BRANCHES:
            raise OutOfRange(f"DraftBranches takes 1 to {MAX_BRANCHES} branches (branch_tokens, and one more with "
                             f"own_token_branch), got {len(branch_tokens) + request.own_token_branch}",
                             field="branch_tokens")
        forks = _fork_points(request.branch_forks, len(branch_tokens), int(request.context_length))
        async with session.lock:
            k = self._commit(session, request)
            started = time.perf_counter()
            seq = session.sequence
            own = await self.lane.run_for(session, own_next_token, session.drafter, list(seq.context), seq.seed) \
                if request.own_token_branch else None
            if own is not None:  # one more branch, forking at the end of the context
                branch_tokens.append(own)
                forks = forks and [*forks, len(seq.context)]
            proposals = await self.lane.run_for(session, session.drafter.propose_branches, list(seq.context),
                                                branch_tokens, k, seq.params, seq.seed, forks) if branch_tokens else []
        return drafter_pb2.DraftBranchesResponse(drafts=[_draft_response(p) for p in proposals],
                                                 draft_time_s=time.perf_counter() - started,
                                                 forked=forks is not None, own_token=own)

    async def RankTokens(self, request, context):
        with orphaned_after(self.sessions, request.session_id):
            return await self._rank_tokens(request)

    async def _rank_tokens(self, request) -> drafter_pb2.DraftResponse:
        session = self.sessions.get(request.session_id)
        if request.k >= request.context_length:
            raise OutOfRange(f"RankTokens ranks the last k tokens of a context and needs one before them; "
                             f"k={request.k} with context_length={request.context_length}", field="k")
        async with session.lock:
            k = self._commit(session, request)
            seq = session.sequence
            started = time.perf_counter()
            ranked = await self.lane.run_for(session, session.drafter.alternatives_for, list(seq.context[:-k]),
                                             list(seq.context[-k:])) if k else RankedTokens()
        response = drafter_pb2.DraftResponse(draft_time_s=time.perf_counter() - started)
        response.alternatives.extend(ranked_to_proto(ranked))
        return response

    def _commit(self, session: DraftSession, request) -> int:
        """Commit what the request commits (forking first if it keeps less than the session
        holds); the request's k, refused beyond this drafter's bound."""
        if request.k > self.config.max_speculative_tokens:
            raise OutOfRange(f"k={request.k} exceeds this drafter's max_speculative_tokens "
                             f"({self.config.max_speculative_tokens})", field="k")
        commit = check_token_ids(request.commit_tokens, session.vocab_size, "commit_tokens")
        keep = int(request.keep) if request.HasField("keep") else None
        session.sequence.commit(commit, int(request.context_length), keep)
        return int(request.k)

    async def CloseSession(self, request, context):
        return common_pb2.CloseSessionResponse(existed=self.sessions.close(request.session_id))

    async def Info(self, request, context):
        self.sessions.evict_expired()
        info = drafter_pb2.DrafterInfo(strategy=self.config.strategy, open_sessions=len(self.sessions),
                                       max_sessions=self.config.max_sessions,
                                       proposal_top_k=self.config.proposal_top_k,
                                       prompt_lookup=self.config.prompt_lookup if self.loaded else 0,
                                       step_cost=self.step_cost,
                                       draft_confidence=self.config.draft_confidence if self.loaded else 0.0)
        if self.loaded is not None:
            info.model.CopyFrom(describe_model(self.loaded))
        return info


def _fork_points(forks, num_branches: int, context_length: int) -> list[int] | None:
    """A DraftBranches request's fork points (None: all at the end), checked against its branches
    and the committed context."""
    if not forks:
        return None
    points = [int(f) for f in forks]
    if len(points) != num_branches:
        raise InvalidRequest(f"branch_forks holds {len(points)} fork points for {num_branches} branch_tokens; send "
                             "one per branch token (or none: all at the end of the context)", field="branch_forks")
    for b, point in enumerate(points):
        if not 1 <= point <= context_length:
            raise InvalidRequest(f"branch_forks[{b}]={point} is outside [1, context_length={context_length}]: a "
                                 "branch forks after at least one token and at most the whole context",
                                 field="branch_forks")
    return points


def _draft_response(proposal) -> drafter_pb2.DraftResponse:
    response = drafter_pb2.DraftResponse(tokens=proposal.tokens)
    if proposal.tokens:
        response.q.CopyFrom(proposal_to_proto(proposal.q))
        response.alternatives.extend(ranked_to_proto(proposal.ranked()))
    return response


async def serve(config: DrafterConfig, loaded: LoadedModel | None = None):
    """Load the draft model if the strategy needs one, and start the gRPC server."""
    lane = ComputeLane("drafter-compute")  # loads on the thread that will run it (see ComputeLane)
    if loaded is None and config.strategy == "draft-model":
        loaded = await lane.run(partial(load_causal_lm, config.model, dtype=config.dtype, device=config.device,
                                        tokenizer=False, quantize=config.quantize))
    servicer = DrafterServicer(config, loaded, lane)
    service = Service(drafter_pb2_grpc.add_DrafterServiceServicer_to_server, servicer,
                      drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name)
    return await start_grpc_server([service], config.host, config.port, stall_timeout_s=config.stall_timeout_s,
                                   keepalive_s=config.keepalive_s)
