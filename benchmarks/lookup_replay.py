"""Prompt lookup's settings without a clock: the windows it would run along the target's answers.

    python -m benchmarks.lookup_replay [--datasets code-edit,humaneval,mtbench] [--num-prompts 8]
        [--max-tokens 192] [--k 4,8,16] [--max-ngram 2,3,4] [--weak-match-tokens 1,3,8]

A timed run of ``--draft ngram`` over 20 code edits moves by ±5% from run to run on this VM, more
than most of its settings change it. Greedy speculation's output *is* the target's greedy answer,
so the windows prompt lookup runs can be replayed along that answer exactly: each window looks up
the context so far (``NgramDrafter.propose``, as the engine calls it), keeps its drafts up to the
first that differs from the answer, and the target adds one token. Every setting is replayed on the
same answers, so they compare with no noise; the speedup column prices windows with the adaptive-K
cost model (``window_cost``: the measured pass costs, and lookups that cost nothing). Only the
target's answers are computed, once; the JSON keeps them, with the prompts' ids.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.acceptance import Replay, greedy_answers, load_target
from benchmarks.flags import add_run_flags, csv_of, positive, torch_threads, window_k
from benchmarks.prompts import add_replay_flags, load_prompts
from benchmarks.run import args_config
from mirrorspec.adaptive import window_cost
from mirrorspec.config import AdaptiveKConfig, InvalidRequest, SamplingParams
from mirrorspec.drafting.ngram import NgramDrafter


def replay_lookup(drafter: NgramDrafter, prompt: Sequence[int], answer: Sequence[int], k: int) -> Replay:
    """The windows greedy speculation with ``drafter`` runs over ``answer``: each drafts what the
    lookup proposes for the context so far, accepts up to its first miss, and the target adds a
    token. Drafts stop at the answer's end, as the engine's stop at max_new_tokens: for an answer
    that ran to the length limit, the engine's windows exactly. An answer that ended at a stop token
    is replayed as if the limit were there; the engine's last window may draft past it (the target's
    tokens after a stop are not in the answer), so its drafted and accepted counts can differ, by
    one window per answer."""
    params = SamplingParams()
    start = accepted = tests = 0
    window_drafts: list[int] = []
    while start < len(answer):
        budget = min(k, len(answer) - start - 1)
        drafts = drafter.propose([*prompt, *answer[:start]], budget, params, seed=0).tokens if budget else ()
        hits = next((i for i, (d, a) in enumerate(zip(drafts, answer[start:])) if d != a), len(drafts))
        window_drafts.append(len(drafts))
        accepted += hits
        tests += hits + (hits < len(drafts))
        start += hits + 1
    return Replay(len(window_drafts), sum(window_drafts), accepted, tests, tuple(window_drafts))


@dataclass(frozen=True)
class Row:
    dataset: str
    max_ngram: int
    weak_match_tokens: int
    k: int
    positions: int
    tokens_per_pass: float  # bonus included
    acceptance_rate: float  # accepted / drafted
    drafts_per_pass: float
    no_match: float  # share of windows the lookup found nothing for (the last token new to the context)
    est_speedup: float  # over target-only, under the adaptive-K cost model


def summarize(dataset: str, drafter: NgramDrafter, k: int, answers: Sequence[tuple[list[int], list[int]]]) -> Row:
    replays = [replay_lookup(drafter, prompt, answer, k) for prompt, answer in answers]
    windows, drafted, accepted, _ = Replay.totals(replays)
    positions = sum(len(answer) for _, answer in answers)
    window_drafts = [d for r in replays for d in r.drafts_per_window]
    costs = AdaptiveKConfig()
    cost = sum(window_cost(d, costs, drafter.step_cost) for d in window_drafts)
    return Row(dataset, drafter.max_ngram, drafter.weak_match_tokens, k, positions,
               round(positions / max(windows, 1), 3), round(accepted / max(drafted, 1), 4),
               round(drafted / max(windows, 1), 3), round(window_drafts.count(0) / max(windows, 1), 3),
               round(positions / cost, 3) if cost else 0.0)


def format_table(rows: Sequence[Row]) -> str:
    lines = [f"{'dataset':<10} {'max_ngram':>9} {'weak':>4} {'K':>2} {'positions':>9} {'tok/pass':>8} "
             f"{'accept':>6} {'drafts':>6} {'none':>5} {'est.x':>5}"]
    lines += [f"{r.dataset:<10} {r.max_ngram:>9} {r.weak_match_tokens:>4} {r.k:>2} {r.positions:>9} "
              f"{r.tokens_per_pass:>8.3f} {r.acceptance_rate:>6.3f} {r.drafts_per_pass:>6.2f} {r.no_match:>5.2f} "
              f"{r.est_speedup:>5.2f}" for r in rows]
    return "\n".join(lines)


LEGEND = ("tok/pass = target passes' tokens, bonus included; accept = accepted / drafted; drafts = drafts per "
          "pass; none = share of windows with no match; est.x = speedup over target-only under the adaptive-K "
          "cost model (pass costs measured on the 2-core VM; lookups free). Replayed along the target's greedy "
          "answers: nothing is timed")


def build_parser(prog: str = "python -m benchmarks.lookup_replay") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_replay_flags(p, datasets=("code-edit", "humaneval", "mtbench"), max_tokens=192)
    p.add_argument("--k", type=csv_of(window_k), default=[4, 8, 16], help="window sizes (default 4,8,16)")
    p.add_argument("--max-ngram", type=csv_of(positive), default=[3], help="longest suffix looked up (default 3)")
    p.add_argument("--min-ngram", type=positive, default=1, help="shortest suffix looked up (default 1)")
    p.add_argument("--weak-match-tokens", type=csv_of(positive), default=[3],
                   help="drafts after a one-token match (default 3)")
    add_run_flags(p)
    p.add_argument("--answers", type=answers_file, default=None,
                   help="replay the answers an earlier run's JSON kept (no target, no prompts loaded; "
                        "--datasets, --num-prompts, --max-tokens and --target are then theirs)")
    return p


Answers = dict[str, list[tuple[list[int], list[int]]]]  # dataset -> (prompt ids, the target's greedy answer)
ANSWER_SOURCE = ("datasets", "num_prompts", "max_tokens", "target")  # the flags that made a run's answers


@dataclass(frozen=True)
class KeptAnswers:
    """The answers an earlier run kept, and the flags that made them."""

    path: str
    answers: Answers
    source: dict


def answers_file(text: str) -> KeptAnswers:
    """``--answers``: the answers a run of this command kept, read (and refused) as the flags are."""
    try:
        run = json.loads(Path(text).read_text())
        answers = {str(dataset): [(list(a["prompt_ids"]), list(a["answer_ids"])) for a in pairs]
                   for dataset, pairs in run["answers"].items()}
        source = {key: run["config"][key] for key in ANSWER_SOURCE}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise argparse.ArgumentTypeError(f"{text}: not the JSON of a lookup_replay run ({err!r})") from None
    if not any(answers.values()):
        raise argparse.ArgumentTypeError(f"{text}: the run kept no answers")
    return KeptAnswers(text, answers, source)


def target_answers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Answers:
    answers: Answers = {}
    with torch_threads(args.threads), torch.inference_mode():
        target = load_target(args.target, parser)
        prompts = {name: load_prompts(name, args.num_prompts) for name in args.datasets}
        for dataset, _, ids, answer in greedy_answers(target, prompts, args.max_tokens, not args.no_progress):
            answers.setdefault(dataset, []).append((ids, answer))
    return answers


def drafters(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[NgramDrafter]:
    """One lookup per setting asked for; a setting it refuses is named by its flag."""
    out = []
    for max_ngram, weak in itertools.product(args.max_ngram, args.weak_match_tokens):
        try:
            out.append(NgramDrafter(max_ngram=max_ngram, min_ngram=args.min_ngram, weak_match_tokens=weak))
        except InvalidRequest as err:
            parser.error(f"--max-ngram/--min-ngram: {err}")
    return out


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.lookup_replay") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    lookups = drafters(args, parser)
    answers = args.answers.answers if args.answers is not None else target_answers(args, parser)
    rows = [summarize(dataset, drafter, k, pairs)
            for dataset, pairs in answers.items() for drafter in lookups for k in args.k]
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / time.strftime("lookup-replay-%Y%m%d-%H%M%S.json")
    config = args_config(args)  # with --answers: the flags that made them, and where they were kept
    config |= {**args.answers.source, "answers": args.answers.path} if args.answers is not None else {}
    out.write_text(json.dumps({"config": config, "rows": [asdict(r) for r in rows],
                               "answers": {dataset: [{"prompt_ids": ids, "answer_ids": answer} for ids, answer in pairs]
                                           for dataset, pairs in answers.items()}}))
    print(format_table(rows))
    print(f"\n{LEGEND}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
