"""The tree replay: a chain replays exactly as greedy speculation runs, trees keep the longest
node prefix, fitted trees are the likeliest prefix-closed sets (fast); one run on the demo pair
(slow). Nothing is timed."""

import json
import random

import pytest

from benchmarks.acceptance import answer_betas, replay_greedy, teacher_forced_logits
from benchmarks.trees import (OUTSIDE, TreeReplay, answer_ranks, chain, fit_tree, main, replay_tree,
                              widths)
from mirrorspec import SamplingParams, generate
from mirrorspec.drafting.draft_model import DRAFT_VOCAB_KEY, DraftModelDrafter
from support import assert_flag_refused, load


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_chain_replays_as_greedy_speculation_does(k):
    """The chain of K is the tree of rank-0 paths: its windows are ``replay_greedy``'s, which the
    acceptance tests hold to the engine's own."""
    rng = random.Random(k)
    for _ in range(50):
        ranks = [rng.choice([0, 0, 1, 3, OUTSIDE]) for _ in range(rng.randint(0, 40))]
        assert replay_tree(ranks, chain(k)).passes == replay_greedy([r == 0 for r in ranks], k).windows


def test_a_window_keeps_the_longest_node_prefix_then_one_target_token():
    tree = frozenset({(0,), (1,), (0, 0), (1, 0), (1, 0, 2)})
    ranks = [1, 0, 2, 5, 0, 1, 0, 0, 0]
    # from 0: (1, 0, 2) is a node, then the target's token at 3; from 4: (0, 1) is not, (0,) is: token
    # 5 is the target's; from 6: (0, 0), then the last token (nothing left to draft beside it)
    assert replay_tree(ranks, tree) == TreeReplay(passes=3, tokens=9)
    assert replay_tree([], tree) == TreeReplay(passes=0, tokens=0)
    assert replay_tree([OUTSIDE, 0], tree).passes == 2


def test_a_fitted_tree_holds_the_likeliest_nodes_each_with_its_parent():
    # windows may start anywhere: (0,) and (1,) are passed through 3 times each; (0, 0), (0, 1),
    # (1, 0) and (0, 0, 1) once
    answers = [[0, 0, 1], [1, 0], [1]]
    assert fit_tree(answers, 2, depth=3) == {(0,), (1,)}
    tree = fit_tree(answers, 5, depth=3)  # ties go to the shallower node, then the lower ranks
    assert tree == {(0,), (1,), (0, 0), (0, 1), (1, 0)}
    assert fit_tree(answers, 6, depth=3) == tree | {(0, 0, 1)}  # only once its parent is in
    assert widths(tree) == [2, 3]
    # a token outside the draft's vocabulary is in no tree, and nor is anything after it
    assert fit_tree([[OUTSIDE, 0, 0]], 8, depth=3) == {(0,), (0, 0)}
    assert fit_tree(answers, 100, depth=1) == {(0,), (1,)}


def test_ranks_are_zero_exactly_where_the_draft_agrees(tiny_target, near_draft):
    prompt, params = [0, 3, 5], SamplingParams(max_new_tokens=24)
    answer = list(generate(tiny_target, None, prompt, params).token_ids)
    ranks = answer_ranks(DraftModelDrafter(near_draft), prompt, answer)
    [betas] = answer_betas(tiny_target, DraftModelDrafter(near_draft), prompt, answer, [0.0]).values()
    assert [r == 0 for r in ranks] == [b > 0.5 for b in betas]
    assert 0 < ranks.count(0) < len(ranks) and max(ranks) < 8  # vocab 8, no sub-vocabulary
    # along its own greedy answer the draft ranks every token first
    own = list(generate(near_draft, None, prompt, params).token_ids)
    assert answer_ranks(DraftModelDrafter(near_draft), prompt, own) == [0] * len(own)


def test_a_sub_vocabulary_draft_ranks_among_its_own_ids_and_never_outside_them(tiny_dir, tiny_target):
    sub_vocabulary = [6, 1, 4, 3]  # any order: a column is not an id
    whole, sub = load(tiny_dir["draft"]), load(tiny_dir["draft"])
    setattr(sub.config, DRAFT_VOCAB_KEY, sub_vocabulary)
    prompt = [0, 3, 5]
    answer = list(generate(tiny_target, None, prompt, SamplingParams(max_new_tokens=24)).token_ids)
    ranks = answer_ranks(DraftModelDrafter(sub), prompt, answer)
    kept = teacher_forced_logits(DraftModelDrafter(whole), prompt, answer)[:, sub_vocabulary]  # [n, 4], by hand
    for i, token in enumerate(answer):
        if token in sub_vocabulary:
            assert ranks[i] == int((kept[i] > kept[i, sub_vocabulary.index(token)]).sum())
        else:
            assert ranks[i] == OUTSIDE
    assert OUTSIDE in ranks and any(r != OUTSIDE for r in ranks)


@pytest.mark.parametrize("argv, flag", [(["--nodes", "0"], "--nodes"), (["--k", "0"], "--k"),
                                        (["--datasets", "nope"], "--datasets")])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    assert_flag_refused(main, argv, flag, capsys)


def test_answers_made_with_other_flags_are_refused(tmp_path, capsys):
    made = tmp_path / "acceptance.json"
    made.write_text(json.dumps({"config": {"max_tokens": 32, "target": "demo-target"}, "answers": {}}))
    assert_flag_refused(main, ["--answers", str(made), "--max-tokens", "64"], "--answers", capsys)
    made.write_text(json.dumps({"config": {"max_tokens": 64, "target": "demo-target"}, "answers": {}}))
    assert_flag_refused(main, ["--answers", str(made)], "--answers", capsys)  # lacks the prompts
    for broken in ("not json", json.dumps({"config": [], "answers": {}}), json.dumps({"config": {}, "answers": []})):
        made.write_text(broken)
        assert_flag_refused(main, ["--answers", str(made)], "--answers", capsys)


@pytest.mark.slow
def test_trees_replay_on_the_demo_pair(tmp_path, capsys):
    assert main(["--datasets", "humaneval", "--num-prompts", "2", "--max-tokens", "12", "--nodes", "2,6",
                 "--k", "2", "--depth", "4", "--reps", "1", "--threads", "1", "--no-progress",
                 "--out", str(tmp_path)]) == 0
    stored = json.loads(next(tmp_path.glob("trees-*.json")).read_text())
    assert stored["chain_check"] == {"humaneval K=2": True}
    rows = {r["shape"]: r for r in stored["rows"]}
    assert set(rows) == {"chain K=2", "tree N=2", "tree N=6"}
    assert rows["tree N=6"]["nodes"] == 6 and sum(rows["tree N=6"]["widths"]) == 6
    assert all(r["tokens_per_pass"] >= 1 and r["verify_cost"] > 0 and r["est_speedup"] > 0 for r in rows.values())
    assert "tok/pass" in capsys.readouterr().out
