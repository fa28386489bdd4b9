"""Windows run on the target (``windows_on_target``): the target asks the drafter for each window's
drafts itself. Same outputs as the front door's own loop, the same failures survived. (Seeded
sampled requests drawing the in-process tokens, and the network chi-square test, run both ways in
test_generation_service.)"""

import asyncio
import random
import threading
import time

import grpc
import pytest

from mirrorspec import SamplingParams, generate
from mirrorspec.adaptive import AdaptiveK
from mirrorspec.client import Client
from mirrorspec.config import AdaptiveKConfig
from mirrorspec.serving.convert import adaptive_to_proto
from mirrorspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, target_pb2, target_pb2_grpc
from served_stack import start_stack, targets_held, two_mirror_requests
from support import load, load_as_served_draft, record_instances, wait_until
from target_service.servicer import TargetServicer


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(16) for _ in range(rng.randint(1, 10))] for _ in range(count)]


def target_only(model, prompt, max_tokens):
    return generate(model, None, prompt, SamplingParams(max_new_tokens=max_tokens)).token_ids


def sessions(server, stub) -> int:
    return stub(grpc.insecure_channel(f"127.0.0.1:{server.port}")).Info(common_pb2.InfoRequest()).open_sessions


@pytest.fixture
def slow_verify(monkeypatch):
    """Every verify takes 50 ms longer: runs last long enough for deadlines, TTLs and freezes."""
    from mirrorspec.engine import TargetVerifier

    verify = TargetVerifier.verify

    def slowed(self, *args, **kwargs):
        time.sleep(0.05)
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(TargetVerifier, "verify", slowed)


@pytest.fixture(scope="module")
def stack(tiny_dir):
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, windows_on_target=True)
    yield s
    s.stop()


@pytest.mark.parametrize("runner_up", [False, True])
def test_greedy_output_is_identical_to_target_only_and_every_window_runs_on_the_target(tiny_dir, runner_up):
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, windows_on_target=True, runner_up=runner_up)
    try:
        with Client(s.address) as client:
            results = [client.generate(prompt, max_tokens=24, k=[1, 3, 5][i % 3])
                       for i, prompt in enumerate(prompts(6))]
    finally:
        s.stop()
    for prompt, result in zip(prompts(6), results):
        assert list(result.token_ids) == target_only(model, prompt, 24)
        assert result.finish_reason == "length" and not result.stats.drafter_fallback
        assert result.stats.windows_on_target == result.stats.windows > 0
        assert result.stats.drafted > 0 and result.stats.network_time_s > 0  # the draft calls' network
    assert (sum(r.stats.runner_up_hits for r in results) > 0) == runner_up


@pytest.mark.parametrize("runner_up", [False, True])
def test_mirror_on_the_target_is_identical_to_target_only_and_to_serial(tiny_dir, near_draft16_dir, runner_up):
    """The target has the drafter draft branches of the next window beside each verify, and takes
    the one the verdict names by its key alone: greedy output is target-only's, and seeded samples
    are the serial run's (and the in-process engine's), token for token. The draft agrees with the
    target now and then (against the random draft16, rejected at its first draft almost always,
    seeded output did not depend on what branches drafted)."""
    from mirrorspec.config import MirrorConfig

    model, draft = load(tiny_dir["target16"]), load_as_served_draft(near_draft16_dir)
    # eight branches: room for the rejections' guesses beside "all accepted"; every window
    # branches, so the hits do not hang on the policy's reading of the timings
    s = start_stack(tiny_dir["target16"], near_draft16_dir, k=3, windows_on_target=True, runner_up=runner_up,
                    mirror=MirrorConfig(max_branches=8, stop_at_verdict=False))
    hits = 0
    try:
        with Client(s.address) as client:
            for prompt in prompts(4, seed=5):
                served = client.generate(prompt, max_tokens=24)
                assert list(served.token_ids) == target_only(model, prompt, 24)
                st = served.stats
                assert st.windows_on_target == st.windows and 0 < st.mirror_windows < st.windows
                assert 0 < st.branches_drafted <= 8 * st.mirror_windows and st.draft_time_off_path_s > 0
                hits += st.branch_hits
                for seed in (1, 2):
                    mirrored = client.generate(prompt, max_tokens=24, temperature=1.0, seed=seed)
                    serial = client.generate(prompt, max_tokens=24, temperature=1.0, seed=seed, mirror=False)
                    assert mirrored.token_ids == serial.token_ids and serial.stats.mirror_windows == 0
                    expected = generate(model, draft, prompt, SamplingParams(temperature=1.0, max_new_tokens=24),
                                        num_speculative_tokens=3, seed=seed, proposal_top_k=4, runner_up=runner_up)
                    assert list(mirrored.token_ids) == expected.token_ids
                    hits += mirrored.stats.branch_hits
    finally:
        s.stop()
    assert hits > 0  # branches were used, not only drafted


