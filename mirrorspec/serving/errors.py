"""Domain errors and the one interceptor that turns them into gRPC status codes.

Servicers raise plain Python exceptions; this module is the single place that decides which
status a client sees, so every server answers the same mistake the same way and none crashes.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from mirrorspec.config import InvalidRequest, OutOfRange

log = logging.getLogger(__name__)

FIELD_METADATA = "mirrorspec-field"  # trailing metadata of an INVALID_ARGUMENT / OUT_OF_RANGE: the field
# a status message travels as trailing metadata, percent-encoded outside printable ASCII (up to 3x),
# where gRPC's limit is 8 KB (16 KB hard): one that quotes a long input back would replace the
# status with RESOURCE_EXHAUSTED "received metadata size exceeds hard limit"
MAX_MESSAGE_BYTES = 2000


class SessionNotFound(KeyError):
    def __str__(self) -> str:
        return (f"unknown session {self.args[0]!r}: it was closed, expired or never opened; "
                f"open a new one with OpenSession")


class SessionClosed(SessionNotFound):
    """A call reached the compute lane after its session was closed (``ComputeLane.run_for``)."""

    def __str__(self) -> str:
        return ("the session was closed (by its caller, or as it expired) while this call waited for the model; "
                "open a new one with OpenSession")


class SessionIdTaken(RuntimeError):
    """An open with a caller's id that is open already, or was closed before its open came."""


class SessionLimitReached(RuntimeError):
    """The replica holds as many sessions as it is configured for."""


class ContextMismatch(RuntimeError):
    """The caller's view of a session's context disagrees with the server's."""


class NoReplicaAvailable(RuntimeError):
    """No replica of a pool could take a session (none registered, all failed or full)."""


class StoppedBeforeDone(RuntimeError):
    """The server stopped before this call finished (its shutdown grace ran out): UNAVAILABLE, to
    send again elsewhere. gRPC's own stop ended such calls with "Cancelling all calls", which says
    neither that the server stopped nor what to do (a soak review)."""


class ReplicaLost(RuntimeError):
    """This replica can serve no more (a tensor-parallel rank died mid-operation): UNAVAILABLE,
    which callers read as the replica gone, so its sessions move and their requests go on."""


def status_for(err: BaseException) -> grpc.StatusCode:
    if isinstance(err, OutOfRange):
        return grpc.StatusCode.OUT_OF_RANGE
    if isinstance(err, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(err, SessionLimitReached):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(err, SessionIdTaken):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(err, ContextMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(err, (NoReplicaAvailable, ReplicaLost, StoppedBeforeDone)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        # a backend refused or failed: pass on what the caller can act on, else UNAVAILABLE
        if err.code() in BACKEND_COMPUTE_FAILED:
            return grpc.StatusCode.INTERNAL
        return err.code() if err.code() in _PASS_THROUGH else grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# a backend's model raised on the request (NaN logits, out of memory): its session moved to another
# replica once where one was free, so what reaches the caller failed there too. UNAVAILABLE said
# "retry", and a client retrying a request whose target turns out NaN never ends (a docs review)
BACKEND_COMPUTE_FAILED = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class ExceptionToStatusInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary and streaming-response handler; unknown errors become INTERNAL, logged.

    A method's handler never changes, so each is wrapped once and reused: the interceptor sits
    on every Draft and Verify, where a per-call rebuild is measurable overhead.

    ``refused``: per full service name, what to tell when one of its requests does not parse.
    Such a request is answered here, before its servicer sees it, so a servicer that counts the
    requests it refuses (the front door's metrics) counted none of these."""

    def __init__(self, refused: dict[str, Callable[[grpc.StatusCode], None]] | None = None) -> None:
        self._wrapped: dict[str, object] = {}
        self._refused = dict(refused or {})

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrapped[method] = self._wrap(await continuation(handler_call_details), method)
        return wrapped

    def _wrap(self, handler, method: str):
        if handler is None:
            return None
        service = method.lstrip("/").rpartition("/")[0]  # "/mirrorspec.v1.GenerationService/Generate"
        parse = _parsing(handler.request_deserializer, method, self._refused.get(service))
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=parse, response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_streaming(handler.unary_stream, method, _checked),
                request_deserializer=parse, response_serializer=handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_streaming(handler.stream_stream, method, _each_checked),
                request_deserializer=parse, response_serializer=handler.response_serializer)
        return handler


class _Malformed:
    """What a request message that does not parse becomes, so that its handler answers
    INVALID_ARGUMENT: a deserializer that raised got UNKNOWN "Unexpected DecodeError" from gRPC."""

    def __init__(self, method: str, err: DecodeError):
        self.error = InvalidRequest(f"the {method} request does not parse as its protobuf message ({err}); build it "
                                    f"with the generated classes in mirrorspec.v1, or call through mirrorspec.Client")


def _parsing(deserialize: Callable[[bytes], object] | None, method: str,
             refused: Callable[[grpc.StatusCode], None] | None) -> Callable[[bytes], object] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserialize(data)
        except DecodeError as err:
            if refused is not None:
                refused(grpc.StatusCode.INVALID_ARGUMENT)
            return _Malformed(method, err)
    return parse


def _checked(request):
    if isinstance(request, _Malformed):
        raise request.error
    return request


async def _each_checked(requests: AsyncIterator) -> AsyncIterator:
    async for request in requests:
        yield _checked(request)


async def _abort(context: grpc.aio.ServicerContext, err: Exception, method: str) -> None:
    code = status_for(err)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method)
    message = str(err) or type(err).__name__
    if isinstance(err, grpc.RpcError) and hasattr(err, "details"):
        message = f"a backend answered {err.code().name}: {err.details()}"
    # the request field at fault, for clients that name their own setting for it (the CLI's flag)
    field = getattr(err, "field", None) if isinstance(err, InvalidRequest) else None
    await context.abort(code, capped(message), trailing_metadata=((FIELD_METADATA, field),) if field else ())


def capped(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``message`` cut to ``limit`` UTF-8 bytes, saying so, where it is longer."""
    raw = message.encode()
    if len(raw) <= limit:
        return message
    return raw[:limit].decode(errors="ignore") + f"... (message cut at {limit} bytes)"


def _wrap_streaming(fn: Callable, method: str, checked: Callable):
    """A streaming handler yields its responses, or is a coroutine that writes them with
    ``context.write`` (grpc_health's ``Watch``, which iterating answered INTERNAL)."""
    return _wrap_stream(fn, method, checked) if inspect.isasyncgenfunction(fn) else _wrap_unary(fn, method, checked)


def _wrap_unary(fn: Callable[..., Awaitable], method: str, checked: Callable = _checked):
    """``checked``: as for ``_wrap_stream``, for a coroutine that writes a stream's responses."""
    async def wrapped(request, context):
        try:
            return await fn(checked(request), context)
        except grpc.aio.AbortError:
            raise
        except Exception as err:  # noqa: BLE001 - mapped to a status, never a crash
            await _abort(context, err, method)
    return wrapped


def _wrap_stream(fn: Callable[..., AsyncIterator], method: str, checked: Callable):
    """``checked``: the request (``_checked``), or the request iterator (``_each_checked``)."""
    async def wrapped(request, context):
        try:
            async for item in fn(checked(request), context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as err:  # noqa: BLE001
            await _abort(context, err, method)
    return wrapped
