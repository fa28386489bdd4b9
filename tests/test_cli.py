"""The mirrorspec CLI: flag-naming errors (fast), and real runs on the demo target (slow)."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2

from mirrorspec.cli import main
from mirrorspec.cli.deployment import _front_door_routes_current_membership
from mirrorspec.config import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_K, DEFAULT_K_CONFIDENT, default_k
from mirrorspec.serving.server import health_status
from support import save_tiny_llama


@pytest.mark.parametrize("argv,flag", [
    (["generate", "hi", "--local", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--local", "--temperature", "1e-40"], "--temperature"),  # p was NaN: token 0 forever
    (["generate", "hi", "--local", "--top-p", "1.5"], "--top-p"),
    (["generate", "hi", "--local", "--top-k", "-2"], "--top-k"),
    (["generate", "hi", "--local", "--k", "99"], "--k"),
    (["generate", "hi", "--local", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "hi", "--local", "--threads", "0"], "--threads"),
    (["generate", "hi", "--local", "--threads", "100000"], "--threads"),
    (["generate", "hi", "--local", "--no-speculate", "--k", "4"], "--k"),  # silently target-only before
    (["generate", "hi", "--no-speculate", "--mirror"], "--mirror"),
    (["generate", "hi", "--local", "--draft", "none", "--adaptive"], "--adaptive"),  # a segfault after "can't start new thread"
    (["generate", "bad \udcff bytes", "--local"], "PROMPT"),  # a tokenizer TypeError traceback before
    (["generate", "bad \udcff bytes", "--server", "127.0.0.1:1"], "PROMPT"),  # a protobuf UnicodeEncodeError
    (["generate", "hi", "--server", "127.0.0.1:1"], "--server"),
    (["generate", "hi", "--server", "127.0.0.1"], "--server"),  # gRPC would dial port 443
    (["generate", "hi", "--server", "http://127.0.0.1:50051"], "--server"),
    (["generate", "hi", "--local", "--timeout", "5"], "--timeout"),  # the engine has no deadline: refused, not ignored
    (["generate", "hi", "--local", "--server", "127.0.0.1:1"], "--server"),  # ignored before
    # a server setting given its default value is given all the same: ignored before (review 10 of stop 47)
    (["generate", "hi", "--target", "demo-target"], "--target"),
    (["generate", "hi", "--draft", "auto"], "--draft"),
    (["generate", "hi", "--threads", "2"], "--threads"),
    (["generate", "hi", "--local", "--server", "127.0.0.1:50051"], "--server"),
    (["serve", "--in-process", "--draft", "none", "--prompt-lookup", "5"], "--prompt-lookup"),  # ignored before
    (["serve", "--hint-vocab", "auto"], "--hint-vocab"),  # without --hint-layer, as --hint-lens is refused
    (["demo", "--rebuild", "--k", "7"], "--k"),  # the side-by-side run's: ignored by a rebuild before
    (["demo", "--rebuild", "--prompt", "hi"], "--prompt"),
    (["generate", "hi", "--timeout", "0"], "--timeout"),
    # accepted and ignored: an n-gram drafter offers no runner-up, and --k 0 drafts nothing (a review)
    (["generate", "hi", "--local", "--draft", "ngram", "--no-runner-up"], "--no-runner-up"),
    (["serve", "--in-process", "--draft", "ngram", "--no-runner-up"], "--no-runner-up"),
    (["generate", "hi", "--local", "--k", "0", "--draft-confidence", "0.5"], "--draft-confidence"),
    (["generate", "hi", "--local", "--k", "0", "--prompt-lookup", "3"], "--prompt-lookup"),
    (["generate", "hi", "--local", "--k", "0", "--no-runner-up"], "--no-runner-up"),
    # the client names the field max_tokens, which the CLI did not map to its flag (a review)
    (["generate", "hi", "--server", "127.0.0.1:1", "--max-tokens", "5000000000"], "--max-tokens"),
    (["generate", "hi", "--timeout", "nan"], "--timeout"),
    (["serve", "--k", "-1"], "--k"),
    (["serve", "--tp", "0"], "--tp"),
    (["serve", "--targets", "0"], "--targets"),
    (["serve", "--detach"], "--detach"),
    (["serve", "--address", "127.0.0.1:1"], "--address"),
    (["scale", "target", "0"], "REPLICAS"),
    # each replica a placement group the controller launches under its lock: a million wedged it,
    # and `status`, `scale` and `stop` with it (review 17 of stop 48)
    (["scale", "drafter", "1000000"], "REPLICAS"),
    (["serve", "--drafters", "100000"], "--drafters"),
    (["serve", "--targets", "257"], "--targets"),
    # no deployment and no Ray here (a second `stop`): it blamed an --address nobody gave
    (["stop", "--name", "gone"], "--name"),
    (["status", "--name", "gone"], "--name"),
    (["stop", "--shutdown-grace", "nan"], "--shutdown-grace"),
    (["stop", "--address", "127.0.0.1:1"], "--address"),
    (["serve", "--target-gpus", "-1"], "--target-gpus"),
    (["serve", "--replica-cpus", "-1"], "--replica-cpus"),
    (["serve", "--replica-cpus", "nan"], "--replica-cpus"),  # a ValueError from math.ceil before
    (["serve", "--drafter-gpus", "inf"], "--drafter-gpus"),
    (["serve", "--target-gpus", "nan"], "--target-gpus"),
    (["serve", "--start-timeout", "inf"], "--start-timeout"),  # an OverflowError in the controller, after Ray
    (["serve", "--num-cpus", "0"], "--num-cpus"),  # silently "this machine's" before
    (["serve", "--stall-timeout", "0"], "--stall-timeout"),
    (["serve", "--in-process", "--stall-timeout", "nan"], "--stall-timeout"),
    (["serve", "--prefill-chunk", "0"], "--prefill-chunk"),
    (["serve", "--shutdown-grace", "-1"], "--shutdown-grace"),
    (["serve", "--in-process", "--shutdown-grace", "nan"], "--shutdown-grace"),
    (["serve", "--in-process", "--prefill-chunk", "-8"], "--prefill-chunk"),
    # a local Ray too small for the replicas waited out --start-timeout (600 s), then blamed it
    (["serve", "--num-cpus", "1", "--replica-cpus", "1"], "--num-cpus"),
    (["serve", "--replica-cpus", "0.00001"], "--replica-cpus"),  # a Ray ValueError traceback before
    (["scale", "drafter", "3", "--wait", "nan"], "--wait"),  # after the scale was applied, before
    # past threading's and gRPC's reach (~9.2e9 s): tracebacks inside the actors, and a stop given
    # one left its deployment half stopped, its front door closed and shown "serving" (review of stop 60)
    (["scale", "drafter", "3", "--wait", "1e10"], "--wait"),
    (["stop", "--shutdown-grace", "1e10"], "--shutdown-grace"),
    (["serve", "--start-timeout", "1e10"], "--start-timeout"),
    (["serve", "--in-process", "--shutdown-grace", "2e7"], "--shutdown-grace"),
    (["serve", "--stall-timeout", "1e10"], "--stall-timeout"),
    # an unset "$HEAD": a local Ray to some checks, a cluster to others (review of stop 60)
    (["serve", "--address", ""], "argument --address"),
    # a Ray review: --num-cpus sizes a local Ray, and was silently ignored with --address
    (["serve", "--address", "127.0.0.1:1", "--num-cpus", "4"], "--num-cpus"),
    # it names actors and a file under the cache: "a/b" became a path, "" a deployment "-controller"
    (["serve", "--name", "a/b"], "argument --name"),
    (["status", "--name", ""], "argument --name"),
    (["stop", "--name", "../x"], "argument --name"),
    (["status", "--address", " "], "argument --address"),
    (["serve", "--tp", "2", "--hint-layer", "20"], "--hint-layer"),
    (["serve", "--speculation-off-above", "-1"], "--speculation-off-above"),
    (["serve", "--max-concurrent-requests", "0"], "--max-concurrent-requests"),
    (["serve", "--in-process", "--max-concurrent-requests", "5000"], "--max-concurrent-requests"),
    (["generate", "hi", "--hint-layer", "20"], "--hint-layer"),
    (["serve", "--hint-vocab", "full"], "--hint-vocab"),
    (["serve", "--hint-layer", "20", "--hint-vocab", "demo-target"], "--hint-vocab"),
    (["serve", "--hint-layer", "20", "--hint-vocab", "./no/such/draft"], "--hint-vocab"),
    (["generate", "hi", "--prompt-lookup", "3"], "--prompt-lookup"),
    (["generate", "hi", "--local", "--prompt-lookup", "9"], "--prompt-lookup"),
    (["serve", "--prompt-lookup", "-1"], "--prompt-lookup"),
    (["generate", "hi", "--draft-confidence", "0.3"], "--draft-confidence"),
    (["generate", "hi", "--local", "--draft-confidence", "1.5"], "--draft-confidence"),
    (["serve", "--draft-confidence", "-0.1"], "--draft-confidence"),
    (["serve", "--draft-confidence", "nan"], "--draft-confidence"),
    (["generate", "hi", "--draft-quantize", "int8"], "--draft-quantize"),  # a server setting without --local
    (["generate", "hi", "--proposal-top-k", "8"], "--proposal-top-k"),  # likewise
    (["generate", "hi", "--local", "--proposal-top-k", "-1"], "--proposal-top-k"),
    (["generate", "hi", "--local", "--draft-quantize", "int4"], "argument --draft-quantize"),
    (["serve", "--draft-quantize", "fp8"], "argument --draft-quantize"),
    (["serve", "--hint-layer", "27", "--hint-lens", "exact"], "argument --hint-lens"),
    (["demo", "--k", "99"], "--k"),
    (["demo", "--rebuild", "--epochs", "0"], "--epochs"),
    (["demo", "--rebuild", "--epochs", "inf"], "--epochs"),  # a traceback after the teacher stage's hour before
    (["demo", "--epochs", "2"], "--epochs"),  # a rebuild's setting without --rebuild: refused, not ignored
    (["demo", "--out", "draft.safetensors"], "--out"),
    (["demo", "--rebuild", "--out", "draft.bin"], "--out"),  # --draft would read it as a model directory
    (["demo", "--rebuild", "--out", "/proc/no/draft.safetensors"], "--out"),  # before the hour of teacher data
    (["generate", "hi", "--local", "--device", "gpu0"], "--device"),
    (["generate", "hi", "--local", "--device", "cpu:5"], "--device"),  # ran on the one CPU device there is
    (["serve", "--device", "tpu"], "--device"),  # refused before a Ray starts
    (["serve", "--in-process", "--drafters", "2"], "--drafters"),  # Ray's placement: ignored in process before
    (["serve", "--in-process", "--tp", "2"], "--tp"),
    (["serve", "--in-process", "--address", "auto"], "--address"),
    (["serve", "--in-process", "--num-cpus", "4"], "--num-cpus"),
    (["serve", "--port", "70000"], "--port"),  # an OverflowError from the port check before
    (["serve", "--metrics-port", "-1"], "--metrics-port"),
    (["serve", "--max-sessions", "0"], "--max-sessions"),  # every session refused before
    (["generate", "hi", "--no-runner-up"], "--no-runner-up"),  # a server's setting without --local
    # accepted and ignored before (review 1 of stop 43)
    (["generate", "hi", "--local", "--no-speculate", "--no-runner-up"], "--no-runner-up"),
    (["generate", "hi", "--local", "--no-speculate", "--draft", "ngram"], "--draft"),
    (["generate", "hi", "--local", "--k", "0", "--adaptive"], "--adaptive"),
    # ran target-only and said nothing, where --k 0 --adaptive is refused (user review of stop 55)
    (["generate", "hi", "--local", "--k", "0", "--mirror"], "--mirror"),
    # started, saying "draft none, K=4" (K=8 mirror), and drafted nothing (user review of stop 55)
    (["serve", "--in-process", "--draft", "none", "--k", "4"], "--k"),
    (["serve", "--in-process", "--draft", "none", "--mirror"], "--mirror"),
    (["serve", "--in-process", "--draft", "none", "--adaptive"], "--adaptive"),
    (["serve", "--in-process", "--draft", "none", "--windows-on-target"], "--windows-on-target"),
    (["generate", "hi", "--local", "--draft", "ngram", "--prompt-lookup", "3"], "--prompt-lookup"),
    (["generate", "hi", "--local", "--draft", "ngram", "--draft-confidence", "0.5"], "--draft-confidence"),
    (["serve", "--in-process", "--draft", "ngram", "--proposal-top-k", "8"], "--proposal-top-k"),
    (["serve", "--in-process", "--draft", "ngram", "--draft-quantize", "none"], "--draft-quantize"),
    (["serve", "--in-process", "--hint-lens", "logit"], "--hint-lens"),
    # the server's own choices, which a request cannot change: refused, not silently ignored
    (["generate", "hi", "--target", "some/model"], "--target"),
    (["generate", "hi", "--draft", "ngram"], "--draft"),
    (["generate", "hi", "--adaptive"], "--adaptive"),
    (["generate", "hi", "--threads", "2"], "--threads"),
    (["generate", "hi", "--device", "cpu"], "--device"),
    (["generate", "hi", "--dtype", "float32"], "--dtype"),
    (["generate", "hi", "--seed", "-5"], "--seed"),  # a uint64 on the wire: protobuf's ValueError before
    (["generate", "hi", "--local", "--seed", str(2 ** 64)], "--seed"),  # and the same range in process
])
def test_bad_flags_are_named(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"error: {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["status"], ["stop"], ["scale", "drafter", "2"], ["serve", "--address", "auto"]])
def test_an_auto_address_that_finds_a_silent_ray_is_an_address_error_in_seconds(argv, monkeypatch, capsys):
    """Ray's ``auto`` takes RAY_ADDRESS, the last `ray start`'s record or any gcs_server process
    on the machine (one in another network namespace too). A stale one hung `status` for minutes
    behind Ray's retry logs; an address nobody gave is named, with where it came from."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing listens on port 1 in the test namespace
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --address: nothing answers at 127.0.0.1:1, where 'auto' finds a Ray (RAY_ADDRESS is set" in err


def ray_auto_finds(monkeypatch, *gcs_addresses: str) -> None:
    """Ray's ``auto`` sees exactly these running Rays (its process scan), no RAY_ADDRESS and no
    `ray start` record."""
    import ray._private.services as services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset(gcs_addresses))
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)