# K swings over [0, 4] on the near draft: windows target-only, probes, and longer windows where it agrees
ADAPTIVE = AdaptiveKConfig(draft_cost=0.2, probe_every=8)


def adaptive_in_process(model, draft, prompt, seed, temperature=1.0, max_tokens=40):
    return generate(model, draft, prompt, SamplingParams(temperature=temperature, max_new_tokens=max_tokens),
                    num_speculative_tokens=4, seed=seed, proposal_top_k=4, adaptive=ADAPTIVE)


@pytest.mark.parametrize("mirror", [False, True])
def test_adaptive_k_on_the_target_chooses_each_window_s_k_as_the_engine_does(tiny_dir, near_draft16_dir, mirror):
    """The target runs the request's adaptive K, and the front door follows it window by window:
    every window runs on the target, and each drafts the K the in-process engine drafts there, so
    seeded samples are the engine's token for token (K changes which draws a position takes). With
    mirror, branches are drafted with the K their window will ask for (``AdaptiveK.peek``)."""
    from mirrorspec.config import MirrorConfig

    model, draft = load(tiny_dir["target16"]), load_as_served_draft(near_draft16_dir)
    s = start_stack(tiny_dir["target16"], near_draft16_dir, k=4, windows_on_target=True, adaptive=ADAPTIVE,
                    mirror=MirrorConfig() if mirror else None)
    drafted = windows = hits = branched = switched_off = 0
    try:
        with Client(s.address) as client:
            for prompt in prompts(3, seed=7):
                greedy = client.generate(prompt, max_tokens=40)
                assert list(greedy.token_ids) == target_only(model, prompt, 40)
                switched_off += greedy.stats.adaptive_off_windows
                for seed in (1, 2):
                    served = client.generate(prompt, max_tokens=40, temperature=1.0, seed=seed)
                    expected = adaptive_in_process(model, draft, prompt, seed)
                    assert list(served.token_ids) == expected.token_ids
                    st = served.stats
                    assert (st.drafted, st.windows) == (expected.stats.drafted, expected.stats.windows)
                    assert st.adaptive_off_windows == expected.stats.adaptive_off_windows
                    switched_off += st.adaptive_off_windows
                    assert st.windows_on_target == st.windows
                    drafted, windows = drafted + st.drafted, windows + st.windows
                    hits, branched = hits + st.branch_hits, branched + st.mirror_windows
        assert s.front.servicer.metrics.adaptive_off_windows._value.get() == switched_off
    finally:
        s.stop()
    assert 0 < drafted < 3 * windows  # K varied: a fixed K=4 drafts ~4 per window
    assert switched_off > 0  # some windows went without drafts, and the front door counted them
    assert (hits > 0 and branched > 0) == mirror


def test_adaptive_k_goes_on_from_where_it_stood_when_the_session_moves(tiny_dir, near_draft16_dir, slow_verify):
    """A run's adaptive state travels with it: after its target dies, half way through the request
    (past windows target-only and probes), the run on the next target starts from the state the
    front door followed, not afresh, and the seeded sample is the in-process engine's."""
    model, draft = load(tiny_dir["target16"]), load_as_served_draft(near_draft16_dir)
    s = start_stack(tiny_dir["target16"], near_draft16_dir, k=4, windows_on_target=True, adaptive=ADAPTIVE,
                    target_replicas=2, failure_cooldown_s=30.0)
    # 20 tokens in, it is in windows target-only (K=0), at 50 ms each: still going
    tokens, last = with_the_holder_stopped(s, after_tokens=20, temperature=1.0, seed=1)
    expected = adaptive_in_process(model, draft, [0, 7, 3], seed=1, max_tokens=60)
    assert tokens == expected.token_ids
    stats = last.stats
    assert stats.target_moves >= 1 and stats.windows_on_target > 0
    assert (stats.drafted, stats.windows) == (expected.stats.drafted, expected.stats.windows)


