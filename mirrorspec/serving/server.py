"""Building and running a mirrorspec gRPC server: the interceptor, health, reflection, one port.

Servers do not care how they are launched: ``start_grpc_server`` is awaited inside any event loop
(a ``python -m`` process, a Ray actor, a test), and ``BackgroundServer`` runs one in a thread of
its own for embedding and tests.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mirrorspec.client import MAX_RECONNECT_BACKOFF_MS, MIN_KEEPALIVE_S, ping_options
from mirrorspec.config import InvalidRequest, check_port, refuse_setting
from mirrorspec.serving.errors import ExceptionToStatusInterceptor, SessionClosed
from mirrorspec.serving.sessions import SessionStore

log = logging.getLogger(__name__)
T = TypeVar("T")

# Dense q rows of a 49k vocabulary are ~200 KB each; leave room for K = 16 of them.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# How long a connection from one server to another (front door to replicas, target to drafters)
# may take before its call fails UNAVAILABLE, and the caller fails over: gRPC's own is 20 s, which
# a 30 s draft deadline did not cut, so an address that drops packets (a firewall, a partition, a
# host gone without a reset) stalled each call that long. Servers on one network connect in ms.
BACKEND_CONNECT_TIMEOUT_S = 2.0
# the client's reconnect cap too: without it a front door whose only target was down two minutes
# took another minute to use it once it was back (a review measured 54-62 s; a fresh one took 5 s)
BACKEND_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.min_reconnect_backoff_ms", int(BACKEND_CONNECT_TIMEOUT_S * 1000)),
                           ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


FLUSH_S = 1.0  # a drained server's wait for the last answers to go out (``RunningServer._drain``)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    servicers: list[object]
    # in the background: the health status kept in step with the compute lanes, expired sessions evicted
    tasks: tuple[asyncio.Task, ...] = ()
    health: object | None = None  # its health servicer
    names: tuple[str, ...] = ()  # the services it serves

    async def _drain(self, grace: float | None) -> float | None:
        """The grace left for gRPC's own stop. Once the draining servicers are idle, a moment
        (``FLUSH_S`` at most) for the answers their handlers just returned to go out: gRPC's stop
        with none cancels every call whose status has not been sent yet. Calls still under way
        when ``grace`` runs out are ended by their servicer (``end_in_flight``) with a status
        that says so, and get the same moment for it to go out."""
        draining = [s for s in self.servicers if hasattr(s, "start_draining")]
        if not draining or not grace:
            return grace
        if self.health is not None:
            await _set_health(self.health, list(self.names), serving=False)
        for servicer in draining:
            servicer.start_draining()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(s.busy() for s in draining) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if any(s.busy() for s in draining):
            for servicer in draining:
                servicer.end_in_flight(grace)
            return FLUSH_S
        return min(max(deadline - loop.time(), 0.0), FLUSH_S)

    async def stop(self, grace: float | None = None) -> None:
        """Stops the server, then lets each servicer that has a ``close`` free what it holds (compute
        lanes, channels to other servers, watchdog threads): an embedding process that starts and
        stops servers must not be left with their threads running into interpreter shutdown.

        Servicers that can drain (``start_draining``, ``busy``: the front door) refuse new calls
        themselves while the port stays open, and the server stops once they are idle or ``grace``
        has passed; others get gRPC's own graceful stop, which closes the port at once."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        grace = await self._drain(grace)
        await self.server.stop(grace)
        for servicer in self.servicers:
            aclose = getattr(servicer, "aclose", None)  # what must close on this loop (aio channels)
            if aclose is not None:
                await aclose()
            close = getattr(servicer, "close", None)
            if close is not None:
                close()


@dataclass
class Service:
    """One servicer to mount: the generated ``add_*_to_server`` function and the full service name."""

    add_to_server: Callable
    servicer: object
    name: str


# gRPC sets SO_REUSEPORT on Linux by default, so a second server on a port in use binds it too and
# the kernel splits connections between the two: a stale `mirrorspec serve` would quietly answer
# half the requests. One server per port; the second one's bind fails and says so.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