def test_an_auto_address_that_finds_another_namespaces_ray_says_so(monkeypatch, capsys):
    """A gcs_server process of a Ray in another network namespace: Ray's ``auto`` finds it by its
    command line (as it does on this machine, where tests run in namespaces of their own)."""
    ray_auto_finds(monkeypatch, "127.0.0.1:1")
    with pytest.raises(SystemExit) as exit_info:
        main(["status"])
    assert exit_info.value.code == 2
    assert ("error: --address: nothing answers at 127.0.0.1:1, where 'auto' finds a Ray (a Ray process on this "
            "machine, perhaps one in another network namespace") in capsys.readouterr().err


def test_a_ray_that_refuses_this_machines_token_is_an_address_error_that_says_so(monkeypatch, capsys):
    """A token-auth Ray (``~/.ray/auth_token`` missing or another cluster's): Ray's own
    AuthenticationError, which says where the token goes, came out as a traceback."""
    import ray
    from ray.exceptions import AuthenticationError

    import cluster.deploy

    def refuse(**_):
        raise AuthenticationError("the token does not match")

    ray_auto_finds(monkeypatch)  # no Ray to probe: ray.init is the one to refuse
    monkeypatch.setattr(cluster.deploy.ray, "init", refuse)
    assert not ray.is_initialized()
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--address", "auto"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --address: the Ray cluster at 'auto' refused this machine's credentials: the token does not match" in err
    assert "Traceback" not in err