def test_windows_whose_drafts_all_pass_take_the_branch_after_the_drafter_s_own_token(tiny_dir):
    """The target as its own draft: every draft passes, and the bonus token is the drafter's own
    greedy one but for int8 rounding. With every window branching (``stop_at_verdict=False``,
    sent as ``branch_every_window``), the "all accepted" branch holds most verdicts; the
    rejection guesses could hold none of them. Greedy output stays target-only's."""
    from mirrorspec.config import MirrorConfig

    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["target16"], k=3, windows_on_target=True,
                    mirror=MirrorConfig(stop_at_verdict=False))
    try:
        with Client(s.address) as client:
            results = [client.generate(prompt, max_tokens=24) for prompt in prompts(4, seed=5)]
    finally:
        s.stop()
    for prompt, result in zip(prompts(4, seed=5), results):
        assert list(result.token_ids) == target_only(model, prompt, 24)
        st = result.stats
        assert st.windows_on_target == st.windows and st.accepted == st.drafted  # every draft passed
        assert st.mirror_windows >= st.windows - 1  # all but the last, which has no next window
    hits, branched = sum(r.stats.branch_hits for r in results), sum(r.stats.mirror_windows for r in results)
    assert hits >= branched / 2


def test_a_stop_token_ends_the_run_where_it_falls(stack, tiny_dir):
    model = load(tiny_dir["target16"])
    full = target_only(model, [0, 7, 3], 30)
    stop = full[9]
    with Client(stack.address) as client:
        result = client.generate([0, 7, 3], max_tokens=30, stop_token_ids=[stop])
    assert list(result.token_ids) == full[:full.index(stop) + 1] and result.finish_reason == "stop"
    assert result.stats.windows_on_target == result.stats.windows


def test_cancellation_frees_the_sessions_on_both_services(stack):
    with Client(stack.address) as client:
        stream = client.stream([0, 1, 2], max_tokens=100)
        next(stream)
        stream.cancel()
    assert wait_until(lambda: (sessions(stack.target, target_pb2_grpc.TargetServiceStub),
                               sessions(stack.drafter, drafter_pb2_grpc.DrafterServiceStub)) == (0, 0))


def test_a_drafter_dying_mid_run_leaves_the_request_to_finish_target_only(tiny_dir):
    """The target's draft call fails: its run ends with drafter_error, and the front door goes on
    window by window from the token log, without drafts (the drafter is gone)."""
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=2, windows_on_target=True)
    try:
        with Client(s.address) as client:
            stream = client.stream([0, 7, 3], max_tokens=60)
            first = next(stream)
            with targets_held(s):  # the run waits in a verify while the drafter dies
                s.drafter.stop(grace=0)
            rest = list(stream)
    finally:
        s.drafters.clear()
        s.stop()
    tokens = list(first.token_ids) + [t for chunk in rest for t in chunk.token_ids]
    assert tokens == target_only(model, [0, 7, 3], 60)
    stats = rest[-1].stats
    assert rest[-1].finish_reason == "length" and stats.drafter_fallback
    assert 0 < stats.windows_on_target < stats.windows


def test_a_target_dying_mid_run_moves_the_session_and_the_request_goes_on(tiny_dir):
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=2, windows_on_target=True, target_replicas=2,
                    failure_cooldown_s=30.0)
    tokens, last = with_the_holder_stopped(s, after_tokens=1)
    assert tokens == target_only(model, [0, 7, 3], 60)
    stats = last.stats
    assert last.finish_reason == "length" and stats.target_moves >= 1 and not stats.drafter_fallback
    assert stats.windows_on_target > 0


@pytest.mark.parametrize("runner_up", [False, True])
def test_a_target_session_closed_mid_run_is_reopened_from_the_token_log(tiny_dir, slow_verify, runner_up):
    """As the front door's own windows do (NOT_FOUND: the session is gone, the replica is not). A
    run failed the request with UNAVAILABLE instead (an exactness review). Seeded sampled output
    is the in-process engine's, token for token, the replayed session's included."""
    prompt, params = [0, 9, 9, 1], SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, proposal_top_k=4, windows_on_target=True,
                    runner_up=runner_up)
    try:
        store = s.target.servicer.sessions
        with Client(s.address) as client:
            stream = client.stream(prompt, max_tokens=40, temperature=0.9, top_p=0.95, seed=11)
            first = next(stream)
            for session_id in list(store._entries):
                store.close(session_id)
            rest = list(stream)
    finally:
        s.stop()
    local = generate(load(tiny_dir["target16"]), load_as_served_draft(tiny_dir["draft16"]), prompt, params,
                     num_speculative_tokens=3, seed=11, proposal_top_k=4, runner_up=runner_up)
    assert list(first.token_ids) + [t for chunk in rest for t in chunk.token_ids] == local.token_ids
    assert rest[-1].finish_reason == "length" and rest[-1].stats.target_moves >= 1
    assert rest[-1].stats.windows_on_target > 0


