"""The benchmark harness: prompt loaders and flag errors (fast), one tiny end-to-end run (slow).

Timings are never asserted: they depend on the machine and on whatever else runs on it.
"""

import json
from pathlib import Path

import pytest
import torch

import support
from benchmarks.harness import MODES, Drafts, RunRecord, identity_failures, mark_identity, select_modes
from benchmarks.metrics import expected_tokens_per_window, speedup_bound, summarize
from benchmarks.prompts import DATASETS, load_prompts
from benchmarks.run import main
from benchmarks.served import server_placement
from mirrorspec.models import LoadedModel
from support import assert_flag_refused


@pytest.mark.parametrize("dataset", list(DATASETS))
def test_prompt_loaders_read_the_wheels_deterministically(dataset):
    five = load_prompts(dataset, 5)
    assert len(five) == 5 and all(p.text.strip() and p.dataset == dataset for p in five)
    assert load_prompts(dataset, 5) == five
    assert load_prompts(dataset, 3) == five[:3]  # "first N": a smaller run is a prefix of a larger one
    assert len({p.prompt_id for p in five}) == 5


def test_a_dataset_smaller_than_asked_runs_whole_and_says_so(capsys):
    """MT-Bench has 80 first turns: asked for 500, a run reported 500 per dataset (a review)."""
    prompts = load_prompts("mtbench", 500)
    assert len(prompts) == 80 and len({p.prompt_id for p in prompts}) == 80
    assert "note: mtbench has 80 prompts: all 80 run, not the 500 --num-prompts asked for" in capsys.readouterr().err
    load_prompts("mtbench", 80)
    assert capsys.readouterr().err == ""


def test_prompt_sets_have_the_expected_shape():
    mtbench, humaneval, edit = (load_prompts(name, 2) for name in ("mtbench", "humaneval", "code-edit"))
    assert mtbench[0].prompt_id == "81" and mtbench[0].category == "writing"
    assert humaneval[0].prompt_id == "HumanEval/0" and "def has_close_elements" in humaneval[0].text
    assert edit[0].text.startswith("Add type hints") and "return False" in edit[0].text  # includes the solution


def test_speedup_bound_matches_the_closed_form():
    assert expected_tokens_per_window(0.0, 4) == 1.0
    assert expected_tokens_per_window(1.0, 4) == 5.0
    assert expected_tokens_per_window(0.5, 2) == pytest.approx(1.75)
    assert speedup_bound(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)


def _record(mode, temperature, tokens, prompt_id="1", k=4):
    return RunRecord(dataset="mtbench", prompt_id=prompt_id, category="writing", mode=mode, temperature=temperature,
                     k=k, seed=0, prompt_tokens=3, new_tokens=len(tokens), wall_time_s=1.0, finish_reason="length",
                     token_ids=list(tokens))


def _stats(windows, accepted, verify_time_s, first_verify_time_s, committed, drafted=8, draft_time_s=0.08):
    return {"windows": windows, "drafted": drafted, "accepted": accepted, "rejected": windows - 1,
            "draft_time_s": draft_time_s, "verify_time_s": verify_time_s, "first_verify_time_s": first_verify_time_s,
            "committed": committed, "drafted_per_position": [], "accepted_per_position": []}


def test_pass_cost_leaves_out_the_prefill_and_tokens_per_pass_count_committed_tokens():
    """In process, a request's first verify prefills the prompt too. Spread over a speculative
    mode's fewer windows it inflated `pass x` (a review measured 1.289 against 1.182 without it)
    and `cost c`. And tokens per pass counted drafts accepted after a stop token, which the output
    never gets (1.50 printed for 5 tokens in 4 passes)."""
    base = _record("target-only", 0.0, [1] * 10, k=0)
    base.stats = _stats(windows=10, accepted=0, verify_time_s=0.3 + 9 * 0.05, first_verify_time_s=0.3, committed=10,
                        drafted=0)
    spec = _record("mirrorspec-draft", 0.0, [1] * 5)
    spec.stats = _stats(windows=4, accepted=2, verify_time_s=0.3 + 3 * 0.06, first_verify_time_s=0.3, committed=5)
    rows = {s.mode: s for s in summarize([base, spec])}
    assert rows["mirrorspec-draft"].pass_cost == pytest.approx(0.06 / 0.05)  # 1.32 with the prefill in
    assert rows["mirrorspec-draft"].mean_accepted_length == pytest.approx(5 / 4)  # (2 + 4) / 4 before
    assert rows["mirrorspec-draft"].cost_ratio == pytest.approx((0.08 / 8) / 0.06)


