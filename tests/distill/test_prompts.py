import random

import pytest

from benchmarks.prompts import load_humaneval, load_mtbench
from mirrorspec.config import DistillRecipe
from mirrorspec.distill.broad_chat import CATEGORIES, broad_chat_prompts
from mirrorspec.distill.build import teacher_dir
from mirrorspec.distill.prompts import training_prompts


@pytest.fixture(scope="module")
def both_sets():
    return training_prompts(0, prompt_set=1), training_prompts(0, prompt_set=2)


def test_prompt_sets_share_code_and_docs_and_differ_in_chat(both_sets):
    one, two = both_sets
    code = ("complete", "edit")
    assert sorted(p.text for p in one if p.kind in code) == sorted(p.text for p in two if p.kind in code)
    assert sum(p.kind == "docs" for p in one) == sum(p.kind == "docs" for p in two)  # phrasing is drawn
    chat_one = {p.text for p in one if p.kind == "chat"}
    chat_two = {p.text for p in two if p.kind == "chat"}
    assert len(chat_two) == 6000  # all distinct
    assert len(chat_one & chat_two) < 60  # a few short templates may coincide; the families differ


def test_prompt_sets_are_seeded(both_sets):
    assert training_prompts(0, prompt_set=2) == both_sets[1]
    assert [p.text for p in training_prompts(1, prompt_set=2)[:50]] != [p.text for p in both_sets[1][:50]]


def test_broad_chat_fills_every_slot_and_visits_every_category():
    prompts = broad_chat_prompts(random.Random(0), 400)
    assert len(set(prompts)) == 400
    assert not [p for p in prompts if "{" in p or "}" in p]
    # categories come in turn, so each category's n-th prompt sits at a fixed stride
    categories = sorted(CATEGORIES)
    for i, name in enumerate(categories):
        own = prompts[i::len(categories)]
        templates = [t.split("{")[0] for t in CATEGORIES[name]]
        assert all(any(p.startswith(head) for head in templates) for p in own), name


def test_no_training_prompt_is_a_benchmark_prompt(both_sets):
    benchmark = [p.text.strip() for p in load_mtbench(80) + load_humaneval(164)]
    training = {p.text.strip() for prompts in both_sets for p in prompts}
    assert not training.intersection(benchmark)
    mtbench_openings = {text[:60] for text in benchmark[:80]}
    assert not {t[:60] for t in training} & mtbench_openings


def test_unknown_prompt_set_is_refused():
    with pytest.raises(ValueError, match="prompt_set must be 1 or 2"):
        training_prompts(0, prompt_set=3)


def test_teacher_cache_is_keyed_by_prompt_set():
    assert teacher_dir(DistillRecipe(prompt_set=1)) != teacher_dir(DistillRecipe(prompt_set=2))


def test_a_bigger_budget_keeps_the_pool_in_place_and_adds_distinct_chat(both_sets):
    pool = both_sets[1]
    bigger = training_prompts(0, prompt_set=2, count=len(pool) + 500)
    assert bigger[:len(pool)] == pool  # so the teacher shards of a smaller run stay valid
    extra = bigger[len(pool):]
    assert len(extra) == 500 and {p.kind for p in extra} == {"chat"}
    assert not {p.text for p in extra} & {p.text for p in pool}
    assert len({p.text for p in extra}) == 500
    assert training_prompts(0, prompt_set=2, count=len(pool) + 500) == bigger  # seeded
    benchmark = {p.text.strip() for p in load_mtbench(80) + load_humaneval(164)}
    assert not {p.text.strip() for p in extra} & benchmark


def test_a_chat_family_that_runs_dry_is_refused():
    from mirrorspec.distill.prompts import more_chat_prompts

    exclude = set(broad_chat_prompts(random.Random(0), 50))
    with pytest.raises(ValueError, match="ran out of distinct chat prompts"):
        more_chat_prompts(0, 10, prompt_set=2, exclude=exclude | {"x"}, max_rounds=0)


def test_a_chat_family_that_runs_dry_returns_short_then_is_refused(monkeypatch):
    """Past the family's distinct prompts (~242k), the draws went on forever: `--teacher-prompts
    1000000000` spun silently (review 5)."""
    from mirrorspec.distill import broad_chat
    from mirrorspec.distill.prompts import PromptsRanOut, more_chat_prompts

    monkeypatch.setattr(broad_chat, "CATEGORIES", {"only": ["Say hello."]})
    few = broad_chat_prompts(random.Random(0), 1000, max_repeats_in_a_row=2000)
    assert 1 < len(few) < 1000 and len(set(few)) == len(few)
    with pytest.raises(PromptsRanOut, match="ran out of distinct chat prompts"):
        more_chat_prompts(0, 1000, prompt_set=2, exclude=set())
