"""The package exports its gRPC clients as the data-plane issue names them (``mirrorspec.Client``)."""

import re
import subprocess
import sys
import time

import grpc
import pytest

from mirrorspec.client import Client
from mirrorspec.config import InvalidRequest


def test_the_clients_are_importable_from_the_package():
    import mirrorspec
    from mirrorspec import client

    assert (mirrorspec.Client, mirrorspec.AsyncClient) == (client.Client, client.AsyncClient)
    assert mirrorspec.NotAFrontDoor is client.NotAFrontDoor  # what the clients raise for a drafter's address
    assert (mirrorspec.RequestRefused, mirrorspec.ClientClosed) == (client.RequestRefused, client.ClientClosed)
    with pytest.raises(AttributeError, match="no attribute 'Clinet'"):
        mirrorspec.Clinet  # noqa: B018


def test_the_in_process_api_imports_no_grpc():
    code = "import sys, mirrorspec; mirrorspec.generate; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("kwargs, field", [
    ({"seed": -5}, "seed"), ({"seed": 2 ** 64}, "seed"), ({"seed": 1.5}, "seed"),
    ({"max_tokens": -1}, "max_tokens"), ({"top_k": -1}, "top_k"), ({"k": -2}, "k"),
    ({"stop_token_ids": [2, -1]}, "stop_token_ids"), ({"prompt": [5, -3, 7]}, "prompt"),
])
def test_a_value_a_request_cannot_carry_is_named_before_protobuf_refuses_it(kwargs, field):
    """protobuf's own error for these is a bare "Value out of range: -1" that names no argument."""
    from mirrorspec.client import build_request
    from mirrorspec.config import InvalidRequest

    kwargs = {"prompt": "hi", **kwargs}
    with pytest.raises(InvalidRequest, match=r"must be an integer in \[0, 2\*\*(32|64)\)") as err:
        build_request(**kwargs)
    assert err.value.field == field


def test_integer_like_values_are_sent_as_they_are():
    import numpy as np
    import torch

    from mirrorspec.client import build_request

    request = build_request([1, np.int64(2), torch.tensor(3)], seed=np.uint64(2 ** 64 - 1), max_tokens=np.int32(4))
    assert list(request.token_ids.ids) == [1, 2, 3]
    assert (request.seed, request.params.max_new_tokens) == (2 ** 64 - 1, 4)
    for one_id in (np.int64(3), torch.tensor(3)):  # "'numpy.int64' object is not iterable" (a user's review)
        assert list(build_request("hi", stop_token_ids=one_id).params.stop_token_ids) == [3]
    assert build_request("hi", timeline=np.bool_(True)).timeline is True
    assert build_request("hi", ignore_eos=np.bool_(True)).ignore_eos is True
    assert build_request("hi").params.max_new_tokens == 0  # unset: the server's default


@pytest.mark.parametrize("address", ["127.0.0.1", "http://127.0.0.1:50051", "localhost:port", "127.0.0.1:70000"])
def test_an_address_that_is_not_host_port_is_named_before_any_call(address):
    """gRPC would dial a bare host at port 443 and say only UNAVAILABLE on the first call."""
    from mirrorspec.client import AsyncClient, Client
    from mirrorspec.config import InvalidRequest

    for make in (Client, AsyncClient):
        with pytest.raises(InvalidRequest, match="expected host:port") as err:
            make(address)
        assert err.value.field == "address"


@pytest.mark.parametrize("address, says", [(50051, "expected host:port as a str"), (None, "as a str"),
                                           ("dns:", "names no dns target"), ("unix:", "names no unix target")])
def test_an_address_of_another_type_or_a_bare_scheme_is_named(address, says):
    """A port alone met "'int' object has no attribute 'startswith'"; a bare scheme passed, and
    gRPC logged "target uri is not valid" (a user's review)."""
    from mirrorspec.client import AsyncClient

    for make in (Client, AsyncClient):
        with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
            make(address)
        assert err.value.field == "address"


def test_grpc_target_schemes_pass_as_they_are():
    from mirrorspec.client import Client

    for target in ("unix:/tmp/mirrorspec.sock", "dns:///localhost:50051", "ipv4:127.0.0.1:50051"):
        Client(target).close()