def test_a_runner_up_mode_none_of_whose_runner_ups_won_shows_a_rate_of_zero_not_none():
    """None is for modes that offer no runner-up; a runner-up mode that never won reads 0.0."""
    records = []
    for mode in ("mirrorspec-draft", "mirrorspec-hybrid-confident-runner-up"):
        records.append(_record(mode, 0.0, [1] * 5))
        records[-1].stats = _stats(windows=4, accepted=2, verify_time_s=0.5, first_verify_time_s=0.3, committed=5)
    rows = {s.mode: s for s in summarize(records)}
    assert rows["mirrorspec-draft"].runner_up_hit_rate is None
    assert rows["mirrorspec-hybrid-confident-runner-up"].runner_up_hit_rate == 0.0
    records[1].stats["runner_up_hits"] = 1
    assert summarize(records)[1].runner_up_hit_rate == pytest.approx(1 / 4)


def test_a_one_window_request_leaves_the_rest_of_its_mode_without_the_prefill():
    """A request whose answer fit one window (all accepted, or K >= max tokens - 1) sent its whole
    mode back to counting every first window, prefill and all, beside target-only's row without
    them (review 14 of stop 47: pass x 5.18 printed for 1.25)."""
    base = _record("target-only", 0.0, [1] * 10, k=0)
    base.stats = _stats(windows=10, accepted=0, verify_time_s=0.3 + 9 * 0.05, first_verify_time_s=0.3, committed=10,
                        drafted=0)
    long, short = _record("mirrorspec-draft", 0.0, [1] * 5), _record("mirrorspec-draft", 0.0, [1] * 5, prompt_id="2")
    long.stats = _stats(windows=4, accepted=2, verify_time_s=0.3 + 3 * 0.06, first_verify_time_s=0.3, committed=5)
    short.stats = _stats(windows=1, accepted=4, verify_time_s=0.3, first_verify_time_s=0.3, committed=5)
    rows = {s.mode: s for s in summarize([base, long, short])}
    assert rows["mirrorspec-draft"].pass_cost == pytest.approx(0.06 / 0.05)
    short_only = {s.mode: s for s in summarize([base, short])}["mirrorspec-draft"]
    assert short_only.pass_cost is None and short_only.cost_ratio is None  # no window but a prefill's to time


def test_sampled_served_runs_are_checked_against_their_in_process_twin():
    """Greedy rows compare with target-only; a sampled served row with the in-process mode it
    reproduces, prompt by prompt at the same K, and a row with no twin that ran stays unknown."""
    twins = {name: mode.twin for name, mode in MODES.items() if mode.twin}
    assert twins["served-hybrid-confident-runner-up"] == "mirrorspec-hybrid-confident-runner-up"
    assert twins["served-hybrid-drafter-lookup"] == "mirrorspec-hybrid"
    assert all(twin in MODES and MODES[twin].in_process for twin in twins.values())
    records = [_record("target-only", 0.0, [1, 2]), _record("served-hybrid", 0.0, [1, 2]),
               _record("mirrorspec-hybrid", 0.7, [5, 6]), _record("served-hybrid", 0.7, [5, 6]),
               _record("mirrorspec-hybrid", 0.7, [5, 7], prompt_id="2"),
               _record("served-hybrid", 0.7, [5, 6], prompt_id="2"),
               _record("served-hybrid", 0.7, [5, 6], k=8), _record("served-draft", 0.7, [5, 6])]
    mark_identity(records, twins)
    assert records[1].identical_to_target_only is True
    assert [r.identical_to_in_process for r in records[2:]] == [None, True, None, False, None, None]
    rows = {(s.mode, s.temperature, s.k): (s.identical, s.same_as_in_process) for s in summarize(records)}
    assert rows[("served-hybrid", 0.7, 4)] == (None, "1/2") and rows[("served-hybrid", 0.0, 4)] == (True, None)
    assert rows[("served-draft", 0.7, 4)] == (None, None)


