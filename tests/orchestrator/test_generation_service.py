"""End to end over real loopback gRPC servers: identity, streaming, cancellation, failures, errors."""

import asyncio
import random
import re
import threading
import time

import grpc
import pytest
import torch

from mirrorspec import SamplingParams, generate
from mirrorspec.config import InvalidRequest, MirrorConfig
from mirrorspec.serving.convert import proposal_from_proto
from mirrorspec.client import AsyncClient, Client
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, target_pb2, target_pb2_grpc
from orchestrator.servicer import OrchestratorConfig, _backend_info
from served_stack import start_stack, targets_held, two_mirror_requests
from support import (MemoSession, chi_square_pvalue, counts_by_label, exact_joint, load, load_as_served_draft,
                     record_instances, record_rpc, wait_until)


def target_only(model, prompt, max_tokens, **params):
    return generate(model, None, prompt, SamplingParams(max_new_tokens=max_tokens, **params)).token_ids


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(16) for _ in range(rng.randint(1, 10))] for _ in range(count)]


def test_greedy_output_is_identical_to_target_only(stack, tiny_dir):
    model = load(tiny_dir["target16"])
    with Client(stack.address) as client:
        for i, prompt in enumerate(prompts(6)):
            k = [1, 3, 5][i % 3]
            served = client.generate(prompt, max_tokens=24, k=k)
            assert served.token_ids == target_only(model, prompt, 24)
            assert served.finish_reason == "length" and served.stats.windows > 0
            # what the bench leaves out of per-window costs, as in process
            assert 0 < served.stats.first_verify_time_s <= served.stats.verify_time_s


@pytest.mark.parametrize("front_door_lookup", [True, False])
def test_n_gram_drafter_over_the_network_is_identical_too(tiny_dir, monkeypatch, front_door_lookup):
    """An n-gram pool is lookup alone: by default the front door runs it on its token log and never
    calls the replicas; left to them, every window is a Draft call. Same tokens either way."""
    from drafter_service.servicer import DrafterServicer

    calls = []
    draft = DrafterServicer._draft  # every Draft, unary or a message on a DraftWindows stream

    async def recorded(self, request):
        calls.append(request)
        return await draft(self, request)

    monkeypatch.setattr(DrafterServicer, "_draft", recorded)
    ngram = start_stack(tiny_dir["target16"], strategy="ngram", k=4, front_door_lookup=front_door_lookup)
    try:
        model = load(tiny_dir["target16"])
        with Client(ngram.address) as client:
            for prompt in prompts(4, seed=1):
                served = client.generate(prompt, max_tokens=40)
                assert served.token_ids == target_only(model, prompt, 40)
                assert served.stats.drafted > 0
                expected = generate(model, "ngram", prompt, SamplingParams(max_new_tokens=40, temperature=1.0),
                                    num_speculative_tokens=4, seed=3)
                sampled = client.generate(prompt, max_tokens=40, temperature=1.0, seed=3)
                assert sampled.token_ids == expected.token_ids
                assert sampled.stats.drafted == expected.stats.drafted
            assert client.model_info().drafter_strategy == "ngram"
        assert (len(calls) == 0) == front_door_lookup
    finally:
        ngram.stop()


def test_a_drafter_with_prompt_lookup_looks_up_and_stays_identical_to_target_only(tiny_dir, stack):
    hybrid = start_stack(tiny_dir["target16"], tiny_dir["draft16"], prompt_lookup=2, k=4)
    try:
        stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{hybrid.drafter.port}"))
        assert stub.Info(common_pb2.InfoRequest()).prompt_lookup == 2
        context = [0, 3, 5, 2, 6, 1, 3, 5]  # "3 5" occurred before, followed by "2 6 1"
        sid = stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=context)).session_id
        response = stub.Draft(drafter_pb2.DraftRequest(session_id=sid, context_length=8, k=3))
        draft = proposal_from_proto(response.tokens, response.q, 16)
        assert draft.tokens == (2, 6, 1) and draft.q.dense(16).max(-1).values.tolist() == [1.0] * 3
        assert [list(a.ids) for a in response.alternatives] == [[2], [6], [1]]  # looked up: no runners-up
        # while the target verifies, mirror asks the model's own view of the looked-up tokens
        ranked = stub.RankTokens(drafter_pb2.DraftRequest(session_id=sid, commit_tokens=[2, 6, 1], context_length=11,
                                                          k=3))
        model_alone = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.drafter.port}"))
        assert model_alone.Info(common_pb2.InfoRequest()).prompt_lookup == 0  # the same draft16, no lookup
        assert len(ranked.alternatives) == 3
        for i, tops in enumerate(ranked.alternatives):
            head = [*context, 2, 6, 1][:8 + i]
            fresh = model_alone.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=head)).session_id
            alone = model_alone.Draft(drafter_pb2.DraftRequest(session_id=fresh, context_length=len(head), k=1))
            model_alone.CloseSession(common_pb2.CloseSessionRequest(session_id=fresh))  # other tests count sessions
            assert list(tops.ids) == list(alone.alternatives[0].ids)
            assert list(tops.probs) == pytest.approx(list(alone.alternatives[0].probs), abs=1e-5)
            assert len(tops.probs) == len(tops.ids) and sorted(tops.probs, reverse=True) == list(tops.probs)
        with pytest.raises(grpc.RpcError) as err:
            stub.RankTokens(drafter_pb2.DraftRequest(session_id=sid, context_length=11, k=11))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "k=11" in err.value.details()
        model = load(tiny_dir["target16"])
        with Client(hybrid.address) as client:
            for prompt in [context, *prompts(4, seed=2)]:
                for mirror in (False, True):
                    served = client.generate(prompt, max_tokens=30, mirror=mirror)
                    assert served.token_ids == target_only(model, prompt, 30)
    finally:
        hybrid.stop()


def test_the_front_door_looks_up_itself_and_asks_the_drafter_only_where_lookup_finds_nothing(tiny_dir, monkeypatch):
    """With a drafter pool that looks up (prompt_lookup 2), the orchestrator runs that lookup on its
    own token log: the replica gets a Draft call exactly where the in-process HybridDrafter asks
    its model, and the output, greedy or seeded, is the in-process hybrid's to the token."""
    from drafter_service.servicer import DrafterServicer
    from mirrorspec.drafting import DraftModelDrafter

    counts = {"rpc": 0, "model": 0}
    draft_rpc, model_propose = DrafterServicer._draft, DraftModelDrafter.propose  # unary or streamed

    async def counted_rpc(self, request):
        counts["rpc"] += 1
        return await draft_rpc(self, request)

    def counted_propose(self, *args, **kwargs):
        counts["model"] += 1
        return model_propose(self, *args, **kwargs)

    monkeypatch.setattr(DrafterServicer, "_draft", counted_rpc)
    monkeypatch.setattr(DraftModelDrafter, "propose", counted_propose)
    target, draft = load(tiny_dir["target16"]), load_as_served_draft(tiny_dir["draft16"])
    repeats = [0, 3, 5, 2, 6, 1, 3, 5, 2, 6, 1, 3, 5]  # lookup fills whole windows, and runs out
    cases = [(repeats, {}), (repeats, {"temperature": 1.0, "seed": 4}), ([1, 4, 2], {"temperature": 0.8, "seed": 9})]
    rpcs = {}
    for front_door_lookup in (True, False):
        s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], prompt_lookup=2, k=4,
                        front_door_lookup=front_door_lookup)
        try:
            with Client(s.address) as client:
                for prompt, sampling in cases:
                    counts.update(rpc=0, model=0)
                    params = SamplingParams(max_new_tokens=30, temperature=sampling.get("temperature", 0.0))
                    expected = generate(target, draft, prompt, params, num_speculative_tokens=4,
                                        seed=sampling.get("seed"), proposal_top_k=4, prompt_lookup=2)
                    in_process_model_drafts = counts["model"]
                    counts.update(rpc=0, model=0)
                    served = client.generate(prompt, max_tokens=30, **sampling)
                    assert served.token_ids == expected.token_ids
                    assert counts["model"] == in_process_model_drafts  # the same drafts, wherever looked up
                    if front_door_lookup:  # a call only where the model drafts
                        assert counts["rpc"] == in_process_model_drafts < served.stats.windows
                    rpcs[front_door_lookup] = rpcs.get(front_door_lookup, 0) + counts["rpc"]
        finally:
            s.stop()
    assert rpcs[True] < rpcs[False]


@pytest.mark.parametrize("on_target, runner_up, filters", [
    (False, False, dict(temperature=0.7, top_k=5, top_p=0.9)),
    (True, False, dict(temperature=0.7, top_k=5, top_p=0.9)),
    (False, True, dict(temperature=1.3, top_p=0.8)),
    (True, True, dict(temperature=1.3, top_k=6)),
], ids=["front door", "on target", "front door, runner-up", "on target, runner-up"])
def test_seeded_samples_with_temperature_top_k_and_top_p_are_the_in_process_engine_s(tiny_dir, on_target, runner_up,
                                                                                  filters):
    """The in-process engine's distribution is tested against exact enumeration with these filters;
    served requests draw its tokens, seed for seed, so the filters reach the target's p over the
    wire as they are (served sampled tests ran at T=1 and no filter: an exactness review)."""
    target, draft = load(tiny_dir["target16"]), load_as_served_draft(tiny_dir["draft16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, proposal_top_k=4, runner_up=runner_up,
                    windows_on_target=on_target)
    try:
        with Client(s.address) as client:
            for seed, prompt in enumerate(prompts(6, seed=4)):
                served = client.generate(prompt, max_tokens=20, seed=seed, **filters)
                local = generate(target, draft, prompt, SamplingParams(max_new_tokens=20, **filters),
                                 num_speculative_tokens=3, seed=seed, proposal_top_k=4, runner_up=runner_up)
                assert served.token_ids == local.token_ids, (seed, prompt)
                assert served.stats.windows_on_target == (served.stats.windows if on_target else 0)
    finally:
        s.stop()


def test_a_drafter_that_ends_windows_when_unsure_serves_the_in_process_output(tiny_dir):
    """A replica with draft_confidence drafts exactly what the in-process drafter does, greedy or
    seeded, serial or mirror: the same tokens and the same shorter windows."""
    target, draft = load(tiny_dir["target16"]), load_as_served_draft(tiny_dir["draft16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], prompt_lookup=2, draft_confidence=0.8, k=4)
    try:
        with Client(s.address) as client:
            for prompt, sampling in (([1, 4, 2], {}), ([0, 3, 5, 2], {"temperature": 1.0, "seed": 4}),
                                     ([1, 4, 2], {"mirror": True})):
                params = SamplingParams(max_new_tokens=30, temperature=sampling.get("temperature", 0.0))
                expected = generate(target, draft, prompt, params, num_speculative_tokens=4, seed=sampling.get("seed"),
                                    proposal_top_k=4, prompt_lookup=2, draft_confidence=0.8)
                always_k = generate(target, draft, prompt, params, num_speculative_tokens=4, seed=sampling.get("seed"),
                                    proposal_top_k=4, prompt_lookup=2)
                served = client.generate(prompt, max_tokens=30, **sampling)
                assert served.token_ids == expected.token_ids
                assert served.stats.drafted == expected.stats.drafted < always_k.stats.drafted
    finally:
        s.stop()


def test_the_first_window_is_drafted_while_the_target_prefills(tiny_dir, monkeypatch):
    """The front door drafts window 1 during the target's OpenSession (a prefill far longer than
    the drafter's): its Draft call is over before the prefill is, and the output is unchanged."""
    from drafter_service.servicer import DrafterServicer
    from target_service.servicer import TargetServicer

    events = []
    open_target, draft_rpc = TargetServicer.OpenSession, DrafterServicer._draft  # unary or streamed

    async def slow_prefill(self, request, context):
        await asyncio.sleep(0.5)  # a long prompt on a big target
        response = await open_target(self, request, context)
        events.append(("target opened", time.perf_counter()))
        return response

    async def timed_draft(self, request):
        response = await draft_rpc(self, request)
        events.append(("drafted", time.perf_counter()))
        return response

    monkeypatch.setattr(TargetServicer, "OpenSession", slow_prefill)
    monkeypatch.setattr(DrafterServicer, "_draft", timed_draft)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3)
    try:
        with Client(s.address) as client:
            for sampling in ({}, {"temperature": 1.0, "seed": 2}):
                events.clear()
                served = client.generate([2, 9, 4], max_tokens=12, **sampling)
                expected = generate(load(tiny_dir["target16"]), load_as_served_draft(tiny_dir["draft16"]), [2, 9, 4], SamplingParams(
                    max_new_tokens=12, temperature=sampling.get("temperature", 0.0)), num_speculative_tokens=3,
                    seed=sampling.get("seed"), proposal_top_k=4)
                assert served.token_ids == expected.token_ids
                assert [what for what, _ in events[:2]] == ["drafted", "target opened"]
                assert served.stats.drafted == expected.stats.drafted  # window 1's drafts were verified
    finally:
        s.stop()


def test_a_first_window_ready_at_once_is_verified_with_the_prefill_in_one_pass(tiny_dir, monkeypatch):
    """Where the first window needs no drafter call (the front door's lookup fills it from the
    prompt, or it has no drafts), the target opens the session without prefilling, and the first
    Verify scores prompt and window in one pass, as in process: one target pass fewer, the same
    output. Where the drafter must draft it, the target prefills meanwhile."""
    from target_service.servicer import TargetServicer

    opened = record_rpc(monkeypatch, TargetServicer, "OpenSession", lambda request: request.defer_prefill)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], prompt_lookup=2, k=3)
    repeats = [0, 3, 5, 2, 6, 1, 3, 5]  # "3 5" occurred before, followed by "2 6 1": a whole window
    novel = [2, 9, 4]
    try:
        with Client(s.address) as client:
            for prompt, deferred in ((repeats, True), (novel, False)):
                for sampling in ({}, {"temperature": 1.0, "seed": 5}):
                    opened.clear()
                    served = client.generate(prompt, max_tokens=12, **sampling)
                    expected = generate(load(tiny_dir["target16"]), load_as_served_draft(tiny_dir["draft16"]), prompt, SamplingParams(
                        max_new_tokens=12, temperature=sampling.get("temperature", 0.0)), num_speculative_tokens=3,
                        seed=sampling.get("seed"), proposal_top_k=4, prompt_lookup=2)
                    assert opened == [deferred]
                    assert served.token_ids == expected.token_ids
                    assert served.stats.drafted == expected.stats.drafted
            opened.clear()
            alone = client.generate(novel, max_tokens=12, k=0, temperature=1.0, seed=5)  # no drafts at all
            assert opened == [True] and alone.stats.drafted == 0
            assert alone.token_ids == generate(load(tiny_dir["target16"]), None, novel, SamplingParams(
                max_new_tokens=12, temperature=1.0), seed=5).token_ids
    finally:
        s.stop()


