"""The core's ``Drafter`` and ``Verifier`` interfaces, implemented over gRPC.

With these, the orchestrator runs the very same ``decode_windows`` loop as the in-process engine.
Both send only what was committed since their last call; the orchestrator's context is the
authoritative token log, so a lost session is reopened from it at any time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from mirrorspec.config import InvalidRequest, SamplingParams
from mirrorspec.drafting import Drafter, Proposal
from mirrorspec.sampling import WindowVerdict
from mirrorspec.serving.convert import (
    TOKEN_KIND_FROM_PROTO,
    params_to_proto,
    proposal_from_proto,
    proposal_to_proto,
)
from mirrorspec.v1 import common_pb2, drafter_pb2, target_pb2

log = logging.getLogger(__name__)


@dataclass
class CallTimes:
    """Client-side call time and the server-side compute time inside it; the gap is network."""

    call_s: float = 0.0
    server_s: float = 0.0

    @property
    def network_s(self) -> float:
        return max(self.call_s - self.server_s, 0.0)


class RemoteDrafter(Drafter):
    """A drafter session on a DrafterService replica. Any failure turns it off for the rest of
    the request: windows then carry no drafts, i.e. the request goes on target-only, unharmed."""

    name = "remote"

    def __init__(self, stub, prompt: Sequence[int], params: SamplingParams, seed: int, vocab_size: int,
                 timeout_s: float | None = None, step_cost: float = Drafter.step_cost):
        self.stub = stub
        self.step_cost = step_cost  # of the replica's strategy, for adaptive K
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.times = CallTimes()
        self.failure: str | None = None
        self.session_id: str | None = None
        self.sent = len(prompt)
        try:
            request = drafter_pb2.OpenDraftSessionRequest(prompt_ids=list(prompt), params=params_to_proto(params),
                                                          seed=seed)
            self.session_id = stub.OpenSession(request, timeout=timeout_s).session_id
        except grpc.RpcError as err:
            self._fail(err)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal:
        if self.failure is not None or k <= 0:
            return Proposal.empty()
        request = drafter_pb2.DraftRequest(session_id=self.session_id, commit_tokens=list(context[self.sent:]),
                                           context_length=len(context), k=k)
        started = time.perf_counter()
        try:
            response = self.stub.Draft(request, timeout=self.timeout_s)
            proposal = proposal_from_proto(response.tokens, response.q, self.vocab_size)
        except (grpc.RpcError, InvalidRequest) as err:
            self._fail(err)
            return Proposal.empty()
        self.times.call_s += time.perf_counter() - started
        self.times.server_s += response.draft_time_s
        self.sent = len(context)
        return proposal

    def _fail(self, err: Exception) -> None:
        detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else str(err)
        self.failure = detail
        log.warning("drafter failed (%s); continuing target-only", detail)

    def release(self) -> None:
        if self.session_id is not None and self.failure is None:
            _close_quietly(self.stub, self.session_id)


class RemoteVerifier:
    """A target session on a TargetService replica. If the session is gone (expired, evicted,
    replica restarted), it is reopened from the orchestrator's context and the window retried."""

    def __init__(self, stub, prompt: Sequence[int], params: SamplingParams, seed: int, vocab_size: int,
                 timeout_s: float | None = None):
        self.stub = stub
        self.params = params
        self.seed = seed
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.times = CallTimes()
        self._open(prompt)

    def _open(self, context: Sequence[int]) -> None:
        request = target_pb2.OpenTargetSessionRequest(prompt_ids=list(context), params=params_to_proto(self.params),
                                                      seed=self.seed)
        self.session_id = self.stub.OpenSession(request, timeout=self.timeout_s).session_id
        self.sent = len(context)

    def verify(self, context: Sequence[int], proposal: Proposal, params: SamplingParams, seed: int) -> WindowVerdict:
        try:
            return self._verify_once(context, proposal)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            log.info("target session %s is gone; reopening from the token log", self.session_id)
            self._open(context)
            return self._verify_once(context, proposal)

    def _verify_once(self, context: Sequence[int], proposal: Proposal) -> WindowVerdict:
        request = target_pb2.VerifyRequest(session_id=self.session_id, commit_tokens=list(context[self.sent:]),
                                           context_length=len(context), draft_tokens=proposal.tokens)
        if proposal.tokens:
            request.q.CopyFrom(proposal_to_proto(proposal.q))
        started = time.perf_counter()
        verdict = None
        for event in self.stub.Verify(request, timeout=self.timeout_s):
            if event.HasField("verdict"):
                verdict = event.verdict
        if verdict is None:
            raise RuntimeError("the target's Verify stream ended without a verdict")
        self.times.call_s += time.perf_counter() - started
        self.times.server_s += verdict.verify_time_s
        self.sent = len(context)
        return WindowVerdict(num_accepted=verdict.num_accepted, next_token=verdict.next_token,
                             next_kind=TOKEN_KIND_FROM_PROTO[verdict.next_kind])

    def release(self) -> None:
        _close_quietly(self.stub, self.session_id)


def _close_quietly(stub, session_id: str) -> None:
    try:
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=5)
    except grpc.RpcError as err:
        log.info("closing session %s failed: %s", session_id, err.code().name)
