"""Python clients for a mirrorspec front door (GenerationService), sync and asyncio.

    client = Client("127.0.0.1:50051")
    result = client.generate("Write a haiku", temperature=0.7, seed=1)
    for chunk in client.stream("Tell me a story"):
        print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal

import grpc

from mirrorspec.config import (InvalidRequest, as_scalar, check_address, check_seed, check_text, check_unsigned,
                               is_integer, is_real)
from mirrorspec.serving.errors import FIELD_METADATA
from mirrorspec.v1 import common_pb2, generation_pb2, generation_pb2_grpc

# a server back at its address is reached within this (gRPC's default grows to 120 s); servers'
# channels to their backends take it too (``mirrorspec.serving.server.BACKEND_CHANNEL_OPTIONS``)
MAX_RECONNECT_BACKOFF_MS = 5_000
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # a front door that restarts (Ray restarts its actor on a crash) is back within seconds; gRPC's
    # reconnect backoff, shared by every channel of the process to that address, grows to 120 s
    # by default, and a client kept failing fast with UNAVAILABLE for minutes after it was back
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]
# servers take pings from a client this often at most (``mirrorspec.serving.server.keepalive_options``);
# a client that pings more often is told to go away (GOAWAY, too_many_pings) and its calls fail
MIN_KEEPALIVE_S = 1.0
MAX_KEEPALIVE_S = (2 ** 31 - 1) // 1000  # gRPC takes the ping interval in int32 milliseconds
DEFAULT_KEEPALIVE_S = 30.0
# gRPC adds a call's timeout to the clock in int64 nanoseconds: a timeout of 2**63 ns (292 years)
# or more wrapped around, and every call failed at once with DEADLINE_EXCEEDED
MAX_TIMEOUT_S = 1e9  # 31 years: longer is no deadline


def keepalive_channel_options(keepalive_s: float | None) -> list[tuple[str, int]]:
    """While a call is open, ping the front door every ``keepalive_s`` and drop the connection
    (the call fails with UNAVAILABLE) if a ping goes unanswered that long. A front door whose host
    died or was cut off sends no FIN: a request would wait for its deadline, or for ever without
    one, where TCP takes hours to give up. None (or infinity): no pings."""
    if keepalive_s is None or (is_real(keepalive_s) and keepalive_s == math.inf):
        return []
    if not is_real(keepalive_s):
        raise InvalidRequest(f"must be a number of seconds, or None for no pings; got {keepalive_s!r}",
                             field="keepalive_s")
    if not MIN_KEEPALIVE_S <= keepalive_s <= MAX_KEEPALIVE_S:  # nan too
        raise InvalidRequest(f"must be in [{MIN_KEEPALIVE_S:g}, {MAX_KEEPALIVE_S}] s (servers refuse pings more "
                             f"often, and gRPC counts the interval in int32 milliseconds), or None for no pings; "
                             f"got {keepalive_s}", field="keepalive_s")
    return [*ping_options(keepalive_s), ("grpc.keepalive_permit_without_calls", 0)]


def ping_options(every_s: float) -> list[tuple[str, int]]:
    """A ping every ``every_s`` on a connection with calls open, and the connection dropped when
    one goes unanswered that long; for clients and servers alike. The keepalive time and timeout
    alone do nothing: after two pings without data gRPC waits five minutes between pings, and a
    minute for an answer (traced with GRPC_TRACE=http_keepalive)."""
    ms = int(every_s * 1000)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.http2.min_sent_ping_interval_without_data_ms", ms),
            ("grpc.http2.min_time_between_pings_ms", ms), ("grpc.http2.ping_timeout_ms", ms)]


# gRPC's own name schemes (a front door behind a Unix socket, DNS with a resolver authority) pass as
# they are; anything else must be host:port, as servers print it
GRPC_TARGET_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def check_target(address: str, field: str = "address") -> str:
    """gRPC dials a bare host at port 443 and reads a URL as a host name; either would surface only
    as UNAVAILABLE on the first call."""
    if not isinstance(address, str):  # a port alone met "'int' object has no attribute 'startswith'"
        raise InvalidRequest(f"expected host:port as a str (e.g. '127.0.0.1:50051'), got {address!r}", field=field)
    scheme = next((s for s in GRPC_TARGET_SCHEMES if address.startswith(s)), None)
    if scheme is None:
        return check_address(address, field)
    if not address[len(scheme):].strip("/"):  # gRPC logs "target uri is not valid", and the first call fails
        raise InvalidRequest(f"{address!r} names no {scheme[:-1]} target after its scheme (e.g. "
                             f"'unix:/tmp/mirrorspec.sock', 'dns:///host:50051')", field=field)
    return address


def check_timeout(timeout_s: float | None) -> float | None:
    """Each call's deadline in seconds, None (or infinity, or above ``MAX_TIMEOUT_S``) for none:
    gRPC failed every call at once with DEADLINE_EXCEEDED for those, 0, a negative or NaN, and
    with a TypeError for a str."""
    if timeout_s is None or (is_real(timeout_s) and timeout_s > MAX_TIMEOUT_S):  # infinity too
        return None
    if not (is_real(timeout_s) and math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidRequest(f"must be a finite number of seconds > 0, or None for no deadline; got {timeout_s!r}",
                             field="timeout_s")
    return float(timeout_s)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    seed: int
    stats: generation_pb2.RequestStats
    prompt_tokens: int = 0


def build_request(prompt: str | Sequence[int] | Sequence[dict] | None = None, *, raw: bool = False,
                  max_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | None = None, stop: str | Sequence[str] = (), stop_token_ids: int | Sequence[int] = (),
                  k: int | None = None, mirror: bool | None = None,
                  timeline: bool = False, ignore_eos: bool = False) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from Python values: a str is a user message (or raw text with raw=True),
    a list of ints is token ids, a list of {"role", "content"} dicts is a chat. ``stop`` and
    ``stop_token_ids`` take one value or a list, as OpenAI's API does. ``max_tokens``, ``k`` and
    ``mirror`` left as None take the server's defaults; ``ignore_eos`` runs the output past the
    model's EOS (to max_tokens, or a stop the request names). Values a request cannot carry (a negative
    count, a seed past 2**64, a top_p of 0 or a max_tokens of 0, which the wire reads as unset)
    raise ``InvalidRequest`` naming the argument, not protobuf's bare "Value out of range"; the
    server checks everything else."""
    seed = check_seed(seed)
    check_prompt(prompt)
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not (is_real(value) or isinstance(value, Decimal)):
            raise InvalidRequest(f"{name} must be a number, got {value!r}", field=name)
        try:
            float(value)
        except OverflowError:  # an int past a double's range met protobuf's bare "int too large to convert"
            raise InvalidRequest(f"{name} must be a number a double holds, got one of {len(str(abs(value)))} digits",
                                 field=name) from None
    raw = as_scalar(raw)
    if not isinstance(raw, bool):
        raise InvalidRequest(f"raw must be True or False, got {raw!r}", field="raw")
    if raw and not isinstance(prompt, str):  # token ids and chats were sent as they are, raw or not
        raise InvalidRequest("raw=True sends a str prompt as text, without the chat template; token ids and chat "
                             "messages take no template anyway: drop raw, or pass the prompt as a str", field="raw")
    mirror = as_scalar(mirror)  # numpy's bool, a 0-d tensor
    if mirror is not None and not isinstance(mirror, bool):
        raise InvalidRequest(f"mirror must be True, False or None (the server's default), got {mirror!r}",
                             field="mirror")
    stop = () if stop is None else stop  # as OpenAI's API takes it
    stop_token_ids = () if stop_token_ids is None else stop_token_ids
    # a str is one stop, not one per letter; an id is refused below, naming stop_token_ids
    stop = [stop] if isinstance(stop, str) or is_integer(stop) else _listed(stop, "stop", "strings")
    for text in stop:
        if not isinstance(text, str):  # an id belongs in stop_token_ids
            raise InvalidRequest(f"stop takes strings; got {text!r} (stop token ids go in stop_token_ids)",
                                 field="stop")
        check_text(text, "stop")
    stop_token_ids = ([stop_token_ids] if is_integer(stop_token_ids)  # numpy's ints, a 0-d tensor too
                      else _listed(stop_token_ids, "stop_token_ids", "token ids"))
    if max_tokens is not None and is_integer(max_tokens) and max_tokens == 0:  # the wire reads 0 as unset
        raise InvalidRequest("max_tokens must be >= 1, or None for the server's default; got 0", field="max_tokens")
    timeline, ignore_eos = as_scalar(timeline), as_scalar(ignore_eos)
    for name, value in (("timeline", timeline), ("ignore_eos", ignore_eos)):
        if not isinstance(value, bool):
            raise InvalidRequest(f"{name} must be True or False, got {value!r}", field=name)
    if top_p == 0:  # the server refuses the rest of what lies outside (0, 1]; this it would read as unset
        raise InvalidRequest("top_p must be in (0, 1] (1 = off), got 0, which the wire reads as unset (off)",
                             field="top_p")
    for name, value in (("max_tokens", max_tokens), ("top_k", top_k), ("k", k)):
        check_unsigned(name, value, 32, name)
    token_prompt = prompt is not None and not isinstance(prompt, str) and not (len(prompt) and isinstance(prompt[0], dict))
    for name, ids in (("stop_token_ids", stop_token_ids), ("prompt", prompt if token_prompt else ())):
        for token in ids:
            check_unsigned(name, token, 32, f"a token id in {name}")
    request = generation_pb2.GenerateRequest(
        params=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                         max_new_tokens=max_tokens or 0, stop_token_ids=stop_token_ids),
        stop=stop)
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        if raw:
            request.raw_text = prompt
        else:
            request.text = prompt
    elif prompt is not None and len(prompt) and isinstance(prompt[0], dict):
        request.chat.messages.extend(_chat_message(i, m) for i, m in enumerate(prompt))
    elif prompt is not None:
        request.token_ids.ids.extend(int(t) for t in prompt)
    if seed is not None:
        request.seed = seed
    if k is not None:
        request.num_speculative_tokens = k
    if mirror is not None:
        request.mirror = mirror
    request.timeline, request.ignore_eos = timeline, ignore_eos
    return request