def test_a_drafter_that_predates_rank_tokens_still_drafts_mirror_requests(tiny_dir, monkeypatch):
    """A replica without RankTokens answers UNIMPLEMENTED: looked-up windows then go without
    guesses, and the request keeps its drafter (no fallback to target-only)."""
    from drafter_service.servicer import DrafterServicer

    async def unimplemented(self, request, context):  # what gRPC answers for a method a server lacks
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(DrafterServicer, "RankTokens", unimplemented)
    old = start_stack(tiny_dir["target16"], tiny_dir["draft16"], prompt_lookup=2, k=4,
                      mirror=MirrorConfig(stop_at_verdict=False))
    try:
        model = load(tiny_dir["target16"])
        with Client(old.address) as client:
            prompt = [0, 3, 5, 2, 6, 1, 3, 5]  # the first window is looked up
            served = client.generate(prompt, max_tokens=30)
        assert served.token_ids == target_only(model, prompt, 30)
        assert not served.stats.drafter_fallback and served.stats.mirror_windows > 1
    finally:
        old.stop()


def test_a_draft_with_a_shorter_context_window_drafts_up_to_its_end(tiny_dir, tmp_path):
    """Its drafter refused every session whose prompt + max_tokens passed its window, so those
    requests ran target-only from their first token (review 9 of stop 47); in process, it drafted
    on past its window (a model with learned positions would fail there), and a seeded sampled
    request no longer matched the served one. Then a prompt past its window was still refused,
    and prompt lookup, which drafts there, with it (review 20 of stop 48)."""
    import json

    from support import save_tiny_llama

    short = save_tiny_llama(tmp_path / "short", seed=1, logit_scale=2.0)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    s = start_stack(tiny_dir["target"], short, k=3)
    try:
        with Client(s.address) as client:
            prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
            served = client.generate(prompt, max_tokens=60)  # 70 tokens: past the draft's 32
            sampled = client.generate(prompt, max_tokens=60, temperature=1.0, seed=3)
        assert served.token_ids == target_only(load(tiny_dir["target"]), prompt, 60)
        assert not served.stats.drafter_fallback and served.stats.drafted > 0
        in_process = generate(load(tiny_dir["target"]), load_as_served_draft(short), prompt,
                              SamplingParams(max_new_tokens=60, temperature=1.0), num_speculative_tokens=3, seed=3,
                              proposal_top_k=4)
        assert sampled.token_ids == in_process.token_ids and sampled.stats.drafted == in_process.stats.drafted
    finally:
        s.stop()
    # a prompt past the draft's window: its prompt lookup still drafts, on the replica or at the front door
    prompt = [1, 2, 3, 4, 5, 6, 7] * 6  # 42 tokens
    in_process = generate(load(tiny_dir["target"]), load_as_served_draft(short), prompt, SamplingParams(max_new_tokens=20),
                          num_speculative_tokens=3, proposal_top_k=4, prompt_lookup=2)
    assert in_process.stats.drafted > 0
    for front_door_lookup in (True, False):
        s = start_stack(tiny_dir["target"], short, k=3, prompt_lookup=2, front_door_lookup=front_door_lookup)
        try:
            with Client(s.address) as client:
                served = client.generate(prompt, max_tokens=20)
            assert served.token_ids == in_process.token_ids and not served.stats.drafter_fallback
            assert (served.stats.drafted, served.stats.accepted) == (in_process.stats.drafted, in_process.stats.accepted)
        finally:
            s.stop()


def test_served_runner_up_windows_on_a_sliding_window_target_stay_identical_to_target_only(tmp_path):
    """A target server scored runner-ups under a whole-context mask in its sliding layers too
    (review 12 of stop 47): greedy output left target-only's past the window."""
    from support import save_tiny_llama

    target = save_tiny_llama(tmp_path / "target", seed=0, layers=2, sliding_window=8)
    draft = save_tiny_llama(tmp_path / "draft", seed=1, layers=1, sliding_window=8)
    s = start_stack(target, draft, k=3, runner_up=True)
    try:
        with Client(s.address) as client:
            for prompt in ([1, 2, 3], [4, 4, 1, 6, 2, 7, 0, 3, 5]):
                assert client.generate(prompt, max_tokens=40).token_ids == target_only(load(target), prompt, 40)
    finally:
        s.stop()


def test_stream_delivers_the_same_tokens_in_order_with_stats_last(stack):
    with Client(stack.address) as client:
        unary = client.generate([0, 4, 2], max_tokens=30, temperature=0.9, seed=5)
        chunks = list(client.stream([0, 4, 2], max_tokens=30, temperature=0.9, seed=5))
    streamed = [t for c in chunks[:-1] for t in c.token_ids]
    assert streamed == unary.token_ids
    assert all(c.token_ids for c in chunks[:-1]) and not chunks[-1].token_ids
    assert chunks[-1].finish_reason == "length" and not any(c.finish_reason for c in chunks[:-1])
    assert chunks[-1].stats.windows == len(chunks) - 1 and chunks[-1].seed == 5


def open_sessions(stack) -> tuple[int, int]:
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.target.port}"))
    drafter = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.drafter.port}"))
    return (target.Info(common_pb2.InfoRequest()).open_sessions,
            drafter.Info(common_pb2.InfoRequest()).open_sessions)


def test_cancellation_frees_the_sessions_on_both_services(stack):
    with Client(stack.address) as client:
        stream = client.stream([0, 1, 2], max_tokens=100)
        next(stream)
        assert open_sessions(stack) == (1, 1)
        stream.cancel()
    assert wait_until(lambda: open_sessions(stack) == (0, 0))


def test_an_async_stream_left_early_cancels_its_request_and_frees_the_sessions(tiny_dir):
    """``break`` out of ``AsyncClient.stream``, then ``aclose()``: the call was never cancelled,
    and the request ran on for nobody to max_tokens with both sessions held (review 19)."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"])

    async def leave_after_one_chunk() -> None:
        async with AsyncClient(s.address) as client:
            stream = client.stream([0, 1, 2], max_tokens=100)
            async for _ in stream:
                break
            with targets_held(s):  # its next window waits: only a cancel can end it now
                await stream.aclose()
                await asyncio.sleep(0.5)  # the front door sees the cancel while the request waits
            # judged while the client is still open (closing its channel cancels every call)
            assert wait_until(lambda: counts_by_label(s.front.servicer.metrics.requests, "finish_reason"))
            assert counts_by_label(s.front.servicer.metrics.requests, "finish_reason") == {"cancelled": 1.0}
            assert wait_until(lambda: open_sessions(s) == (0, 0))

    try:
        asyncio.run(leave_after_one_chunk())
    finally:
        s.stop()


def test_a_client_process_killed_mid_stream_frees_the_sessions_and_ends_its_request(tiny_dir):
    """A client that dies (SIGKILL: no cancel sent, its connection just drops) is a client that
    left: the request stops there and both sessions close, rather than running on for nobody."""
    import signal
    import subprocess
    import sys

    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"])
    script = ("import sys\nfrom mirrorspec.client import Client\n"
              "with Client(sys.argv[1]) as client:\n"
              "    for chunk in client.stream([0, 1, 2], max_tokens=100):\n        pass\n")
    try:
        with targets_held(s):  # in flight, its prefill held
            client = subprocess.Popen([sys.executable, "-c", script, s.address])
            assert wait_until(lambda: open_sessions(s)[0] == 1, timeout=60)
            client.send_signal(signal.SIGKILL)
            client.wait()
            time.sleep(0.5)  # the front door sees the connection go while the request still waits
        assert wait_until(lambda: open_sessions(s) == (0, 0))
        assert counts_by_label(s.front.servicer.metrics.requests, "finish_reason") == {"cancelled": 1.0}
    finally:
        s.stop()


def test_deadline_frees_the_sessions_too(stack):
    with Client(stack.address, timeout_s=0.05) as client:
        with pytest.raises(grpc.RpcError) as err:
            for _ in client.stream([0, 1, 2], max_tokens=100):
                time.sleep(0.02)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: open_sessions(stack) == (0, 0))


@pytest.mark.parametrize("mirror", [False, True], ids=["serial", "mirror"])
def test_drafter_failure_mid_request_falls_back_without_losing_it(tiny_dir, mirror):
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=2)
    try:
        model = load(tiny_dir["target16"])
        with Client(s.address) as client:
            stream = client.stream([0, 7, 3], max_tokens=60, mirror=mirror)
            first = next(stream)
            s.drafter.stop(grace=0)  # the drafter replica dies mid-request (no grace for its streams)
            rest = list(stream)
        tokens = list(first.token_ids) + [t for c in rest for t in c.token_ids]
        assert tokens == target_only(model, [0, 7, 3], 60)
        assert rest[-1].finish_reason == "length" and rest[-1].stats.drafter_fallback
        assert rest[-1].stats.drafter_moves == 0  # with no drafter to move to, it never moved (a review)
    finally:
        s.drafters.clear()
        s.stop()


def compute_fails(server) -> None:
    """``server``'s compute raises from now on, as on a CUDA out-of-memory or device error: it
    answers INTERNAL, and its health check still says SERVING."""
    async def raising(session, fn, *args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (simulated)")
    server.servicer.lane.run_for = raising


@pytest.mark.parametrize("on_target", [False, True], ids=["front door windows", "windows on target"])
def test_a_target_whose_compute_fails_mid_request_hands_its_session_to_another(tiny_dir, on_target):
    """Its requests were lost (UNAVAILABLE "a backend answered INTERNAL"), though the other replica
    was healthy, and it was not reported failed, so every new request that tied onto it was lost
    too (a review's find). The session moves once, the replica is kept off for the cooldown, and a
    request whose compute fails where no other replica is free is its own failure: raised at once."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, target_replicas=2, windows_on_target=on_target,
                    failure_cooldown_s=600)  # the failed one stays off for the whole test
    targets = s.front.servicer.targets
    try:
        with Client(s.address) as client:
            stream = client.stream([0, 7, 3], max_tokens=40)
            first = next(stream)
            holder = next(address for address, sessions in targets.load().items() if sessions)
            compute_fails(next(t for t in s.targets if holder.endswith(f":{t.port}")))
            rest = list(stream)
            assert list(first.token_ids) + [t for c in rest for t in c.token_ids] == target_only(
                load(tiny_dir["target16"]), [0, 7, 3], 40)
            assert rest[-1].stats.target_moves == 1 and set(targets._failed_at) == {holder}
            assert client.generate([1, 2], max_tokens=4).stats.target_moves == 0  # new ones go to the other
            for target in s.targets:
                compute_fails(target)
            with pytest.raises(grpc.RpcError) as err:
                client.generate([1, 2], max_tokens=4)
            assert "CUDA out of memory" in err.value.details() and set(targets._failed_at) == {holder}
    finally:
        s.stop()


def test_a_request_whose_compute_fails_on_every_target_fails_having_put_one_replica_off(tiny_dir):
    """A failure that follows the request from replica to replica is the request's own: it moves
    once, and is raised on the second, rather than putting each replica of the pool off in turn."""
    s = start_stack(tiny_dir["target16"], strategy=None, target_replicas=3, failure_cooldown_s=600)
    try:
        for target in s.targets:
            compute_fails(target)
        with Client(s.address) as client, pytest.raises(grpc.RpcError) as err:
            client.generate([1, 2], max_tokens=4)
        assert "CUDA out of memory" in err.value.details()
        assert err.value.code() == grpc.StatusCode.INTERNAL  # not UNAVAILABLE, which says "retry"
        assert len(s.front.servicer.targets._failed_at) == 1
    finally:
        s.stop()


