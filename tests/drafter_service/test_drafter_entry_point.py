"""``python -m drafter_service``: bad settings exit 2 naming the flag, before any model loads."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args,flag,needle", [
    (["--strategy", "draft-model", "--model", "x", "--prompt-lookup", "-1"], "--prompt-lookup", "[0, 8]"),
    (["--strategy", "draft-model"], "--model", "needs a draft model path"),
    (["--strategy", "draft-model", "--model", "x", "--draft-confidence", "1"], "--draft-confidence", "in [0, 1)"),
    (["--strategy", "draft-model", "--model", "x", "--quantize", "int4"], "argument --quantize", "'none', 'int8'"),
])
def test_bad_settings_name_their_flag(args, flag, needle):
    out = subprocess.run([sys.executable, "-m", "drafter_service", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"error: {flag}" in out.stderr and needle in out.stderr
