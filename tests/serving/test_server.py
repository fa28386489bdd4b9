"""One gRPC server per port: gRPC's default SO_REUSEPORT would let a second server share a port
in use, and the kernel would split connections between the two."""

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from mirrorspec.config import InvalidRequest
from mirrorspec.serving.errors import SessionClosed
from mirrorspec.serving.server import BackgroundServer, ComputeLane, check_health, start_grpc_server
from support import wait_until


def test_a_second_server_on_a_port_in_use_is_refused_and_the_first_keeps_it():
    first = BackgroundServer(lambda: start_grpc_server([], "127.0.0.1", 0)).start()
    try:
        port = first.port
        second = BackgroundServer(lambda: start_grpc_server([], "127.0.0.1", port))
        with pytest.raises(InvalidRequest, match=f"cannot listen on 127.0.0.1:{port}: the port is in use") as err:
            second.start()
        assert err.value.field == "port"
        second.stop()
        check_health(f"127.0.0.1:{port}", timeout_s=10)
    finally:
        first.stop()


def test_the_health_check_fails_for_a_wedged_event_loop_and_a_stopped_server():
    """What the Ray supervisor asks each replica: its actor can answer while its server cannot."""
    server = BackgroundServer(lambda: start_grpc_server([], "127.0.0.1", 0)).start()
    address = f"127.0.0.1:{server.port}"
    try:
        check_health(address, timeout_s=10)
        server._loop.call_soon_threadsafe(time.sleep, 3.0)  # a coroutine that blocks the loop
        with pytest.raises(grpc.RpcError) as err:
            check_health(address, timeout_s=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(2.5)
        check_health(address, timeout_s=10)  # the loop is free again
    finally:
        server.stop()
    with pytest.raises(grpc.RpcError) as err:
        check_health(address, timeout_s=2.0)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.mark.parametrize("pool", ["target", "drafter"])
def test_a_wedged_compute_lane_makes_the_health_check_answer_not_serving_until_it_frees(tiny_dir, pool):
    """Its event loop stays free, so a server whose lane hung (a GPU kernel, a collective whose
    peer stopped) answered SERVING for good: its supervisor never replaced it."""
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter
    from target_service.servicer import TargetConfig
    from target_service.servicer import serve as serve_target

    if pool == "target":
        factory = lambda: serve_target(TargetConfig(model=str(tiny_dir["target16"]), stall_timeout_s=0.5))  # noqa: E731
    else:
        factory = lambda: serve_drafter(DrafterConfig.for_draft(str(tiny_dir["draft16"]), stall_timeout_s=0.5))  # noqa: E731
    server = BackgroundServer(factory).start()
    address = f"127.0.0.1:{server.port}"
    released = threading.Event()
    try:
        server.servicer.lane.later(time.sleep, 0.2)  # a job shorter than the stall timeout
        time.sleep(1.0)
        check_health(address, timeout_s=10)
        server.servicer.lane.later(released.wait, 60)  # wedged
        assert wait_until(lambda: not healthy(address), timeout=10)
        with pytest.raises(RuntimeError, match="NOT_SERVING"):
            check_health(address, timeout_s=10)
        released.set()
        assert wait_until(lambda: healthy(address), timeout=10)
    finally:
        released.set()
        server.stop()


def test_stall_timeout_must_be_a_positive_number_of_seconds():
    from target_service.servicer import TargetConfig

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidRequest, match="stall_timeout_s must be a positive number") as err:
            TargetConfig(stall_timeout_s=bad)
        assert err.value.field == "stall_timeout_s"


def healthy(address: str) -> bool:
    try:
        check_health(address, timeout_s=5)
    except RuntimeError:
        return False
    return True


def test_a_stopped_stack_leaves_none_of_its_threads_running(tiny_dir):
    """Compute lanes, request workers, deadline watchdogs, ``asyncio.to_thread``'s executors and
    the event loops all end with the servers: an embedding process (a test run, a notebook) that
    starts and stops stacks must not carry their threads into interpreter shutdown, where a
    thread still inside gRPC or torch can crash the exit."""
    from served_stack import start_stack
    from mirrorspec.client import Client

    start_stack(tiny_dir["target16"], tiny_dir["draft16"]).stop()  # gRPC's process-wide threads start once
    before = set(threading.enumerate())
    stack = start_stack(tiny_dir["target16"], tiny_dir["draft16"], metrics_port=0)
    with Client(stack.address) as client:
        assert len(client.generate([1, 2, 3], max_tokens=8, k=3).token_ids) == 8
    started = set(threading.enumerate()) - before
    assert {t.name.split("_")[0] for t in started} >= {"target-compute", "drafter-compute", "request",
                                                      "target-deadlines", "drafter-deadlines"}
    stack.stop()
    assert wait_until(lambda: not (set(threading.enumerate()) - before), timeout=10), \
        sorted(t.name for t in set(threading.enumerate()) - before)