def test_a_target_whose_logits_hold_nan_fails_the_request_with_internal_naming_the_dtype(tmp_path):
    """Not UNAVAILABLE, which says "retry": a client that did would retry for ever (a docs review).
    The metrics count it under INTERNAL too."""
    import torch
    from transformers import AutoModelForCausalLM

    from support import save_tiny_llama

    path = save_tiny_llama(tmp_path / "nan-target", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[2, 0] = float("nan")
    model.save_pretrained(path)
    s = start_stack(path, strategy=None)
    try:
        with Client(s.address) as client, pytest.raises(grpc.RpcError) as err:
            client.generate([1, 2, 3], max_tokens=4)
        text = s.front.servicer.metrics.text()
    finally:
        s.stop()
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "the target model's logits hold NaN" in err.value.details() and "--dtype" in err.value.details()
    assert 'mirrorspec_request_errors_total{code="INTERNAL"} 1.0' in text


def test_a_drafter_that_answers_out_of_the_vocabulary_is_dropped_and_the_request_goes_on(tiny_dir, monkeypatch):
    """Its answer would reach the target (a runner-up is taken from the alternatives) and fail the
    request there with INVALID_ARGUMENT, blaming the client; refused at the front door, it turns
    drafting off instead, as a drafter that fails does."""
    import drafter_service.servicer as drafter_module

    honest = drafter_module._draft_response

    def out_of_vocabulary(proposal):
        response = honest(proposal)
        if response.alternatives:  # 16 is the runner-up now: the first of them after the draft
            ids = list(response.alternatives[0].ids)
            response.alternatives[0].ids[:] = [response.tokens[0], 16, *(t for t in ids if t != response.tokens[0])]
            del response.alternatives[0].probs[:]
        return response

    monkeypatch.setattr(drafter_module, "_draft_response", out_of_vocabulary)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=2, runner_up=True)
    try:
        with Client(s.address) as client:
            result = client.generate([0, 7, 3], max_tokens=20)
        assert list(result.token_ids) == target_only(load(tiny_dir["target16"]), [0, 7, 3], 20)
        assert result.stats.drafter_fallback and result.stats.drafted == 0
    finally:
        s.stop()


def test_expired_target_session_is_reopened_from_the_token_log(stack, tiny_dir):
    """Evicting the target session behind the orchestrator's back, as a TTL would."""
    model = load(tiny_dir["target16"])
    store = stack.target.servicer.sessions
    with Client(stack.address) as client:
        stream = client.stream([0, 9, 9, 1], max_tokens=40)
        first = next(stream)
        assert len(store) == 1
        for session_id in list(store._entries):
            store.close(session_id)
        rest = list(stream)
    tokens = list(first.token_ids) + [t for c in rest for t in c.token_ids]
    assert tokens == target_only(model, [0, 9, 9, 1], 40)


@pytest.mark.parametrize("kwargs,code,needle", [
    (dict(prompt=None), grpc.StatusCode.INVALID_ARGUMENT, "no input"),
    (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty"),
    (dict(prompt=[0, 99]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    (dict(prompt=[0, 1], temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature is NaN"),
    # logits / T overflowed float32: p was NaN and the target emitted token 0 forever, with OK
    (dict(prompt=[0, 1], temperature=1e-40), grpc.StatusCode.INVALID_ARGUMENT, "use 0 for greedy"),
    (dict(prompt=[0, 1], temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt=[0, 1], top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt=[0, 1], top_p=-0.1), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt=[0, 1], k=99), grpc.StatusCode.OUT_OF_RANGE, "num_speculative_tokens"),
    (dict(prompt=[0, 1], max_tokens=1000), grpc.StatusCode.OUT_OF_RANGE, "context window"),
    (dict(prompt=[0, 1] * 64, max_tokens=1), grpc.StatusCode.OUT_OF_RANGE, "leaves no room in the context window"),
    (dict(prompt=[0, 1], stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop strings"),
    (dict(prompt=[0, 1], stop_token_ids=[16]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids holds ids [16]"),
    (dict(prompt="hello"), grpc.StatusCode.INVALID_ARGUMENT, "no tokenizer"),
    (dict(prompt=[{"role": "user", "content": "hi"}]), grpc.StatusCode.INVALID_ARGUMENT, "instead of chat"),
    (dict(prompt=[0, 1], stop=["x"], max_tokens=3), grpc.StatusCode.INVALID_ARGUMENT, "stop strings need a tokenizer"),
    # it ran target-only and said nothing, as the CLI's --mirror --k 0 did (review of stop 60)
    (dict(prompt=[0, 1], k=0, mirror=True), grpc.StatusCode.INVALID_ARGUMENT,
     "mirror=true drafts the next window while the target verifies this one, and num_speculative_tokens=0 drafts"),
])
def test_bad_requests_get_clear_statuses_and_the_server_stays_up(stack, kwargs, code, needle):
    with Client(stack.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(**kwargs)
        assert err.value.code() == code and needle in err.value.details()
        assert open_sessions(stack) == (0, 0)  # refused before any session opened: none is left to its TTL
        assert client.generate([0, 1], max_tokens=3).token_ids  # still serving


def test_a_text_prompt_past_what_any_context_window_holds_is_refused_before_it_is_tokenized(padded_pair,
                                                                                            monkeypatch):
    """A 20 MB prompt held a request thread for ~20 s of tokenizing before the context window
    refused it (a review of stop 60)."""
    import orchestrator.servicer as servicer_module

    s = start_stack(padded_pair["target"], padded_pair["draft"], k=3)
    tokenized = []
    monkeypatch.setattr(servicer_module, "encode_prompt", lambda *a, **kw: tokenized.append(a) or [1, 2])
    try:
        with Client(s.address) as client:
            limit = 128 * servicer_module.MAX_PROMPT_CHARS_PER_TOKEN  # the tiny target's 128 positions
            too_long = "w1 " * (limit // 3 + 1)
            for prompt in (too_long, [{"role": "user", "content": too_long}]):
                with pytest.raises(grpc.RpcError) as err:
                    client.generate(prompt, max_tokens=3)
                assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
                assert f"holds {len(too_long):,} characters, more than the context window of 128 tokens" in \
                    err.value.details() and "send it as token_ids" in err.value.details()
            assert not tokenized
            assert client.generate("w1 " * (limit // 3), raw=True, max_tokens=3).token_ids  # at the limit: tokenized
            assert len(tokenized) == 1
    finally:
        s.stop()


def test_an_unset_max_tokens_is_the_default_cut_to_the_room_the_context_window_leaves(stack):
    """As vLLM does: a long prompt with no max_tokens was refused for the front door's own default
    (128), which the client never sent. One that is set is still refused where it does not fit."""
    with Client(stack.address) as client:
        served = client.generate([0, 1] * 50)  # 100 of the tiny target's 128 positions
        assert len(served.token_ids) == 28 and served.finish_reason == "length"
        assert len(client.generate([0, 1] * 60 + [2]).token_ids) == 7
        with pytest.raises(grpc.RpcError) as err:
            client.generate([0, 1] * 50, max_tokens=29)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "at most 28" in err.value.details()


def test_a_stop_string_ends_the_output_with_the_token_that_completes_it(padded_pair):
    """What generation.proto says of ``stop``: the output keeps the stop string (transformers'
    stop_strings do; OpenAI's API drops it), streamed and unary alike. Its stats count the tokens
    sent: the tokens of the window after the cut were counted as committed (a review's find)."""
    s = start_stack(padded_pair["target"], padded_pair["draft"], k=3)
    try:
        with Client(s.address) as client:
            free = client.generate("w1 w2", raw=True, max_tokens=30)
            words = free.text.split()
            stop = next(w for w in words[2:] if w != words[0])  # a word the output reaches after its start
            cut = words.index(stop) + 1
            stopped = client.generate("w1 w2", raw=True, max_tokens=30, stop=stop)
            assert stopped.finish_reason == "stop" and stopped.text.split() == words[:cut]
            assert list(stopped.token_ids) == list(free.token_ids)[:cut] and stopped.text.endswith(stop)
            chunks = list(client.stream("w1 w2", raw=True, max_tokens=30, stop=stop))
            assert "".join(c.text for c in chunks) == stopped.text and chunks[-1].finish_reason == "stop"
            for stats in (stopped.stats, chunks[-1].stats):  # the tokens cut off are not counted as sent
                assert stats.mean_accepted_length * stats.windows == pytest.approx(cut)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def target_stub(stack):
    return target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.target.port}"))


def q_frame(probs, ids=None):
    from mirrorspec.codec import encode_tensor
    import torch

    q = common_pb2.ProposalDistribution(probs=common_pb2.TensorFrame(frame=encode_tensor(torch.tensor(probs))))
    if ids is not None:
        q.ids.frame = encode_tensor(torch.tensor(ids, dtype=torch.int32))
    return q


@pytest.fixture(params=["Verify", "VerifyWindow", "VerifyWindows"])
def verify(request):
    """Every way to verify a window checks it the same way."""
    def call(stub, **fields):
        message = target_pb2.VerifyRequest(**fields)
        if request.param == "VerifyWindows":
            return list(stub.VerifyWindows(iter([message])))
        answer = getattr(stub, request.param)(message)
        return answer if request.param == "VerifyWindow" else list(answer)
    return call


@pytest.mark.parametrize("q,code,needle", [
    (q_frame([[0.5, 0.5]], [[3, 4]]), grpc.StatusCode.INVALID_ARGUMENT, None),  # 2 drafts, 1 row
    (q_frame([[float("nan"), 1.0], [0.5, 0.5]], [[3, 4], [3, 4]]), grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
    (q_frame([[-0.5, 1.5], [0.5, 0.5]], [[3, 4], [3, 4]]), grpc.StatusCode.INVALID_ARGUMENT, "negative"),
    (q_frame([[0.2, 0.2], [0.5, 0.5]], [[3, 4], [3, 4]]), grpc.StatusCode.INVALID_ARGUMENT, "sum to 1"),
    (common_pb2.ProposalDistribution(probs=common_pb2.TensorFrame(frame=b"junk")),
     grpc.StatusCode.INVALID_ARGUMENT, "tensor frame"),
])
def test_target_rejects_malformed_q(target_stub, verify, q, code, needle):
    sid = target_stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0, 1])).session_id
    try:
        with pytest.raises(grpc.RpcError) as err:
            verify(target_stub, session_id=sid, context_length=2, draft_tokens=[3, 4], q=q)
        assert err.value.code() == code
        assert needle is None or needle in err.value.details()
    finally:
        target_stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid))


@pytest.mark.parametrize("fields,needle", [
    (dict(runner_up=5), "at least one draft token"),
    (dict(draft_tokens=[3], runner_up=3), "is the first draft token itself"),
    (dict(draft_tokens=[3], runner_up=99), "outside the vocabulary"),
])
def test_target_rejects_a_malformed_runner_up(target_stub, verify, fields, needle):
    sid = target_stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0, 1])).session_id
    try:
        if "draft_tokens" in fields:
            fields["q"] = q_frame([[1.0]], [[fields["draft_tokens"][0]]])
        with pytest.raises(grpc.RpcError) as err:
            verify(target_stub, session_id=sid, context_length=2, **fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
    finally:
        target_stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid))


def test_target_session_errors(target_stub, verify):
    with pytest.raises(grpc.RpcError) as err:
        verify(target_stub, session_id="nope", context_length=2)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "OpenSession" in err.value.details()
    sid = target_stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0, 1])).session_id
    with pytest.raises(grpc.RpcError) as err:
        verify(target_stub, session_id=sid, commit_tokens=[5], context_length=7)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        verify(target_stub, session_id=sid, context_length=2, draft_tokens=list(range(16)) + [1])
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(grpc.RpcError) as err:
        target_stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert target_stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid)).existed


def test_drafter_session_errors(stack):
    stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.drafter.port}"))
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(drafter_pb2.DraftRequest(session_id="nope", k=2))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    sid = stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=[0, 1])).session_id
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(drafter_pb2.DraftRequest(session_id=sid, context_length=2, k=99))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    draft = stub.Draft(drafter_pb2.DraftRequest(session_id=sid, context_length=2, k=3))
    assert len(draft.tokens) == 3 and draft.q.ids.frame  # sparse q by default
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid))


