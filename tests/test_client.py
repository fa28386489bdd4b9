"""The package exports its gRPC clients as the data-plane issue names them (``mirrorspec.Client``)."""

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