def test_a_rebuild_out_that_is_a_folder_is_refused_before_the_work(tmp_path, capsys):
    """A folder named like weights passed the suffix check and failed at the very end (review 5)."""
    folder = tmp_path / "draft.safetensors"
    folder.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--rebuild", "--out", str(folder)])
    assert exit_info.value.code == 2 and "error: --out: " in capsys.readouterr().err


def test_a_teacher_budget_past_the_prompt_set_is_refused_naming_the_flag(monkeypatch, tmp_path, capsys):
    """It drew forever, silently, past the chat family's distinct prompts (review 5); here a
    family of one template runs dry at once."""
    from mirrorspec.distill import broad_chat

    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    monkeypatch.setattr(broad_chat, "CATEGORIES", {"only": ["Say hello."]})
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--rebuild", "--teacher-prompts", "20000", "--out", str(tmp_path / "draft.safetensors")])
    assert exit_info.value.code == 2
    assert "error: --teacher-prompts: prompt set 2 ran out of distinct chat prompts" in capsys.readouterr().err


def test_a_rebuild_runs_both_stages_on_the_threads_asked_for(monkeypatch, tmp_path):
    """--threads was set, then each stage reset torch to every core (review 5)."""
    from mirrorspec.distill import build

    seen = {}
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # this process's own stay as they are
    monkeypatch.setattr(build, "teacher_stage", lambda recipe, threads=None: seen.setdefault("teacher", threads) and [])
    monkeypatch.setattr(build, "student_stage", lambda recipe, shards, out, threads=None: seen.setdefault(
        "student", threads) and {"held_out_top1_agreement": {"after": 0.0}})
    monkeypatch.setattr("mirrorspec.models.demo_draft.weights_digest", lambda path: str(path))
    main(["demo", "--rebuild", "--threads", "1", "--out", str(tmp_path / "draft.safetensors")])
    assert seen == {"teacher": 1, "student": 1}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("argv, says", [
    (["generate", "hi", "--local", "--device", "cuda"], "--device: device 'cuda' asked for, but this torch sees no CUDA GPU"),
    (["serve", "--device", "cuda"], "--device: device 'cuda' asked for, but this torch sees no CUDA GPU"),
    # a local Ray has no autoscaler: these replicas waited out --start-timeout (600 s), then blamed it
    (["serve", "--target-gpus", "1"], "--target-gpus: the replicas ask for 1 GPUs in all and a local Ray on this"),
    (["serve", "--drafter-gpus", "0.5"], "--drafter-gpus: the replicas ask for 0.5 GPUs in all"),
])
def test_asking_for_a_gpu_this_machine_lacks_is_a_flag_error(argv, says, capsys):
    """Not a traceback from deep inside torch at load (nor, for serve, a local Ray whose replicas
    fail one after another until the start times out)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"error: {says}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--local", "--target", "{bad}"], "--target"),
    (["generate", "hi", "--local", "--draft", "{bad}"], "--draft"),  # named as the draft, not as the target
    (["serve", "--target", "{bad}"], "--target"),  # before a local Ray starts replicas that would each fail
    (["serve", "--draft", "{bad}"], "--draft"),
    (["serve", "--in-process", "--draft", "{bad}"], "--draft"),
])
def test_a_model_flag_naming_something_that_is_not_a_model_is_a_flag_error(argv, flag, tmp_path, capsys):
    """Not a transformers traceback, nor a local Ray relaunching replicas until --start-timeout."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(bad=bad) for a in argv])
    assert exit_info.value.code == 2
    assert f"error: {flag}: cannot load a causal LM from {bad}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["serve"], "--port"), (["serve", "--in-process"], "--port"),
                                        (["serve", "--port", "0", "--metrics-port"], "--metrics-port")])