def test_drafter_rewinds_a_session_for_a_branch(stack):
    """`keep` forks a drafter session a few tokens back (a mirror branch): the draft is then the
    one a fresh session on that context gives (q up to float rounding: a rolled-back KV cache and a
    fresh prefill sum in different orders)."""
    stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.drafter.port}"))
    params = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=8)

    def open_on(prompt):
        return stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=prompt, params=params,
                                                                    seed=11)).session_id

    forked = open_on([0, 1, 2])
    stub.Draft(drafter_pb2.DraftRequest(session_id=forked, context_length=3, k=3))
    branch = stub.Draft(drafter_pb2.DraftRequest(session_id=forked, keep=2, commit_tokens=[9], context_length=3, k=3))
    fresh = stub.Draft(drafter_pb2.DraftRequest(session_id=open_on([0, 1, 9]), context_length=3, k=3))
    assert list(branch.tokens) == list(fresh.tokens)
    q_branch, q_fresh = (proposal_from_proto(d.tokens, d.q, 16).q.dense(16, "cpu") for d in (branch, fresh))
    assert torch.allclose(q_branch, q_fresh, atol=1e-6)
    assert len(branch.alternatives) == 3 and all(a.ids for a in branch.alternatives)
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(drafter_pb2.DraftRequest(session_id=forked, keep=7, context_length=7, k=1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "keep=7" in err.value.details()
    for call, branches in ((stub.Draft, []), (stub.DraftBranches, [1, 2])):  # INTERNAL from the model before
        with pytest.raises(grpc.RpcError) as err:
            call(drafter_pb2.DraftRequest(session_id=forked, keep=0, context_length=0, k=1, branch_tokens=branches))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "would hold no tokens" in err.value.details()
    again = stub.Draft(drafter_pb2.DraftRequest(session_id=forked, context_length=3, k=3))  # refusals changed nothing
    assert list(again.tokens) == list(branch.tokens)



def test_drafter_drafts_branches_that_fork_at_one_point_together(stack):
    """DraftBranches: one call (one batched forward per step) for every branch token; each draft
    is the one a fresh session on its own context gives, and the session stays at the fork."""
    stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.drafter.port}"))
    params = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=8)

    def open_on(prompt):
        return stub.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=prompt, params=params,
                                                                    seed=5)).session_id

    sid = open_on([0, 1])
    together = stub.DraftBranches(drafter_pb2.DraftRequest(session_id=sid, commit_tokens=[2], context_length=3,
                                                           k=3, branch_tokens=[9, 4, 9]))
    assert len(together.drafts) == 3 and together.drafts[0] == together.drafts[2]
    for token, draft in zip([9, 4], together.drafts):
        alone = stub.Draft(drafter_pb2.DraftRequest(session_id=open_on([0, 1, 2, token]), context_length=4, k=3))
        assert list(draft.tokens) == list(alone.tokens)
        q_together, q_alone = (proposal_from_proto(d.tokens, d.q, 16).q.dense(16, "cpu") for d in (draft, alone))
        assert torch.allclose(q_together, q_alone, atol=1e-6)
    assert stub.Draft(drafter_pb2.DraftRequest(session_id=sid, commit_tokens=[9], context_length=4, k=2)).tokens
    for tokens, code in (([], grpc.StatusCode.OUT_OF_RANGE), ([99], grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as err:
            stub.DraftBranches(drafter_pb2.DraftRequest(session_id=sid, context_length=4, k=2, branch_tokens=tokens))
        assert err.value.code() == code and "branch_tokens" in err.value.details()


@pytest.fixture(scope="module")
def mirror_stack(tiny_dir, near_draft16_dir):
    """Mirror on by default, every branch drafted whatever the timing: branch counts are then
    reproducible, and the test does not depend on how fast this machine is. Windows offer their
    runner-up too, as `mirrorspec serve` does by default. The draft agrees with the target now and
    then: the random draft16 is rejected at its first draft almost always, so seeded output did
    not depend on what branches drafted (branches drafted with the wrong seed passed)."""
    s = start_stack(tiny_dir["target16"], near_draft16_dir, k=3, mirror=MirrorConfig(stop_at_verdict=False),
                    runner_up=True)
    yield s
    s.stop()


def test_mirror_over_the_network_is_identical_to_target_only_and_to_serial(mirror_stack, tiny_dir):
    """The orchestrator overlaps the Verify RPC with the branches' Draft RPCs; a branch is taken by
    its key alone, so greedy output is target-only's and seeded samples are serial's, runner-up
    windows included (a runner-up's win has branches of its own)."""
    model = load(tiny_dir["target16"])
    hits = runner_up_hits = 0
    with Client(mirror_stack.address) as client:
        for prompt in prompts(4, seed=3):
            served = client.generate(prompt, max_tokens=24)
            assert served.token_ids == target_only(model, prompt, 24)
            s = served.stats
            # every window branches; the last one too where a verdict it guessed would have left room
            assert 0 < s.windows - 1 <= s.mirror_windows <= s.windows
            assert 0 < s.branches_drafted <= 4 * s.mirror_windows and s.mean_k == pytest.approx(s.drafted / s.windows)
            hits += s.branch_hits
            for seed in (1, 2):
                mirrored = client.generate(prompt, max_tokens=24, temperature=1.0, seed=seed)
                serial = client.generate(prompt, max_tokens=24, temperature=1.0, seed=seed, mirror=False)
                assert mirrored.token_ids == serial.token_ids
                assert mirrored.stats.mirror_windows > 0 and serial.stats.mirror_windows == 0
                assert mirrored.stats.runner_up_hits == serial.stats.runner_up_hits
                hits += mirrored.stats.branch_hits
                runner_up_hits += mirrored.stats.runner_up_hits
    assert hits > 0  # branches were really used, not just drafted
    assert runner_up_hits > 0  # and runner-ups won windows beside them
    with Client(mirror_stack.address) as client:
        traced = client.generate([0, 4, 2], max_tokens=16, timeline=True).stats
        untraced = client.generate([0, 4, 2], max_tokens=16).stats
        assert not untraced.timeline  # only when asked
        hits += traced.branch_hits + untraced.branch_hits  # the metric counts every request's
    spans = [(span.what, span.start_s, span.end_s) for span in traced.timeline]
    verifies = [s for s in spans if s[0] == "verify"]
    assert len(verifies) == traced.windows and all(0 <= start <= end for _, start, end in spans)
    # mirror: each window's branch drafting lies inside that window, between the submit of its
    # verify and the next window's start. Whether the two spans overlap is up to the scheduler (a
    # loaded machine can finish a tiny verify before the drafting thread wakes), so only what
    # causality fixes is asserted; the overlap itself is what `mirrorspec bench`'s timeline shows.
    windows = spans_by_window(spans)
    assert len(windows) == traced.windows
    assert sum(any(what == "branches" for what, _, _ in w) for w in windows) == traced.mirror_windows
    for earlier, later in zip(windows, windows[1:]):
        assert max(end for _, _, end in earlier) <= min(start for _, start, _ in later)
    metrics = mirror_stack.front.servicer.metrics
    assert metrics.branch_hits._value.get() == hits and "mirrorspec_mirror_windows_total" in metrics.text()


def spans_by_window(spans: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """Timeline spans grouped per window: an optional fresh "draft", its "verify", then its
    "branches" when it was mirrored (the order the engine records them in)."""
    windows: list[list[tuple[str, float, float]]] = []
    for span in spans:
        opens_window = span[0] == "draft" or (span[0] == "verify" and not (windows and windows[-1][-1][0] == "draft"))
        if opens_window or not windows:
            windows.append([])
        windows[-1].append(span)
    return windows


SUB_VOCABULARY = [0, 1, 2, 3, 5, 8, 13]


@pytest.fixture(scope="module")
def draft16_with_sub_vocabulary(tiny_dir, tmp_path_factory):
    from mirrorspec.drafting.draft_model import DRAFT_VOCAB_KEY

    model = load(tiny_dir["draft16"])
    setattr(model.config, DRAFT_VOCAB_KEY, SUB_VOCABULARY)
    path = tmp_path_factory.mktemp("draft16-sub")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("sub_vocabulary", [False, True], ids=["full-vocabulary", "sub-vocabulary"])
def test_a_target_with_a_hint_layer_streams_hints_before_the_verdict(tiny_dir, draft16_with_sub_vocabulary,
                                                                     sub_vocabulary):
    """Verify(hints=true) streams the early-exit hint first; mirror requests steer their branches
    with it, and the output stays target-only's (greedy) and serial's (seeded). A target told the
    draft's sub-vocabulary hints from those ids alone."""
    draft = draft16_with_sub_vocabulary if sub_vocabulary else tiny_dir["draft16"]
    s = start_stack(tiny_dir["target16"], draft, k=3, hint_layer=1, hint_vocab=str(draft) if sub_vocabulary else None,
                    mirror=MirrorConfig(stop_at_verdict=False))
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{s.target.port}"))
        assert stub.Info(common_pb2.InfoRequest()).hint_layer == 1
        sid = stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0, 3])).session_id
        events = list(stub.Verify(target_pb2.VerifyRequest(session_id=sid, context_length=2, draft_tokens=[5, 1],
                                                           q=q_frame([[1.0], [1.0]], [[5], [1]]), hints=True)))
        assert [e.WhichOneof("event") for e in events] == ["hint", "verdict"]
        assert events[0].hint.layer == 1 and len(events[0].hint.rows) == 3
        assert all(len(row.ids) == 4 and sorted(row.probs, reverse=True) == list(row.probs)
                   for row in events[0].hint.rows)
        hinted = {i for row in events[0].hint.rows for i in row.ids}
        assert (hinted <= set(SUB_VOCABULARY)) == sub_vocabulary  # this target hints outside it otherwise
        model = load(tiny_dir["target16"])
        with Client(s.address) as client:
            for prompt in prompts(3, seed=5):
                assert client.generate(prompt, max_tokens=20).token_ids == target_only(model, prompt, 20)
                mirrored = client.generate(prompt, max_tokens=20, temperature=1.0, seed=3)
                assert mirrored.token_ids == client.generate(prompt, max_tokens=20, temperature=1.0, seed=3,
                                                             mirror=False).token_ids
    finally:
        s.stop()


