"""The target's side of windows it runs itself: its draft stream to a drafter session."""

import asyncio

import grpc
import pytest
import torch

from drafter_service.servicer import DrafterConfig
from drafter_service.servicer import serve as serve_drafter
from mirrorspec.sampling.proposal import ProposalRows
from mirrorspec.serving.convert import proposal_to_proto
from mirrorspec.serving.server import BackgroundServer
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.run_windows import DraftCallFailed, DrafterLinks, DraftStream


def with_a_draft_stream(tiny_dir, body, temperature: float = 0.0, seed: int = 0) -> None:
    """``await body(stream, drafter)``: a target's draft stream to a session after [0, 1, 2] on a
    drafter server on the tiny draft (top-4 q), which stops after."""
    drafter = BackgroundServer(lambda: serve_drafter(DrafterConfig(strategy="draft-model", proposal_top_k=4,
                                                                   model=str(tiny_dir["draft16"])))).start()
    address = f"127.0.0.1:{drafter.port}"
    stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(address))
    session = stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(
        prompt_ids=[0, 1, 2], params=common_pb2.SamplingParams(temperature=temperature, max_new_tokens=16),
        seed=seed)).session_id

    async def run():
        links = DrafterLinks()
        stream = DraftStream(await links.acquire(address), session, held=3, vocab_size=16, timeout_s=5.0)
        try:
            await body(stream, drafter)
        finally:
            stream.close()
            await links.close()

    try:
        asyncio.run(run())
    finally:
        drafter.stop()


def test_a_draft_stream_whose_drafter_went_away_fails_the_next_draft_with_a_status(tiny_dir):
    """A write on a stream that already ended raises asyncio's InvalidStateError in grpc.aio, not
    an RpcError: it must still end the run as a failed draft call (drafter_error), not as an
    internal error of the target that loses the request's window run."""
    async def body(stream, drafter):
        proposal, draft_s, call_s = await stream.draft([0, 1, 2], 2)
        assert len(proposal) == 2 and 0 < draft_s <= call_s
        await asyncio.get_running_loop().run_in_executor(None, lambda: drafter.stop(grace=0))
        for _ in range(200):  # until this side has seen the stream end
            if stream._call.done():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(DraftCallFailed, match="^(UNAVAILABLE|CANCELLED): "):
            await stream.draft([0, 1, 2, proposal.tokens[0]], 2)

    with_a_draft_stream(tiny_dir, body)


@pytest.mark.parametrize("draft_vocab_size, widths_taken", [(12, [12, 14, 16]), (1, [8, 12, 14, 16]), (16, [16])])
def test_a_draft_streams_dense_rows_are_taken_from_the_drafters_table_width_to_the_vocabulary(
        draft_vocab_size, widths_taken):
    """The front door's rule (``RemoteDrafter.draft_vocab``), sent in ``draft_vocab_size``: a target
    running the windows used to take any width (it was not told the drafter's), 1 where unsent."""
    stream = DraftStream(None, "s", held=3, vocab_size=16, timeout_s=5.0, draft_vocab_size=draft_vocab_size)
    for width in (8, 12, 14, 16, 17):
        q = torch.zeros(1, width)
        q[0, 3] = 1.0
        response = drafter_pb2.DraftResponse(tokens=[3], q=proposal_to_proto(ProposalRows(probs=q)))
        if width in widths_taken:
            assert stream._checked(response, k=2).tokens == (3,)
        else:
            with pytest.raises(DraftCallFailed, match="^INVALID_ARGUMENT: the drafter's answer: .*columns"):
                stream._checked(response, k=2)