def _listed(values, field: str, what: str) -> list:
    """One value or a list of them: bytes, and a value that is no list, met a bare TypeError or
    went out one entry per byte."""
    if isinstance(values, (bytes, bytearray)):
        raise InvalidRequest(f"{field} is bytes; decode it to a str first", field=field)
    if isinstance(values, dict):  # went out as its keys
        raise InvalidRequest(f"{field} takes one of its {what} or a list of them, got a dict", field=field)
    try:
        return list(values)
    except TypeError:
        raise InvalidRequest(f"{field} takes one of its {what} or a list of them, got {values!r}", field=field) from None


def check_prompt(prompt) -> None:
    """A str, a sequence of token ids or of chat messages, or None: anything else met a bare
    TypeError naming no argument, and bytes went out as token ids, one per byte."""
    if isinstance(prompt, (bytes, bytearray)):
        raise InvalidRequest("prompt is bytes; decode it to a str first (prompt.decode('utf-8')), or pass token ids "
                             "as a list of ints", field="prompt")
    if isinstance(prompt, dict):
        raise InvalidRequest("prompt is one chat message; a chat is a list of them: [message]", field="prompt")
    if getattr(prompt, "ndim", None) == 0:  # a 0-d tensor or array has __len__, which raises
        raise InvalidRequest("prompt is one token id (a 0-d tensor or array); pass a list of ids, e.g. [id]",
                             field="prompt")
    sized = hasattr(prompt, "__len__") and hasattr(prompt, "__getitem__")  # a numpy array or tensor of ids too
    if prompt is not None and not isinstance(prompt, str) and not sized:
        raise InvalidRequest(f"prompt must be a str, a list of token ids or a list of chat messages, got "
                             f"{type(prompt).__name__}", field="prompt")