@pytest.mark.parametrize("strategy", ["draft-model", "ngram"])  # ngram: drafted at the front door
def test_speculation_pauses_while_the_front_door_is_saturated(tiny_dir, strategy):
    """Past speculation_off_above requests in flight, windows go without drafts (vLLM's
    speculative_disable_by_batch_size); the output is the same, and drafting resumes after."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"] if strategy == "draft-model" else None,
                    strategy=strategy, k=3, speculation_off_above=1)
    try:
        with Client(s.address) as client:
            alone = client.generate([0, 6, 1], max_tokens=20)
            s.front.servicer.in_flight += 1  # one more request in flight: past the limit of 1
            try:
                busy = client.generate([0, 6, 1], max_tokens=20)
            finally:
                s.front.servicer.in_flight -= 1
            again = client.generate([0, 6, 1], max_tokens=20)
        assert alone.token_ids == busy.token_ids == again.token_ids
        assert alone.stats.drafted > 0 and alone.stats.speculation_paused_windows == 0
        assert busy.stats.drafted == 0 and busy.stats.speculation_paused_windows == busy.stats.windows - 1
        assert again.stats.drafted == alone.stats.drafted
        assert s.front.servicer.metrics.paused_windows._value.get() == busy.stats.speculation_paused_windows
        if strategy == "draft-model":  # documented: a seeded sampled request's paused windows are K = 0 ones
            sampled = dict(max_tokens=20, temperature=1.0, seed=5)
            with Client(s.address) as client:
                alone = client.generate([0, 6, 1], **sampled)
                s.front.servicer.in_flight += 1
                try:
                    busy = client.generate([0, 6, 1], **sampled)
                finally:
                    s.front.servicer.in_flight -= 1
                k0 = client.generate([0, 6, 1], k=0, **sampled)
                assert client.generate([0, 6, 1], **sampled).token_ids == alone.token_ids
            assert busy.token_ids == k0.token_ids and busy.stats.drafted == 0
    finally:
        s.stop()


def test_session_limit_is_resource_exhausted(tiny_dir):
    s = start_stack(tiny_dir["target16"], strategy=None, target_max_sessions=1)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{s.target.port}"))
        stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0]))
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-sessions" in err.value.details()
        with Client(s.address) as client, pytest.raises(grpc.RpcError) as err:
            client.generate([0, 1], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        s.stop()


def test_a_request_the_target_refuses_leaves_no_drafter_session_behind(tiny_dir):
    """The drafter's session opens while the target's does; when the target refuses, the
    drafter's session must be closed rather than left to its TTL."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], target_max_sessions=1)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{s.target.port}"))
        stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0]))
        with Client(s.address) as client, pytest.raises(grpc.RpcError) as err:
            client.generate([0, 1], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "raise the replicas' --max-sessions" in (
            err.value.details())
        assert open_sessions(s) == (1, 0)
    finally:
        s.stop()


def test_health_and_reflection_on_every_server(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {stack.front.port: "mirrorspec.v1.GenerationService",
                stack.target.port: "mirrorspec.v1.TargetService",
                stack.drafter.port: "mirrorspec.v1.DrafterService"}
    for port, service in expected.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # left open, its threads lived on
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            reply = next(reflection.ServerReflectionInfo(iter([request])))
            assert service in {s.name for s in reply.list_services_response.service}


def test_a_front_door_with_no_target_it_can_use_answers_its_health_check_not_serving(tiny_dir):
    """It answered SERVING while every target was failed or frozen, and a request sent there waited
    for one (review 2). A load balancer now sends requests elsewhere until a target is back."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], failure_cooldown_s=3.0)
    check = health_pb2_grpc.HealthStub(grpc.insecure_channel(s.address)).Check
    status = lambda: check(health_pb2.HealthCheckRequest(), timeout=5).status  # noqa: E731
    try:
        pool, (address,) = s.front.servicer.targets, s.front.servicer.targets.addresses
        replica = pool.acquire()
        pool.release(replica)
        pool.report_failure(replica)  # as a session does when its target stops answering
        assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=10)  # cooled down
        pool.set_members([])
        assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        pool.set_members([address])
        assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=5)
        with Client(s.address) as client:
            assert len(client.generate([0, 7, 3], max_tokens=4).token_ids) == 4
    finally:
        s.stop()


@pytest.mark.slow
def test_a_front_door_whose_only_target_is_down_stays_not_serving_past_the_cooldown(tiny_dir):
    """Once the failure's cooldown ended it answered SERVING again while the target was still down,
    and a load balancer sent it requests that could only fail (a review of stop 60). Now it says
    NOT_SERVING while the target's connection fails, and SERVING once one answers at the address."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mirrorspec.serving.server import BackgroundServer
    from target_service.servicer import TargetConfig
    from target_service.servicer import serve as serve_target

    s = start_stack(tiny_dir["target16"], None, strategy=None, k=0, failure_cooldown_s=1.0)
    check = health_pb2_grpc.HealthStub(grpc.insecure_channel(s.address)).Check
    status = lambda: check(health_pb2.HealthCheckRequest(), timeout=5).status  # noqa: E731
    back = None
    try:
        (address,) = s.front.servicer.targets.addresses
        s.targets[0].stop()
        with Client(s.address) as client, pytest.raises(grpc.RpcError) as err:
            client.generate([0, 7, 3], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        time.sleep(3)  # three cooldowns
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert "cannot be reached" in s.front.servicer.unready()
        port = int(address.rsplit(":", 1)[1])
        back = BackgroundServer(lambda: serve_target(TargetConfig(model=str(tiny_dir["target16"]), port=port)),
                                "target").start()
        assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=20)
        with Client(s.address) as client:
            assert len(client.generate([0, 7, 3], max_tokens=4).token_ids) == 4
    finally:
        s.stop()
        if back is not None:
            back.stop()


def test_metrics_count_drafts_like_vllm(stack):
    with Client(stack.address) as client:
        client.generate([0, 5], max_tokens=10, k=3)
    text = stack.front.servicer.metrics.text()
    for name in ("mirrorspec_spec_decode_num_drafts_total", "mirrorspec_spec_decode_num_draft_tokens_total",
                 "mirrorspec_spec_decode_num_accepted_tokens_total", "mirrorspec_time_to_first_token_seconds"):
        assert name in text


def test_async_client(stack):
    async def run():
        client = AsyncClient(stack.address)
        whole = await client.generate([0, 3], max_tokens=12, temperature=1.0, seed=2)
        streamed = [t async for c in client.stream([0, 3], max_tokens=12, temperature=1.0, seed=2) for t in c.token_ids]
        await client.close()
        return whole.token_ids, streamed

    whole, streamed = asyncio.run(run())
    assert whole == streamed and len(whole) == 12


def test_an_async_client_made_before_its_event_loop_serves_each_loop_that_uses_it_in_turn(stack, tiny_dir):
    """grpc.aio binds a channel to the loop it is made on: a client made at module level, before
    ``asyncio.run``, failed every call with "attached to a different loop" (a user's review)."""
    import threading

    client = AsyncClient(stack.address)

    async def run():
        return (await client.generate([0, 3], max_tokens=6)).token_ids

    first, second = asyncio.run(run()), asyncio.run(run())  # the second loop: a new channel
    assert first == second == target_only(load(tiny_dir["target16"]), [0, 3], 6)
    running, done = threading.Event(), threading.Event()

    async def hold():  # the client's loop runs on in another thread
        await client.model_info()
        running.set()
        while not done.is_set():
            await asyncio.sleep(0.01)
        await client.close()

    holder = threading.Thread(target=asyncio.run, args=(hold(),))
    holder.start()
    try:
        assert running.wait(30)
        with pytest.raises(InvalidRequest, match="make one AsyncClient per event loop"):
            asyncio.run(run())
    finally:
        done.set()
        holder.join()


@pytest.mark.slow
@pytest.mark.parametrize("windows_on_target, mirror", [(False, False), (True, False), (True, True)],
                         ids=["front door", "on target", "mirror on target"])
def test_sampled_output_through_the_network_follows_the_exact_distribution(tiny_dir, windows_on_target, mirror):
    """A smaller statistical test over gRPC: sparse q crosses the wire, rejection runs remotely
    (with the windows run by the front door, or by the target calling the drafter itself, with
    branches of each next window drafted beside each verify or not). 1,500 requests each (about
    60 ms a request on CI: 3,000 made these three 10 of the suite's minutes). What it is here for,
    a q or a coin mangled on the way, shows far sooner: on this case in process, 1,500 samples
    reject a q that is not the one drafted from at p = 0 and a residual of p at p = 1e-40. The
    fine-grained proofs are the in-process ones (test_engine_exactness.py, 10,000 samples)."""
    s = start_stack(tiny_dir["target"], tiny_dir["draft"], proposal_top_k=3, k=3, windows_on_target=windows_on_target,
                    mirror=MirrorConfig() if mirror else None)
    try:
        prompt = [0, 3, 5, 2]
        expected = exact_joint(MemoSession(load(tiny_dir["target"])), prompt, 2, temperature=1.0)
        with Client(s.address) as client:
            done = [client.generate(prompt, max_tokens=4, temperature=1.0, seed=seed) for seed in range(1500)]
        samples = [tuple(d.token_ids[:2]) for d in done]
        assert chi_square_pvalue(samples, expected) > 1e-4
        # branches drafted beside verifies on the target. They seldom feed the second token: that
        # takes a rejection of the first draft whose sampled recovery a runner-up guessed (0 of 300
        # requests in a run). Branch-fed windows are held to serial's tokens, seed for seed, by
        # test_windows_on_target.py, which asserts hits.
        assert (sum(d.stats.mirror_windows for d in done) > 0) == mirror
        assert all(d.stats.windows_on_target == (d.stats.windows if windows_on_target else 0) for d in done)
    finally:
        s.stop()


def test_a_runner_up_front_door_keeps_greedy_output_and_takes_runner_ups(tiny_dir):
    """``serve`` (runner-up on by default): windows offer the drafter's runner-up over the wire; greedy output
    stays target-only's, seeded sampled output is reproducible, and runner-ups win in both; mirror
    requests verify chains (no runner-up hits)."""
    model = load(tiny_dir["target16"])
    stack = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, runner_up=True)
    hits = 0
    try:
        with Client(stack.address) as client:
            for prompt in prompts(8, seed=11):
                served = client.generate(prompt, max_tokens=24)
                assert served.token_ids == target_only(model, prompt, 24)
                hits += served.stats.runner_up_hits
            mirrored = client.generate([0, 4, 2], max_tokens=16, mirror=True)
            sampled = [client.generate(prompt, max_tokens=24, temperature=1.0, seed=3)
                       for prompt in prompts(8, seed=11)]
            again = client.generate(prompts(1, seed=11)[0], max_tokens=24, temperature=1.0, seed=3)
    finally:
        stack.stop()
    assert hits > 0
    assert mirrored.token_ids == target_only(model, [0, 4, 2], 16) and mirrored.stats.runner_up_hits == 0
    assert sum(s.stats.runner_up_hits for s in sampled) > 0 and again.token_ids == sampled[0].token_ids


@pytest.mark.parametrize("windows_on_target", [False, True], ids=["front door", "on target"])
def test_seeded_sampled_runner_up_requests_draw_the_in_process_tokens(tiny_dir, windows_on_target):
    """Randomness is addressed by (seed, position), so a seeded sampled request served with
    runner-ups draws exactly what the in-process engine draws with the same sparse q: the second
    round of rejection sampling runs in the target server on the same uniforms, whether the front
    door runs the windows or the target does, asking the drafter itself."""
    target, draft = load(tiny_dir["target16"]), load_as_served_draft(tiny_dir["draft16"])
    stack = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, runner_up=True, proposal_top_k=4,
                        windows_on_target=windows_on_target)
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    try:
        with Client(stack.address) as client:
            pairs = [(client.generate(prompt, max_tokens=24, temperature=1.0, seed=seed),
                      generate(target, draft, prompt, params, num_speculative_tokens=3, seed=seed, proposal_top_k=4,
                               runner_up=True)) for seed, prompt in enumerate(prompts(8, seed=11))]
    finally:
        stack.stop()
    assert all(served.token_ids == local.token_ids for served, local in pairs)
    assert all(served.stats.windows_on_target == (served.stats.windows if windows_on_target else 0)
               for served, _ in pairs)
    assert [s.stats.runner_up_hits for s, _ in pairs] == [local.stats.runner_up_hits for _, local in pairs]
    assert sum(local.stats.runner_up_hits for _, local in pairs) > 0


@pytest.mark.parametrize("address, says", [
    ("127.0.0.1:1", "no target server answered Info at 127.0.0.1:1 within 1 s (127.0.0.1:1: DEADLINE_EXCEEDED"),
    ("drafter", ": UNIMPLEMENTED"),  # a drafter's address given as a target's
])
def test_a_front_door_whose_backend_does_not_answer_names_the_setting(stack, address, says):
    address = f"127.0.0.1:{stack.drafters[0].port}" if address == "drafter" else address
    with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
        asyncio.run(_backend_info("target", [address], target_pb2_grpc.TargetServiceStub, wait_s=1.0))
    assert err.value.field == "target"


def test_a_front_door_starts_and_serves_where_the_first_replica_of_each_pool_is_down(stack, tiny_dir, caplog):
    """Only the first replica of a pool was asked to describe it: a front door whose list named a
    lost replica first (as one restarted with a membership that still lists it) waited 60 s and
    refused to start, the one that answers never asked (a failure-injection review). It now logs
    the replicas that had not answered (it said nothing of them: a review of stop 60)."""
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import serve

    down = "127.0.0.1:1"
    front = OrchestratorConfig(target=f"{down},127.0.0.1:{stack.targets[0].port}",
                               drafter=f"{down},127.0.0.1:{stack.drafters[0].port}", port=0)
    with BackgroundServer(lambda: serve(front)) as door, Client(f"127.0.0.1:{door.port}", timeout_s=60) as client:
        served = client.generate([0, 7, 3], max_tokens=12)
    assert list(served.token_ids) == target_only(load(tiny_dir["target16"]), [0, 7, 3], 12)
    for pool in ("target", "drafter"):
        assert f"{pool} {down} has not answered yet (starting, or down)" in caplog.text


@pytest.mark.parametrize("field, value", [("target", "127.0.0.1"), ("drafter", "http://127.0.0.1:50062"),
                                          ("target", "127.0.0.1:70000")])
def test_a_front_door_address_that_is_not_host_port_is_refused_at_once(field, value):
    config = {"target": "127.0.0.1:50061", "drafter": None, field: value}
    with pytest.raises(InvalidRequest, match="expected host:port") as err:
        OrchestratorConfig(**config)
    assert err.value.field == field


@pytest.mark.parametrize("drafter, k", [(dict(strategy="ngram"), 8), (dict(strategy="draft-model"), 4),
                                         (dict(strategy="draft-model", draft_confidence=0.5), 8), (None, 4)],
                         ids=["ngram", "draft-model", "draft-model-confident", "no-drafter"])
def test_a_front_door_not_told_its_k_drafts_the_window_the_cli_would(tiny_dir, drafter, k):
    """``python -m orchestrator`` and a Ray stack start a front door with no K of their own: it
    takes the one ``mirrorspec serve`` picks (config.default_k) for the drafters it finds, which
    now tell their confidence cut. Before, such a front door drafted 4 for an n-gram pool."""
    from drafter_service.servicer import DrafterConfig
    from mirrorspec.cli.local_stack import start_local_stack
    from mirrorspec.config import default_k
    from target_service.servicer import TargetConfig

    config = None if drafter is None else DrafterConfig(**drafter, model=str(tiny_dir["draft16"])
                                                        if drafter["strategy"] == "draft-model" else None)
    s = start_local_stack(TargetConfig(model=str(tiny_dir["target16"])), config, port=0)
    try:
        with Client(s.address) as client:
            assert client.model_info().default_num_speculative_tokens == k
            if config is not None:
                assert k == default_k(config.strategy == "draft-model", config.draft_confidence)
                stub = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{s.drafter.port}"))
                assert stub.Info(common_pb2.InfoRequest()).draft_confidence == config.draft_confidence
            prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2 + [1, 2, 3]  # a strong match, 8+ tokens long
            served = client.generate(prompt, max_tokens=12)
            assert served.token_ids == target_only(load(tiny_dir["target16"]), prompt, 12)
            longest = len(served.stats.per_position_acceptance)  # the longest window's drafts
            if config is None:
                assert longest == 0
            elif config.draft_confidence > 0:  # its windows end at the first unsure token
                assert 1 <= longest <= k
            else:  # the lookup matches 8+ tokens; the model drafts K whatever it believes
                assert longest == k
    finally:
        s.stop()