def test_one_stop_string_or_id_is_one_stop_not_one_per_letter():
    """A str is a sequence of strs: stop="END" went out as three stops, "E", "N" and "D", and the
    output ended at the first of those letters."""
    from mirrorspec.client import build_request

    request = build_request("hi", stop="END", stop_token_ids=7)
    assert list(request.stop) == ["END"] and list(request.params.stop_token_ids) == [7]


@pytest.mark.parametrize("kwargs, field, says", [
    ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1]"),  # the wire reads 0 as "off": it sampled unfiltered
    ({"prompt": [{"role": "user", "content": "hi", "name": "ann"}]}, "prompt", "chat message 0 has keys ['name']"),
    # undecodable bytes, as a command line passes them on (lone surrogates): protobuf's UnicodeEncodeError before
    ({"prompt": "bad \udcff bytes"}, "prompt", "prompt is not valid UTF-8 text (undecodable bytes at character 4)"),
    ({"prompt": [{"role": "user", "content": "bad \udcff"}]}, "prompt", "prompt is not valid UTF-8 text"),
    ({"stop": ["ok", "\udcfe"]}, "stop", "stop is not valid UTF-8 text"),
    ({"stop": [1]}, "stop", "stop takes strings; got 1 (stop token ids go in stop_token_ids)"),  # AttributeError
    # a bare TypeError, or, for bytes, "stop takes strings; got 119" (a user's review)
    ({"stop": 3}, "stop", "stop takes strings; got 3 (stop token ids go in stop_token_ids)"),
    ({"stop": b"w8"}, "stop", "stop is bytes; decode it"),
    ({"stop_token_ids": 2.5}, "stop_token_ids", "stop_token_ids takes one of its token ids or a list of them"),
    ({"timeline": "no"}, "timeline", "timeline must be True or False, got 'no'"),
    ({"ignore_eos": 1}, "ignore_eos", "ignore_eos must be True or False, got 1"),
    # the wire reads 0 as unset: the server's default, 128 tokens, came back (a user's review)
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, or None for the server's default; got 0"),
    # the rest raised bare errors from protobuf or torch, or went out misread (a client review)
    ({"temperature": 10 ** 400}, "temperature", "temperature must be a number a double holds"),  # OverflowError
    ({"prompt": "hi", "raw": "yes"}, "raw", "raw must be True or False, got 'yes'"),
    ({"prompt": [1, 2], "raw": True}, "raw", "raw=True sends a str prompt as text"),  # ignored before
    ({"stop": {"END": 1}}, "stop", "stop takes one of its strings or a list of them, got a dict"),  # its keys
])
def test_values_the_wire_would_misread_or_protobuf_refuse_are_named(kwargs, field, says):
    from mirrorspec.client import build_request
    from mirrorspec.config import InvalidRequest

    with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
        build_request(**{"prompt": "hi", **kwargs})
    assert err.value.field == field


@pytest.mark.parametrize("kwargs, field, says", [
    ({"prompt": b"hello"}, "prompt", "prompt is bytes; decode it"),  # went out as token ids 104, 101, ...
    ({"prompt": 5}, "prompt", "prompt must be a str, a list of token ids or a list of chat messages, got int"),
    ({"prompt": iter([1, 2])}, "prompt", "got list_iterator"),
    ({"prompt": {"role": "user", "content": "hi"}}, "prompt", "prompt is one chat message; a chat is a list"),
    ({"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "prompt",
     "chat message 0: its content must be a str, got list (content parts are not taken"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}]}, "prompt",
     "chat message 1: its role must be a str, got int"),
    ({"prompt": [{"role": "user", "content": "a"}, "b"]}, "prompt", "chat message 1 must be a dict"),
    ({"temperature": "0.5"}, "temperature", "temperature must be a number, got '0.5'"),
    ({"top_p": None}, "top_p", "top_p must be a number"),
    ({"mirror": "no"}, "mirror", "mirror must be True, False or None"),
])
def test_arguments_of_the_wrong_type_are_named_not_met_with_a_bare_type_error(kwargs, field, says):
    """Each of these raised protobuf's or Python's own TypeError ("bad argument type for built-in
    operation"), naming no argument (review 19)."""
    from mirrorspec.client import build_request

    with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
        build_request(**{"prompt": "hi", **kwargs})
    assert err.value.field == field


