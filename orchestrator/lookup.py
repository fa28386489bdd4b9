"""Prompt lookup at the front door, where the token log is.

A draft-model replica with prompt lookup (``DrafterInfo.prompt_lookup``) looks up first and lets
its model draft only where the context does not repeat itself. Lookup reads nothing but the
context, and the orchestrator holds the authoritative context of every request, so it finds the
very matches the replica would. Run here, a looked-up window costs no drafter call at all, and
the replica's compute lane (one per replica, shared by all its sessions) serves only the windows
that need its model: on the benchmark prompts, greedy at K=4, that is 50% fewer drafter calls on
code edits, 26% on HumanEval, 8% on MT-Bench. The replica's session is opened without its own
lookup (``caller_looks_up``), drafts only where lookup found nothing, and catches up on the
skipped tokens at its next call (commit-then-draft sends everything since).

Same output: this is ``HybridDrafter`` with the remote drafter as its model, the composition the
replica itself runs in process, so every position is drafted by the same source from the same
context, and each q row is what its token was drawn from.

A model-free (n-gram) pool is lookup and nothing else, so the front door runs its whole strategy
here (``FrontDoorNgram``) and never calls it: a round trip per window saved, and the first window
is always ready at once, so the target scores it with the prompt in one pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mirrorspec.config import SamplingParams
from mirrorspec.drafting import HybridDrafter, NgramDrafter, Proposal
from mirrorspec.drafting.hybrid import prompt_lookup
from orchestrator.remote import CallTimes, PauseGate, RemoteDrafter


class FrontDoorLookup(HybridDrafter):
    """Lookup here, the replica's draft model behind it. While speculation is paused it drafts
    nothing; while the drafter is off after a failure, lookup goes on alone (it needs no drafter,
    and a looked-up token is as exact as any)."""

    name = "front-door-lookup"

    def __init__(self, remote: RemoteDrafter, min_match: int):
        super().__init__(remote, min_match=min_match)
        self.remote = remote

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal:
        if k <= 0 or not self.remote.gate.allows():
            return Proposal.empty()
        return super().propose(context, k, params, seed)


class FrontDoorNgram(NgramDrafter):
    """An n-gram replica's strategy (``NgramDrafter()``, as ``DrafterServicer`` makes it), run on
    the token log here. It answers what the window loop and the request's statistics ask of a
    pool session: no failures, no moves, no network time, and windows refused while paused."""

    name = "front-door-ngram"
    fell_back = False
    moves = 0

    def __init__(self, paused: Callable[[], bool] | None = None):
        super().__init__()
        self.gate = PauseGate(paused)
        self.times = CallTimes()

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, seed: int) -> Proposal:
        if k <= 0 or not self.gate.allows():
            return Proposal.empty()
        return super().propose(context, k, params, seed)

    @property
    def paused_windows(self) -> int:
        return self.gate.refused

    def release(self) -> None:
        pass

    def start_release(self) -> None:
        """No replica session to close (``RemoteDrafter.start_release``)."""
        return None


def front_door_drafter(remote: RemoteDrafter | None) -> FrontDoorLookup | RemoteDrafter | None:
    """The request's drafter: lookup here in front of ``remote`` where it leaves lookup to us."""
    return FrontDoorLookup(remote, remote.caller_lookup) if remote is not None and remote.caller_lookup else remote


def looks_up_whole_window(min_match: int, context: Sequence[int], k: int) -> bool:
    """Whether lookup alone fills a ``k``-token window after ``context``. For a prompt, the first
    window is then ready the moment the request arrives, with no drafter call: the target need
    not prefill first, and scores the prompt with that window in one pass (``defer_prefill``)."""
    return k > 0 and len(prompt_lookup(min_match).lookup(context, k)) == k