def _chat_message(index: int, message: dict) -> generation_pb2.ChatMessage:
    if not isinstance(message, dict):
        raise InvalidRequest(f"chat message {index} must be a dict with a role and a content, got "
                             f"{type(message).__name__}", field="prompt")
    unknown = sorted(set(message) - {"role", "content"})
    if unknown:
        raise InvalidRequest(f"chat message {index} has keys {unknown} a request cannot carry; a message has a role "
                             f"and a content only", field="prompt")
    for key, value in message.items():
        if not isinstance(value, str):
            parts = " (content parts are not taken: join their text into one str)" if isinstance(value, list) else ""
            raise InvalidRequest(f"chat message {index}: its {key} must be a str, got {type(value).__name__}{parts}",
                                 field="prompt")
        check_text(value, "prompt")
    return generation_pb2.ChatMessage(**message)


def _completion(response: generation_pb2.GenerateResponse) -> Completion:
    return Completion(response.text, list(response.token_ids), response.finish_reason, response.seed,
                      response.stats, response.prompt_tokens)


class NotAFrontDoor(InvalidRequest):
    """The server at the client's address answers gRPC, but not GenerationService: a drafter's or
    a target's address given for the front door's. gRPC says only "Method not found!"."""

    def __init__(self, address: str, details: str | None):
        super().__init__(f"{address} answers gRPC but not as a mirrorspec front door ({details}): a drafter's or "
                         f"target's address, or a front door too old for this call? Pass the address `mirrorspec "
                         f"serve` printed", field="address")