def test_a_front_door_started_with_no_drafter_takes_the_k_of_the_pool_it_is_given_later(tiny_dir):
    """A Ray stack scaled up from no drafter: the front door settled its K (4) once, at start,
    and kept it when an n-gram pool came, which then drafted 4-token windows for good. Then the
    first request after they came still drafted 4 (its K was taken before its drafters were
    asked to describe themselves: review of stop 55), and ModelInfo said 4 until a request ran.
    Both now follow the pool from the moment it is there."""
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter
    from mirrorspec.cli.local_stack import start_local_stack
    from mirrorspec.serving.server import BackgroundServer
    from target_service.servicer import TargetConfig

    s = start_local_stack(TargetConfig(model=str(tiny_dir["target16"])), None, port=0)
    ngram = BackgroundServer(lambda: serve_drafter(DrafterConfig(strategy="ngram")), "drafter").start()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2 + [1, 2, 3]  # a strong match, 8+ tokens long
    try:
        with Client(s.address) as client:
            assert client.model_info().default_num_speculative_tokens == 4
            s.front.servicer.drafters.set_members([f"127.0.0.1:{ngram.port}"])
            served = client.generate(prompt, max_tokens=12)  # the first request the pool is there for
            assert served.token_ids == target_only(load(tiny_dir["target16"]), prompt, 12)
            assert len(served.stats.per_position_acceptance) == 8  # the longest window drafted 8
            assert client.model_info().default_num_speculative_tokens == 8
        s.front.servicer.drafter_info = None  # a front door that has not asked its pool yet
        with Client(s.address) as client:
            info = client.model_info()
            assert (info.drafter_strategy, info.default_num_speculative_tokens) == ("ngram", 8)
    finally:
        s.stop()
        ngram.stop()


def test_a_finished_request_closes_its_target_and_drafter_sessions_at_once(tiny_dir, monkeypatch):
    """The answer waits for both closes (a client that reads the replicas next finds the sessions
    gone), and they go out together: one round trip, where the target's close was waited for
    before the drafter's went. Here the target answers its close only once the drafter's has
    arrived, or after 3 s, within the close's own 5 s deadline: in turn, the drafter's would
    only go once the target's had answered."""
    from drafter_service.servicer import DrafterServicer
    from target_service.servicer import TargetServicer

    drafter_closing = threading.Event()
    target_saw_it = []
    close_target, close_drafter = TargetServicer.CloseSession, DrafterServicer.CloseSession

    async def target_close_waits_for_the_drafters(self, request, context):
        target_saw_it.append(await asyncio.to_thread(drafter_closing.wait, 3))
        return await close_target(self, request, context)

    async def drafter_close_says_so(self, request, context):
        drafter_closing.set()
        return await close_drafter(self, request, context)

    monkeypatch.setattr(TargetServicer, "CloseSession", target_close_waits_for_the_drafters)
    monkeypatch.setattr(DrafterServicer, "CloseSession", drafter_close_says_so)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"])
    try:
        with Client(s.address) as client:
            served = client.generate([1, 2, 3, 4], max_tokens=8)
        assert served.stats.drafted > 0 and not served.stats.drafter_fallback
        assert target_saw_it == [True]
        assert len(s.target.servicer.sessions) == 0 and len(s.drafter.servicer.sessions) == 0
    finally:
        s.stop()


@pytest.mark.parametrize("fails", ["drafter", "target"])
def test_a_session_whose_close_cannot_start_leaves_the_other_closed_and_let_go(tiny_dir, monkeypatch, fails):
    """At a request's end both sessions' closes start, then are waited for. Started in turn as
    arguments, a drafter close that raised (its channel closed as the front door stopped) left the
    target's close, already sent, unawaited and its replica held (review of stop 55). Now the
    other session is closed and its replica let go, and the request fails with the error."""
    from orchestrator.remote import RemoteDrafter, RemoteVerifier

    cls = RemoteDrafter if fails == "drafter" else RemoteVerifier

    def cannot_start(self):
        # the stream half-closes first, as in start_letting_go (left open, gRPC's thread that feeds
        # it waited on its queue for good: one of the threads the suite's census found alive at exit)
        getattr(self, "session", self)._close_stream()
        raise ValueError("Cannot invoke RPC on closed channel!")

    monkeypatch.setattr(cls, "start_release", cannot_start)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"])
    front = s.front.servicer
    try:
        with Client(s.address) as client:
            with pytest.raises(grpc.RpcError):
                client.generate([1, 2, 3, 4], max_tokens=8)
        other, pool = (s.target, front.targets) if fails == "drafter" else (s.drafter, front.drafters)
        assert len(other.servicer.sessions) == 0 and set(pool.load().values()) == {0}
    finally:
        s.stop()


def test_a_front_door_refuses_a_drafter_whose_vocabulary_is_not_the_targets(stack, tiny_dir):
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import serve

    config = DrafterConfig(strategy="draft-model", model=str(tiny_dir["draft"]))  # vocab 8; the target's is 16
    with BackgroundServer(lambda: serve_drafter(config)) as drafter:
        front = OrchestratorConfig(target=f"127.0.0.1:{stack.targets[0].port}", drafter=f"127.0.0.1:{drafter.port}",
                                   port=0)
        with pytest.raises(InvalidRequest, match=r"the draft's vocabulary \(8 ids\) differs from the target's \(16\)") as err:
            asyncio.run(serve(front))
    assert err.value.field == "drafter"


def test_a_chat_with_an_unknown_role_is_refused_over_the_wire(tiny_dir):
    """The front door encodes chats with the tokenizer it was given (here the demo target's, over
    a tiny target): a role the template would print verbatim is INVALID_ARGUMENT, not a prompt."""
    s = start_stack(tiny_dir["target16"], strategy=None, tokenizer="demo-target")
    try:
        with Client(s.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate([{"role": "usr", "content": "hi"}], max_tokens=3)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "chat message 0 has role 'usr'; use one of system, user" in err.value.details()
    finally:
        s.stop()


def test_an_error_that_quotes_a_long_input_keeps_its_status_and_message(tiny_dir):
    """A message over gRPC's metadata limit lost both before: the client got RESOURCE_EXHAUSTED
    "received metadata size exceeds hard limit". The message is cut, and the server serves on."""
    s = start_stack(tiny_dir["target16"], strategy=None, tokenizer="demo-target")
    try:
        with Client(s.address) as client:
            for role in ("u" * 20000, "\u00e9" * 20000):  # 2 bytes each, percent-encoded to 6
                with pytest.raises(grpc.RpcError) as err:
                    client.generate([{"role": role, "content": "hi"}], max_tokens=3)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith("chat message 0 has role")
                assert err.value.details().endswith("(message cut at 2000 bytes)")
            target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{s.targets[0].port}"))
            with pytest.raises(grpc.RpcError) as err:
                list(target.Verify(target_pb2.VerifyRequest(session_id="s" * 100000, context_length=3)))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert err.value.details().startswith("unknown session 'sss")
            assert len(client.generate([1, 2, 3], max_tokens=3).token_ids) == 3
    finally:
        s.stop()


def test_a_drafter_pool_that_joins_later_is_described_by_a_replica_that_can_draft(stack, tiny_dir):
    """A front door started without drafters asks the pool that joins later for its Info. A
    replica that does not answer, or drafts another vocabulary, is passed over for the next one;
    before, every request asked that same replica again and went without drafts."""
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import serve
    from support import free_port

    other_vocab = DrafterConfig(strategy="draft-model", model=str(tiny_dir["draft"]))  # vocab 8; the target's 16
    front = OrchestratorConfig(target=f"127.0.0.1:{stack.targets[0].port}", drafter=None, port=0)
    with BackgroundServer(lambda: serve_drafter(other_vocab)) as wrong, BackgroundServer(lambda: serve(front)) as door:
        door.servicer.drafters.set_members([f"127.0.0.1:{free_port()}", f"127.0.0.1:{wrong.port}",
                                            f"127.0.0.1:{stack.drafters[0].port}"])
        with Client(f"127.0.0.1:{door.port}") as client:
            completion = client.generate([0, 7, 3], max_tokens=20)
        assert door.servicer.drafter_info.model.vocab_size == 16
    assert completion.stats.drafted > 0 and not completion.stats.drafter_fallback


def test_an_n_gram_drafter_pool_that_joins_later_drafts_too(stack):
    """An n-gram replica's Info carries no model: it was checked as a model of 0 ids, refused as
    another vocabulary, and the front door never drafted with the pool."""
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import serve

    front = OrchestratorConfig(target=f"127.0.0.1:{stack.targets[0].port}", drafter=None, port=0,
                               front_door_lookup=False)
    with (BackgroundServer(lambda: serve_drafter(DrafterConfig(strategy="ngram"))) as ngram,
          BackgroundServer(lambda: serve(front)) as door):
        door.servicer.drafters.set_members([f"127.0.0.1:{ngram.port}"])
        with Client(f"127.0.0.1:{door.port}") as client:
            completion = client.generate([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=20)
        assert door.servicer.drafter_info is not None
    assert completion.stats.drafted > 0 and not completion.stats.drafter_fallback


def test_a_target_restarted_at_its_own_address_serves_the_request_that_waited_for_it(tiny_dir):
    """A single-target deployment whose target restarts on the same host:port. Its address used to
    be avoided for the rest of the request, which then waited out replacement_wait_s and failed
    UNAVAILABLE although the target was back; now it is kept off for the pool's failure cooldown."""
    import threading

    from mirrorspec.serving.server import BackgroundServer
    from target_service.servicer import TargetConfig
    from target_service.servicer import serve as serve_target

    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], replacement_wait_s=30)
    restarted = []
    try:
        port = s.targets[0].port
        s.targets[0].stop()
        config = TargetConfig(model=str(tiny_dir["target16"]), host="127.0.0.1", port=port)

        def restart():
            time.sleep(1.0)
            restarted.append(BackgroundServer(lambda: serve_target(config), "target").start())

        thread = threading.Thread(target=restart)
        thread.start()
        with Client(s.address, timeout_s=60) as client:
            completion = client.generate([0, 7, 3], max_tokens=20)
        thread.join()
        assert completion.token_ids == target_only(load(tiny_dir["target16"]), [0, 7, 3], 20)
    finally:
        s.stop()
        for server in restarted:
            server.stop()


