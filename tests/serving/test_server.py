"""One gRPC server per port: gRPC's default SO_REUSEPORT would let a second server share a port
in use, and the kernel would split connections between the two."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mirrorspec.config import InvalidRequest
from mirrorspec.serving.server import BackgroundServer, start_grpc_server


def test_a_second_server_on_a_port_in_use_is_refused_and_the_first_keeps_it():
    first = BackgroundServer(lambda: start_grpc_server([], "127.0.0.1", 0)).start()
    try:
        port = first.port
        second = BackgroundServer(lambda: start_grpc_server([], "127.0.0.1", port))
        with pytest.raises(InvalidRequest, match=f"cannot listen on 127.0.0.1:{port}: the port is in use") as err:
            second.start()
        assert err.value.field == "port"
        second.stop()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        first.stop()