def test_a_0_d_tensor_prompt_is_named_not_met_with_torchs_type_error():
    import torch

    from mirrorspec.client import build_request

    with pytest.raises(InvalidRequest, match=re.escape("prompt is one token id (a 0-d tensor or array)")) as err:
        build_request(torch.tensor(3))
    assert err.value.field == "prompt"
    assert list(build_request(torch.tensor([3, 4])).token_ids.ids) == [3, 4]


def test_an_argument_no_call_takes_is_named_for_the_call_not_for_build_request():
    """``generate("hi", timeout=5)`` raised "build_request() got an unexpected keyword argument",
    a function the caller never called (a client review)."""
    import asyncio

    from mirrorspec.client import AsyncClient

    with Client("127.0.0.1:1") as client, pytest.raises(TypeError, match=re.escape(
            "generate() got an unexpected keyword argument 'timeout'; it takes the prompt, timeout_s")):
        client.generate("hi", timeout=5)
    with pytest.raises(TypeError, match=re.escape("stream() got an unexpected keyword argument 'max_new_tokens'")):
        AsyncClient("127.0.0.1:1").stream("hi", max_new_tokens=5)  # at the call, as the sync client checks
    with pytest.raises(InvalidRequest, match="must be a finite number of seconds > 0") as err:
        asyncio.run(AsyncClient("127.0.0.1:1").generate("hi", timeout_s=-1))
    assert err.value.field == "timeout_s"


def test_numbers_and_bools_of_other_kinds_are_taken_as_they_were():
    """numpy's bool for mirror, and a Decimal temperature, went out before the type checks came."""
    from decimal import Decimal

    import numpy as np
    import torch

    from mirrorspec.client import build_request

    for flag in (np.bool_(True), torch.tensor(True)):
        assert build_request("hi", mirror=flag).mirror is True
    request = build_request("hi", temperature=Decimal("0.5"), top_p=np.float32(0.25))
    assert (request.params.temperature, request.params.top_p) == (0.5, 0.25)


def test_no_stops_may_be_given_as_none_as_openai_s_api_takes_them():
    from mirrorspec.client import build_request

    request = build_request("hi", stop=None, stop_token_ids=None)
    assert list(request.stop) == [] and list(request.params.stop_token_ids) == []


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), "5"])
def test_a_timeout_no_call_could_meet_is_refused_naming_it(timeout_s):
    """gRPC failed every call at once with DEADLINE_EXCEEDED (a str: a TypeError) (review 19)."""
    from mirrorspec.client import AsyncClient

    for make in (Client, AsyncClient):
        with pytest.raises(InvalidRequest, match="must be a finite number of seconds > 0, or None") as err:
            make("127.0.0.1:1", timeout_s=timeout_s)
        assert err.value.field == "timeout_s"


def test_an_infinite_timeout_is_no_deadline():
    with Client("127.0.0.1:1", timeout_s=float("inf")) as client:
        assert client.timeout_s is None
    # gRPC's deadline is the clock plus the timeout in int64 ns: 1e10 s wrapped, and every call
    # failed at once with DEADLINE_EXCEEDED, against a dead address too (a user's review)
    for beyond_any_deadline in (1e10, 2 ** 63):
        with Client("127.0.0.1:1", timeout_s=beyond_any_deadline) as client:
            assert client.timeout_s is None
    with Client("127.0.0.1:1", timeout_s=2) as client:
        assert client.timeout_s == 2.0


def test_the_async_client_is_an_async_context_manager():
    import asyncio

    from mirrorspec.client import AsyncClient

    async def use() -> bool:
        async with AsyncClient("127.0.0.1:1") as client:
            channel = client.channel
        return channel.get_state() == __import__("grpc").ChannelConnectivity.SHUTDOWN

    assert asyncio.run(use())