def test_work_put_on_the_lane_for_later_runs_after_what_is_queued_and_at_once_after_shutdown():
    """Session closes go this way: after that session's forwards, off the event loop."""
    lane = ComputeLane("test-lane")
    order: list[str] = []
    release, done = threading.Event(), threading.Event()
    lane._pool.submit(lambda: (release.wait(30), order.append("forward")))
    lane.later(lambda: (order.append("close"), done.set()))
    assert order == []  # not run on the caller's thread
    release.set()
    assert done.wait(30) and order == ["forward", "close"]
    lane.shutdown()
    lane.later(order.append, "after shutdown")
    assert order[-1] == "after shutdown"


def test_work_for_a_session_still_queued_as_it_closes_is_refused_and_never_runs():
    """A window queued behind its session's close would run on the freed cache (ComputeLane.run_for)."""
    lane, session = ComputeLane("test-lane"), SimpleNamespace(closed=False)
    ran: list[str] = []
    release = threading.Event()

    async def body():
        running = asyncio.ensure_future(lane.run_for(session, lambda: (release.wait(30), ran.append("running"))))
        queued = asyncio.ensure_future(lane.run_for(session, ran.append, "queued"))
        await asyncio.sleep(0.05)  # both on the lane: one running, one behind it
        lane.close_later(session, lambda: ran.append("close"))
        after = asyncio.ensure_future(lane.run_for(session, ran.append, "after"))
        release.set()
        await running
        for refused in (queued, after):
            with pytest.raises(SessionClosed, match="closed .* while this call waited"):
                await refused

    asyncio.run(body())
    lane.shutdown()
    assert ran == ["running", "close"]
    assert str(SessionClosed()).endswith("open a new one with OpenSession")


def test_grpc_s_completion_queue_shut_down_under_a_pending_read_prints_no_traceback(caplog):
    """At one stop of an in-process stack in four, the loop printed "Exception in callback ...
    PollerCompletionQueue._handle_events: OSError: [Errno 9] Bad file descriptor": grpc takes its
    queue's socket off a loop another thread runs. Its twin, "Event loop is closed" from the reader
    handing an event to a stopped server's loop, showed where one replica of a stack stopped (a
    failure-injection review). Those errors are dropped; any other still reaches the loop's own
    handler, as they do raised anywhere else."""
    import errno
    import logging

    def _check_closed():
        raise RuntimeError("Event loop is closed")

    def _handle_events(error):  # named as grpc's reader callback is
        if error == "closed":
            _check_closed()  # deeper, as asyncio's call_soon_threadsafe raises it
        raise OSError(errno.EBADF, "Bad file descriptor") if error == "ebadf" else RuntimeError(error)

    def raised(fn, *args) -> BaseException:
        try:
            fn(*args)
        except (OSError, RuntimeError) as err:
            return err

    def elsewhere(error):
        raise OSError(errno.EBADF, "Bad file descriptor") if error == "ebadf" else RuntimeError("Event loop is closed")

    server = BackgroundServer(lambda: None)
    loop = server._loop
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for error in ("ebadf", "closed"):
                loop.call_exception_handler({"message": "Exception in callback None()",
                                             "exception": raised(_handle_events, error)})
            assert not caplog.records
            for i, fn, error in ((0, elsewhere, "ebadf"), (1, elsewhere, "closed"), (2, _handle_events, "other")):
                loop.call_exception_handler({"message": f"Exception in callback f{i}()",
                                             "exception": raised(fn, error)})
            assert [r.getMessage() for r in caplog.records] == [f"Exception in callback f{i}()" for i in range(3)]
    finally:
        loop.close()


def test_a_background_task_that_fails_says_so_at_once(caplog):
    """One that died unobserved (the health watch) left the health status frozen."""
    from mirrorspec.serving.server import _supervised

    async def failing():
        raise RuntimeError("the hook broke")

    async def body():
        task = _supervised(failing())
        await asyncio.sleep(0.05)
        return task

    with caplog.at_level("ERROR"):
        task = asyncio.run(body())
    assert task.done()
    assert any("background task" in r.getMessage() and "failing" in r.getMessage() and r.exc_info
               for r in caplog.records)


def test_backend_channels_cap_their_reconnect_backoff_at_a_few_seconds():
    """gRPC's reconnect backoff grows to 120 s by default: a front door whose only target was down
    two minutes took another 54-62 s to use it once it was back at its address, while its health
    check already said SERVING (a review; a fresh front door took 5 s). The cap is what bounds
    that; a behavioural test would have to hold a target down for minutes."""
    from mirrorspec.serving.server import BACKEND_CHANNEL_OPTIONS

    options = dict(BACKEND_CHANNEL_OPTIONS)
    assert options["grpc.min_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"] <= 10_000