def check_port_free(host: str, port: int | None, field: str) -> None:
    """Refuses a port another process listens on, before a launcher spends its start-up (loading
    models, starting Ray) on a server that could not bind it. SO_REUSEADDR, as gRPC and HTTP
    servers set it, so a port whose last connections linger in TIME_WAIT still counts as free;
    the bind itself stays the final word (another process may take the port meanwhile). A host
    that does not resolve, or is no address of this machine, is the host's fault, not the port's."""
    check_port(port, field)
    if not host.strip():  # the probe's bind takes "" for every interface; gRPC refuses it, blaming the port
        raise InvalidRequest("is empty; give a host name or address of this machine (127.0.0.1, 0.0.0.0 for every "
                             "interface)", field="host")
    if not port:  # None: not asked for; 0: any free port
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except socket.gaierror as err:
            raise InvalidRequest(f"cannot listen on {host!r}: {err.strerror or err}; give a host name or address "
                                 f"of this machine (127.0.0.1, 0.0.0.0 for every interface)", field="host") from None
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                raise InvalidRequest(f"cannot listen on {host}: {err.strerror} (it is no address of this machine); "
                                     f"use one of its own, or 0.0.0.0 for every interface", field="host") from None
            why = err.strerror or str(err)
            raise port_refused(host, port, f"{why} (another server still running?)" if err.errno == errno.EADDRINUSE
                               else why, field) from None


def port_refused(host: str, port: int, why: str, field: str = "port") -> InvalidRequest:
    return InvalidRequest(f"cannot listen on {host}:{port}: {why}; pick another port, or 0 for a free one", field=field)


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """The server pings each connection that has calls open every ``keepalive_s``, and drops one
    whose peer does not answer within ``keepalive_s``: a caller's host that died or was cut off
    sends no FIN, so without pings its window streams (and, through them, its sessions: see
    ``SessionStore``) stayed open until TCP gave up, hours later. Pings without data in between
    are unlimited and as frequent (gRPC's defaults: two, then one per five minutes): a front
    door's open stream between two requests carries no data. Clients may ping as often as
    ``MIN_KEEPALIVE_S`` (``mirrorspec.Client`` does, every 30 s by default): gRPC's default takes
    one ping per five minutes without data, and sends a client that pings more often (during a
    long prefill) GOAWAY, failing its call."""
    return [*ping_options(keepalive_s), ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 1000))]


async def start_grpc_server(services: list[Service], host: str, port: int,
                            stall_timeout_s: float | None = None, keepalive_s: float = 30.0) -> RunningServer:
    """``stall_timeout_s``: the health check answers NOT_SERVING while a servicer's compute lane
    has been on one job that long, or while a servicer's ``unready()`` says why it cannot serve
    (``watch_health``). ``keepalive_s``: ``keepalive_options``."""
    refused = {s.name: hook for s in services if (hook := getattr(s.servicer, "refused", None)) is not None}
    server = grpc.aio.server(interceptors=[ExceptionToStatusInterceptor(refused)],
                             options=[*SERVER_OPTIONS, *keepalive_options(keepalive_s)])
    for service in services:
        service.add_to_server(service.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise port_refused(host, port, f"the port is in use (another server still running?) or {host} is not an "
                                       f"address of this machine")
    await server.start()
    await _set_health(health_servicer, names, serving=True)
    lanes = [lane for s in services if isinstance(lane := getattr(s.servicer, "lane", None), ComputeLane)]
    if stall_timeout_s is None:
        lanes = []
    readiness = [unready for s in services if (unready := getattr(s.servicer, "unready", None)) is not None]
    stores = [store for s in services if isinstance(store := getattr(s.servicer, "sessions", None), SessionStore)]
    tasks = []
    if lanes or readiness:
        tasks.append(watch_health(health_servicer, names, lanes, stall_timeout_s or math.inf, readiness))
    if stores:
        tasks.append(evict_expired_sessions(stores))
    return RunningServer(server, bound, [s.servicer for s in services], tuple(map(_supervised, tasks)),
                         health_servicer, tuple(names))


def _supervised(coroutine) -> asyncio.Task:
    """A background task whose failure is logged as it happens: one that died unobserved left the
    health status frozen (a review's find, from reading)."""
    task = asyncio.get_running_loop().create_task(coroutine)
    task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                           or log.error("background task %s failed", coroutine.__qualname__, exc_info=t.exception()))
    return task


async def evict_expired_sessions(stores: list[SessionStore], every_s: float = 1.0) -> None:
    """Expired sessions go within a second, whether or not calls come. Stores evicted only as the
    next session opened (or a load poll came), so on an idle replica a crashed front door's
    sessions kept their KV caches, GPU memory, until then, not for ``orphan_ttl_s``."""
    while True:
        await asyncio.sleep(every_s)
        for store in stores:
            store.evict_expired()