def test_serve_refuses_a_port_another_process_listens_on_before_it_loads_anything(argv, flag, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, port] if argv[-1] == "--metrics-port" else [*argv, "--port", port])
    assert exit_info.value.code == 2
    assert f"error: {flag}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("host, port, says", [
    ("not.a.host", "50091", "cannot listen on 'not.a.host': "),  # it blamed --port, "another server still running?"
    ("10.9.9.9", "50091", "cannot listen on 10.9.9.9: "),  # no address of this machine (the loopback-only namespace's)
    ("", "50091", "is empty; give a host name"),  # gRPC logged, then blamed --port (user review of stop 55)
    (" ", "0", "is empty; give a host name"),  # any free port too
])
def test_serve_names_a_host_it_cannot_listen_on_as_the_host_flag(host, port, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--in-process", "--host", host, "--port", port])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --host: {says}" in err and "another server" not in err


def test_serve_refuses_the_same_port_for_the_front_door_and_its_metrics(capsys):
    """It was "--port: ... the port is in use (another server still running?)" once the front door
    had bound it, after the models loaded."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--in-process", "--port", "50092", "--metrics-port", "50092"])
    assert exit_info.value.code == 2
    assert "error: --metrics-port: is --port too (50092)" in capsys.readouterr().err


@pytest.mark.parametrize("address", [[], ["--address", "auto"]], ids=["local-ray", "cluster"])
def test_a_tp_the_target_cannot_be_cut_into_is_a_tp_flag_error_before_ray_starts(address, tmp_path, capsys):
    """Every rank failed to shard it and the pool relaunched them until --start-timeout, which the
    error then named. A cluster's head reads the target's config where it can (the demo target's:
    9 query heads in 3 KV groups, which 4 ranks cannot share)."""
    target = ["--target", str(save_tiny_llama(tmp_path / "heads-2", seed=0))] if not address else []
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *target, "--draft", "ngram", "--tp", "3" if target else "4", *address])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --tp: tp=" in err and "cannot split" in err


@pytest.mark.parametrize("argv", [["generate", "hi", "--local"], ["serve"], ["serve", "--in-process"]])
def test_a_draft_with_another_vocabulary_is_a_draft_flag_error(argv, tmp_path, capsys):
    """An IndexError deep in the draft's embedding before (generate), a server that failed every
    request's drafting (serve)."""
    draft = save_tiny_llama(tmp_path / "vocab-8", seed=0)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--draft", str(draft)])
    assert exit_info.value.code == 2
    assert "error: --draft: the draft's vocabulary (8 ids) differs from the target's (49152)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag, says", [
    (["w1 w1", "--max-tokens", "100000"], "--max-tokens", "exceeds the context window"),
    (["w1 " * 200], "PROMPT", "the context window"),  # 200 tokens; the tiny target's window is 128
])
def test_a_request_the_server_refuses_names_the_flag(padded_pair, argv, flag, says, capsys):
    """The front door's refusal named no flag ("the server refused the request: ..."), where the
    same value with --local named it: the field now travels in the status's trailing metadata."""
    from served_stack import start_stack

    s = start_stack(padded_pair["target"], strategy=None)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--server", s.address, *argv])
    finally:
        s.stop()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: the server refused the request:" in err and says in err


def test_generate_server_without_max_tokens_leaves_the_length_to_the_server(padded_pair, capsys):
    """It sent its own default (128), and a long prompt was refused for a limit the user never set
    (review 4 of stop 43); the server's default is cut to the room the prompt leaves."""
    from served_stack import start_stack

    s = start_stack(padded_pair["target"], strategy=None)
    try:
        main(["generate", "--server", s.address, "w1 " * 120, "--raw", "--json"])  # 120 of 128 positions
    finally:
        s.stop()
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 120 and len(out["token_ids"]) == 8 and out["finish_reason"] == "length"


def test_generate_server_json_prints_every_stats_field_zeros_too(padded_pair, capsys):
    """protobuf's MessageToDict drops proto3 fields that are zero: with --k 0 the stats had no
    "drafted" (a KeyError for a script), and fields came and went from run to run (review 1 of stop 43)."""
    from served_stack import start_stack

    s = start_stack(padded_pair["target"], strategy=None)
    try:
        main(["generate", "--server", s.address, "w1 w1", "--k", "0", "--max-tokens", "4", "--json"])
    finally:
        s.stop()
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["drafted"] == 0 and stats["accepted"] == 0 and stats["acceptance_rate"] == 0
    assert stats["drafter_fallback"] is False and stats["windows"] == 4 and "windows_on_target" in stats


