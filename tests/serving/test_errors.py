"""The interceptor that maps errors to statuses (``mirrorspec/serving/errors.py``), on real servers."""

import grpc
import pytest

from mirrorspec.client import Client
from served_stack import start_stack

GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x02\xff\xfe"]  # a corrupt wire format; bad UTF-8 in a string field


@pytest.fixture(scope="module")
def stack(tiny_dir):
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"], k=3)
    yield s
    s.stop()


def raw(port: int, method: str, kind: str):
    """A call that sends bytes as they are, as a client of another language's broken build would."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return getattr(channel, kind)(method, request_serializer=None, response_deserializer=None)


@pytest.mark.parametrize("payload", GARBAGE, ids=["corrupt", "bad-utf8"])
@pytest.mark.parametrize("server,method,kind", [
    ("front", "/mirrorspec.v1.GenerationService/Generate", "unary_unary"),
    ("front", "/mirrorspec.v1.GenerationService/GenerateStream", "unary_stream"),
    ("target", "/mirrorspec.v1.TargetService/VerifyWindows", "stream_stream"),
    ("drafter", "/mirrorspec.v1.DrafterService/DraftWindows", "stream_stream"),
])
def test_a_request_that_does_not_parse_is_invalid_argument_naming_the_method(stack, server, method, kind, payload):
    """gRPC answered UNKNOWN "Unexpected DecodeError" before any handler ran."""
    port = {"front": stack.front.port, "target": stack.targets[0].port, "drafter": stack.drafters[0].port}[server]
    call = raw(port, method, kind)
    with pytest.raises(grpc.RpcError) as err:
        if kind == "unary_unary":
            call(payload, timeout=10)
        else:
            list(call(iter([payload]) if kind == "stream_stream" else payload, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"the {method} request does not parse as its protobuf message")
    with Client(stack.address) as client:  # and the server serves on
        assert len(client.generate([1, 2, 3], max_tokens=3).token_ids) == 3


@pytest.mark.parametrize("server", ["front", "target", "drafter"])
def test_the_health_watch_streams_through_the_interceptor(stack, server):
    """grpc_health's Watch writes with context.write() from a coroutine: iterating it answered
    INTERNAL "'async for' requires an object with __aiter__ method, got coroutine"."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = {"front": stack.front.port, "target": stack.targets[0].port, "drafter": stack.drafters[0].port}[server]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # left open, its thread lived to the suite's end
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(call).status == health_pb2.HealthCheckResponse.SERVING
        call.cancel()