def test_cost_c_leaves_out_the_first_windows_drafting_which_prefills_the_draft_model():
    """The verify side left each request's first window out, its prefill with it; the drafting
    side kept the draft model's prefill of the prompt in its first window (a benchmark review:
    `cost c` 0.123 printed for 0.077, and `bound` 1.47 for 1.58)."""
    base = _record("target-only", 0.0, [1] * 10, k=0)
    base.stats = _stats(windows=10, accepted=0, verify_time_s=0.3 + 9 * 0.05, first_verify_time_s=0.3, committed=10,
                        drafted=0)
    spec = _record("mirrorspec-draft", 0.0, [1] * 5)
    spec.stats = _stats(windows=4, accepted=2, verify_time_s=0.3 + 3 * 0.06, first_verify_time_s=0.3, committed=5,
                        drafted=8, draft_time_s=0.2 + 6 * 0.01)
    spec.stats.update(first_draft_time_s=0.2, first_drafted=2)  # a prefill and 2 drafts in the first window
    row = {s.mode: s for s in summarize([base, spec])}["mirrorspec-draft"]
    assert row.cost_ratio == pytest.approx(0.01 / 0.06)  # 0.26 / 8 / 0.06 = 0.54 with the prefill in


def test_each_row_shows_how_far_its_speedup_moves_from_prompt_to_prompt():
    """One run per prompt and mode: a row's ratio can ride on one slowed baseline (a benchmark
    review), which the per-prompt range shows."""
    base = [_record("target-only", 0.0, [1] * 10, k=0), _record("target-only", 0.0, [1] * 10, "2", k=0)]
    spec = [_record("mirrorspec-draft", 0.0, [1] * 10), _record("mirrorspec-draft", 0.0, [1] * 10, "2")]
    base[1].wall_time_s, spec[0].wall_time_s, spec[1].wall_time_s = 2.0, 0.8, 0.5  # prompt 2's baseline was slowed
    rows = {s.mode: s for s in summarize(base + spec)}
    assert rows["mirrorspec-draft"].speedup == pytest.approx((20 / 1.3) / (20 / 3.0))
    assert rows["mirrorspec-draft"].speedup_range == pytest.approx([1 / 0.8, 2 / 0.5])
    assert rows["target-only"].speedup_range is None
    assert summarize(base[:1] + spec[:1])[1].speedup_range is None  # one prompt: nothing to range over


def test_a_run_that_is_not_token_identical_where_it_must_be_is_named_with_where_it_differs():
    """A greedy mismatch showed only as `NO` in one cell, beside its speed, and the run exited 0
    (a benchmark review); the run now names each such run and fails."""
    records = [_record("target-only", 0.0, [1, 2, 3]), _record("mirrorspec-draft", 0.0, [1, 2, 4]),
               _record("mirrorspec-ngram", 0.0, [1, 2, 3]),
               _record("mirrorspec-hybrid", 0.7, [5, 6]), _record("served-hybrid", 0.7, [5, 7]),
               _record("hf-assisted", 0.0, [1, 9, 9])]  # HF's loops are compared, not held to exactness
    mark_identity(records, {"served-hybrid": "mirrorspec-hybrid"})
    assert identity_failures(records) == [
        "mirrorspec-draft (K=4, T=0) on mtbench prompt 1: its tokens differ from target-only's, first at output "
        "token 2",
        "served-hybrid (K=4, T=0.7) on mtbench prompt 1: its tokens differ from its in-process twin's"]
    assert identity_failures(records[:1] + records[2:4]) == []


