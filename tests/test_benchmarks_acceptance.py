"""The acceptance replay: its greedy windows are the engine's own, and beta is the acceptance
probability (fast, tiny models); one run on the demo target (slow). Nothing is timed."""

import json

import pytest
import torch

from benchmarks.acceptance import (Replay, acceptance_probability, answer_betas, answer_confidences, category_betas,
                                   main, replay_greedy, summarize)
from mirrorspec.adaptive import window_cost
from mirrorspec.config import AdaptiveKConfig
from mirrorspec import SamplingParams, generate
from mirrorspec.drafting.draft_model import DraftModelDrafter
from support import assert_flag_refused


def test_replay_accepts_up_to_the_first_miss_then_adds_one_target_token():
    assert replay_greedy([True] * 10, 4) == Replay(windows=2, drafted=8, accepted=8, tests=8)
    # windows from 0: T T, miss at 2; from 3: T, miss at 4; from 5: four hits, bonus at 9; from 10: the
    # last token, nothing left to draft beside it
    pattern = [True, True, False, True, False, True, True, True, True, True, True]
    assert replay_greedy(pattern, 4) == Replay(windows=4, drafted=4 + 4 + 4 + 0, accepted=2 + 1 + 4, tests=3 + 2 + 4)
    assert replay_greedy([False] * 3, 2) == Replay(windows=3, drafted=2 + 1 + 0, accepted=0, tests=2)


def test_an_unsure_draft_ends_its_window_after_itself():
    agrees = [True, True, True, True, False, True, True, True]
    sure = [0.9] * 8
    # from 0: an unsure draft at 1 is accepted and ends the window; from 3: a hit, then the miss at 4
    # (sure) is tested and the window drafts on to K; from 5: the last two, bonus at 7
    unsure_at_1 = [0.9, 0.2, *[0.9] * 6]
    replay = replay_greedy(agrees, 3, unsure_at_1, threshold=0.3)
    assert replay == Replay(windows=3, drafted=2 + 3 + 2, accepted=2 + 1 + 2, tests=2 + 2 + 2)
    assert replay.drafts_per_window == (2, 3, 2)
    # the miss itself unsure: the window ends at it, the drafts past it are not made
    unsure_miss = [0.9, 0.9, 0.9, 0.9, 0.1, 0.9, 0.9, 0.9]
    assert replay_greedy(agrees, 8, unsure_miss, threshold=0.3).drafts_per_window == (5, 2)
    # threshold 0, or every draft sure: the plain replay
    assert replay_greedy(agrees, 3, unsure_at_1, threshold=0.0) == replay_greedy(agrees, 3)
    assert replay_greedy(agrees, 3, sure, threshold=0.3).drafts_per_window == replay_greedy(agrees, 3).drafts_per_window


def test_an_empty_answer_has_no_positions(tiny_target, near_draft):
    assert answer_betas(tiny_target, DraftModelDrafter(near_draft), [0, 3], [], [0.0, 0.7]) == {0.0: [], 0.7: []}


def test_acceptance_probability_is_the_overlap_of_p_and_q():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.2, 0.8]])
    assert acceptance_probability(p, q).tolist() == pytest.approx([1.0, 0.0])


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("prompt", [[0, 3, 5], [1, 2]])
def test_greedy_replay_reproduces_the_engines_own_windows(tiny_target, near_draft, prompt, k):
    """The replay claims to be what greedy speculation does: the engine's statistics must match it."""
    params = SamplingParams(max_new_tokens=24)
    answer = list(generate(tiny_target, None, prompt, params).token_ids)
    [betas] = answer_betas(tiny_target, DraftModelDrafter(near_draft), prompt, answer, [0.0]).values()
    replay = replay_greedy([b > 0.5 for b in betas], k)
    stats = generate(tiny_target, near_draft, prompt, params, num_speculative_tokens=k).stats
    assert 0 < replay.accepted < replay.drafted  # the tiny pair agrees sometimes, not always
    assert (replay.windows, replay.drafted, replay.accepted) == (stats.windows, stats.drafted, stats.accepted)
    assert replay.tests - replay.accepted == stats.rejected


@pytest.mark.parametrize("quantile", [0.3, 0.7])
@pytest.mark.parametrize("k", [2, 5])
def test_confidence_replay_reproduces_the_engines_windows(tiny_target, near_draft, k, quantile):
    """Up to each window's first miss the replay with a confidence stop is the engine's; past a miss
    it only estimates how far a sure draft runs on, so drafted is bounded, not equal."""
    prompt, params = [0, 3, 5], SamplingParams(max_new_tokens=24)
    answer = list(generate(tiny_target, None, prompt, params).token_ids)
    [betas] = answer_betas(tiny_target, DraftModelDrafter(near_draft), prompt, answer, [0.0]).values()
    confidences = answer_confidences(DraftModelDrafter(near_draft), prompt, answer)
    threshold = sorted(confidences)[int(quantile * len(confidences))]  # a stop that some drafts trip, some not
    replay = replay_greedy([b > 0.5 for b in betas], k, confidences, threshold)
    stats = generate(tiny_target, DraftModelDrafter(near_draft, confidence=threshold), prompt, params,
                     num_speculative_tokens=k).stats
    assert replay.drafted < replay_greedy([b > 0.5 for b in betas], k).drafted  # the stop cut some windows short
    assert (replay.windows, replay.accepted, replay.tests - replay.accepted) == (
        stats.windows, stats.accepted, stats.rejected)
    assert stats.accepted + stats.rejected <= replay.drafted <= stats.windows * k