def test_the_all_accepted_guess_is_the_branch_after_the_drafter_s_own_next_token(tiny_dir):
    """Mirror on the target guesses "all K drafts pass" too: one branch after the whole window and
    the drafter's own greedy next token, which the drafter finds and reports (``own_token``), keyed
    (K, that token) beside the rejection guesses of the same call. Each branch holds what a fresh
    draft call on its context gives."""
    from mirrorspec import SamplingParams
    from mirrorspec.drafting import DraftModelDrafter
    from mirrorspec.mirror import GREEDY
    from support import load_as_served_draft

    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    local = DraftModelDrafter(load_as_served_draft(tiny_dir["draft16"]), proposal_top_k=4)

    async def body(stream, drafter):
        window, _, _ = await stream.draft([0, 1, 2], 3)
        branches, _ = await stream.branches([0, 1, 2], window.tokens, [(3, None), (0, 9), (2, 5)], 2)
        after_window = [0, 1, 2, *window.tokens]
        own = local.propose(after_window, 1, GREEDY, 3).tokens[0]
        assert set(branches) == {(3, own), (0, 9), (2, 5)}
        for (j, c), branch in branches.items():
            assert branch.tokens == local.propose([*after_window[:3 + j], c], 2, params, 3).tokens
        # a call with the all-accepted guess alone, and the session still drafts from what it committed
        alone, _ = await stream.branches([0, 1, 2], window.tokens, [(3, None)], 2)
        assert list(alone) == [(3, own)]
        again, _, _ = await stream.draft([0, 1, 2], 3)
        assert again.tokens == window.tokens

    with_a_draft_stream(tiny_dir, body, temperature=1.0, seed=3)


def test_a_drafter_from_before_own_token_branches_is_asked_for_one_alone_once(tiny_dir, monkeypatch):
    """A drafter built before ``own_token_branch`` never sees it: beside rejection guesses it
    drafts those alone, and a call with the own-token branch alone it refuses (no branch_tokens).
    After that refusal, the run's windows whose only guess is "all accepted" do not branch
    (review 2 of stop 44: each such window made a failing call and logged it)."""
    from dataclasses import replace

    from drafter_service.servicer import DrafterServicer
    from target_service.run_windows import Branching

    draft_branches = DrafterServicer._draft_branches

    async def older(self, request):
        request.own_token_branch = False
        return await draft_branches(self, request)

    monkeypatch.setattr(DrafterServicer, "_draft_branches", older)

    async def body(stream, drafter):
        window, _, _ = await stream.draft([0, 1, 2], 3)
        branches, _ = await stream.branches([0, 1, 2], window.tokens, [(3, None), (0, 9)], 2)
        assert list(branches) == [(0, 9)] and stream.own_token_alone
        with pytest.raises(DraftCallFailed, match="^OUT_OF_RANGE: "):
            await stream.branches([0, 1, 2], window.tokens, [(3, None)], 2)
        assert not stream.own_token_alone
        looked_up = replace(window, alternatives=(), alternative_probs=())  # no runner-ups: "all accepted" only
        assert Branching(4, 7).start(stream, [0, 1, 2], looked_up, None, lambda j: 2) is None

    with_a_draft_stream(tiny_dir, body)


def test_channels_to_drafters_no_run_uses_are_kept_for_the_last_few_addresses_only():
    """Any caller may name any drafter address: one channel kept per address held memory for the
    server's life (review 2 of stop 43: 1,500 addresses, 11 MB). A channel a run uses stays open."""
    async def run():
        links = DrafterLinks(max_idle=2)
        await links.acquire("127.0.0.1:1")  # a run still going
        for port in range(2, 12):
            await links.acquire(f"127.0.0.1:{port}")
            links.release(f"127.0.0.1:{port}")
        # what runs use, and the last max_idle others as of the last run's start
        assert list(links._channels) == ["127.0.0.1:1", "127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"]
        await links.acquire("127.0.0.1:10")  # used again: the last one used now
        links.release("127.0.0.1:10")
        await links.acquire("127.0.0.1:12")
        links.release("127.0.0.1:12")
        assert list(links._channels) == ["127.0.0.1:1", "127.0.0.1:11", "127.0.0.1:10", "127.0.0.1:12"]
        await links.close()
        assert len(links) == 0

    asyncio.run(run())


def test_a_run_cancelled_while_its_link_closes_an_old_channel_leaves_no_run_counted():
    """A run counted for good kept its address from ever counting as idle: its channel was never
    closed, against ``max_idle``'s bound (a review's find, from reading)."""
    class Hanging:
        async def close(self):
            await asyncio.Event().wait()

    async def run():
        links = DrafterLinks(max_idle=0)
        links._channels["127.0.0.1:1"] = Hanging()  # idle, and closing it hangs
        acquiring = asyncio.ensure_future(links.acquire("127.0.0.1:2"))
        await asyncio.sleep(0.05)
        acquiring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await acquiring
        assert links._runs == {}
        await links.close()

    asyncio.run(run())