@pytest.mark.parametrize("argv, flag", [
    (["--k", "0"], "--k"),
    (["--k", "2,x"], "--k"),
    (["--datasets", "mtbench,nope"], "--datasets"),
    (["--modes", "warp-drive"], "--modes"),
    (["--temperatures", "-1"], "--temperatures"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--draft", "truncate:zero"], "--draft"),
    (["--draft-quantize", "int8,int4"], "--draft-quantize"),
    # each was a traceback at the first prompt, after the models loaded (or named --target); the
    # last one alone loads the target (to count the prompts' tokens)
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2 ** 64 - 1), "--num-prompts", "2"], "--seed"),  # prompt 1's seed passes 2**64
    (["--dtype", "bogus"], "--dtype"),
    (["--max-tokens", "1000000", "--num-prompts", "1", "--datasets", "humaneval", "--draft", "none"],
     "--max-tokens"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    assert_flag_refused(main, argv, flag, capsys)


def _run(tmp_path: Path, *argv: str) -> dict:
    assert main([*argv, "--out", str(tmp_path), "--threads", "1", "--no-progress"]) == 0
    [result] = tmp_path.glob("bench-*.json")
    assert result.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--reprint", str(result)]) == 0  # the stored records are enough to rebuild the table
    return json.loads(result.read_text())


@pytest.mark.slow
def test_a_run_that_is_not_exact_fails_after_writing_what_it_measured(tmp_path, capsys, monkeypatch):
    import benchmarks.run

    monkeypatch.setattr(benchmarks.run, "identity_failures", lambda records: ["mirrorspec-draft (K=2) ... differ"])
    assert main(["--datasets", "humaneval", "--num-prompts", "1", "--max-tokens", "4", "--modes", "target-only",
                 "--temperatures", "0", "--out", str(tmp_path), "--threads", "1", "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert "note: NOT EXACT: mirrorspec-draft (K=2) ... differ" in out and "1 runs were not token-identical" in err
    [written] = tmp_path.glob("bench-*.json")
    assert "NOT EXACT: mirrorspec-draft (K=2) ... differ" in json.loads(written.read_text())["notes"]


@pytest.mark.slow
def test_a_run_records_how_many_prompts_it_ran_where_a_dataset_had_fewer(tmp_path, monkeypatch):
    from benchmarks.prompts import load_humaneval

    monkeypatch.setitem(DATASETS, "humaneval", lambda n: load_humaneval(min(n, 1)))  # a one-prompt set
    out = _run(tmp_path, "--datasets", "humaneval", "--num-prompts", "3", "--max-tokens", "2", "--modes",
               "target-only", "--temperatures", "0", "--draft", "none")
    assert out["config"]["prompts_run"] == {"humaneval": 1} and out["config"]["num_prompts"] == 3
    assert "humaneval has 1 prompt: all 1 run, not the 3 --num-prompts asked for" in out["notes"]
    assert len(out["records"]) == 1


@pytest.mark.slow
def test_tiny_benchmark_runs_every_mode_and_greedy_is_identical(tmp_path, capsys):
    modes = ["target-only", "mirrorspec-ngram", "mirrorspec-ngram-full-weak-windows", "mirrorspec-draft",
             "mirrorspec-draft-adaptive", "mirrorspec-draft-mirror", "mirrorspec-hybrid-adaptive-confident",
             "hf-assisted", "served-ngram",
             "served-draft", "served-hybrid-confident", "served-hybrid-adaptive-confident"]
    out = _run(tmp_path, "--datasets", "mtbench,humaneval,code-edit", "--num-prompts", "1", "--max-tokens", "8",
               "--k", "2", "--temperatures", "0", "--modes", ",".join(modes), "--draft", "truncate:2")
    records = out["records"]
    for dataset in DATASETS:
        ran = {r["mode"] for r in records if r["dataset"] == dataset}
        assert ran == set(modes), dataset
    for r in records:
        assert 1 <= r["new_tokens"] <= 8
        if r["mode"].startswith(("mirrorspec", "served")) or r["mode"] == "target-only":
            assert r["identical_to_target_only"] is True, (r["dataset"], r["mode"])
    summaries = {(s["dataset"], s["mode"]) for s in out["summaries"]}
    assert ("code-edit", "mirrorspec-ngram") in summaries
    # served rows count tokens per pass as in-process ones do (they printed 0.00)
    assert all(s["mean_accepted_length"] >= 1 for s in out["summaries"] if s["mode"].startswith("served"))
    assert out["environment"]["torch_threads"] == 1 and out["config"]["draft"] == "truncate:2"
    printed = capsys.readouterr().out
    assert "mirrorspec-draft" in printed and "identical" in printed


@pytest.mark.slow
def test_sampled_served_modes_draw_their_in_process_twins_tokens(tmp_path):
    """At T=0.7 the served path (its drafter in a server process) and the in-process engine draw
    the same tokens for the same seed: the same sparse q, randomness addressed by position."""
    modes = ["mirrorspec-hybrid-confident-runner-up", "served-hybrid-confident-runner-up", "mirrorspec-draft",
             "served-draft"]
    out = _run(tmp_path, "--datasets", "mtbench,humaneval", "--num-prompts", "2", "--max-tokens", "12", "--k", "3",
               "--temperatures", "0.7", "--modes", ",".join(modes), "--draft", "truncate:2")
    served = [r for r in out["records"] if r["mode"].startswith("served")]
    assert len(served) == 8 and all(r["identical_to_in_process"] is True for r in served)
    assert all(s["same_as_in_process"] == "2/2" for s in out["summaries"] if s["mode"].startswith("served"))


@pytest.mark.slow
def test_a_second_quantization_runs_the_in_process_draft_modes_again_side_by_side(tmp_path):
    out = _run(tmp_path, "--datasets", "mtbench", "--num-prompts", "1", "--max-tokens", "6", "--k", "2",
               "--temperatures", "0", "--modes", "mirrorspec-draft,mirrorspec-hybrid,hf-assisted",
               "--draft", "truncate:2", "--draft-quantize", "int8,none")
    modes = {r["mode"] for r in out["records"]}
    assert modes == {"target-only", "mirrorspec-draft", "mirrorspec-draft@none", "mirrorspec-hybrid",
                     "mirrorspec-hybrid@none", "hf-assisted", "hf-assisted@none"}
    for r in out["records"]:
        if r["mode"].startswith("mirrorspec"):
            assert r["identical_to_target_only"] is True, r["mode"]
    drafted = {r["mode"]: r["stats"]["drafted"] for r in out["records"] if r["mode"].startswith("mirrorspec-draft")}
    assert all(n > 0 for n in drafted.values())


@pytest.mark.slow
def test_draft_model_modes_are_skipped_without_a_draft(tmp_path):
    out = _run(tmp_path, "--datasets", "mtbench", "--num-prompts", "1", "--max-tokens", "4", "--k", "2",
               "--temperatures", "0", "--modes", "mirrorspec-draft,hf-assisted", "--draft", "none")
    assert {r["mode"] for r in out["records"]} == {"target-only"}
    assert any("mirrorspec-draft" in note for note in out["notes"])



def test_hf_assisted_is_skipped_with_a_note_for_a_draft_of_a_narrower_table(padded_pair):
    """transformers asks for both tokenizers for such a pair, then runs its universal assisted
    decoding, whose sampling path crashes: the run used to stop with HF's ValueError at warm-up."""
    drafts = Drafts(model=support.load(padded_pair["draft"]), name="narrow")
    modes, notes = select_modes(["mirrorspec-draft", "hf-assisted"], drafts, target_vocab=16)
    assert [m.name for m in modes] == ["target-only", "mirrorspec-draft"]
    assert notes == ["skipping hf-assisted: the draft's vocabulary table (12 rows) is narrower than the target's "
                     "(16), and HF assisted generation then runs another algorithm (universal assisted decoding)"]
    modes, notes = select_modes(["hf-assisted"], drafts, target_vocab=12)
    assert [m.name for m in modes] == ["target-only", "hf-assisted"] and notes == []


def test_a_server_that_fails_to_start_says_why_and_takes_the_other_down(tiny_dir, tmp_path):
    """The target comes up; the drafter cannot load its model. The error carries the drafter's
    own reason, and the target must not be left running."""
    import psutil

    from benchmarks.data_plane import start_processes

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match=r"drafter_service exited before listening \(code 2\)[\s\S]*"
                                            r"error: --model: model directory \S*no-such-draft does not exist"):
        start_processes(tiny_dir["target16"], tmp_path / "no-such-draft", proposal_top_k=4, pin=False)
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []


@pytest.mark.slow
def test_data_plane_reports_its_overhead_beside_the_round_trip_floor(tmp_path, capsys):
    from benchmarks import data_plane

    assert data_plane.main(["--windows", "10", "--k", "2", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("data_plane-*.json")).read_text())
    rows = {(r["servers"], r["q"]): r for r in result["rows"]}
    assert set(rows) == {(s, q) for s in ("in this process", "separate processes") for q in ("sparse top-32", "dense")}
    for r in rows.values():
        assert r["windows"] == 10 and r["floor_ms_p50"] > 0
        assert r["above_floor_ms_p50"] == pytest.approx(r["overhead_ms_p50"] - r["floor_ms_p50"])
    sparse, dense = (rows["separate processes", q]["q_bytes_per_window"] for q in ("sparse top-32", "dense"))
    assert dense > 100 * sparse
    assert "floor ms" in capsys.readouterr().out


def test_served_modes_start_their_servers_where_and_as_the_in_process_modes_run(tiny_dir):
    """Left to ``auto``, a server on a GPU machine would take the GPU under ``--device cpu``, and
    would not follow ``--dtype``: a served row would no longer be its in-process twin's."""
    model = support.load(tiny_dir["target"])  # a copy of its own: it is cast below
    device = str(model.device)
    assert server_placement(LoadedModel(model, None, "t")) == ("--device", device, "--dtype", "float32")
    half = LoadedModel(model.to(torch.bfloat16), None, "t")
    assert server_placement(half) == ("--device", device, "--dtype", "bfloat16")


@pytest.mark.slow
def test_modes_on_transformers_sdpa_give_the_tokens_of_the_same_modes_on_mirrorspec_sdpa(tmp_path):
    """The demo target groups 9 query heads over 3 key/value heads, so its verify passes run
    ``mirrorspec_sdpa``'s own path; the A/B modes that switch back to transformers' ``sdpa``
    must decode the very same tokens, greedy and sampled (bit-identical logits)."""
    modes = ["target-only", "mirrorspec-ngram", "mirrorspec-ngram-on-sdpa", "mirrorspec-hybrid-confident-runner-up",
             "mirrorspec-hybrid-confident-runner-up-on-sdpa"]
    out = _run(tmp_path, "--datasets", "humaneval,code-edit", "--num-prompts", "2", "--max-tokens", "16", "--k", "4",
               "--temperatures", "0,0.7", "--modes", ",".join(modes), "--draft", "truncate:2")
    records = out["records"]
    assert all(r["identical_to_target_only"] is True for r in records if r["temperature"] == 0.0)
    on_sdpa = [r for r in records if r["mode"].endswith("-on-sdpa") and r["temperature"] > 0.0]
    assert len(on_sdpa) == 8 and all(r["identical_to_in_process"] is True for r in on_sdpa)