def test_generate_server_no_mirror_turns_a_servers_mirror_default_off_for_its_request(padded_pair, capsys):
    """A server started with --mirror drafted every request mirror-style: generate had --mirror to
    ask for it and nothing to decline it (a user's review of the README)."""
    from served_stack import start_stack

    from mirrorspec.config import MirrorConfig

    s = start_stack(padded_pair["target"], padded_pair["draft"], mirror=MirrorConfig())
    stats = {}
    try:
        for flags in ((), ("--no-mirror",)):
            main(["generate", "--server", s.address, "w1 w2 w3", "--max-tokens", "12", "--json", *flags])
            stats[flags] = json.loads(capsys.readouterr().out)["stats"]
    finally:
        s.stop()
    assert stats[()]["mirror_windows"] > 0 and stats[("--no-mirror",)]["mirror_windows"] == 0
    with pytest.raises(SystemExit):
        main(["generate", "--server", "127.0.0.1:1", "hi", "--mirror", "--no-mirror"])
    assert "not allowed with argument --mirror" in capsys.readouterr().err


def test_generate_prints_the_same_lines_from_a_server_as_locally(padded_pair, capsys):
    """Text from --server ended without its newline, so a shell prompt or the next output began
    on its last line; --local ended it (a review's find)."""
    from served_stack import start_stack

    argv = ["w1 w2", "--raw", "--max-tokens", "6"]
    main(["generate", *argv, "--local", "--target", str(padded_pair["target"]), "--draft", "none", "--threads", "1"])
    local = capsys.readouterr()
    s = start_stack(padded_pair["target"], strategy=None)
    try:
        main(["generate", *argv, "--server", s.address])
    finally:
        s.stop()
    served = capsys.readouterr()
    assert served.out == local.out and served.out.endswith("\n") and served.out.count("\n") == 1
    assert served.err.startswith("[") and local.err.startswith("[")


@pytest.mark.parametrize("max_tokens, room", [(None, 128 - 120), ("8", 8)])
def test_generate_local_cuts_its_default_max_tokens_to_the_room_the_prompt_leaves(padded_pair, capsys,
                                                                                   max_tokens, room):
    """A server cuts its default to the context window's room; --local refused the same prompt,
    naming --max-tokens, which the user had not given (user review of stop 55). A --max-tokens
    given is kept as it is (past the room, it is refused: test_bad_flags_are_named)."""
    prompt = " ".join(["w1"] * 120)  # 120 of the target's 128 positions
    main(["generate", prompt, "--local", "--raw", "--target", str(padded_pair["target"]), "--draft", "none", "--json",
          "--threads", "1", *(["--max-tokens", max_tokens] if max_tokens else [])])
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 120 and len(out["token_ids"]) <= room
    assert out["finish_reason"] != "length" or len(out["token_ids"]) == room


def test_ignore_eos_runs_the_output_past_the_models_eos_locally_and_from_a_server(tmp_path, capsys):
    """vLLM's ignore_eos: fixed-length outputs, to time decoding rather than where a model stops."""
    from served_stack import start_stack
    from support import save_word_tokenizer

    def tiny_target(name, eos):  # the same weights (the seed), with or without an EOS id in its config
        return save_word_tokenizer(save_tiny_llama(tmp_path / name, seed=2, vocab=16, layers=2, eos_token_id=eos), 16)

    def generated(*flags):
        main(["generate", "w1 w2", "--raw", "--max-tokens", "20", "--json", *flags])
        out = json.loads(capsys.readouterr().out)
        return out["token_ids"], out["finish_reason"]

    local = ["--local", "--draft", "none", "--threads", "1", "--target"]
    free, _ = generated(*local, str(tiny_target("free", None)))
    target = tiny_target("eos", free[5])
    stop = free[:free.index(free[5]) + 1]
    assert generated(*local, str(target)) == (stop, "stop")
    assert generated(*local, str(target), "--ignore-eos") == (free, "length")
    s = start_stack(target, strategy=None)
    try:
        assert generated("--server", s.address) == (stop, "stop")
        assert generated("--server", s.address, "--ignore-eos") == (free, "length")
    finally:
        s.stop()


def test_generate_local_takes_a_draft_with_a_narrower_table_and_the_targets_tokenizer(padded_pair, capsys):
    """Refused as another vocabulary before; the answer holds the target's padding ids 14, 15, 13."""
    main(["generate", "w1 w1", "--local", "--target", str(padded_pair["target"]), "--draft", str(padded_pair["draft"]),
          "--max-tokens", "12", "--json", "--threads", "1"])
    out = json.loads(capsys.readouterr().out)
    from mirrorspec import SamplingParams, generate
    from support import load

    alone = generate(load(padded_pair["target"]), None, [1, 1], SamplingParams(max_new_tokens=12)).token_ids
    assert out["token_ids"] == alone and {13, 14, 15} <= set(alone) and out["stats"]["drafted"] > 0


@pytest.mark.parametrize("draft_model,confidence,k", [
    (True, DEFAULT_DRAFT_CONFIDENCE, DEFAULT_K_CONFIDENT),  # the demo draft as the CLI runs it
    (True, 0.0, DEFAULT_K),  # a draft that always drafts K: long windows are mostly rejected tails
    # prompt lookup alone: its windows end with the match (1.68x -> 1.95x on code edits at K=8)
    (False, DEFAULT_DRAFT_CONFIDENCE, DEFAULT_K_CONFIDENT),
    (False, 0.0, DEFAULT_K_CONFIDENT),  # a draft model's setting, which lookup does not read
])
def test_the_default_k_reaches_further_only_where_the_draft_stops_itself(draft_model, confidence, k):
    assert default_k(draft_model, confidence) == k


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mirrorspec", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_local_greedy_is_identical_with_and_without_speculation():
    prompt = "Write a Python function that returns the square of a number."
    spec = json.loads(run_cli("generate", prompt, "--local", "--max-tokens", "40", "--json", "--threads", "1").stdout)
    base = json.loads(run_cli("generate", prompt, "--local", "--max-tokens", "40", "--json", "--threads", "1",
                              "--no-speculate").stdout)
    assert spec["token_ids"] == base["token_ids"] and len(spec["token_ids"]) > 0
    assert spec["draft"] == "demo-draft" and base["draft"] == "none"  # the trained draft is the default
    assert spec["k"] == DEFAULT_K_CONFIDENT  # its windows end where it is unsure, so K reaches further
    assert spec["stats"]["accepted"] > 0
    for key in ("drafted", "accepted", "acceptance_rate", "token_acceptance_rate", "mean_accepted_length",
                "per_position_acceptance", "draft_time_s", "verify_time_s"):
        assert key in spec["stats"]


