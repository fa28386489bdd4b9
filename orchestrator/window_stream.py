"""A session's window calls as messages on one bidirectional gRPC stream.

A unary call to a server that has been idle (as a target is while the drafter drafts, and the
other way round) pays for setting up a call on cold caches and woken cores: on the 2-core CI VM
a bare unary echo took 0.96-1.24 ms after a 10 ms pause, and a message on an open stream
0.67-0.76 ms. So each session keeps one stream per replica for its window calls
(``VerifyWindows``, ``DraftWindows``); the answers come back in order.

A sync stream's ``next()`` takes no timeout, so per-window deadlines come from a ``Watchdog``:
one thread per pool that cancels a stream whose window outlived its deadline, which the caller
then reports as DEADLINE_EXCEEDED, exactly as a unary call with ``timeout=`` would.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import grpc

_END = object()  # ends the request iterator: the client half-closes the stream


class StreamStatus(grpc.RpcError):
    """A status the caller's side of a window stream decides (a missed deadline, a stream the
    server ended without answering); reads like the status of a unary call."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__()
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"


class _Armed:
    """One pending window's deadline, and whether the watchdog fired on it."""

    __slots__ = ("deadline", "call", "fired")

    def __init__(self, deadline: float, call: grpc.Call):
        self.deadline = deadline
        self.call = call
        self.fired = False


class Watchdog:
    """Cancels calls whose deadline passed. Windows arm it one after another with the same
    timeout, so a new deadline is never the earliest one and arming wakes nothing: the thread
    wakes about once per timeout, not once per window."""

    def __init__(self, name: str):
        self._name = name
        self._changed = threading.Condition()
        self._armed: set[_Armed] = set()
        self._wakes_at = float("inf")
        self._thread: threading.Thread | None = None
        self._stopped = False

    def arm(self, timeout_s: float, call: grpc.Call) -> _Armed:
        armed = _Armed(time.monotonic() + timeout_s, call)
        with self._changed:
            self._armed.add(armed)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if armed.deadline < self._wakes_at:
                self._changed.notify()
        return armed

    def disarm(self, armed: _Armed) -> bool:
        """Whether the deadline had already fired."""
        with self._changed:
            self._armed.discard(armed)
            return armed.fired

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._stopped:
                    return
                now = time.monotonic()
                expired = [a for a in self._armed if a.deadline <= now]
                for armed in expired:
                    armed.fired = True
                    self._armed.discard(armed)
                self._wakes_at = min((a.deadline for a in self._armed), default=float("inf"))
                if not expired:
                    self._changed.wait(None if self._wakes_at == float("inf") else self._wakes_at - now)
            for armed in expired:  # outside the lock: the caller's next() raises, and it sees ``fired``
                armed.call.cancel()


class WindowStream:
    """One session's stream to one replica. ``open_stream(requests)`` starts the call (e.g.
    ``stub.VerifyWindows``). Any error ends the stream, and the next call opens a new one."""

    def __init__(self, open_stream: Callable, watchdog: Watchdog):
        self._open_stream = open_stream
        self._watchdog = watchdog
        self._requests: queue.SimpleQueue | None = None
        self._responses = None

    def call(self, request, timeout_s: float | None):
        if self._responses is None:
            self._requests = queue.SimpleQueue()
            self._responses = self._open_stream(iter(self._requests.get, _END))
        self._requests.put(request)
        armed = self._watchdog.arm(timeout_s, self._responses) if timeout_s is not None else None
        try:
            return next(self._responses)
        except StopIteration:  # the server closed the stream without answering (shutting down)
            self.close()
            raise StreamStatus(grpc.StatusCode.UNAVAILABLE,
                               "the replica closed the window stream without answering") from None
        except grpc.RpcError:
            self.close()
            if armed is not None and self._watchdog.disarm(armed):
                raise StreamStatus(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no answer to the window within {timeout_s:g} s") from None
            raise
        finally:
            # a deadline that fired just as the answer came still cancels this stream: the next
            # window must open a new one, not read CANCELLED from it as if the replica were gone
            if armed is not None and self._watchdog.disarm(armed):
                self.close()

    def close(self) -> None:
        """Half-close: the server finishes the stream once it has answered what it was sent."""
        if self._requests is not None:
            self._requests.put(_END)
        self._requests = self._responses = None