def test_a_run_branches_only_while_its_branches_pay():
    """Mirror on the target (``Branching``): branching beside a verify that slows the verify and
    never hits is dropped after the first windows, bar a probe now and then (the front door's
    policy, ``BranchPolicy.should_branch``); branches that hit and cost nothing keep going."""
    from mirrorspec.drafting import Proposal
    from mirrorspec.sampling import ProposalRows, TokenKind, WindowVerdict
    from target_service.run_windows import Branching

    proposal = Proposal(tokens=(3, 4), q=ProposalRows.one_hot([3, 4]), alternatives=((3, 5), (4, 6)),
                        alternative_probs=((0.6, 0.3), (0.7, 0.2)))

    class Drafts:
        async def branches(self, context, window, guessed, k):
            return {key: proposal for key in guessed}, 0.001

    async def windows(verdict: WindowVerdict, branched_verify_s: float) -> list[bool]:
        branching, branched = Branching(max_branches=4, alternatives=7), []
        for _ in range(60):
            branching.take(2)
            call = branching.start(Drafts(), [0, 1], proposal, None, lambda j: 2)
            branched.append(call is not None)
            await branching.finish(call, branched_verify_s if call is not None else 0.030)
            branching.observe_fresh_draft(0.005)
            branching.observe(verdict, 2)
        return branched

    missing = WindowVerdict(num_accepted=0, next_token=7, next_kind=TokenKind.RECOVERED)  # no branch guessed 7
    costly = asyncio.run(windows(missing, branched_verify_s=0.040))
    assert costly[0] and sum(costly[20:]) <= 4  # probes only
    held = WindowVerdict(num_accepted=0, next_token=5, next_kind=TokenKind.RECOVERED)  # the drafter's runner-up
    paying = asyncio.run(windows(held, branched_verify_s=0.030))
    assert sum(paying[20:]) >= 36


def test_a_run_whose_session_closes_while_it_waits_for_a_draft_runs_no_forward_for_it_after(tiny_dir, monkeypatch):
    """A front door closes its sessions as a stop string or a cancel ends a request, while the
    target's run may be waiting on a draft. The run's next verify was queued behind the close on
    the compute lane and recomputed the whole context on the freed cache (a review's find; on a
    tensor-parallel target the followers kept that cache for good)."""
    import time

    import target_service.servicer as target_servicer
    from mirrorspec.drafting.draft_model import DraftModelDrafter
    from mirrorspec.models import KVSession
    from target_service.servicer import TargetConfig
    from target_service.servicer import serve as serve_target

    events: list[str] = []

    class Recorded(KVSession):
        def _extend(self, context, num_positions, runner_up=None):
            events.append("forward")
            return super()._extend(context, num_positions, runner_up)

        def close(self):
            events.append("close")
            super().close()

    propose = DraftModelDrafter.propose

    def slow_propose(self, *args, **kwargs):
        time.sleep(0.3)  # a draft model's K steps, as the session closes
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(target_servicer, "KVSession", Recorded)
    monkeypatch.setattr(DraftModelDrafter, "propose", slow_propose)
    target = BackgroundServer(lambda: serve_target(TargetConfig(model=str(tiny_dir["target16"])))).start()
    drafter = BackgroundServer(lambda: serve_drafter(DrafterConfig(strategy="draft-model", quantize="none",
                                                                   model=str(tiny_dir["draft16"])))).start()
    try:
        targets = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{target.port}"))
        drafters = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{drafter.port}"))
        prompt, params = [(7 * i + 3) % 16 for i in range(40)], common_pb2.SamplingParams(max_new_tokens=20)
        target_session = targets.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=prompt,
                                                                                 params=params)).session_id
        drafter_session = drafters.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=prompt,
                                                                                   params=params)).session_id
        run = targets.RunWindows(target_pb2.RunWindowsRequest(
            session_id=target_session, context_length=len(prompt), drafter_address=f"127.0.0.1:{drafter.port}",
            drafter_session_id=drafter_session, drafter_context_length=len(prompt), k=3, max_new_tokens=20,
            draft_timeout_s=5.0), timeout=30)
        assert next(run).tokens
        time.sleep(0.1)  # the run waits for its next window's draft
        assert targets.CloseSession(common_pb2.CloseSessionRequest(session_id=target_session)).existed
        with pytest.raises(grpc.RpcError) as ended:
            list(run)
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND
        assert "closed" in ended.value.details() or "unknown session" in ended.value.details()
        time.sleep(0.5)  # anything still queued has run
    finally:
        drafter.stop()
        target.stop()
    assert "close" in events and "forward" not in events[events.index("close"):]