def test_a_drained_target_s_session_moves_at_its_next_window_not_at_the_request_s_end(tiny_dir):
    """A run on the target read window after window off one stream, and never asked whether its
    replica was still in the pool: a drained one (scale-down) kept the session to the request's
    end, and its drain waited for it (review 22 of stop 48). Seeded sampled output is unchanged."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, windows_on_target=True, target_replicas=2)
    pool = s.front.servicer.targets
    request = dict(max_tokens=100, temperature=1.0, seed=1)
    try:
        with Client(s.address) as client:
            unmoved = client.generate([0, 7, 3], **request)
            stream = client.stream([0, 7, 3], **request)
            tokens = list(next(stream).token_ids)
            with targets_held(s):
                holder = next(t for t in s.targets if sessions(t, target_pb2_grpc.TargetServiceStub) == 1)
                pool.set_members([a for a in pool.addresses if not a.endswith(f":{holder.port}")])
            rest = list(stream)
    finally:
        s.stop()
    assert tokens + [t for chunk in rest for t in chunk.token_ids] == unmoved.token_ids
    assert rest[-1].stats.target_moves == 1 and rest[-1].stats.windows_on_target > 0


def with_the_holder_stopped(s, after_tokens: int, **request):
    """Streams 60 tokens after [0, 7, 3], stopping the target replica that holds the session once
    ``after_tokens`` have come; then (every token, the last chunk). Stops the stack."""
    holder = None
    try:
        with Client(s.address) as client:
            stream = client.stream([0, 7, 3], max_tokens=60, **request)
            tokens = []
            while len(tokens) < after_tokens:
                tokens += next(stream).token_ids
            holder = next(t for t in s.targets if sessions(t, target_pb2_grpc.TargetServiceStub) == 1)
            holder.stop(grace=0)
            rest = list(stream)
    finally:
        s.targets = [t for t in s.targets if t is not holder]
        s.stop()
    return tokens + [t for chunk in rest for t in chunk.token_ids], rest[-1]


def test_a_target_that_cannot_reach_the_drafter_leaves_the_windows_to_the_front_door(tiny_dir, monkeypatch):
    """The target's draft calls fail where the front door's succeed (the pools partitioned from
    each other, or a drafter address that names another host from the target's side): the
    windows run at the front door, drafting from there, and the drafter is not blamed. Before,
    drafting turned off for the request, which went on target-only. The front door remembers the
    pair for its cooldown: the later requests do not send the target a run that fails too (each
    paid one before, and a black-holed drafter address costs a run the draft deadline)."""
    from support import free_port
    from target_service.run_windows import DrafterLinks

    acquire = DrafterLinks.acquire
    runs = []

    async def elsewhere(self, address):
        runs.append(address)
        return await acquire(self, f"127.0.0.1:{free_port()}")  # nobody there

    monkeypatch.setattr(DrafterLinks, "acquire", elsewhere)
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, windows_on_target=True, failure_cooldown_s=30.0)
    try:
        with Client(s.address) as client:
            results = [client.generate(prompt, max_tokens=24) for prompt in prompts(3)]
    finally:
        s.stop()
    for prompt, result in zip(prompts(3), results):
        assert list(result.token_ids) == target_only(model, prompt, 24)
        st = result.stats
        assert not st.drafter_fallback and st.drafted >= 2 * st.windows  # drafted from the front door, every window
        assert st.windows_on_target == 0
    assert len(runs) == 1, runs


def test_a_window_that_made_no_draft_call_does_not_clear_a_pair_found_cut(tiny_dir, monkeypatch):
    """A run under way as another request's found the pair cut, whose window needs no draft (one
    token left: K=0), says nothing of the pair: it cleared it, and the next request sent the
    target a run that failed again (review 4's repro)."""
    from support import free_port
    from target_service.run_windows import DrafterLinks

    acquire = DrafterLinks.acquire
    runs = []

    async def elsewhere(self, address):
        runs.append(address)
        if len(runs) == 1:  # the one-token request's run: its window comes after the other's failure
            await asyncio.sleep(3.0)
        return await acquire(self, f"127.0.0.1:{free_port()}")  # nobody there

    monkeypatch.setattr(DrafterLinks, "acquire", elsewhere)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, windows_on_target=True, failure_cooldown_s=30.0)
    try:
        with Client(s.address) as client:
            short = threading.Thread(target=client.generate, args=([1, 2, 3],), kwargs={"max_tokens": 1})
            short.start()
            assert wait_until(lambda: len(runs) == 1)
            assert client.generate([1, 2, 3], max_tokens=24).stats.windows_on_target == 0  # finds the pair cut
            short.join()
            assert client.generate([1, 2, 3], max_tokens=24).stats.windows_on_target == 0
    finally:
        s.stop()
    assert len(runs) == 2, runs  # the third request sent no run


