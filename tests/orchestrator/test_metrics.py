"""The Prometheus endpoint's port: one in use is a named setting error, not an OSError traceback."""

import socket

import pytest

from mirrorspec.config import InvalidRequest
from orchestrator.metrics import SpecDecodeMetrics
from support import counts_by_label


def test_a_metrics_port_in_use_is_refused_naming_the_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidRequest, match=f"cannot serve metrics on 127.0.0.1:{port}") as err:
            SpecDecodeMetrics().serve("127.0.0.1", port)
    assert err.value.field == "metrics_port"


def test_a_metrics_port_of_0_serves_on_a_free_port_it_tells():
    """The busy-port error offers 0 for a free port, and the port taken was told to no one (a
    review's find): ``port`` says it, and the front door logs it and `serve --in-process` prints it."""
    import urllib.request

    metrics = SpecDecodeMetrics()
    assert metrics.port is None
    metrics.serve("127.0.0.1", 0)
    try:
        assert metrics.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as page:
            assert "mirrorspec_requests_total" in page.read().decode()
    finally:
        metrics.close()
    assert metrics.port is None


def test_cancelled_requests_are_counted_with_their_finish_reason(tiny_dir):
    """The metrics were observed after the response generator finished normally, so a cancelled,
    timed-out or failed request was never counted (nor its tokens, windows and latency)."""
    from mirrorspec.client import Client
    from served_stack import start_stack
    from support import wait_until

    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"])
    metrics = s.front.servicer.metrics

    def requests() -> dict[str, float]:
        return counts_by_label(metrics.requests, "finish_reason")

    try:
        with Client(s.address) as client:
            client.generate([0, 1, 2], max_tokens=10)
            assert requests() == {"length": 1.0}
            stream = client.stream([0, 1, 2], max_tokens=100)
            next(stream)
            stream.cancel()
            assert wait_until(lambda: requests().get("cancelled") == 1.0, timeout=10)
    finally:
        s.stop()
    assert metrics.generation_tokens._value.get() > 10  # the cancelled request's tokens too


def test_num_drafts_counts_windows_that_carried_drafts_only():
    """vLLM's num_drafts: a window sent without drafts (K=0, paused, after a drafter fallback) is
    no draft, and counting it lowered 1 + accepted / num_drafts, the mean acceptance length."""
    from mirrorspec.engine import GenerationStats
    from orchestrator.servicer import RequestOutcome

    metrics = SpecDecodeMetrics()
    stats = GenerationStats()
    for drafted, accepted in ((3, 2), (0, 0), (0, 0), (2, 2)):
        stats.record(drafted, accepted)
    metrics.observe(RequestOutcome(stats=stats))
    assert metrics.num_drafts._value.get() == 2
    assert metrics.num_draft_tokens._value.get() == 5 and metrics.num_accepted_tokens._value.get() == 4
    assert metrics.summary()["acceptance_rate"] == 0.8


def test_a_front_door_that_drafted_nothing_yet_has_no_acceptance_rate_for_status():
    """`status` showed 0.00 before any request: every draft rejected, at a glance (a review's find)."""
    from mirrorspec.cli.deployment import format_status

    summary = SpecDecodeMetrics().summary()
    assert summary["acceptance_rate"] is None and summary["requests"] == 0
    row = format_status([{"replica": "front-door", "pool": "orchestrator", **summary}]).splitlines()[1]
    assert row.split()[-2:] == ["0", "-"]  # requests, acceptance


def test_refused_requests_windows_and_runner_up_wins_reach_the_metrics(tiny_dir, near_draft16_dir):
    """An operator saw no request refused for bad input (one that does not parse included) or by a
    stopping front door, and without windows or runner-up wins the mean accepted length was not to
    be had (review 13 of stop 47: 1 + accepted / num_drafts gave 1.66 where the requests' own
    stats said 2.14)."""
    import grpc

    from mirrorspec.client import Client
    from served_stack import start_stack

    s = start_stack(tiny_dir["target16"], near_draft16_dir, k=3, runner_up=True)
    metrics = s.front.servicer.metrics
    try:
        with Client(s.address) as client:
            done = [client.generate(prompt, max_tokens=30) for prompt in ([0, 5], [3, 1, 4], [9, 2, 6, 5])]
            with pytest.raises(grpc.RpcError):
                client.generate([99], max_tokens=4)  # outside the vocabulary
            malformed = grpc.insecure_channel(s.address).unary_unary("/mirrorspec.v1.GenerationService/Generate")
            with pytest.raises(grpc.RpcError):  # answered before any handler runs
                malformed(b"\xff\xff\xff\xff", timeout=10)
            s.front.servicer.draining = True
            with pytest.raises(grpc.RpcError):
                client.generate([0, 5], max_tokens=4)
    finally:
        s.stop()
    assert counts_by_label(metrics.refused, "code") == {"INVALID_ARGUMENT": 2.0, "UNAVAILABLE": 1.0}
    assert metrics.num_windows._value.get() == sum(r.stats.windows for r in done)
    assert metrics.num_runner_up_hits._value.get() == sum(r.stats.runner_up_hits for r in done) > 0
    tokens = metrics.generation_tokens._value.get()
    assert tokens / metrics.num_windows._value.get() == pytest.approx(
        sum(len(r.token_ids) for r in done) / sum(r.stats.windows for r in done))