FROZEN_FRONT_DOOR = """
import sys, time, grpc
from concurrent.futures import ThreadPoolExecutor
from mirrorspec.serving.server import SERVER_OPTIONS, keepalive_options
from mirrorspec.v1 import generation_pb2

def model_info(request, context):
    return generation_pb2.ModelInfoResponse()

def generate_stream(request, context):
    time.sleep(3600)  # never answers: the test freezes this process anyway
    yield generation_pb2.GenerateStreamResponse()

service = "mirrorspec.v1.GenerationService"
handlers = grpc.method_handlers_generic_handler(service, {
    "ModelInfo": grpc.unary_unary_rpc_method_handler(
        model_info, generation_pb2.ModelInfoRequest.FromString, generation_pb2.ModelInfoResponse.SerializeToString),
    "GenerateStream": grpc.unary_stream_rpc_method_handler(
        generate_stream, generation_pb2.GenerateRequest.FromString,
        generation_pb2.GenerateStreamResponse.SerializeToString)})
server = grpc.server(ThreadPoolExecutor(4), options=[*SERVER_OPTIONS, *keepalive_options(30.0)])
server.add_generic_rpc_handlers((handlers,))
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


@pytest.mark.parametrize("keepalive_s", [1.0, None], ids=["pings", "no pings"])
def test_a_client_drops_a_front_door_that_stopped_answering_its_pings(keepalive_s):
    """A front door's host that dies or is cut off sends no FIN (a SIGSTOPped process stands in
    for it): with pings the stream fails with UNAVAILABLE within a few seconds; without, only
    the call's deadline ends it."""
    import signal

    server = subprocess.Popen([sys.executable, "-c", FROZEN_FRONT_DOOR], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        with Client(f"127.0.0.1:{port}", timeout_s=8.0, keepalive_s=keepalive_s) as client:
            client.model_info()  # connected while the server still answers
            server.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(client.stream([1, 2, 3]))
        waited = time.monotonic() - started
    finally:
        server.kill()
        server.wait(timeout=30)
    if keepalive_s is None:
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and waited < 7.0


@pytest.mark.parametrize("keepalive_s", [0.5, 0.0, -1.0, float("nan")])
def test_a_keepalive_shorter_than_servers_take_is_refused(keepalive_s):
    with pytest.raises(InvalidRequest, match=re.escape("must be in [1, 2147483] s (servers refuse pings more")) as err:
        Client("127.0.0.1:1", keepalive_s=keepalive_s)
    assert err.value.field == "keepalive_s"


@pytest.mark.parametrize("keepalive_s, says", [(3e6, "must be in [1, 2147483] s"), ("30", "must be a number")])
def test_a_keepalive_grpc_cannot_count_or_not_a_number_is_refused(keepalive_s, says):
    """3e6 s met OverflowError inside gRPC's option parsing; "30" a bare TypeError (a user's review)."""
    from mirrorspec.client import AsyncClient

    for make in (Client, AsyncClient):
        with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
            make("127.0.0.1:1", keepalive_s=keepalive_s)
        assert err.value.field == "keepalive_s"


def test_an_infinite_keepalive_is_no_pings():
    """OverflowError: cannot convert float infinity to integer (a user's review)."""
    from mirrorspec.client import keepalive_channel_options

    assert keepalive_channel_options(float("inf")) == keepalive_channel_options(None) == []
    Client("127.0.0.1:1", keepalive_s=float("inf")).close()


def test_a_server_that_is_not_a_front_door_is_named_not_met_with_method_not_found(not_a_front_door):
    """gRPC's own answer was UNIMPLEMENTED "Method not found!", naming neither the address nor
    what to pass instead."""
    from mirrorspec.client import NotAFrontDoor

    with Client(not_a_front_door, timeout_s=30) as client:
        for call in (lambda: client.generate([1, 2]), lambda: list(client.stream([1, 2])), client.model_info):
            with pytest.raises(NotAFrontDoor, match=re.escape(not_a_front_door)) as err:
                call()
            assert err.value.field == "address" and "not as a mirrorspec front door" in str(err.value)
            assert err.value.__cause__.code() == grpc.StatusCode.UNIMPLEMENTED
        stream = client.stream([1, 2])
        assert stream.code() == grpc.StatusCode.UNIMPLEMENTED  # the call's own methods, as before
        assert stream.details() == "Method not found!"


def test_the_async_client_names_a_server_that_is_not_a_front_door(not_a_front_door):
    import asyncio

    from mirrorspec.client import AsyncClient, NotAFrontDoor

    async def refusals() -> list[BaseException]:
        async with AsyncClient(not_a_front_door, timeout_s=30) as client:
            async def stream():
                return [chunk async for chunk in client.stream([1, 2])]
            return await asyncio.gather(client.generate([1, 2]), stream(), client.model_info(),
                                        return_exceptions=True)

    for refusal in asyncio.run(refusals()):
        assert isinstance(refusal, NotAFrontDoor) and not_a_front_door in str(refusal)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from served_stack import start_stack
    from support import save_tiny_llama

    root = tmp_path_factory.mktemp("client")
    served = start_stack(save_tiny_llama(root / "target", seed=0, vocab=16), save_tiny_llama(root / "draft", seed=1,
                                                                                             vocab=16))
    yield served
    served.stop()


def test_the_front_doors_refusal_names_the_argument_as_the_caller_passed_it(stack):
    """Refused by the server, ``max_tokens`` came back as a bare ``RpcError`` naming the wire's
    ``max_new_tokens``, where the client's own check of the same argument raises ``InvalidRequest``
    naming ``max_tokens`` (a client review). It is both now: code catching either sees it."""
    import asyncio
    import pickle

    from mirrorspec.client import AsyncClient, RequestRefused

    with Client(stack.address) as client:
        for kwargs, field, code in (({"max_tokens": 10 ** 6}, "max_tokens", grpc.StatusCode.OUT_OF_RANGE),
                                    ({"k": 100}, "k", grpc.StatusCode.OUT_OF_RANGE)):
            with pytest.raises(RequestRefused) as err:
                client.generate([0, 1, 2], **kwargs)
            assert isinstance(err.value, InvalidRequest) and isinstance(err.value, grpc.RpcError)
            assert (err.value.field, err.value.code()) == (field, code)
        with pytest.raises(RequestRefused) as err:
            next(iter(client.stream([0, 1, 2], max_tokens=10 ** 6)))
        assert err.value.field == "max_tokens"
        assert "max_new_tokens" in err.value.debug_error_string()  # the rest of the call, reached through it
        with pytest.raises(RequestRefused) as err:
            client.generate()  # no prompt: the wire names it "input"
        assert err.value.field == "prompt"
    again = pickle.loads(pickle.dumps(err.value))  # a Ray task or a process pool carries it
    assert (type(again), again.field, again.code(), again.details(), str(again)) == (
        RequestRefused, "prompt", err.value.code(), err.value.details(), str(err.value))

    async def refused_async():
        async with AsyncClient(stack.address) as client:
            return await client.generate([0, 1, 2], k=100)

    with pytest.raises(RequestRefused) as err:
        asyncio.run(refused_async())
    assert err.value.field == "k"


def test_a_call_may_set_its_own_deadline(stack):
    """The client's ``timeout_s`` was the only deadline, and it covered a whole stream: a long one
    still producing tokens was cut there (a client review). A call's own ``timeout_s`` wins."""
    with Client(stack.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate([0, 1, 2], max_tokens=100, timeout_s=1e-4)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(client.generate([0, 1, 2], max_tokens=4, timeout_s=None).token_ids) == 4
    with Client(stack.address, timeout_s=1e-4) as client:
        assert len(client.generate([0, 1, 2], max_tokens=4, timeout_s=60).token_ids) == 4


def test_calls_under_way_when_an_async_client_closes_fail_with_client_closed(stack):
    """grpc.aio ends them with a bare ``CancelledError``: a ``TaskGroup`` took them for cancelled
    tasks and finished with no result and no error (a client review)."""
    import asyncio

    from mirrorspec.client import AsyncClient, ClientClosed
    from served_stack import targets_held

    async def closed_under_its_calls():
        client = AsyncClient(stack.address)

        async def streamed():
            async for _ in client.stream([0, 1, 2], max_tokens=100):
                pass

        async def close_once_both_run():
            while stack.front.servicer.in_flight < 2:
                await asyncio.sleep(0.01)
            await client.close()

        async with asyncio.TaskGroup() as group:
            group.create_task(streamed())
            group.create_task(client.generate([0, 1, 2], max_tokens=100))
            group.create_task(close_once_both_run())

    with targets_held(stack), pytest.raises(ExceptionGroup) as err:
        asyncio.run(closed_under_its_calls())
    assert [type(e) for e in err.value.exceptions] == [ClientClosed, ClientClosed]
    assert all(e.code() == grpc.StatusCode.CANCELLED for e in err.value.exceptions)


def test_calls_under_way_when_a_sync_client_closes_fail_with_client_closed(stack):
    """They failed with grpc's bare CANCELLED "Channel closed!", which names neither the client nor
    what became of the request (a soak review). They are ``ClientClosed`` now, as an async
    client's are, with the same CANCELLED code; a stream closed on its own still just ends."""
    from concurrent.futures import ThreadPoolExecutor

    from mirrorspec.client import ClientClosed
    from served_stack import targets_held
    from support import wait_until

    client = Client(stack.address)

    def streamed():
        return sum(len(chunk.token_ids) for chunk in client.stream([0, 1, 2], max_tokens=100))

    with targets_held(stack), ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(streamed), pool.submit(lambda: client.generate([0, 1, 2], max_tokens=100))]
        assert wait_until(lambda: stack.front.servicer.in_flight == 2)
        client.close()
        for call in calls:
            with pytest.raises(ClientClosed, match="was closed while this call ran; its result is lost") as err:
                call.result(30)
            assert err.value.code() == grpc.StatusCode.CANCELLED
    assert wait_until(lambda: stack.front.servicer.in_flight == 0)


def test_a_sync_stream_closes_as_a_generator_does_and_frees_its_sessions(stack):
    """``stream.close()``, ``contextlib.closing(stream)`` and ``with stream:`` raised AttributeError
    on grpc's call object; only ``cancel()`` worked (a client review)."""
    import contextlib

    from support import wait_until

    with Client(stack.address) as client:
        for leave in (lambda s: s.close(), lambda s: contextlib.closing(s).__exit__(None, None, None),
                      lambda s: s.__exit__(None, None, None)):
            stream = client.stream([0, 1, 2], max_tokens=100)
            next(stream)
            leave(stream)
            assert stream.code() == grpc.StatusCode.CANCELLED
        with client.stream([0, 1, 2], max_tokens=4) as stream:
            assert sum(len(chunk.token_ids) for chunk in stream) == 4
        stream, chunks = client.stream([0, 1, 2], max_tokens=100), 0
        for _ in stream:  # a loop that closes its stream ends there, as a generator's does
            chunks += 1
            stream.close()
        assert chunks == 1
    assert wait_until(lambda: stack.front.servicer.in_flight == 0)


def test_an_async_client_is_closed_on_its_own_event_loop_not_dropped_from_another(stack):
    """``close()`` from a second loop dropped the channel unclosed while the first loop's calls ran
    on, and their next call opened a second channel (a client review): it is refused there, as a
    call from that loop is, and closes the channel on its own loop."""
    import asyncio
    import threading

    from mirrorspec.client import AsyncClient

    client, home = AsyncClient(stack.address), asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(client.generate([0, 1, 2], max_tokens=2), home).result(30)
        with pytest.raises(InvalidRequest, match="serves the event loop it was first used on") as err:
            asyncio.run(client.close())
        assert err.value.field == "address"
        channel = client._channel
        asyncio.run_coroutine_threadsafe(client.close(), home).result(30)
        assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN and client._channel is None
    finally:
        home.call_soon_threadsafe(home.stop)
        thread.join()
        home.close()


def test_a_closed_sync_client_says_so(stack):
    """Its next call raised grpc's bare ValueError "Cannot invoke RPC on closed channel!" (a client review)."""
    from mirrorspec.client import ClientClosed

    client = Client(stack.address)
    assert len(client.generate([0, 1, 2], max_tokens=2).token_ids) == 2
    client.close()
    for call in (lambda: client.generate([0, 1, 2]), lambda: client.stream([0, 1, 2]), client.model_info):
        with pytest.raises(ClientClosed, match="was closed; make a new one") as err:
            call()
        assert err.value.code() == grpc.StatusCode.CANCELLED