def test_a_drafter_address_that_never_connects_fails_the_run_at_the_connect_timeout(tiny_dir, monkeypatch, caplog):
    """From the target, the drafter's address accepts TCP and never speaks (a middlebox, packets
    dropped: the connect never completes). The run's first draft call waited for gRPC's connect
    timeout, 20 s, or the draft deadline where shorter (30 s by default; 7.5 s here, half the
    client's 15 s), before the front door could draft. The target now stops connecting after
    BACKEND_CONNECT_TIMEOUT_S, and says it could not connect."""
    import logging
    import socket

    from target_service.run_windows import DrafterLinks

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # the kernel completes TCP handshakes; nobody speaks HTTP/2
    address = f"127.0.0.1:{hole.getsockname()[1]}"
    acquire, release = DrafterLinks.acquire, DrafterLinks.release
    monkeypatch.setattr(DrafterLinks, "acquire", lambda self, _: acquire(self, address))
    monkeypatch.setattr(DrafterLinks, "release", lambda self, _: release(self, address))
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, windows_on_target=True, drafter_timeout_s=60.0)
    try:
        with Client(s.address, timeout_s=15.0) as client, caplog.at_level(logging.WARNING, logger="orchestrator"):
            result = client.generate([1, 2, 3], max_tokens=24)
    finally:
        s.stop()
        hole.close()
    assert list(result.token_ids) == target_only(model, [1, 2, 3], 24)
    assert result.stats.windows_on_target == 0 and result.stats.drafted >= 2 * result.stats.windows
    said = [r.getMessage() for r in caplog.records if "got no drafts" in r.getMessage()]
    assert len(said) == 1 and "UNAVAILABLE: failed to connect" in said[0], said  # not "no draft within 7.5 s"


def test_target_reach_is_kept_per_pair_of_replicas(monkeypatch):
    """One pair failing keeps only its own windows at the front door; runs that were under way as
    it failed fail for the same cause, and do not double the wait; a run that got its drafts
    clears the pair."""
    from orchestrator import direct
    from orchestrator.direct import TargetReach

    now = [100.0]
    monkeypatch.setattr(direct.time, "monotonic", lambda: now[0])
    reach = TargetReach(cooldown_s=2.0)
    cut, other = ("t:1", "d:1"), ("t:1", "d:2")
    assert reach.back(cut) and reach.back(None)
    assert reach.lost(cut) == 2.0
    assert not reach.back(cut) and reach.back(other) and reach.back(None)
    now[0] += 1.5
    assert reach.lost(cut) == pytest.approx(0.5)  # a run begun before the first failed: same cause
    now[0] += 0.5
    assert reach.back(cut)
    assert reach.lost(cut) == 4.0  # failed again once back: the wait doubles
    now[0] += 4.0
    reach.held(cut)
    assert reach.back(cut) and reach.lost(cut) == 2.0
    now[0] += TargetReach.FORGET_AFTER_S + 3.0
    reach.lost(other)
    assert cut not in reach._pairs  # long past: forgotten (replacements come on new ports)


def test_a_target_without_run_windows_serves_the_windows_from_the_front_door(tiny_dir, monkeypatch):
    """A replica built before RunWindows answers UNIMPLEMENTED, having run nothing."""
    async def unimplemented(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield  # a server-streaming handler

    monkeypatch.setattr(TargetServicer, "RunWindows", unimplemented)
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, windows_on_target=True)
    try:
        with Client(s.address) as client:
            result = client.generate([0, 7, 3], max_tokens=24)
    finally:
        s.stop()
    assert list(result.token_ids) == target_only(model, [0, 7, 3], 24)
    assert result.stats.windows_on_target == 0 and result.stats.drafted > 0 and not result.stats.drafter_fallback