async def _set_health(health_servicer, names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


async def watch_health(health_servicer, names: list[str], lanes: list[ComputeLane], stall_timeout_s: float,
                       readiness: list[Callable[[], str | None]]) -> None:
    """The health check answers NOT_SERVING while the server cannot serve, and SERVING again once it
    can; checked every second.

    A wedged compute lane (a hung GPU kernel, a collective whose peer is stopped) leaves the event
    loop free, so the server answered SERVING and its supervisor kept it for good, while every
    request routed to it waited out its window timeout. A lane on one job longer than
    ``stall_timeout_s`` now counts as down, as vLLM's engine iteration timeout does. So does a
    servicer whose ``unready()`` names a reason (a front door with no target it can use), so that
    a load balancer sends requests elsewhere rather than into a wait."""
    down: str | None = None
    while True:
        await asyncio.sleep(min(stall_timeout_s / 4, 1.0))
        stalled = max((lane.busy_for() for lane in lanes), default=0.0)
        why = (f"compute lane on one job for {stalled:.0f} s (stall_timeout_s {stall_timeout_s:.0f} s)"
               if stalled > stall_timeout_s else next((r for check in readiness if (r := check())), None))
        if (why is None) != (down is None):
            if why is None:
                log.warning("%s no longer holds; the health check answers SERVING", down)
            else:
                log.error("%s; the health check answers NOT_SERVING", why)
            await _set_health(health_servicer, names, serving=why is None)
        down = why


def health_status(channel: grpc.Channel, timeout_s: float) -> int:
    """What the server behind ``channel`` answers gRPC's own health check within ``timeout_s``
    (``HealthCheckResponse.SERVING``, ...); raises ``grpc.RpcError`` where it answers nothing."""
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status


def check_health(address: str, timeout_s: float = 5.0) -> None:
    """Raises unless the server at ``address`` answers gRPC's own health check with SERVING in
    ``timeout_s``. A supervisor asks this, not the process hosting the server: a process can answer
    while its server has stopped or its event loop is wedged, and clients see only the server."""
    with grpc.insecure_channel(address) as channel:
        status = health_status(channel, timeout_s)
    if status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        raise RuntimeError(f"the server at {address} answers its health check with {name}")


class ComputeLane:
    """One thread for model work per server, like a GPU stream: forwards run one at a time, and
    the event loop stays free for health checks, new sessions and cancellations.

    Loading the model belongs on the lane too. Each thread that has run torch on CPU keeps its
    own OpenMP pool, and once a process's OpenMP threads outnumber its cores libgomp stops
    spinning between parallel regions: every region then waits on a futex. On 2 cores, a thread
    decoding the demo target ran 35% slower per token once another, idle, thread had run torch
    with 2 threads."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._busy_since: float | None = None  # when the job running now started

    async def run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, fn, *args)

    def busy_for(self) -> float:
        """Seconds the lane has spent on the job it runs now; 0 when idle."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _timed(self, fn: Callable, *args):
        self._busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._busy_since = None

    async def run_for(self, session: LaneSession, fn: Callable, *args):
        """``run`` for a session's work, refused (``SessionClosed``, NOT_FOUND) where the session
        was closed before the lane reached it. Its close is queued on the lane (``close_later``),
        so work queued behind it would run on a freed cache: a forward then recomputed the whole
        context for a session nobody held, and a tensor-parallel target's followers built a cache
        for it again that no close would free (a review's find: a front door closes its sessions
        as a stop string ends a request, while the target's window run waits for a draft)."""
        return await self.run(_unless_closed, session, fn, *args)

    def close_later(self, session: LaneSession, release: Callable[[], object]) -> None:
        """Close ``session`` for work not yet on the lane, and ``release`` it there after the work
        already queued (``later``)."""
        session.closed = True
        self.later(release)

    def later(self, fn: Callable, *args) -> None:
        """Run ``fn`` after the work already queued, without waiting for it: closing a session
        this way frees its cache after its own forwards, never in the middle of one, and never
        blocks the event loop on a forward of another session (a tensor-parallel driver holds
        its lock for a whole step). After ``shutdown``, at once."""
        try:
            self._pool.submit(self._timed, fn, *args)
        except RuntimeError:  # shut down: nothing runs on the lane any more
            fn(*args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class LaneSession(Protocol):
    closed: bool  # set on the event loop as the session's close is queued; read on the lane


def _unless_closed(session: LaneSession, fn: Callable, *args):
    if session.closed:
        raise SessionClosed()
    return fn(*args)


def stop_gracefully_on_signals(running: RunningServer, grace_s: float, banner: str) -> list[asyncio.Task]:
    """On this loop: the first SIGTERM, SIGINT or SIGHUP stops ``running`` with ``grace_s`` for the
    calls in flight, a second one at once. Returns where the stop's task will be."""
    import signal

    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    def on_signal() -> None:
        if not stopping:
            log.warning("%s stopping: new calls are refused, those in flight have %g s to finish", banner, grace_s)
            stopping.append(loop.create_task(running.stop(grace_s)))
        else:
            log.warning("%s stopping at once", banner)
            stopping.append(loop.create_task(running.server.stop(None)))  # held: the loop keeps tasks weakly

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    return stopping


class BackgroundServer:
    """Runs an async server factory on its own event loop in a daemon thread."""

    def __init__(self, factory: Callable[[], Awaitable[RunningServer]], name: str = "grpc"):
        self._factory = factory
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_ignore_grpc_teardown_race)
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self.running: RunningServer | None = None

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        self._thread.start()
        try:
            self.running = asyncio.run_coroutine_threadsafe(self._factory(), self._loop).result(timeout)
        except BaseException:  # a server that did not come up leaves no loop thread behind
            self.stop()
            raise
        return self

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def servicer(self):
        return self.running.servicers[0]

    def call(self, fn: Callable[[], T], timeout: float = 5.0) -> T:
        """``fn()`` run on the server's event loop, from another thread: the servicers' state (a
        session store) lives on that loop and takes no lock. Counted from a Ray actor's thread, a
        store's sessions changed under the count ("dictionary changed size during iteration"), and
        the controller read that replica as empty when it chose one to drain (a review's find)."""
        async def on_loop() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(on_loop(), self._loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        """Stops the server and its servicers, then the loop's own threads (``asyncio.to_thread``'s
        executor) and the loop itself."""
        if not self._thread.is_alive():
            return
        if self.running is not None:
            asyncio.run_coroutine_threadsafe(self.running.stop(grace), self._loop).result(grace + 5)
            self.running = None
        asyncio.run_coroutine_threadsafe(self._loop.shutdown_default_executor(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _ignore_grpc_teardown_race(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """grpc.aio reads its completion queue's events through a socket that one event loop watches.
    When a process's last gRPC server or channel goes, grpc shuts that queue down from the thread
    that let it go, and takes the socket off a loop another thread runs: a read already due there
    then finds the socket closed, and the loop printed an EBADF traceback at one stop of an
    in-process stack in four (grpc/grpc#36096 silences its BlockingIOError twin). Its other twin:
    the reader, on a loop that runs on, hands an event to a stopped server's loop, closed by
    then ("Event loop is closed"; a failure-injection review saw it where one replica of a
    stack stopped). Nothing is lost: the queue is gone with the last server, and the next
    server makes a new one."""
    err = context.get("exception")
    closed = (isinstance(err, OSError) and err.errno == errno.EBADF
              or isinstance(err, RuntimeError) and str(err) == "Event loop is closed")
    if closed and _raised_in(err, "_handle_events"):
        log.debug("grpc.aio's completion queue was shut down under a pending read (%s)", err)
        return
    loop.default_exception_handler(context)


def _raised_in(err: BaseException, function: str) -> bool:
    """Whether ``function`` is on the stack ``err`` was raised through."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name.endswith(function):
            return True
        tb = tb.tb_next
    return False


def run_until_terminated(factory: Callable[[], Awaitable[RunningServer]], banner: str,
                         parser: argparse.ArgumentParser, grace_s: float = 5.0) -> None:
    """For ``python -m <service>``: start, print where it listens (for launchers to parse), serve.
    A setting refused while starting (a model that does not load, a port in use) is named by its
    flag (``refuse_setting``). SIGTERM, SIGHUP or Ctrl-C stops it gracefully: new calls are refused and
    those in flight get ``grace_s`` to finish (a service manager's stop used to kill them); a
    second signal stops it at once. transformers keeps to its errors: a service's log is what an
    operator reads, and its loading bars filled it (the CLI's servers had them off already)."""
    from mirrorspec.models.loading import quiet_transformers

    quiet_transformers()

    async def main() -> None:
        running = await factory()
        print(f"{banner} listening on port {running.port}", flush=True)
        stopping = stop_gracefully_on_signals(running, grace_s, banner)
        await running.server.wait_for_termination()
        for stop in stopping:  # it closes the servicers once the server has stopped
            await stop

    try:
        asyncio.run(main())
    except InvalidRequest as err:
        refuse_setting(parser, err)
    except KeyboardInterrupt:
        pass