# the front door names a refused field as the protocol does; the client, as its caller typed it
ARGUMENT_FOR_FIELD = {"max_new_tokens": "max_tokens", "num_speculative_tokens": "k", "text": "prompt",
                      "raw_text": "prompt", "token_ids": "prompt", "chat": "prompt", "input_ids": "prompt",
                      "input": "prompt"}
REFUSAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


class RequestRefused(InvalidRequest, grpc.RpcError):
    """The front door refused an argument (INVALID_ARGUMENT, OUT_OF_RANGE). An ``InvalidRequest``
    naming the argument as the caller passed it (``max_tokens``, not the wire's ``max_new_tokens``),
    as the client's own checks raise for the same argument: code catching ``InvalidRequest`` saw
    half the refusals as a bare ``RpcError`` (a review's find). Still the ``RpcError`` it was:
    ``code()``, ``details()`` and ``trailing_metadata()`` are the call's, and the rest of the call
    (``debug_error_string()``, ...) is reached through it while it is at hand. It pickles as its
    values (a Ray task or a process pool may carry it), without the call."""

    def __init__(self, message: str, field: str | None, code: grpc.StatusCode, details: str,
                 trailing_metadata: tuple = (), call: grpc.RpcError | None = None):
        super().__init__(message, field=field)
        self._code, self._details, self._trailing = code, details, tuple(trailing_metadata)
        self.call = call

    @classmethod
    def of(cls, call: grpc.RpcError) -> RequestRefused:
        trailing = tuple((key, value) for key, value in (call.trailing_metadata() or ()))
        wire_field = dict(trailing).get(FIELD_METADATA)
        return cls(f"the front door refused the request: {call.details()}",
                   ARGUMENT_FOR_FIELD.get(wire_field, wire_field), call.code(), call.details(), trailing, call)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing

    def __reduce__(self):
        return type(self), (str(self), self.field, self._code, self._details, self._trailing)

    def __getattr__(self, name: str):
        call = self.__dict__.get("call")
        if call is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(call, name)