def test_a_drafter_that_hangs_costs_a_request_its_drafter_timeout_not_its_budget(tiny_dir, caplog):
    """Drafter calls had the request's whole budget as their deadline: a hung drafter stalled each
    request for up to 120 s, and failed one whose client set a deadline, though the target was
    well. Here its compute lane is stuck for 5 s: the request goes on target-only at once."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], drafter_timeout_s=0.5)
    try:
        with Client(s.address, timeout_s=30) as client:
            assert not client.generate([0, 7, 3], max_tokens=4).stats.drafter_fallback
            s.drafters[0].servicer.lane.later(time.sleep, 5.0)
            completion = client.generate([0, 7, 3], max_tokens=20)
    finally:
        s.stop()
    assert completion.token_ids == target_only(load(tiny_dir["target16"]), [0, 7, 3], 20)
    assert completion.stats.drafter_fallback
    assert "drafter failed (DEADLINE_EXCEEDED" in caplog.text


def test_a_target_that_hangs_mid_request_is_left_and_the_session_moves(tiny_dir, caplog):
    """A target replica whose compute lane is stuck (a stopped process, a wedged GPU) held every
    window to the request's whole budget, was never reported, and so failed this request and every
    later one routed to it while the other replica idled. Now a window past ``window_timeout_s``
    marks it failed, and the session replays on the other replica, token-identical."""
    prompt = [0, 7, 3]
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], target_replicas=2, window_timeout_s=0.5)
    try:
        with Client(s.address, timeout_s=60) as client:
            tokens, stats = [], None
            for i, message in enumerate(client.stream(prompt, max_tokens=40, k=2)):
                if i == 0:  # stall the replica that holds the session, mid-request
                    (hung,) = [t for t in s.targets if len(t.servicer.sessions)]
                    hung.servicer.lane.later(time.sleep, 5.0)
                tokens += message.token_ids
                stats = message.stats if message.finish_reason else stats
            # later requests go to the healthy replica (the hung one is in its failure cooldown)
            later = client.generate(prompt, max_tokens=8)
    finally:
        s.stop()
    assert tokens == target_only(load(tiny_dir["target16"]), prompt, 40)
    assert stats.target_moves >= 1
    assert "is hung; replaying the session elsewhere" in caplog.text
    assert later.token_ids == tokens[:8] and later.stats.target_moves == 0


def test_a_session_leaving_a_hung_target_reopens_before_the_replica_answers_its_close(tiny_dir, monkeypatch, caplog):
    """A replica that hangs whole (a stopped process) answers no close either: the move waited
    out the close's 5 s deadline before it reopened the session elsewhere, on top of the window
    timeout (review of stop 55). Here the hung replica answers the close only once the session
    has reopened on the other one: it must not have to wait, nor time out."""
    import logging

    from target_service.servicer import TargetServicer

    caplog.set_level(logging.INFO, logger="orchestrator.pool")
    prompt, hung, reopened = [0, 7, 3], [], threading.Event()
    close, open_session = TargetServicer.CloseSession, TargetServicer.OpenSession

    async def answers_once_reopened(self, request, context):
        if self in hung:
            await asyncio.to_thread(reopened.wait, 30)
        return await close(self, request, context)

    async def says_when_reopened(self, request, context):
        if hung and self not in hung:
            reopened.set()
        return await open_session(self, request, context)

    monkeypatch.setattr(TargetServicer, "CloseSession", answers_once_reopened)
    monkeypatch.setattr(TargetServicer, "OpenSession", says_when_reopened)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], target_replicas=2, window_timeout_s=0.5)
    try:
        with Client(s.address, timeout_s=60) as client:
            tokens, stats = [], None
            for i, message in enumerate(client.stream(prompt, max_tokens=40, k=2)):
                if i == 0:
                    (replica,) = [t for t in s.targets if len(t.servicer.sessions)]
                    hung.append(replica.servicer)
                    replica.servicer.lane.later(time.sleep, 3.0)
                tokens += message.token_ids
                stats = message.stats if message.finish_reason else stats
        assert wait_until(lambda: len(hung[0].sessions) == 0)  # closed there all the same
    finally:
        reopened.set()
        s.stop()
    assert tokens == target_only(load(tiny_dir["target16"]), prompt, 40)
    assert stats.target_moves >= 1 and reopened.is_set()
    assert "closing session" not in caplog.text  # the close was answered, not timed out


def test_a_slow_deferred_prefill_is_not_taken_for_a_hung_target(tiny_dir, monkeypatch, caplog):
    """A target-only request defers its prefill to its first window, which then commits no tokens
    but prefills the whole prompt: it was held to window_timeout_s, and a healthy target taken for
    hung (reported failed, the session replayed, 5 s of cooldown with one target)."""
    from mirrorspec.models.session import KVSession

    prompt = [i % 16 for i in range(100)]
    alone = target_only(load(tiny_dir["target16"]), prompt, 8)
    forward = KVSession.forward

    def slow_prefill(self, input_ids, cache, num_positions, **masking):
        if input_ids.shape[-1] > 64:  # the prefill of this target takes 1.5 s
            time.sleep(1.5)
        return forward(self, input_ids, cache, num_positions, **masking)

    monkeypatch.setattr(KVSession, "forward", slow_prefill)
    s = start_stack(tiny_dir["target16"], strategy=None, window_timeout_s=1.0)
    try:
        with Client(s.address, timeout_s=60) as client:
            completion = client.generate(prompt, max_tokens=8)
    finally:
        s.stop()
    assert completion.token_ids == alone and completion.stats.target_moves == 0
    assert "is hung" not in caplog.text


def test_a_request_cancelled_while_it_waits_for_a_target_lets_go_of_its_drafter_session_at_once(tiny_dir):
    """With the only target down, a request waits up to replacement_wait_s for it to come back.
    A client that left during that wait kept its drafter session and a front-door worker for the
    whole wait (here 30 s): clients that cancel and retry through an outage piled them up."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], replacement_wait_s=30)
    drafter = s.drafters[0].servicer
    try:
        s.targets[0].stop()
        with Client(s.address, timeout_s=60) as client:
            call = client.stream([0, 7, 3], max_tokens=8)
            assert wait_until(lambda: len(drafter.sessions) == 1)  # opened while the target is awaited
            time.sleep(0.3)
            call.cancel()
            assert wait_until(lambda: len(drafter.sessions) == 0, timeout=5)
    finally:
        s.stop()


@pytest.mark.parametrize("settings, field, says", [
    (dict(max_speculative_tokens=0), "max_speculative_tokens", "max_speculative_tokens must be in [1, 64], got 0"),
    (dict(max_speculative_tokens=65, num_speculative_tokens=4), "max_speculative_tokens", "in [1, 64], got 65"),
    (dict(num_speculative_tokens=17), "num_speculative_tokens", "(K) must be in [0, 16], got 17"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens", "must be in [0, 16], got -1"),
], ids=["no room, K left to the drafters", "ceiling too high", "K over the ceiling", "K negative"])
def test_a_front_door_k_or_its_ceiling_out_of_range_is_refused_at_start(settings, field, says):
    """A ceiling of 0 with K left to the drafters started a front door whose every request then
    failed on it (review of stop 55)."""
    with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
        OrchestratorConfig(target="127.0.0.1:50061", drafter=None, **settings)
    assert err.value.field == field


@pytest.mark.parametrize("field", ["backend_timeout_s", "drafter_timeout_s", "window_timeout_s", "failure_cooldown_s"])
@pytest.mark.parametrize("value", [0.0, float("nan")])
def test_a_front_door_timeout_must_be_positive(field, value):
    with pytest.raises(InvalidRequest, match="must be > 0 seconds") as err:
        OrchestratorConfig(target="127.0.0.1:50061", drafter=None, **{field: value})
    assert err.value.field == field


@pytest.mark.parametrize("requests", [0, 4097, 2.5])
def test_a_front_door_request_thread_count_out_of_range_is_refused_at_start(requests):
    """0 failed in ThreadPoolExecutor as a bare ValueError, naming no setting."""
    with pytest.raises(InvalidRequest, match="max_concurrent_requests must be a whole number from 1 to 4096") as err:
        OrchestratorConfig(target="127.0.0.1:50061", drafter=None, max_concurrent_requests=requests)
    assert err.value.field == "max_concurrent_requests"


def test_a_front_door_stops_at_the_eos_ids_of_its_targets_generation_config(tiny_dir, tmp_path):
    """As `generate --local` does. The front door took EOS from its tokenizer alone (here there is
    none): an instruct model whose end of turn is in its generation config alone (Llama 3's
    <|eot_id|>) ran on to max_tokens when served, and said "length". With ignore_eos it runs on;
    the stop ids the request names still stop it."""
    from support import save_tiny_llama

    reference = target_only(load(tiny_dir["target16"]), [0, 7, 3], 20)
    eos = reference[5]
    # the same weights (target16's seed and shape), with an EOS list in its generation config
    target = save_tiny_llama(tmp_path / "target", seed=2, vocab=16, layers=2, eos_token_id=[eos, 99 % 16])
    s = start_stack(target, tiny_dir["draft16"])
    try:
        with Client(s.address) as client:
            completion = client.generate([0, 7, 3], max_tokens=20)
            past_eos = client.generate([0, 7, 3], max_tokens=20, ignore_eos=True)  # vLLM's, for timing
            stopped_by_id = client.generate([0, 7, 3], max_tokens=20, ignore_eos=True, stop_token_ids=reference[8])
    finally:
        s.stop()
    first_stop = min(reference.index(t) for t in (eos, 99 % 16) if t in reference)
    assert completion.token_ids == reference[:first_stop + 1]
    assert completion.finish_reason == "stop"
    assert past_eos.token_ids == reference and past_eos.finish_reason == "length"
    assert stopped_by_id.token_ids == reference[:reference.index(reference[8]) + 1]


@pytest.mark.parametrize("proposal_top_k", [0, 4], ids=["dense-q", "sparse-q"])
def test_a_drafter_with_a_narrower_table_and_the_targets_tokenizer_serves_token_identically(padded_pair,
                                                                                            proposal_top_k):
    """Qwen2.5's shape over the wire: the front door checks the two tokenizers, widens the
    drafter's dense q for the target, and opens drafter sessions that take the target's padding
    ids (this answer holds 13, 14 and 15), which the draft is fed as id 0. Before, the front door
    refused the drafter; had it not, each padding id would have been INVALID_ARGUMENT at the drafter."""
    prompt = [1, 1]
    alone = target_only(load(padded_pair["target"]), prompt, 24)
    assert {13, 14, 15} <= set(alone)
    s = start_stack(padded_pair["target"], padded_pair["draft"], proposal_top_k=proposal_top_k, quantize="none")
    try:
        with Client(s.address) as client:
            served = client.generate(prompt, max_tokens=24, k=4)
        assert served.token_ids == alone
        assert not served.stats.drafter_fallback
        assert served.stats.drafted > 0 and served.stats.accepted > 0
    finally:
        s.stop()


def test_a_narrower_drafter_that_looks_up_itself_may_copy_the_targets_padding_ids(padded_pair):
    """With the lookup left to the drafter (front_door_lookup=False), its lookup copies a context id
    past its own table (13): the front door checked sparse q ids against the draft's table, and the
    request fell back to target-only. Sparse ids are the target's; only dense rows are the draft's width."""
    prompt = [1, 1, 13, 14, 1, 1, 13]
    alone = target_only(load(padded_pair["target"]), prompt, 24)
    s = start_stack(padded_pair["target"], padded_pair["draft"], quantize="none", prompt_lookup=1,
                    front_door_lookup=False)
    try:
        with Client(s.address) as client:
            served = client.generate(prompt, max_tokens=24, k=4)
    finally:
        s.stop()
    assert served.token_ids == alone
    assert not served.stats.drafter_fallback and served.stats.drafted > 0


@pytest.mark.parametrize("windows_on_target", [False, True], ids=["front door", "on target"])
def test_a_narrower_drafters_dense_q_is_taken_sampled_with_its_own_lookup_and_on_the_target(padded_pair,
                                                                                           windows_on_target):
    """Sampled, so q goes dense (greedy q is one-hot, sparse): a target running the windows refused
    the draft table's 12 columns and sent each run back to the front door, and a replica's own lookup
    that copied padding id 13 into a window made its dense rows 14 wide, which the front door refused
    and turned drafting off for (review of stop 60). Both still served exact output, target-only."""
    prompt = [1, 1, 13, 14, 1, 1, 13]
    s = start_stack(padded_pair["target"], padded_pair["draft"], proposal_top_k=0, quantize="none", prompt_lookup=1,
                    front_door_lookup=False, windows_on_target=windows_on_target)
    try:
        with Client(s.address) as client:
            served = [client.generate(prompt, max_tokens=24, k=4, temperature=1.0, seed=seed) for seed in range(4)]
    finally:
        s.stop()
    assert all(len(c.token_ids) == 24 and not c.stats.drafter_fallback for c in served)
    assert sum(c.stats.drafted for c in served) > 0 and sum(c.stats.accepted for c in served) > 0
    if windows_on_target:
        assert all(c.stats.windows_on_target == c.stats.windows for c in served)


def test_a_front_door_refuses_a_narrower_drafter_whose_tokenizer_is_not_the_targets(padded_pair):
    with pytest.raises(InvalidRequest, match=r"the draft's vocabulary \(12 ids\) differs from the target's \(16\), "
                                             r"and their tokenizers are not known to be one") as err:
        start_stack(padded_pair["target"], padded_pair["stranger"], quantize="none")
    assert err.value.field in ("drafter", "draft")


@pytest.mark.parametrize("busy", ["target", "drafter"])
def test_a_client_whose_own_deadline_runs_out_behind_a_busy_replica_keeps_no_request_off_it(tiny_dir, monkeypatch,
                                                                                              busy):
    """A client that gave up behind a busy (healthy) replica had it reported failed: with one
    replica per pool, every request of the next 5 s then waited out its cooldown (target) or went
    without drafts for its whole life (drafter); and the request was counted as an "error" where
    the backend's copy of the client's deadline fired first."""
    from orchestrator.pool import ReplicaPool

    excluded = []
    report_failure = ReplicaPool.report_failure
    monkeypatch.setattr(ReplicaPool, "report_failure", lambda pool, replica: (excluded.append(pool.name),
                                                                             report_failure(pool, replica)))
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3)
    try:
        metrics = s.front.servicer.metrics
        with Client(s.address) as client:
            client.generate([1, 2, 3], max_tokens=4)
        for _ in range(3):
            lane = (s.targets if busy == "target" else s.drafters)[0].servicer.lane
            lane.later(time.sleep, 0.6)  # other sessions' work, as a prefill of a long prompt
            with Client(s.address, timeout_s=0.3) as impatient:
                try:  # behind a busy drafter it may finish target-only in time
                    impatient.generate([1, 2, 3], max_tokens=40)
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            time.sleep(0.5)  # the replica is idle again
            with Client(s.address, timeout_s=4) as client:  # less than the failure cooldown (5 s)
                after = client.generate([1, 2, 3, 4, 5], max_tokens=20)
            assert after.token_ids == target_only(load(tiny_dir["target16"]), [1, 2, 3, 4, 5], 20)
            assert after.stats.drafted > 0 and not after.stats.drafter_fallback
        assert excluded == []
        reasons = counts_by_label(metrics.requests, "finish_reason")
        assert reasons.get("error", 0) == 0
        if busy == "target":
            assert reasons["deadline_exceeded"] == 3  # not "cancelled": the client did not leave, it timed out
    finally:
        s.stop()


