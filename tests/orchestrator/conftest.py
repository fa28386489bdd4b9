import pytest

from served_stack import start_stack


@pytest.fixture(scope="module")
def stack(tiny_dir):
    """Target, draft-model drafter and front door on loopback, with tiny vocab-16 models."""
    s = start_stack(tiny_dir["target16"], tiny_dir["draft16"])
    yield s
    s.stop()
