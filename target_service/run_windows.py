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
import time

import grpc

from mirrorspec.config import InvalidRequest
from mirrorspec.drafting import Proposal
from mirrorspec.serving.convert import proposal_from_proto
from mirrorspec.serving.server import CHANNEL_OPTIONS
from mirrorspec.v1 import drafter_pb2, drafter_pb2_grpc



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
        channel = self._channels.pop(address, None) or grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._channels[address] = channel
        self._runs[address] = self._runs.get(address, 0) + 1
        idle = [a for a in self._channels if a not in self._runs]
        for stale in idle[:max(len(idle) - self.max_idle, 0)]:
            await self._channels.pop(stale).close()
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
                 timeout_s: float):
        self._stub = stub
        self._session_id = session_id
        self._held = held  # how many tokens of the context the drafter session holds
        self._vocab_size = vocab_size
        self._timeout_s = timeout_s
        self._call = None

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
        try:
            proposal = proposal_from_proto(response.tokens, response.q, self._vocab_size, response.alternatives)
        except InvalidRequest as err:
            raise DraftCallFailed(f"INVALID_ARGUMENT: the drafter's answer: {err}") from None
        if len(proposal) > k:
            raise DraftCallFailed(f"INVALID_ARGUMENT: the drafter answered {len(proposal)} drafts for k={k}")
        return proposal, response.draft_time_s, call_s

    async def _exchange(self, request: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse:
        await self._call.write(request)
        return await self._call.read()

    def close(self) -> None:
        """Cancels the stream: the drafter keeps the session (orphaned until its caller's next call)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