def start_serving(*flags: str) -> tuple[subprocess.Popen, str]:
    """`mirrorspec serve FLAGS` in a subprocess, once it says it is serving: (process, that line)."""
    server = subprocess.Popen([sys.executable, "-m", "mirrorspec", "serve", *flags],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    line = ""
    while "serving on" not in line and time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            raise AssertionError("server exited before serving")
    return server, line


@pytest.mark.slow
def test_serve_on_local_ray_then_generate_scale_and_status():
    """The embedded default: `mirrorspec serve` starts a local Ray with one drafter and one target
    actor on the demo models; `generate`, `scale` and `status` are separate processes."""
    import signal

    server, line = start_serving("--port", "50593", "--replica-cpus", "0.5", "--hint-layer", "24", "--metrics-port", "0")
    try:
        assert "(Ray; deployment 'mirrorspec'" in line
        prompt = "Name three colors."
        served = json.loads(run_cli("generate", prompt, "--server", "127.0.0.1:50593", "--max-tokens", "24",
                                    "--json").stdout)
        local = json.loads(run_cli("generate", prompt, "--local", "--max-tokens", "24", "--json", "--no-speculate",
                                   "--threads", "1").stdout)
        assert served["token_ids"] == local["token_ids"]
        assert served["text"] == local["text"]
        streamed = run_cli("generate", prompt, "--server", "127.0.0.1:50593", "--max-tokens", "24")
        assert streamed.returncode == 0 and streamed.stdout.strip() == local["text"].strip()

        scaled = run_cli("scale", "drafter", "2", "--wait", "240")
        assert scaled.returncode == 0, scaled.stderr
        assert scaled.stdout.count("serving") == 4  # 2 drafters, the target, the front door
        rows = json.loads(run_cli("status", "--json").stdout)
        assert sorted(r["pool"] for r in rows if r["state"] == "serving") == ["drafter", "drafter", "orchestrator",
                                                                             "target"]
        front = next(r for r in rows if r["pool"] == "orchestrator")
        assert front["requests"] == 2
        # the port --metrics-port 0 took was in the front door actor's log alone
        with urllib.request.urlopen(front["metrics"], timeout=10) as page:
            counts = [line.split()[-1] for line in page.read().decode().splitlines()
                      if line.startswith("mirrorspec_requests_total{")]
        assert sum(map(float, counts)) == 2
        assert f"front-door metrics: {front['metrics']}" in run_cli("status").stdout
        # past the local Ray's CPUs (this machine's, 0.5 a replica): no autoscaler will place the
        # rest, and scale says so and how to get out, rather than "wait for resources" forever
        beyond = str(2 * len(os.sched_getaffinity(0)) + 2)
        over = run_cli("scale", "drafter", beyond, timeout=150)  # not after all of --wait's 300 s
        assert over.returncode == 1, over.stderr  # short of what it was asked: a script can tell
        assert "cannot be placed: a local Ray has no autoscaler" in over.stderr
        assert "--num-cpus" in over.stderr and "--replica-cpus" in over.stderr
        assert run_cli("scale", "drafter", "1").stdout.count("drafter-") == 1  # the unplaced ones go too
        again = json.loads(run_cli("generate", prompt, "--server", "127.0.0.1:50593", "--max-tokens", "24",
                                   "--json", "--mirror").stdout)  # mirror, steered by the target's hints
        assert again["token_ids"] == local["token_ids"] and again["stats"]["mirror_windows"] > 0
        # `mirrorspec stop` from another shell, as for a --detach'ed deployment: a drain, then teardown,
        # and the `serve` that waits on the deployment sees it gone and exits by itself
        stopping = []

        def start_stop():  # and wait for the drain to begin: the new process needs seconds to reach Ray
            stopping.append(subprocess.Popen([sys.executable, "-m", "mirrorspec", "stop", "--shutdown-grace", "60"],
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            with grpc.insecure_channel("127.0.0.1:50593") as channel:
                deadline = time.monotonic() + 120
                while health_status(channel, 5) == health_pb2.HealthCheckResponse.SERVING:
                    assert time.monotonic() < deadline and stopping[0].poll() is None
                    time.sleep(0.2)

        tokens, last, refused, out = stop_while_streaming(server, "127.0.0.1:50593", start_stop, max_tokens=200)
        assert last.finish_reason in ("length", "stop") and (last.finish_reason == "stop" or tokens == 200)
        assert refused.code() == grpc.StatusCode.UNAVAILABLE  # the front door drains, then the deployment goes
        assert "this front door is stopping" in refused.details()
        stop_out, _ = stopping[0].communicate(timeout=120)
        assert stopping[0].returncode == 0 and "deployment 'mirrorspec' stopped" in stop_out, stop_out
        assert "was stopped (`mirrorspec stop`)" in out
        assert run_cli("status").returncode != 0  # nothing left to show
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert server.returncode == 0


@pytest.mark.slow
def test_a_seeded_sample_is_the_same_from_generate_local_as_from_serve():
    """`generate --local` drafts from the same sparse top-32 q as a server's drafters by default,
    and randomness is addressed by (seed, position), so a seeded sampled request draws the same
    tokens either way (the target's own prefill on the server moves its logits in the last bits,
    which an exponential race does not feel)."""
    server, line = start_serving("--in-process", "--port", "50594", "--threads", "1")
    try:
        sampled = ("Write a short poem about the sea.", "--temperature", "0.7", "--seed", "1", "--max-tokens", "32",
                   "--json")
        served = json.loads(run_cli("generate", *sampled, "--server", "127.0.0.1:50594").stdout)
        local_flags = ("--local", "--threads", "1")
        local = json.loads(run_cli("generate", *sampled, *local_flags).stdout)
        dense = json.loads(run_cli("generate", *sampled, *local_flags, "--proposal-top-k", "0").stdout)
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert "target demo-target on cpu in float32" in line  # the banner says what --device/--dtype auto chose
    assert served["token_ids"] == local["token_ids"] and served["stats"]["drafted"] > 0
    assert dense["token_ids"] != local["token_ids"]  # another q draws other (equally exact) tokens


def stop_while_streaming(server: subprocess.Popen, address: str, sig, max_tokens: int = 200):
    """Signal ``server`` (or call ``sig``, to stop it another way) once a stream through it has its
    first tokens: (the whole stream's token count, its last message, what a request sent after the
    stop met, the server's output after)."""
    from mirrorspec.client import Client

    with Client(address) as client:
        stream = client.stream("Write a long story about a lighthouse keeper.", max_tokens=max_tokens)
        first = next(stream)
        sig() if callable(sig) else server.send_signal(sig)
        time.sleep(1.0)
        with pytest.raises(grpc.RpcError) as refused:
            client.generate("hi", max_tokens=2)
        rest = list(stream)
    out, _ = server.communicate(timeout=120)
    return len(first.token_ids) + sum(len(c.token_ids) for c in rest), rest[-1], refused.value, out


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stopped_server_finishes_the_requests_in_flight_and_refuses_new_ones(sig):
    """They were cut off at once, UNAVAILABLE mid-stream (review 2)."""
    import signal

    server, _ = start_serving("--in-process", "--port", "50595", "--threads", "1")
    try:
        tokens, last, refused, out = stop_while_streaming(server, "127.0.0.1:50595", getattr(signal, sig))
    finally:
        server.kill()
        server.wait()
    assert last.finish_reason in ("length", "stop") and (last.finish_reason == "stop" or tokens == 200)
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "this front door is stopping" in refused.details()
    assert "those in flight have up to 30 s to finish" in out and server.returncode == 0


@pytest.mark.slow
def test_demo_runs_the_shipped_draft_beside_the_target():
    out = run_cli("demo", "--max-tokens", "32", "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "greedy output identical to the target alone: yes" in out.stdout
    assert "held-out top-1 agreement" in out.stdout


def test_serve_prints_what_its_controller_noted_of_the_replicas_since_it_started(capsys):
    """A replica that died and was replaced showed in Ray's worker logs alone (a review of stop 60)."""
    from mirrorspec.cli.lifecycle import ReplicaEvents

    held = ["drafter-1 serves at 127.0.0.1:1", "target-2 serves at 127.0.0.1:2"]  # `serve` reported these

    def events_since(seen):  # the controller's: all it holds where it counts afresh (restarted)
        return len(held), held[seen:] if seen <= len(held) else list(held)

    events = ReplicaEvents(events_since)
    held += ["drafter-1 at 127.0.0.1:1 is down (ActorDiedError); replacing it", "drafter-3 serves at 127.0.0.1:3"]
    events.print_new()
    events.print_new()
    assert capsys.readouterr().out == ("mirrorspec: drafter-1 at 127.0.0.1:1 is down (ActorDiedError); replacing it\n"
                                       "mirrorspec: drafter-3 serves at 127.0.0.1:3\n")
    held[:] = ["controller restarted: adopted drafter-3, target-2"]
    events.print_new()
    assert capsys.readouterr().out == "mirrorspec: controller restarted: adopted drafter-3, target-2\n"
    events.fetch = lambda seen: 1 / 0  # the controller cannot answer just now: nothing, and no failure
    events.print_new()
    assert capsys.readouterr().out == ""


def test_the_summary_line_names_runner_up_wins_windows_on_the_target_and_adaptive_off_where_there_were_any():
    """One summary for in-process stats and a server's RequestStats alike."""
    from mirrorspec.cli.generate import speculation_summary
    from mirrorspec.engine import GenerationStats
    from mirrorspec.v1 import generation_pb2

    local = GenerationStats(windows=4, drafted=8, accepted=6, runner_up_hits=2)
    assert speculation_summary(local).startswith("acceptance 0.75, ")
    assert speculation_summary(local).endswith("tokens/pass, runner-up won 2 windows")
    assert speculation_summary(GenerationStats(windows=4, runner_up_hits=1)).endswith("runner-up won 1 window")
    served = generation_pb2.RequestStats(acceptance_rate=0.5, mean_accepted_length=2.0)
    assert speculation_summary(served) == "acceptance 0.50, 2.00 tokens/pass"
    on_target = generation_pb2.RequestStats(acceptance_rate=0.5, mean_accepted_length=2.0, windows=9,
                                            windows_on_target=7)
    assert speculation_summary(on_target) == "acceptance 0.50, 2.00 tokens/pass, 7 of 9 windows run on the target"
    switched_off = GenerationStats(windows=10, drafted=4, accepted=2, adaptive_off_windows=6)
    assert speculation_summary(switched_off).endswith("tokens/pass, adaptive K drafted nothing in 6 of 10 windows")
    served_off = generation_pb2.RequestStats(acceptance_rate=0.5, mean_accepted_length=2.0, windows=10,
                                             adaptive_off_windows=6)
    assert speculation_summary(served_off).endswith(", adaptive K drafted nothing in 6 of 10 windows")


def test_a_termination_signal_while_a_deployment_starts_interrupts_it_like_ctrl_c():
    """So ``deploy`` tears down the detached controller rather than the process dying with it left
    on the cluster; the handlers before are back afterwards."""
    import os
    import signal

    from mirrorspec.cli.lifecycle import interrupted_by_termination

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with pytest.raises(KeyboardInterrupt), interrupted_by_termination():
            os.kill(os.getpid(), sig)
            time.sleep(30)  # the handler raises at once, ending the sleep
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before


def test_a_sighup_the_process_was_started_ignoring_stays_ignored_while_a_deployment_starts():
    """The `ray up` configs start `serve --detach` under nohup, to outlive the SSH session that
    starts it: taking over SIGHUP there would have torn the deployment down as that session closed."""
    import os
    import signal

    from mirrorspec.cli.lifecycle import interrupted_by_termination

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupted_by_termination():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)  # nothing raised
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_serving_process_ends_its_wait_on_sigterm_and_sighup_so_it_tears_down(sig):
    """A closed terminal (SIGHUP) used to kill `serve` while it served, before its teardown, which
    left a Ray deployment on the cluster; in a process of its own, since the old default handler
    would end the test run."""
    import signal

    waiting = subprocess.Popen([sys.executable, "-c", "from mirrorspec.cli.lifecycle import wait_for_stop; print('waiting', "
                                "flush=True); wait_for_stop(); print('stopped')"], stdout=subprocess.PIPE, text=True)
    assert waiting.stdout.readline().strip() == "waiting"
    time.sleep(1.0)  # into the wait, past installing the handlers (microseconds after the print)
    waiting.send_signal(getattr(signal, sig))
    out, _ = waiting.communicate(timeout=30)
    assert (waiting.returncode, out.strip()) == (0, "stopped")


def test_a_local_stack_whose_drafter_fails_to_start_leaves_no_server_running(tiny_dir, tmp_path):
    """The target started first; it used to keep serving (its model loaded, its port bound) with no
    handle left to stop it."""
    import threading

    from drafter_service.servicer import DrafterConfig
    from mirrorspec.cli.local_stack import start_local_stack
    from mirrorspec.config import InvalidRequest
    from target_service.servicer import TargetConfig

    before = set(threading.enumerate())
    with pytest.raises(InvalidRequest):
        start_local_stack(TargetConfig(model=str(tiny_dir["target16"])),
                          DrafterConfig(strategy="draft-model", model=str(tmp_path)), port=0)
    left = [t for t in threading.enumerate() if t not in before and t.name in ("target", "drafter", "orchestrator")]
    assert not [t for t in left if (t.join(5), t.is_alive())[1]]


def test_a_request_past_its_timeout_is_a_timeout_flag_error(tiny_dir, capsys):
    """A gRPC deadline on the request, named by its flag; before, `generate` had no deadline, and a
    server that stalled held the terminal for good."""
    from served_stack import start_stack

    stack = start_stack(tiny_dir["target16"], tiny_dir["draft16"])
    try:
        address = f"127.0.0.1:{stack.front.port}"
        stack.front._loop.call_soon_threadsafe(time.sleep, 3.0)  # the front door stalls
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "hi", "--server", address, "--timeout", "0.5"])
    finally:
        stack.stop()
    assert exit_info.value.code == 2
    assert f"error: --timeout: {address} did not finish the request within 0.5 s" in capsys.readouterr().err


@pytest.mark.parametrize("flags, option, value, default", [
    (["--windows-on-target"], "windows_on_target", True, False),
    (["--max-concurrent-requests", "3"], "max_concurrent_requests", 3, 64),
])
def test_a_front_door_flag_reaches_the_front_door_on_ray_and_in_process(monkeypatch, flags, option, value, default):
    """The flag reaches the Ray deployment's spec and, from it, its front door's config; and the
    in-process stack's front door."""
    import mirrorspec.cli.serve as serve
    from cluster.replicas import front_door_config
    from mirrorspec.cli import parse_command_line

    members = {"target": ["127.0.0.1:1"], "drafter": ["127.0.0.1:2"]}
    spec = serve._stack_spec(parse_command_line(["serve", *flags, "--draft", "ngram"]), target_gpus=0.0)
    assert getattr(front_door_config(spec, members), option) == value
    unset = serve._stack_spec(parse_command_line(["serve", "--draft", "ngram"]), 0.0)
    assert getattr(front_door_config(unset, members), option) == default

    started = {}

    def fake_stack(target, drafter, **front):
        started.update(front)
        raise KeyboardInterrupt  # the front door's options are all this test wants

    monkeypatch.setattr(serve, "start_local_stack", fake_stack)
    monkeypatch.setattr("mirrorspec.models.load_causal_lm", lambda source, **_: SimpleNamespace(source=source))
    with pytest.raises(KeyboardInterrupt):
        serve._serve_in_process(parse_command_line(
            ["serve", "--in-process", *flags, "--draft", "ngram", "--threads", "1"]))
    assert started[option] == value


def test_in_process_takes_one_of_each_replica_as_typed(monkeypatch):
    """--tp 1, --drafters 1 and --targets 1 say what --in-process runs: a script that switches
    between Ray and in-process by one flag keeps them (they are refused at any other value)."""
    import mirrorspec.cli.serve as serve

    monkeypatch.setattr(serve, "_serve_in_process", lambda args: 0)
    assert main(["serve", "--in-process", "--tp", "1", "--drafters", "1", "--targets", "1", "--port", "0",
                 "--metrics-port", "0"]) == 0


def test_scale_on_a_local_ray_waits_for_the_front_door_to_route_to_the_new_replicas():
    serving = [{"pool": "drafter", "state": "serving"}, {"pool": "target", "state": "serving"}]
    assert not _front_door_routes_current_membership([*serving, {"pool": "orchestrator", "membership": "updating"}])
    assert _front_door_routes_current_membership([*serving, {"pool": "orchestrator", "membership": "current"}])
    assert _front_door_routes_current_membership([*serving, {"pool": "orchestrator"}])  # a controller before stop 51
    assert _front_door_routes_current_membership([*serving, {"pool": "orchestrator", "membership": None}])  # down


def test_generate_names_the_server_flag_for_an_address_that_is_not_a_front_door(not_a_front_door, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--server", not_a_front_door, "--timeout", "30"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"error: --server: {not_a_front_door} answers gRPC but not as a mirrorspec " \
        "front door" in err


@pytest.mark.parametrize("module", ["mirrorspec", "mirrorspec.cli"])
def test_the_command_runs_as_a_module_too(module):
    """``python -m mirrorspec.cli`` ran the old one-file CLI; the package needs its own __main__."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: " in done.stdout and "{generate,serve,scale,status,stop,demo" in done.stdout


def test_status_shows_where_the_front_door_serves_its_metrics():
    """``--metrics-port 0`` takes a free port on the front door's node: it was in that actor's log alone."""
    from mirrorspec.cli.deployment import format_status

    rows = [{"replica": "target-0", "pool": "target", "state": "serving", "address": "10.0.0.2:40001"},
            {"replica": "front-door", "pool": "orchestrator", "state": "serving", "address": "10.0.0.1:50051",
             "metrics": "http://10.0.0.1:43117/metrics"}]
    shown = format_status(rows).splitlines()
    assert shown[-1] == "front-door metrics: http://10.0.0.1:43117/metrics"
    assert len(shown) == 4  # the header, two rows, the URL
    assert "metrics:" not in format_status(rows[:1])