def test_a_lone_hung_drafter_is_kept_off_so_later_requests_go_target_only_at_once(tiny_dir, monkeypatch):
    """Drafts are optional: a drafter that had its whole drafter timeout and did not answer is
    excluded for the cooldown, rather than cost every later request that timeout again (only
    marking it slow did, with no other drafter to prefer)."""
    from orchestrator.pool import ReplicaPool

    excluded = []
    report_failure = ReplicaPool.report_failure
    monkeypatch.setattr(ReplicaPool, "report_failure", lambda pool, replica: (excluded.append(pool.name),
                                                                             report_failure(pool, replica)))
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, drafter_timeout_s=1.5)
    released = threading.Event()
    try:
        s.drafters[0].servicer.lane.later(released.wait, 120)  # wedged
        with Client(s.address, timeout_s=60) as client:
            completions = [client.generate([1, 2, 3, 4, 5], max_tokens=20) for _ in range(3)]
        expected = target_only(load(tiny_dir["target16"]), [1, 2, 3, 4, 5], 20)
        assert all(c.token_ids == expected and c.stats.drafter_fallback for c in completions)
        assert excluded == ["drafter"]  # once: the later requests did not ask it again
    finally:
        released.set()
        s.stop()


def test_a_hung_drafter_among_two_is_left_by_the_requests_after_the_first(tiny_dir):
    """Its calls time out at half the client's budget; later requests draft on the other one."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, drafter_replicas=2)
    released = threading.Event()
    try:
        with Client(s.address) as client:
            client.generate([1, 2, 3], max_tokens=4)
        s.drafters[0].servicer.lane.later(released.wait, 120)  # wedged
        s.drafters[1].servicer.lane.later(time.sleep, 0.0)
        completions = []
        with Client(s.address, timeout_s=4) as client:
            for _ in range(4):
                completions.append(client.generate([1, 2, 3, 4, 5], max_tokens=20))
        expected = target_only(load(tiny_dir["target16"]), [1, 2, 3, 4, 5], 20)
        assert all(c.token_ids == expected for c in completions)
        assert sum(c.stats.drafter_fallback for c in completions) <= 1  # only a request that met the hung one
        assert all(c.stats.drafted > 0 for c in completions[-2:])
    finally:
        released.set()
        s.stop()


def start_front_door_process(stack, *flags: str):
    """`python -m orchestrator` over ``stack``'s target and drafter: (process, its port)."""
    import subprocess
    import sys

    targets, drafters = (getattr(stack.front.servicer, pool).addresses[0] for pool in ("targets", "drafters"))
    front = subprocess.Popen([sys.executable, "-m", "orchestrator", "--target", targets, "--drafter", drafters,
                              "--port", "0", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return front, int(front.stdout.readline().rsplit(" ", 1)[1])


def test_a_front_door_process_exits_once_its_grace_has_passed_though_a_backend_call_still_blocks(stack):
    """The gRPC server stopped after the grace, but the process lived on until the request's
    blocked backend call returned (a slow or hung target: as long as its timeouts), and a service
    manager would kill it (review 3)."""
    import signal

    release = threading.Event()
    stack.target.servicer.lane._pool.submit(release.wait, 120)
    front, port = start_front_door_process(stack, "--shutdown-grace", "1")
    opened = len(stack.target.servicer.sessions)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            # no drafts: the session opens without its prefill, and the first window, which brings
            # it, is the call the held target holds
            stream = client.stream([0, 7, 3], max_tokens=60, k=0)
            assert wait_until(lambda: len(stack.target.servicer.sessions) == opened + 1)
            front.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as ended:
                list(stream)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "its shutdown grace (1 s) ran out; send the request again" in ended.value.details()
        _, err = front.communicate(timeout=30)  # while the target still holds the call
        assert front.returncode == 0 and not release.is_set()
        assert "unreachable" not in err  # the calls the stop cancelled are not blamed on the target
        # and the request's session on the target is closed: it held a session slot for ten minutes
        assert len(stack.target.servicer.sessions) == opened
    finally:
        release.set()
        front.kill()
        front.wait()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_front_door_process_stopped_mid_request_finishes_it_and_refuses_new_ones(stack, tiny_dir, sig):
    """`python -m orchestrator` under a service manager: SIGTERM killed it, and its streams with it."""
    import signal

    front, port = start_front_door_process(stack, "--shutdown-grace", "20")
    opened = len(stack.target.servicer.sessions)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            with targets_held(stack):
                stream = client.stream([0, 7, 3], max_tokens=60)
                # in flight, its prefill held (a session an earlier test's stopped process left may be open)
                assert wait_until(lambda: len(stack.target.servicer.sessions) == opened + 1)
                front.send_signal(getattr(signal, sig))
                time.sleep(1.0)
                with pytest.raises(grpc.RpcError) as refused:
                    client.generate([1, 2], max_tokens=2)
            chunks = list(stream)
        _, err = front.communicate(timeout=60)
    finally:
        front.kill()
        front.wait()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "this front door is stopping" in refused.value.details()  # not a bare "connection refused"
    assert [t for c in chunks for t in c.token_ids] == target_only(load(tiny_dir["target16"]), [0, 7, 3], 60)
    assert chunks[-1].finish_reason == "length" and front.returncode == 0
    assert "orchestrator stopping: new calls are refused, those in flight have 20 s to finish" in err


@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
def test_a_drain_that_ends_as_a_request_finishes_still_sends_its_answer(stack, tiny_dir, streamed):
    """A request counted as in flight only while its windows ran. A drain that saw it end stopped
    the server before the handler's answer (the stream's last chunk, with its finish reason) went
    out, and the client got UNAVAILABLE "Cancelling all calls" for a finished request (CI of stop
    51, on a SIGINT'ed front door process). Here the handler takes 1 s after its windows."""
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import serve

    front = OrchestratorConfig(target=f"127.0.0.1:{stack.targets[0].port}", drafter=None, port=0)
    results = {}
    with BackgroundServer(lambda: serve(front)) as door, Client(f"127.0.0.1:{door.port}", timeout_s=60) as client:
        windows = door.servicer._run

        async def windows_then_a_pause(*args):
            async for tokens in windows(*args):
                yield tokens
            await asyncio.sleep(1.0)
        door.servicer._run = windows_then_a_pause

        def send():
            try:
                results["tokens"] = ([t for c in client.stream([0, 7, 3], max_tokens=8) for t in c.token_ids]
                                     if streamed else list(client.generate([0, 7, 3], max_tokens=8).token_ids))
            except grpc.RpcError as err:
                results["error"] = f"{err.code()}: {err.details()}"
        worker = threading.Thread(target=send)
        worker.start()
        assert wait_until(lambda: door.servicer.in_flight == 1, timeout=30, every=0.01)
        door.stop(grace=20)
        worker.join(timeout=60)
    assert "error" not in results, results["error"]
    assert results["tokens"] == target_only(load(tiny_dir["target16"]), [0, 7, 3], 8)


def test_requests_still_in_flight_when_the_grace_runs_out_are_told_so(stack):
    """Running or queued for a worker, they got gRPC's UNAVAILABLE "Cancelling all calls" as the
    server stopped, which says neither that the front door stopped nor what to do (a soak review).
    Here one request runs, held on the target, and one waits for the front door's only worker."""
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import serve

    front = OrchestratorConfig(target=f"127.0.0.1:{stack.targets[0].port}", drafter=None, port=0,
                               max_concurrent_requests=1)
    errors = []
    with targets_held(stack), BackgroundServer(lambda: serve(front)) as door:
        client = Client(f"127.0.0.1:{door.port}", timeout_s=60)

        def send(call):
            try:
                call()
            except grpc.RpcError as err:
                errors.append(err)
        senders = [threading.Thread(target=send, args=(lambda: client.generate([0, 7, 3], max_tokens=8),)),
                   threading.Thread(target=send, args=(lambda: list(client.stream([0, 7, 3], max_tokens=8)),))]
        for sender in senders:
            sender.start()
        assert wait_until(lambda: door.servicer.in_flight == 2, timeout=30, every=0.01)
        door.stop(grace=1)
        for sender in senders:
            sender.join(timeout=30)
        client.close()
    assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert all("this front door stopped before the request finished: its shutdown grace (1 s) ran out"
               in e.details() for e in errors), [e.details() for e in errors]


def test_a_client_pinging_every_second_keeps_a_call_that_sends_nothing_for_seconds(stack, tiny_dir):
    """Servers take a client's pings as often as every second (``MIN_KEEPALIVE_S``): gRPC's default
    takes one per five minutes without data, and answered a client that pinged more often, during
    a call quiet for a while (a long prefill, a busy target), with GOAWAY, failing the call."""
    results = []
    with Client(stack.address, keepalive_s=1.0) as client:
        with targets_held(stack):
            worker = threading.Thread(target=lambda: results.append(client.generate([0, 7, 3], max_tokens=12)))
            worker.start()
            time.sleep(5)  # the call is in flight, and nothing moves on it
        worker.join(timeout=30)
    assert list(results[0].token_ids) == target_only(load(tiny_dir["target16"]), [0, 7, 3], 12)


def test_a_front_door_s_mirror_requests_start_from_what_the_last_one_learnt(tiny_dir, monkeypatch):
    """Each request's branch policy starts from the last finished one's (``BranchHistory``), so a
    short request does not spend its first windows learning what the last one already knew."""
    import orchestrator.servicer as front_door

    made = record_instances(monkeypatch, front_door, "MirrorPipeline", lambda p: (p.history, p.policy.verify_s.count))
    two_mirror_requests(tiny_dir["target16"], tiny_dir["draft16"])
    [(history, blank), (again, resumed)] = made
    assert history is again is not None
    assert blank == 0 and resumed > 0  # the second request started with the first one's verify times


def test_a_request_is_tokenized_off_the_event_loop_and_a_drain_begun_meanwhile_lets_it_finish(padded_pair,
                                                                                             monkeypatch):
    """A 2.8k-token chat prompt took 14.5 ms of the demo tokenizer on the front door's event loop,
    which every other stream's next window waited out: it is tokenized in a thread of its own, and
    the front door answers meanwhile. The request is in flight from its admission on, so a drain
    that begins while it is tokenized waits for it, rather than stopping the server under it."""
    from support import HeldTokenizing

    held, results = HeldTokenizing(monkeypatch), {}
    s = start_stack(padded_pair["target"], strategy=None)
    try:
        def send():
            try:
                with Client(s.address, timeout_s=60) as client:
                    results["text"] = client.generate("w1 w2", raw=True, max_tokens=4).text
            except grpc.RpcError as err:
                results["error"] = f"{err.code()}: {err.details()}"
        worker = threading.Thread(target=send)
        worker.start()
        assert held.entered.wait(30)
        with Client(s.address, timeout_s=10) as other:
            assert other.model_info().target.vocab_size == 16  # the loop answers while the prompt is tokenized
        stopping = threading.Thread(target=lambda: s.front.stop(grace=20))
        stopping.start()
        assert wait_until(lambda: s.front.servicer.draining, timeout=10, every=0.01)
        assert s.front.servicer.busy()  # the drain waits for it (it stopped the server after FLUSH_S)
        held.release.set()
        worker.join(timeout=60)
        stopping.join(timeout=60)
    finally:
        held.release.set()
        s.stop()
    assert "error" not in results, results["error"]
    assert results["text"] and [name.split("_")[0] for name in held.threads] == ["prepare"]


def test_the_unary_text_is_the_streamed_texts_with_a_tokenizer_that_cleans_up_spaces(tmp_path):
    """transformers' clean-up of a whole decode (" 's" -> "'s", BERT-style tokenizers) is not one
    of its pieces: the unary text had it and the streamed deltas could not add up to it (a review's
    find). Both decode by one rule (``decode_text``), without it."""
    from transformers import AutoTokenizer

    from support import save_tiny_llama, save_wordpiece_tokenizer

    words = "I don't think O'Brien's dog can't run. Hello , world ! Is it ? Yes, it's fine; we'll see. "
    vocab = len(AutoTokenizer.from_pretrained(save_wordpiece_tokenizer(tmp_path / "words", words)))
    target = save_wordpiece_tokenizer(save_tiny_llama(tmp_path / "target", seed=3, vocab=vocab, logit_scale=0.5),
                                      words)
    s = start_stack(target, strategy=None)
    try:
        with Client(s.address) as client:
            prompt = AutoTokenizer.from_pretrained(target).encode("o ' brien ' s", add_special_tokens=False)
            done = client.generate(prompt, max_tokens=100, seed=1, temperature=1.0)  # an output with " ' "s
            streamed = "".join(chunk.text for chunk in client.stream(prompt, max_tokens=100, seed=1, temperature=1.0))
    finally:
        s.stop()
    assert done.text == streamed
    assert AutoTokenizer.from_pretrained(target).decode(done.token_ids, skip_special_tokens=True) != done.text
