"""The mirror benchmark (`mirrorspec bench mirror`): flag errors (fast), one short run (slow).

Timings are never asserted; the run's own identity check and its outputs are."""

import json

import pytest

from mirrorspec.cli import main


@pytest.mark.parametrize("argv, flag", [
    (["--k", "0"], "argument --k"),
    (["--datasets", "humaneval,nope"], "--datasets"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--prompt-lookup", "9"], "--prompt-lookup"),
    (["--draft-confidence", "1"], "--draft-confidence"),
    (["--threads", "0"], "argument --threads"),  # read as a thread count since stop 60
    (["--target-device", "nope"], "argument --target-device"),
    (["--drafter-device", "cuda:x"], "argument --drafter-device"),
    (["--dtype", "fp8"], "argument --dtype"),
    (["--max-branches", "17"], "--max-branches"),
    # these failed after the servers started: a traceback (--k 99 left both server processes running),
    # a server's exit status, or an IndexError drawing the plot of an empty run (review 24 of stop 48)
    (["--k", "99"], "argument --k"),
    (["--proposal-top-k", "-1"], "argument --proposal-top-k"),
    (["--hint-layer", "0"], "argument --hint-layer"),
    (["--hint-layer", "30"], "--hint-layer: must be in [1, 29] for this 30-layer target"),
    (["--datasets", ","], "--datasets: needs at least one"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "mirror", *argv])
    assert exc.value.code == 2 and f"error: {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["mirror", "hints"])
@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_a_model_flag_that_is_not_a_model_is_named_before_any_server_starts(bench, flag, tmp_path, capsys):
    """mirror: it was the server process's exit status; hints: a transformers ValueError."""
    from benchmarks.hints import main as hints_main

    with pytest.raises(SystemExit) as exc:
        (lambda argv: main(["bench", "mirror", *argv]) if bench == "mirror" else hints_main(argv))([flag, str(tmp_path)])
    assert exc.value.code == 2 and f"error: {flag}: cannot load a causal LM from {tmp_path}" in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_writes_json_and_a_timeline_and_every_mode_is_identical(tmp_path):
    """Drafter and target as their own processes on the demo models, every mode, hints on."""
    assert main(["bench", "mirror", "--datasets", "humaneval", "--num-prompts", "1", "--max-tokens", "12",
                 "--hint-layer", "27", "--on-target", "--out", str(tmp_path)]) == 0
    [result] = tmp_path.glob("mirror-*.json")
    out = json.loads(result.read_text())
    modes = out["results"]["humaneval"]
    assert set(modes) == {"target-only", "serial", "mirror", "mirror+hints", "serial-on-target", "mirror-on-target"}
    assert modes["mirror-on-target"]["branched_share"] > 0 and "bounds" in modes["mirror-on-target"]
    # on the target, though the target sends hints for mirror+hints (it stayed at the front door: review 4)
    assert modes["mirror-on-target"]["on_target_share"] == modes["serial-on-target"]["on_target_share"] == 1
    assert modes["mirror"]["on_target_share"] == 0
    assert all(m["identical_to_target_only"] and m["tokens"] > 0 for m in modes.values())
    assert modes["serial"]["alpha"] == modes["mirror"]["alpha"]  # same windows, drafted at other times
    # windows offer the runner-up in both (as `serve` does), and it wins the same ones
    assert modes["serial"]["runner_up_share"] == modes["mirror"]["runner_up_share"]
    serial = modes["serial"]
    window_s = serial["wall_s"] * serial["tokens_per_pass"] / serial["tokens"]
    assert 0 < serial["network_s_per_window"] < window_s  # real calls cost something beyond compute
    assert 0 <= modes["mirror+hints"]["branch_hit_rate"] <= 1 and "bounds" in modes["mirror"]
    assert set(out["timeline_modes"]) == {"serial", "mirror", "mirror+hints"}
    [png] = tmp_path.glob("mirror-*-timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,flag", [(["--num-prompts", "0"], "--num-prompts"), (["--reps", "0"], "--reps"),
                                       (["--datasets", "nope"], "--datasets"),
                                       (["--prompt-lookup", "9"], "--prompt-lookup"),
                                       (["--alternatives", "-1"], "--alternatives"),
                                       (["--draft-confidence", "1.5"], "--draft-confidence")])
def test_hint_benchmark_flags_are_named(argv, flag, capsys):
    from benchmarks.hints import main as hints_main

    with pytest.raises(SystemExit):
        hints_main(argv)
    assert f"error: {flag}" in capsys.readouterr().err


def test_hint_benchmark_sorts_each_branched_window_by_why_it_was_or_was_not_held():
    from benchmarks.hints import window_outcome
    from mirrorspec.drafting import Proposal
    from mirrorspec.mirror import Branch, Prefetch
    from mirrorspec.sampling import TokenKind, WindowVerdict

    drafted = [Branch(2, 7, 4, Proposal.empty()), Branch(0, 5, 4, Proposal.empty()),
               Branch(1, 9, 4, Proposal.empty(), runner_up=3)]
    branches = {b.key: b for b in drafted}

    def outcome(num_accepted, next_token, runner_up=None):
        verdict = WindowVerdict(num_accepted, next_token, TokenKind.RECOVERED, runner_up)
        return window_outcome(Prefetch(verdict, 0.0, 0.0, branches))

    assert outcome(2, 7) == "held"
    assert outcome(2, 8) == outcome(0, 6) == "length guessed, token missed"
    assert outcome(1, 9) == "length not guessed"  # (1, 9) is drafted only after the runner-up 3
    assert outcome(1, 9, runner_up=3) == "runner-up won, held"
    assert outcome(1, 8, runner_up=3) == outcome(1, 9, runner_up=4) == "runner-up won, missed"
