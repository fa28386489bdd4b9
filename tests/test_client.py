"""The package exports its gRPC clients as the data-plane issue names them (``mirrorspec.Client``)."""

import re
import subprocess
import sys

import pytest


def test_the_clients_are_importable_from_the_package():
    import mirrorspec
    from mirrorspec import client

    assert (mirrorspec.Client, mirrorspec.AsyncClient) == (client.Client, client.AsyncClient)
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


@pytest.mark.parametrize("address", ["127.0.0.1", "http://127.0.0.1:50051", "localhost:port", "127.0.0.1:70000"])
def test_an_address_that_is_not_host_port_is_named_before_any_call(address):
    """gRPC would dial a bare host at port 443 and say only UNAVAILABLE on the first call."""
    from mirrorspec.client import AsyncClient, Client
    from mirrorspec.config import InvalidRequest

    for make in (Client, AsyncClient):
        with pytest.raises(InvalidRequest, match="expected host:port") as err:
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
])
def test_values_the_wire_would_misread_or_protobuf_refuse_are_named(kwargs, field, says):
    from mirrorspec.client import build_request
    from mirrorspec.config import InvalidRequest

    with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
        build_request(**{"prompt": "hi", **kwargs})
    assert err.value.field == field


def test_the_async_client_is_an_async_context_manager():
    import asyncio

    from mirrorspec.client import AsyncClient

    async def use() -> bool:
        async with AsyncClient("127.0.0.1:1") as client:
            channel = client.channel
        return channel.get_state() == __import__("grpc").ChannelConnectivity.SHUTDOWN

    assert asyncio.run(use())