def test_a_request_that_ran_into_a_full_target_is_an_error_by_its_status(tiny_dir):
    """It was an "error" like any other: an operator could not tell overload from a fault."""
    import grpc

    from mirrorspec.client import Client
    from mirrorspec.v1 import target_pb2, target_pb2_grpc
    from served_stack import start_stack

    s = start_stack(tiny_dir["target16"], strategy=None, target_max_sessions=1)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{s.target.port}"))
        stub.OpenSession(target_pb2.OpenTargetSessionRequest(prompt_ids=[0]))  # the only session
        with Client(s.address) as client, pytest.raises(grpc.RpcError) as err:
            client.generate([0, 1], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        metrics = s.front.servicer.metrics
        assert counts_by_label(metrics.requests, "finish_reason") == {"error": 1.0}
        assert counts_by_label(metrics.errors, "code") == {"RESOURCE_EXHAUSTED": 1.0}
    finally:
        s.stop()


def test_a_request_its_client_leaves_while_it_is_tokenized_is_counted(padded_pair, monkeypatch):
    """Requests are tokenized off the event loop; one whose client left (or whose deadline passed)
    meanwhile never reached the window loop, which is where requests were counted (review of
    this stop)."""
    import grpc

    from mirrorspec.client import Client
    from served_stack import start_stack
    from support import HeldTokenizing, wait_until

    held = HeldTokenizing(monkeypatch)
    s = start_stack(padded_pair["target"], strategy=None)
    metrics = s.front.servicer.metrics
    try:
        with Client(s.address, timeout_s=0.5) as client, pytest.raises(grpc.RpcError):
            client.generate("w1 w2", raw=True, max_tokens=4)
        assert wait_until(lambda: counts_by_label(metrics.requests, "finish_reason") == {"deadline_exceeded": 1.0})
        held.release.set()
        held.entered.clear()
        held.release.clear()
        with Client(s.address) as client:
            stream = client.stream("w1 w2", raw=True, max_tokens=4)
            assert held.entered.wait(30)
            stream.cancel()
            assert wait_until(lambda: counts_by_label(metrics.requests, "finish_reason").get("cancelled") == 1.0)
    finally:
        held.release.set()
        s.stop()


def test_latency_and_time_to_first_token_count_from_the_requests_arrival(padded_pair, monkeypatch):
    """They counted from the end of tokenizing: a request that waited for a preparer thread, or
    whose long prompt took its time to tokenize, reported a latency without that wait (a review's
    find). The tokenizing is held here for ``hold_s``, which both must then include."""
    import threading
    import time

    from mirrorspec.client import Client
    from served_stack import start_stack
    from support import HeldTokenizing

    hold_s = 0.3
    held = HeldTokenizing(monkeypatch)
    s = start_stack(padded_pair["target"], strategy=None)
    metrics = s.front.servicer.metrics
    releaser = threading.Thread(target=lambda: held.entered.wait(30) and (time.sleep(hold_s), held.release.set()))
    releaser.start()
    try:
        with Client(s.address) as client:
            done = client.generate("w1 w2", raw=True, max_tokens=4)
    finally:
        held.release.set()
        releaser.join()
        s.stop()
    assert done.stats.total_time_s >= hold_s and done.stats.time_to_first_token_s >= hold_s
    assert metrics.e2e._sum.get() >= hold_s and metrics.ttft._sum.get() >= hold_s


def test_requests_past_the_front_doors_threads_are_counted_as_waiting(tiny_dir):
    """Past ``max_concurrent_requests`` a request waits for a request thread, FIFO, and was seen
    in no metric (a load review); vLLM's running / waiting gauges show it."""
    import threading

    from mirrorspec.client import Client
    from served_stack import start_stack, targets_held
    from support import wait_until

    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3, max_concurrent_requests=1)
    metrics = s.front.servicer.metrics
    try:
        with Client(s.address) as client:
            done = []
            calls = [threading.Thread(target=lambda: done.append(client.generate([0, 1, 2], max_tokens=4)))
                     for _ in range(2)]
            with targets_held(s):
                for call in calls:
                    call.start()
                assert wait_until(lambda: (metrics.running._value.get(), metrics.waiting._value.get()) == (1, 1))
            for call in calls:
                call.join(30)
        assert [len(d.token_ids) for d in done] == [4, 4]
        assert (metrics.running._value.get(), metrics.waiting._value.get()) == (0, 0)
        assert "mirrorspec_requests_waiting 0.0" in metrics.text()
    finally:
        s.stop()