@pytest.mark.parametrize("proposal_top_k", [0, 2])
def test_beta_matches_the_acceptance_rate_the_engine_samples(tiny_target, near_draft, proposal_top_k):
    """At T=1, beta at the first answer position is the chance the engine accepts its first draft,
    with a dense q and with a sparse one."""
    prompt = [0, 3, 5]
    answer = list(generate(tiny_target, None, prompt, SamplingParams(max_new_tokens=2)).token_ids)
    drafter = DraftModelDrafter(near_draft, proposal_top_k=proposal_top_k)
    [betas] = answer_betas(tiny_target, drafter, prompt, answer, [1.0]).values()
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    runs = [generate(tiny_target, DraftModelDrafter(near_draft, proposal_top_k=proposal_top_k), prompt, params,
                     num_speculative_tokens=1, seed=s).stats for s in range(1500)]
    accepted = sum(r.accepted_per_position[0] for r in runs) / len(runs)
    assert accepted == pytest.approx(betas[0], abs=4 * (betas[0] * (1 - betas[0]) / len(runs)) ** 0.5 + 1e-3)


def test_summary_rows_replay_greedy_and_estimate_sampled():
    greedy = summarize("d", "x", 0.0, [[1.0, 1.0, 0.0, 1.0]], [2])[0]
    # one window of two hits and the bonus, then the last token alone: the miss is never tested
    assert (greedy.positions, greedy.beta, greedy.acceptance_rate, greedy.alpha) == (4, 0.75, 1.0, 1.0)
    assert greedy.tokens_per_pass == 4 / 2
    sampled = summarize("d", "x", 0.7, [[0.5, 0.5]], [2])[0]
    assert sampled.tokens_per_pass == pytest.approx(1.75) and sampled.alpha is None


def test_greedy_rows_price_each_threshold_by_its_windows():
    betas, confidences = [[1.0, 1.0, 0.0, 1.0, 1.0]], [[0.9, 0.1, 0.9, 0.9, 0.9]]
    plain, stopped = summarize("d", "x", 0.0, betas, [4], confidences, [0.0, 0.5], draft_cost=0.05)
    # no stop: from 0, 4 drafts (2 hits, the miss at 2), from 3 the last draft; the stop: from 0, 2 drafts
    # (the unsure second ends the window, accepted), then the same last window
    assert (plain.draft_confidence, plain.drafts_per_pass, plain.tokens_per_pass) == (0.0, 5 / 2, 5 / 2)
    assert (stopped.draft_confidence, stopped.drafts_per_pass, stopped.tokens_per_pass) == (0.5, 3 / 2, 5 / 2)
    assert plain.est_speedup < stopped.est_speedup  # the same tokens for fewer drafts
    cost = sum(window_cost(d, AdaptiveKConfig(), 0.05) for d in (2, 1))
    assert stopped.est_speedup == round(5 / cost, 3)


def test_categories_weigh_their_prompts_by_answer_positions():
    betas = [[1.0, 0.0], [1.0], [0.0, 0.0, 0.0, 1.0]]
    assert category_betas(["writing", "writing", "math"], betas) == {"writing": round(2 / 3, 4), "math": 0.25}


@pytest.mark.parametrize("argv, flag", [(["--k", "0"], "--k"), (["--draft-quantize", "int4"], "--draft-quantize"),
                                        (["--datasets", "nope"], "--datasets"), (["--draft", "truncate:x"], "--draft"),
                                        (["--draft", "demo-draft,truncate:0"], "--draft"),
                                        (["--proposal-top-k", "-1"], "--proposal-top-k"),
                                        (["--draft-confidence", "1.5"], "--draft-confidence")])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    assert_flag_refused(main, argv, flag, capsys)


@pytest.mark.slow
def test_the_target_as_its_own_draft_is_always_accepted(tmp_path, capsys):
    """The demo target as its own draft: every proposal must be accepted (a q read one position
    off, or p and q over different vocabularies, would fall far below); truncate:2 must not be."""
    common = ["--datasets", "humaneval", "--num-prompts", "1", "--max-tokens", "12", "--k", "4",
              "--temperatures", "0,0.7", "--draft-quantize", "none", "--threads", "1", "--no-progress"]
    # both drafts in one run, along the same target answers
    assert main([*common, "--draft", "demo-target,truncate:2", "--out", str(tmp_path)]) == 0
    stored = json.loads(next(tmp_path.glob("*.json")).read_text())
    rows = {draft: {r["temperature"]: r for r in stored["rows"] if r["draft"] == f"{draft}@none"}
            for draft in ("demo-target", "truncate:2")}
    whole, cut = rows["demo-target"], rows["truncate:2"]
    assert whole[0.0]["acceptance_rate"] == 1.0 and whole[0.0]["beta"] == 1.0
    assert whole[0.7]["beta"] > 0.999
    assert cut[0.0]["beta"] < 0.9 and cut[0.7]["beta"] < 0.9
    assert "tok/pass" in capsys.readouterr().out
    assert stored["beta_by_category"]["humaneval truncate:2@none T=0"]["completion"] == cut[0.0]["beta"]


def test_mirrorspec_bench_acceptance_is_the_same_command(capsys):
    from mirrorspec.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "acceptance", "--num-prompts", "0"])
    assert exc.value.code == 2 and "argument --num-prompts" in capsys.readouterr().err