class ClientClosed(grpc.RpcError):
    """The client was closed, before this call or while it ran. grpc.aio ends a call under way
    with a bare ``CancelledError``, which a ``TaskGroup`` takes for a cancelled task and drops
    with no error: the work was lost in silence. A closed sync channel raised a bare
    ``ValueError`` (both a review's finds), and a sync call under way when its client closed a
    bare CANCELLED "Channel closed!", which names neither the client nor what became of the
    request (a soak review). Its code is CANCELLED, as grpc's own is."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return str(self)

    def trailing_metadata(self) -> tuple:
        return ()


@contextmanager
def _front_door_answers(address: str):
    try:
        yield
    except grpc.RpcError as err:  # a sync call's error is a grpc.Call, an asyncio one's an AioRpcError: both have code()
        code = err.code() if callable(getattr(err, "code", None)) else None
        if code == grpc.StatusCode.UNIMPLEMENTED:
            raise NotAFrontDoor(address, err.details()) from err
        if code in REFUSAL_CODES and not isinstance(err, RequestRefused):
            raise RequestRefused.of(err) from err
        raise


@contextmanager
def _closing_is_an_error(address: str):
    """A ``CancelledError`` that no one sent this task (it is not being cancelled) came from the
    channel closing under the call: raised as ``ClientClosed``."""
    try:
        yield
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling() == 0:
            raise closed_under_the_call("AsyncClient", address) from None
        raise


def closed_under_the_call(kind: str, address: str) -> ClientClosed:
    return ClientClosed(f"the {kind} of {address} was closed while this call ran; its result is lost (the front "
                        f"door freed its sessions): close the client after its calls end")


@contextmanager
def _closing_is_an_error_sync(client: Client):
    """A sync call that fails CANCELLED because its client closed under it: raised as ``ClientClosed``."""
    try:
        yield
    except grpc.RpcError as err:
        if client.closed and not isinstance(err, ClientClosed) and err.code() == grpc.StatusCode.CANCELLED:
            raise closed_under_the_call("Client", client.address) from err
        raise


REQUEST_ARGUMENTS = frozenset(list(inspect.signature(build_request).parameters)[1:])


def _request(call: str, prompt, arguments: dict) -> generation_pb2.GenerateRequest:
    """``build_request`` for a client call, whose unknown argument was reported as ``build_request``'s."""
    unknown = sorted(set(arguments) - REQUEST_ARGUMENTS)
    if unknown:
        raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r}; it takes the prompt, "
                        f"timeout_s (this call's deadline) and {', '.join(sorted(REQUEST_ARGUMENTS))}")
    return build_request(prompt, **arguments)


CLIENT_DEADLINE = object()  # a call's timeout_s left out: the client's ``timeout_s``


class _Stream:
    """A GenerateStream call whose UNIMPLEMENTED answer is raised as ``NotAFrontDoor``; the rest
    (``cancel()``, ``code()``, ...) is the call's own. It closes as a generator does (``close()``,
    ``contextlib.closing``, ``with``), which cancels the call and frees its sessions: each raised
    AttributeError on grpc's call object (a review's find)."""

    def __init__(self, call, client: Client):
        self._call, self._client = call, client
        self._closed = False

    def __iter__(self) -> _Stream:
        return self

    def close(self) -> None:
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __next__(self) -> generation_pb2.GenerateStreamResponse:
        if self._closed:  # a loop that closed its stream ends, as a generator's does
            raise StopIteration
        try:
            with _closing_is_an_error_sync(self._client), _front_door_answers(self._client.address):
                return next(self._call)
        except grpc.RpcError:
            if self._closed:  # closed from another thread while this waited
                raise StopIteration from None
            raise

    def __getattr__(self, name: str):
        return getattr(self._call, name)


class _Deadlines:
    """The address and deadlines both clients keep: each call's (``timeout_s``), which a call may
    set for itself."""

    def __init__(self, address: str, timeout_s: float | None):
        self.timeout_s = check_timeout(timeout_s)
        self.address = check_target(address)

    def _deadline(self, timeout_s) -> float | None:
        return self.timeout_s if timeout_s is CLIENT_DEADLINE else check_timeout(timeout_s)


