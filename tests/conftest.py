import os

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One torch thread per test process: tests that start servers run several torch processes on two cores.
torch.set_num_threads(1)

import support  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Target and two different drafts, vocab 8, saved and reloaded with from_pretrained."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": support.save_tiny_llama(root / "target", seed=0, logit_scale=1.5),
        "draft": support.save_tiny_llama(root / "draft", seed=1, logit_scale=2.0),
        "target16": support.save_tiny_llama(root / "target16", seed=2, vocab=16, layers=2),
        "draft16": support.save_tiny_llama(root / "draft16", seed=3, vocab=16),
    }


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    return support.load(tiny_dir["target"])


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir):
    return support.load(tiny_dir["draft"])


@pytest.fixture(scope="session")
def demo_target():
    """The real SmolLM2-135M-Instruct demo target (converted from GGUF once, then cached)."""
    from mirrorspec.models import load_causal_lm

    return load_causal_lm("demo-target")
