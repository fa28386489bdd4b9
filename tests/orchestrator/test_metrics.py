"""The Prometheus endpoint's port: one in use is a named setting error, not an OSError traceback."""

import socket

import pytest

from mirrorspec.config import InvalidRequest
from orchestrator.metrics import SpecDecodeMetrics


def test_a_metrics_port_in_use_is_refused_naming_the_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidRequest, match=f"cannot serve metrics on 127.0.0.1:{port}") as err:
            SpecDecodeMetrics().serve("127.0.0.1", port)
    assert err.value.field == "metrics_port"
