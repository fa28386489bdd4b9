"""The prompt-lookup replay: its windows are the engine's own with the n-gram drafter (fast, tiny
model), a setting it cannot run is refused by its flag, and one run on the demo target (slow).
Nothing is timed."""

import json

import pytest

from benchmarks.acceptance import Replay
from benchmarks.lookup_replay import Row, main, replay_lookup, summarize
from mirrorspec import SamplingParams, generate
from mirrorspec.drafting.ngram import NgramDrafter


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("lookup", [NgramDrafter(), NgramDrafter(max_ngram=2, weak_match_tokens=1)],
                         ids=["default", "short"])
def test_the_replay_is_the_windows_the_engine_runs_with_prompt_lookup(tiny_target, lookup, k):
    # a prompt whose earlier n-grams send some lookups the wrong way before the answer settles
    prompt, params = [1, 6, 5, 7, 3, 1, 0, 1], SamplingParams(max_new_tokens=40)
    answer = list(generate(tiny_target, None, prompt, params).token_ids)
    replay = replay_lookup(lookup, prompt, answer, k)
    stats = generate(tiny_target, lookup, prompt, params, num_speculative_tokens=k).stats
    assert 0 < replay.accepted < replay.drafted  # lookups that hit and lookups that miss
    assert (replay.windows, replay.drafted, replay.accepted) == (stats.windows, stats.drafted, stats.accepted)
    assert replay.tests - replay.accepted == stats.rejected


def test_an_answer_that_copies_its_prompt_is_drafted_in_windows_of_k():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    answer = [2, 3, 4, 5, 6, 7, 8, 9, 1]
    # the one-token match "1" drafts 2 3 4 5, all kept, and the target adds 6; then "4 5 6" drafts on
    # to the answer's end (7 8 9), and the target adds the last token
    replay = replay_lookup(NgramDrafter(weak_match_tokens=8), prompt, answer, 4)
    assert replay == Replay(windows=2, drafted=7, accepted=7, tests=7)
    assert replay.drafts_per_window == (4, 3)
    row = summarize("copy", NgramDrafter(weak_match_tokens=8), 4, [(prompt, answer)])
    assert row == Row("copy", 3, 8, 4, 9, tokens_per_pass=round(9 / replay.windows, 3), acceptance_rate=1.0,
                      drafts_per_pass=round(replay.drafted / replay.windows, 3), no_match=0.0,
                      est_speedup=row.est_speedup)
    assert row.est_speedup > 1


@pytest.mark.parametrize("argv, flag", [
    (["--max-ngram", "2", "--min-ngram", "3"], "--max-ngram/--min-ngram"),
    (["--datasets", "nope"], "--datasets"),
    (["--k", "0"], "--k"),
    (["--weak-match-tokens", "0"], "--weak-match-tokens"),
])
def test_a_setting_it_cannot_run_is_refused_by_its_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_a_window_with_no_match_drafts_nothing_and_is_counted():
    # "3" ends the context and occurs nowhere before it, so the first window finds nothing; then "1"
    # matches and drafts on
    row = summarize("new", NgramDrafter(), 4, [([5, 1, 2, 3], [1, 2, 3, 4])])
    assert row.no_match == 0.5 and row.tokens_per_pass == 2.0


@pytest.mark.parametrize("text", ['{"rows": []}', '{"answers": [], "config": {}}', '{"answers": "x"}',
                                  '{"answers": {}, "config": {"datasets": [], "num_prompts": 1, "max_tokens": 1, '
                                  '"target": "t"}}', "not json"])
def test_answers_that_are_not_a_runs_json_are_refused_by_the_flag(tmp_path, capsys, text):
    (tmp_path / "other.json").write_text(text)
    for path in (tmp_path / "other.json", tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as exc:
            main(["--answers", str(path)])
        assert exc.value.code == 2 and "--answers" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_on_the_demo_target_writes_a_row_per_setting(tmp_path, capsys):
    assert main(["--datasets", "code-edit", "--num-prompts", "1", "--max-tokens", "24", "--k", "4,8",
                 "--max-ngram", "2,3", "--threads", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    [written] = tmp_path.glob("lookup-replay-*.json")
    result = json.loads(written.read_text())
    rows = result["rows"]
    [answer] = result["answers"]["code-edit"]
    assert len(answer["answer_ids"]) == 24 and answer["prompt_ids"]
    assert [(r["max_ngram"], r["k"]) for r in rows] == [(2, 4), (2, 8), (3, 4), (3, 8)]
    assert all(r["positions"] == 24 and r["tokens_per_pass"] >= 1 for r in rows)
    assert "est.x" in capsys.readouterr().out
    # the kept answers replay to the same rows, with no target loaded
    again = tmp_path / "again"
    assert main(["--answers", str(written), "--k", "4,8", "--max-ngram", "2,3", "--out", str(again)]) == 0
    [rewritten] = again.glob("lookup-replay-*.json")
    replayed = json.loads(rewritten.read_text())
    assert replayed["rows"] == rows
    # its config says where the answers came from and the flags that made them
    assert replayed["config"]["answers"] == str(written) and replayed["config"]["max_tokens"] == 24
    assert replayed["config"]["datasets"] == ["code-edit"] and replayed["config"]["num_prompts"] == 1
