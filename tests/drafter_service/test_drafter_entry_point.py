"""``python -m drafter_service`` (and ``target_service``): bad settings exit 2 naming the flag, before
any model loads or, for a model that does not load, with what its loader said."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args,flag,needle", [
    (["--strategy", "draft-model", "--model", "x", "--prompt-lookup", "-1"], "--prompt-lookup", "[0, 8]"),
    (["--strategy", "draft-model"], "--model", "needs a draft model path"),
    (["--strategy", "draft-model", "--model", "x", "--draft-confidence", "1"], "--draft-confidence", "in [0, 1)"),
    (["--strategy", "draft-model", "--model", "x", "--quantize", "int4"], "argument --quantize", "'none', 'int8'"),
    (["--strategy", "draft-model", "--model", "x", "--proposal-top-k", "-1"], "--proposal-top-k", ">= 0"),
    (["--max-sessions", "0"], "--max-sessions", ">= 1"),  # a replica that refused every session before
    (["--port", "70000"], "--port", "[0, 65535]"),  # it hung before
    # it served n-gram drafts, the model silently unused (review 26 of stop 49)
    (["--strategy", "ngram", "--model", "demo-draft"], "--model", "strategy ngram drafts by prompt lookup and uses "
                                                                  "no model"),
    # they served n-gram drafts, the setting silently unused (review of stop 60)
    *[([*strategy, flag, value], flag, "strategy ngram has no model")
      for flag, value in (("--prompt-lookup", "3"), ("--draft-confidence", "0.5"), ("--quantize", "none"),
                          ("--proposal-top-k", "0"))
      for strategy in (["--strategy", "ngram"], [])],
])
def test_bad_settings_name_their_flag(args, flag, needle):
    out = subprocess.run([sys.executable, "-m", "drafter_service", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"error: {flag}" in out.stderr and needle in out.stderr


@pytest.mark.parametrize("service, args", [("drafter_service", ["--strategy", "draft-model"]),
                                           ("drafter_service", []),  # a --model implies the draft-model strategy
                                           ("target_service", [])])
def test_a_model_that_does_not_load_names_model_and_exits_2(service, args, tmp_path):
    out = subprocess.run([sys.executable, "-m", service, *args, "--model", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert f"error: --model: cannot load a causal LM from {tmp_path}" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("service, args, flag, needle", [
    ("target_service", ["--max-sessions", "-1"], "--max-sessions", ">= 1"),
    ("target_service", ["--port", "-2"], "--port", "[0, 65535]"),
    ("orchestrator", ["--target", "127.0.0.1:5", "--k", "99"], "--k", "in [0, 16]"),  # not after 60 s of waiting
    ("orchestrator", ["--target", "127.0.0.1:5", "--metrics-port", "70000"], "--metrics-port", "[0, 65535]"),
    # an OverflowError at the first SIGTERM, past threading's reach (review of stop 60)
    ("orchestrator", ["--target", "127.0.0.1:5", "--shutdown-grace", "1e10"], "--shutdown-grace", "at most 1e+07"),
])
def test_the_other_services_name_a_bad_setting_before_they_start(service, args, flag, needle):
    out = subprocess.run([sys.executable, "-m", service, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"error: {flag}" in out.stderr and needle in out.stderr


def test_a_draft_with_a_malformed_sub_vocabulary_is_refused_before_the_server_starts(tmp_path):
    """It used to serve, and fail every session's open as INTERNAL (review 27 of stop 49)."""
    import json

    import support
    from mirrorspec.models.loading import DRAFT_VOCAB_KEY

    draft = support.save_tiny_llama(tmp_path / "draft", seed=1)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, DRAFT_VOCAB_KEY: [1, 3, 20]}))
    out = subprocess.run([sys.executable, "-m", "drafter_service", "--strategy", "draft-model", "--model", str(draft),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"error: --model: {draft}'s config.json has a {DRAFT_VOCAB_KEY} that holds 20" in out.stderr
    assert "Traceback" not in out.stderr