class Client(_Deadlines):
    """``timeout_s``: each call's deadline (None or infinity: none); ``keepalive_s``: ``keepalive_channel_options``."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout_s: float | None = None,
                 keepalive_s: float | None = DEFAULT_KEEPALIVE_S):
        super().__init__(address, timeout_s)
        self.closed = False
        self.channel = grpc.insecure_channel(self.address,
                                             options=[*CHANNEL_OPTIONS, *keepalive_channel_options(keepalive_s)])
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    def generate(self, prompt=None, *, timeout_s=CLIENT_DEADLINE, **kwargs) -> Completion:
        """``kwargs``: ``build_request``'s; ``timeout_s``: this call's deadline, if not the client's."""
        request = _request("generate", prompt, kwargs)
        with _closing_is_an_error_sync(self), _front_door_answers(self.address):
            return _completion(self._open().Generate(request, timeout=self._deadline(timeout_s)))

    def stream(self, prompt=None, *, timeout_s=CLIENT_DEADLINE,
               **kwargs) -> Iterator[generation_pb2.GenerateStreamResponse]:
        request = _request("stream", prompt, kwargs)
        return _Stream(self._open().GenerateStream(request, timeout=self._deadline(timeout_s)), self)

    def model_info(self, *, timeout_s=CLIENT_DEADLINE) -> generation_pb2.ModelInfoResponse:
        with _closing_is_an_error_sync(self), _front_door_answers(self.address):
            return self._open().ModelInfo(generation_pb2.ModelInfoRequest(), timeout=self._deadline(timeout_s))

    def _open(self) -> generation_pb2_grpc.GenerationServiceStub:
        if self.closed:
            raise ClientClosed(f"this Client of {self.address} was closed; make a new one")
        return self.stub

    def close(self) -> None:
        self.closed = True
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Deadlines):
    """As ``Client``, for asyncio. Its channel opens on first use, on the event loop that uses it:
    grpc.aio binds a channel to the loop it was made on, and a client made before ``asyncio.run``
    (at module level, say) failed every call with "attached to a different loop". A client used
    again after its loop closed (a second ``asyncio.run``) opens a new channel on the new loop."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout_s: float | None = None,
                 keepalive_s: float | None = DEFAULT_KEEPALIVE_S):
        super().__init__(address, timeout_s)
        self._options = [*CHANNEL_OPTIONS, *keepalive_channel_options(keepalive_s)]
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationServiceStub | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def channel(self) -> grpc.aio.Channel:
        loop = asyncio.get_running_loop()
        if self._channel is not None and loop is not self._loop:
            if not self._loop.is_closed():
                raise InvalidRequest("this AsyncClient serves the event loop it was first used on, which still runs: "
                                     "make one AsyncClient per event loop", field="address")
            self._channel = None  # its loop is gone, and with it anything the channel could still do
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
            self._loop = loop
        return self._channel

    @property
    def stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        self.channel  # noqa: B018 - opens it on this loop, or checks the loop it was opened on
        return self._stub

    async def generate(self, prompt=None, *, timeout_s=CLIENT_DEADLINE, **kwargs) -> Completion:
        """``kwargs``: ``build_request``'s; ``timeout_s``: this call's deadline, if not the client's."""
        request = _request("generate", prompt, kwargs)
        with _closing_is_an_error(self.address), _front_door_answers(self.address):
            return _completion(await self.stub.Generate(request, timeout=self._deadline(timeout_s)))

    def stream(self, prompt=None, *, timeout_s=CLIENT_DEADLINE,
               **kwargs) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """A stream left early (``break``, then ``aclose()`` or the generator dropped) cancels its
        call, which frees its sessions on the server: it ran on for nobody, to ``max_tokens``. Its
        arguments are checked here, at the call, as the sync client's are (they were checked at
        the first ``__anext__``)."""
        return self._stream(_request("stream", prompt, kwargs), self._deadline(timeout_s))

    async def _stream(self, request, timeout_s: float | None) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        call = self.stub.GenerateStream(request, timeout=timeout_s)
        try:
            with _closing_is_an_error(self.address), _front_door_answers(self.address):
                async for chunk in call:
                    yield chunk
        finally:
            call.cancel()

    async def model_info(self, *, timeout_s=CLIENT_DEADLINE) -> generation_pb2.ModelInfoResponse:
        with _closing_is_an_error(self.address), _front_door_answers(self.address):
            return await self.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=self._deadline(timeout_s))

    async def close(self) -> None:
        """Closes the channel on its own event loop. From another loop, while its own still runs,
        it is refused, as a call from there is: it dropped the channel unclosed, and the calls on
        its loop ran on and opened a second one (a review's find)."""
        if self._channel is not None and self._loop is not asyncio.get_running_loop():
            if not self._loop.is_closed():
                raise InvalidRequest("this AsyncClient serves the event loop it was first used on, which still runs: "
                                     "close it there (asyncio.run_coroutine_threadsafe(client.close(), that_loop))",
                                     field="address")
        elif self._channel is not None:
            await self._channel.close()
        self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