def test_adaptive_k_stays_at_the_front_door_with_targets_built_before_they_chose_k(tiny_dir, near_draft16_dir,
                                                                                  monkeypatch):
    """A target built before ``RunWindowsRequest.adaptive`` drops the field and runs every window at
    the largest K (review 1 of stop 44): the front door keeps adaptive windows itself unless the
    targets say they choose K (``TargetInfo.runs_adaptive_k``)."""
    info, run = TargetServicer.Info, TargetServicer.RunWindows

    async def older_info(self, request, context):
        return target_pb2.TargetInfo(**{**{f.name: getattr(await info(self, request, context), f.name)
                                           for f in target_pb2.TargetInfo.DESCRIPTOR.fields},
                                        "runs_adaptive_k": False})

    async def older_run(self, request, context):
        request.ClearField("adaptive")
        async for result in run(self, request, context):
            yield result

    monkeypatch.setattr(TargetServicer, "Info", older_info)
    monkeypatch.setattr(TargetServicer, "RunWindows", older_run)
    model, draft = load(tiny_dir["target16"]), load_as_served_draft(near_draft16_dir)
    s = start_stack(tiny_dir["target16"], near_draft16_dir, k=4, windows_on_target=True, adaptive=ADAPTIVE)
    try:
        with Client(s.address) as client:
            served = client.generate([0, 7, 3], max_tokens=40, temperature=1.0, seed=1)
    finally:
        s.stop()
    assert list(served.token_ids) == adaptive_in_process(model, draft, [0, 7, 3], seed=1).token_ids
    assert served.stats.windows_on_target == 0 and served.stats.drafted > 0


def adaptive_proto(**state) -> target_pb2.AdaptiveK:
    msg = adaptive_to_proto(AdaptiveK(AdaptiveKConfig(), 2))
    for name, value in state.items():
        if name == "pass_costs":
            msg.pass_costs[:] = value
        else:
            setattr(msg, name, value)
    return msg


def _opened(stack) -> tuple[str, str]:
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.target.port}"))
    drafter = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.drafter.port}"))
    prompt, params = [0, 1, 2], common_pb2.SamplingParams(max_new_tokens=8)
    return (target.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=prompt, params=params)).session_id,
            drafter.OpenSession(drafter_pb2.OpenDraftSessionRequest(prompt_ids=prompt, params=params)).session_id)


def _run(stack, **fields):
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.target.port}"))
    return list(stub.RunWindows(target_pb2.RunWindowsRequest(**fields), timeout=30))


@pytest.mark.parametrize("change, code, needle", [
    (dict(k=0), grpc.StatusCode.OUT_OF_RANGE, "k must be in [1, 16]"),
    (dict(k=17), grpc.StatusCode.OUT_OF_RANGE, "k must be in [1, 16]"),
    (dict(max_new_tokens=0), grpc.StatusCode.OUT_OF_RANGE, "max_new_tokens must be at least 1"),
    (dict(drafter_address="localhost"), grpc.StatusCode.INVALID_ARGUMENT, "expected host:port"),
    (dict(drafter_session_id=""), grpc.StatusCode.INVALID_ARGUMENT, "open a session on the drafter first"),
    (dict(drafter_context_length=4), grpc.StatusCode.OUT_OF_RANGE, "drafter_context_length must be in [1, "),
    (dict(session_id="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
    (dict(context_length=5), grpc.StatusCode.FAILED_PRECONDITION, "reopen the session"),
    (dict(commit_tokens=[16], context_length=4), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    # it ended the run at once with "no draft within -1 s", and NaN with "within nan s" (review 2 of stop 43)
    (dict(draft_timeout_s=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "draft_timeout_s must be a finite"),
    (dict(draft_timeout_s=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "draft_timeout_s must be a finite"),
    (dict(draft_timeout_s=float("inf")), grpc.StatusCode.INVALID_ARGUMENT, "draft_timeout_s must be a finite"),
    (dict(adaptive=target_pb2.AdaptiveK()), grpc.StatusCode.INVALID_ARGUMENT, "decay must be in (0, 1]"),
    (dict(adaptive=adaptive_proto(accepted=float("nan"))), grpc.StatusCode.INVALID_ARGUMENT,
     "accepted and rejected counts must be finite and >= 0"),
    (dict(adaptive=adaptive_proto(pass_costs=[0.5])), grpc.StatusCode.INVALID_ARGUMENT, "pass_costs are in one-token"),
    (dict(draft_vocab_size=17), grpc.StatusCode.OUT_OF_RANGE, "draft_vocab_size must be at most this target's"),
])
def test_bad_run_requests_get_clear_statuses(stack, change, code, needle):
    target_session, drafter_session = _opened(stack)
    fields = dict(session_id=target_session, context_length=3, drafter_address=f"127.0.0.1:{stack.drafter.port}",
                  drafter_session_id=drafter_session, drafter_context_length=3, k=2, max_new_tokens=8)
    with pytest.raises(grpc.RpcError) as err:
        _run(stack, **{**fields, **change})
    assert err.value.code() == code and needle in err.value.details()
    assert _run(stack, **fields)[-1].tokens  # the session is intact, the server serving


@pytest.mark.parametrize("drafter", ["unknown session", "nobody there"])
def test_a_draft_call_that_fails_ends_the_run_with_the_reason(stack, drafter):
    from support import free_port

    target_session, drafter_session = _opened(stack)
    address = f"127.0.0.1:{stack.drafter.port if drafter == 'unknown session' else free_port()}"
    results = _run(stack, session_id=target_session, context_length=3, drafter_address=address,
                   drafter_session_id="nope" if drafter == "unknown session" else drafter_session,
                   drafter_context_length=3, k=2, max_new_tokens=8)
    assert len(results) == 1 and not results[0].HasField("verdict") and results[0].context_length == 3
    assert results[0].drafter_error.startswith("NOT_FOUND" if drafter == "unknown session" else "UNAVAILABLE")


def test_a_run_longer_than_a_backend_call_may_take_finishes(tiny_dir, slow_verify):
    """The run carries the client's deadline only; each window has its own, as at the front door
    (a run given backend_timeout_s failed any generation that took longer in all: review 1, 2)."""
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=1, windows_on_target=True, backend_timeout_s=1.0)
    try:
        with Client(s.address) as client:
            started = time.monotonic()
            result = client.generate([0, 7, 3], max_tokens=60)
            took = time.monotonic() - started
    finally:
        s.stop()
    assert took > 1.0 and list(result.token_ids) == target_only(model, [0, 7, 3], 60)
    assert result.stats.windows_on_target == result.stats.windows


def test_a_frozen_drafter_is_blamed_not_the_target(tiny_dir):
    """The target gives up on a draft call before the front door gives up on the window: with the
    drafter's deadline as long as the window's (as by default), the front door took the target
    for hung, and with one target replica the request stalled for its failure cooldown."""
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=2, windows_on_target=True, window_timeout_s=1.0,
                    drafter_timeout_s=1.0, failure_cooldown_s=30.0)
    tokens, stats = with_the_drafter_frozen_after_the_first_window(s, max_tokens=40)
    assert tokens == target_only(model, [0, 7, 3], 40)
    assert stats.drafter_fallback and stats.target_moves == 0 and 0 < stats.windows_on_target < stats.windows


def test_a_drafter_that_hung_on_the_target_gets_a_short_deadline_from_the_front_door(tiny_dir, caplog):
    """The target's draft call ran out of time: the drafter hangs, or the target cannot reach it.
    The front door's own call settles which within ``HUNG_AFTER_S``, not the drafter deadline
    again: a hung drafter stalled a request for twice that deadline (review 2 of stop 44)."""
    import logging

    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=2, windows_on_target=True, drafter_timeout_s=4.0,
                    failure_cooldown_s=30.0)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        tokens, stats = with_the_drafter_frozen_after_the_first_window(s, max_tokens=20)
    assert tokens == target_only(model, [0, 7, 3], 20)
    assert stats.drafter_fallback and stats.target_moves == 0
    said = [r.getMessage() for r in caplog.records]
    assert any("got no drafts" in m and "within 4 s" in m for m in said)  # the target's call
    # the front door's ran out of its short deadline (taken for hung: the session moves, here nowhere)
    assert any("drafter replica" in m and "is hung" in m for m in said)
    assert not any("drafter failed" in m and "within 4 s" in m for m in said)  # not its own 4 s again


def with_the_drafter_frozen_after_the_first_window(s, max_tokens: int, for_s: float | None = None):
    """A stream of ``max_tokens`` after [0, 7, 3] whose drafter's compute lane stops after the first
    window (for ``for_s`` seconds; for good if None): (its tokens, its final stats). Stops ``s``."""
    release = threading.Event()
    try:
        with Client(s.address) as client:
            stream = client.stream([0, 7, 3], max_tokens=max_tokens)
            first = next(stream)
            s.drafter.servicer.lane._pool.submit(release.wait, 60)  # drafts wait from now on ...
            if for_s is not None:
                threading.Timer(for_s, release.set).start()  # ... for a while
            rest = list(stream)
    finally:
        release.set()
        s.stop()
    return list(first.token_ids) + [t for chunk in rest for t in chunk.token_ids], rest[-1].stats


def test_a_run_longer_than_the_session_ttl_keeps_its_target_session(tiny_dir, slow_verify):
    """Each window of a run refreshes its session's TTL, as each window call does at the front
    door: a run that outlived the TTL had its session evicted (and its KV cache freed) under it,
    and the target counted it as closed (review 1)."""
    from drafter_service.servicer import DrafterConfig
    from mirrorspec.cli.local_stack import start_local_stack
    from target_service.servicer import TargetConfig

    s = start_local_stack(TargetConfig(model=str(tiny_dir["target16"]), session_ttl_s=1.0),
                          DrafterConfig(strategy="draft-model", model=str(tiny_dir["draft16"])), port=0,
                          num_speculative_tokens=1, windows_on_target=True)
    results = []
    try:
        with Client(s.address) as client:
            worker = threading.Thread(target=lambda: results.append(client.generate([0, 7, 3], max_tokens=60)))
            worker.start()
            time.sleep(1.5)  # past the TTL, with the run going on
            during = sessions(s.target, target_pb2_grpc.TargetServiceStub)  # Info evicts expired sessions first
            worker.join(timeout=60)
    finally:
        s.stop()
    assert during == 1 and results[0].stats.windows_on_target == results[0].stats.windows


def test_windows_go_back_to_the_target_once_a_failed_drafter_is_back(tiny_dir, slow_verify):
    """A drafter frozen for a moment fails a run's draft call, and then the front door's own; the
    front door goes on window by window, target-only, reopens the drafter session after its
    cooldown, and hands the windows back to the target: most of a long request still runs there."""
    model = load(tiny_dir["target16"])
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=2, windows_on_target=True, drafter_timeout_s=0.3,
                    failure_cooldown_s=0.2)
    tokens, stats = with_the_drafter_frozen_after_the_first_window(s, max_tokens=100, for_s=0.9)
    assert tokens == target_only(model, [0, 7, 3], 100)
    assert stats.drafter_fallback and stats.target_moves == 0
    assert stats.windows_on_target < stats.windows and stats.windows_on_target > stats.windows / 2


def test_a_target_s_runs_start_their_branch_policy_from_what_the_last_run_learnt(tiny_dir, monkeypatch):
    """Mirror on the target: each run's branch policy starts where the last run's on this target
    finished (``BranchHistory``), as the front door's requests do."""
    import target_service.servicer as target_servicer

    made = record_instances(monkeypatch, target_servicer, "Branching",
                            lambda b: (b.history, b.policy.verify_s.count if b.policy else None))
    two_mirror_requests(tiny_dir["target16"], tiny_dir["draft16"], windows_on_target=True)
    [(history, blank), (again, resumed)] = made
    assert history is again is not None
    assert blank == 0 and resumed > 0


def test_a_request_the_client_leaves_ends_its_run_on_the_target_before_closing_its_sessions(tiny_dir, monkeypatch,
                                                                                            slow_verify):
    """The front door closed the sessions with the target's run still going (its call was cancelled
    only as the window generator was collected): the run drafted its next window for a closed
    session, and queued a verify for it (a review's find)."""
    import orchestrator.servicer as front_door

    order: list[str] = []
    windows, release = front_door.windows_on_target, front_door.release_together

    def recorded_windows(*args, **kwargs):
        try:
            yield from windows(*args, **kwargs)
        finally:
            order.append("run cancelled")

    def recorded_release(*holders):
        order.append("sessions closed")
        release(*holders)

    monkeypatch.setattr(front_door, "windows_on_target", recorded_windows)
    monkeypatch.setattr(front_door, "release_together", recorded_release)
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, windows_on_target=True)
    try:
        with Client(s.address) as client:
            stream = client.stream([0, 7, 3], max_tokens=120)
            assert next(stream).token_ids
            stream.cancel()
            wait_until(lambda: "sessions closed" in order, timeout=10)
    finally:
        s.stop()
    assert order[:2] == ["run cancelled", "sessions closed"]
