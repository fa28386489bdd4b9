"""Draft quality without a clock: how often the target would accept the draft, computed exactly.

    python -m benchmarks.acceptance [--draft demo-draft[,OTHER]] [--draft-quantize int8,none]
        [--datasets humaneval,mtbench] [--num-prompts 8] [--max-tokens 64] [--k 2,4,8]
        [--temperatures 0,0.7]          (also: mirrorspec bench acceptance ...)

Timed benchmark runs over a few prompts report acceptance with noise: a sampled run's alpha
swings by ±0.06 between drafts that barely differ, and greedy runs mix in adaptive K, confidence
stops and prompt lookup. This replays the draft along the target's own greedy answer to each
prompt instead. At every answer position the draft proposes one token exactly as it does when
decoding (``DraftModelDrafter.propose``: its sub-vocabulary, its quantization, its q) and the
target's p is formed as the verifier forms it (``target_probs``). From those:

* ``beta``: per-token acceptance sum_x min(p(x), q(x)), the probability that rejection sampling
  keeps the draft's token there (Leviathan et al. 2023's alpha); greedy, 1 where the argmaxes agree;
* greedy, per K: the windows greedy speculation runs, replayed along the answer, which *is* the
  output: acceptance (accepted / drafted), Leviathan's alpha (accepted / tests run) and tokens per
  target pass with the bonus token, the figures of the demo-draft issue's goal (alpha >= 0.55,
  >= 2.1 tokens per pass at K=4), for a draft-model window with no prompt lookup or confidence stop;
* greedy, per K and ``--draft-confidence`` threshold: the same windows when each also ends after the
  draft's first token it gives less than the threshold (``mirrorspec generate --draft-confidence``),
  with drafts per pass and the speedup over target-only those windows would give under the
  adaptive-K cost model (``window_cost``: the drafter's step cost, the measured pass costs). Up to
  a window's first miss its drafts and their confidence are exact; the drafts a confident draft
  would add after its own miss are estimated from its confidence along the target's answer;
* sampled, per K: tokens per pass from ``beta`` under i.i.d. acceptance (an estimate: a sampled
  run leaves the greedy path).

Deterministic: the same draft gives the same figures on every run, so two drafts, or one draft's
quantizations, compare with no noise. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm import tqdm

from benchmarks.flags import (add_run_flags, csv_of, draft_confidence, draft_spec, integer_at_least, one_of,
                              sampling_temperature, torch_threads, window_k)
from benchmarks.metrics import expected_tokens_per_window
from benchmarks.prompts import add_replay_flags, load_prompts
from benchmarks.run import args_config, load_draft
from mirrorspec.adaptive import window_cost
from mirrorspec.config import (DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DRAFT_QUANTIZE, QUANTIZATIONS, AdaptiveKConfig,
                               InvalidRequest, SamplingParams)
from mirrorspec.drafting.draft_model import DraftModelDrafter
from mirrorspec.engine import generate
from mirrorspec.models import KVSession, LoadedModel, encode_prompt, load_causal_lm
from mirrorspec.sampling.distributions import target_probs


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The chance rejection sampling accepts a token drawn from q where the target's law is p.

    # [n, vocab], [n, vocab] -> [n]
    """
    return torch.minimum(p, q).sum(-1)


@dataclass(frozen=True)
class Replay:
    """Greedy windows of at most K drafts run along one answer."""

    windows: int
    drafted: int
    accepted: int
    tests: int  # positions tested: a window stops at its first rejection
    drafts_per_window: tuple[int, ...] = field(default=(), compare=False)

    @staticmethod
    def totals(replays: Sequence[Replay]) -> tuple[int, int, int, int]:
        """(windows, drafted, accepted, tests) over many answers' replays."""
        return tuple(sum(getattr(r, f) for r in replays) for f in ("windows", "drafted", "accepted", "tests"))


def replay_greedy(agrees: Sequence[bool], k: int, confidences: Sequence[float] | None = None,
                  threshold: float = 0.0) -> Replay:
    """The windows greedy speculation runs over an answer whose position i the draft gets right
    iff ``agrees[i]``: each accepts drafts up to its first miss, then the target adds one token
    (the correction, or the bonus after K hits). The last window drafts no further than the
    answer's end, as the engine drafts no further than max_new_tokens.

    With ``confidences`` (the draft's own probability of its token at each position), a window
    also ends after its first draft below ``threshold``; past a miss, the draft's confidence along
    the answer stands in for its confidence along its own tokens (what a replay cannot see)."""
    start = tests = 0
    window_drafts: list[int] = []
    accepted_total = 0
    while start < len(agrees):
        budget = min(k, len(agrees) - start - 1)
        hits = drafted = 0
        missed = False
        while drafted < budget:
            position = start + drafted
            drafted += 1
            missed = missed or not agrees[position]
            hits += not missed
            if confidences is not None and confidences[position] < threshold:
                break
        window_drafts.append(drafted)
        accepted_total += hits
        tests += hits + missed
        start += hits + 1
    return Replay(len(window_drafts), sum(window_drafts), accepted_total, tests, tuple(window_drafts))


def answer_betas(target: torch.nn.Module, drafter: DraftModelDrafter, prompt: list[int], answer: list[int],
                 temperatures: Sequence[float]) -> dict[float, list[float]]:
    """beta at every answer position, per temperature (teacher-forced on the answer)."""
    if not answer:
        return {temperature: [] for temperature in temperatures}
    sequence = prompt + answer
    target_logits = KVSession(target).logits_for(sequence[:-1], len(answer))  # [m, vocab], row i -> answer[i]
    vocab_size = target_logits.shape[-1]
    betas: dict[float, list[float]] = {}
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature)
        p = target_probs(target_logits, params)  # [m, vocab]
        q = torch.cat([drafter.propose(sequence[:len(prompt) + i], 1, params, seed=0).q.dense(vocab_size)
                       for i in range(len(answer))])  # [m, vocab]
        betas[temperature] = acceptance_probability(p, q).tolist()
    drafter.release()
    return betas


def teacher_forced_logits(drafter: DraftModelDrafter, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The draft's logits at every answer position, teacher-forced on the answer, addressed by
    vocabulary id: -inf outside its sub-vocabulary, which it never proposes.

    # -> [len(answer), vocab] float32, row i scores answer[i]
    """
    logits = drafter.session.logits_for((prompt + answer)[:-1], len(answer)).float()  # [n, vocab or m]
    drafter.release()
    if drafter.vocab_ids is None:
        return logits
    full = logits.new_full((len(answer), drafter.session.vocab_size), float("-inf"))  # [n, vocab]
    full[:, drafter.vocab_ids.to(full.device)] = logits
    return full


def answer_confidences(drafter: DraftModelDrafter, prompt: list[int], answer: list[int]) -> list[float]:
    """The draft's own probability (temperature 1) of its greedy token at every answer position,
    teacher-forced: what ``DraftModelDrafter`` compares with its confidence threshold."""
    if not answer:
        return []
    return teacher_forced_logits(drafter, prompt, answer).softmax(-1).amax(-1).tolist()  # [n]


@dataclass
class Row:
    dataset: str
    draft: str
    temperature: float
    k: int
    positions: int
    beta: float  # mean per-token acceptance over every answer position
    tokens_per_pass: float  # greedy: replayed; sampled: i.i.d. estimate from beta
    acceptance_rate: float | None = None  # greedy: accepted / drafted
    alpha: float | None = None  # greedy: accepted / tests run
    draft_confidence: float = 0.0  # greedy: windows end after a draft below this (0: never)
    drafts_per_pass: float | None = None  # greedy: draft steps per target pass
    est_speedup: float | None = None  # greedy: over target-only, under the adaptive-K cost model


def summarize(dataset: str, draft: str, temperature: float, betas: list[list[float]], ks: Sequence[int],
              confidences: list[list[float]] | None = None, thresholds: Sequence[float] = (0.0,),
              draft_cost: float = DraftModelDrafter.step_cost) -> list[Row]:
    """One row per K from the betas of every prompt's answer; greedy, one per K and confidence
    threshold (``confidences``: the draft's own, per answer and position)."""
    flat = [b for answer in betas for b in answer]
    beta = sum(flat) / max(len(flat), 1)
    agrees = [[b > 0.5 for b in answer] for answer in betas]  # greedy: beta is 1 where the argmaxes agree
    rows = []
    for k in ks:
        estimate = Row(dataset, draft, temperature, k, len(flat), round(beta, 4),
                       round(expected_tokens_per_window(beta, k), 3))
        if temperature != 0:
            rows.append(estimate)
            continue
        for threshold in thresholds:
            replays = [replay_greedy(answer, k, None if confidences is None else confidences[i], threshold)
                       for i, answer in enumerate(agrees)]
            rows.append(_greedy_row(estimate, replays, threshold, draft_cost))
    return rows


def _greedy_row(estimate: Row, replays: Sequence[Replay], threshold: float, draft_cost: float) -> Row:
    windows, drafted, accepted, tests = Replay.totals(replays)
    costs = AdaptiveKConfig()
    cost = sum(window_cost(d, costs, draft_cost) for r in replays for d in r.drafts_per_window)
    return replace(estimate, tokens_per_pass=round(estimate.positions / max(windows, 1), 3),
                   acceptance_rate=round(accepted / max(drafted, 1), 4), alpha=round(accepted / max(tests, 1), 4),
                   draft_confidence=threshold, drafts_per_pass=round(drafted / max(windows, 1), 3),
                   est_speedup=round(estimate.positions / cost, 3) if cost else None)


def category_betas(categories: Sequence[str], betas: Sequence[Sequence[float]]) -> dict[str, float]:
    """Mean beta per prompt category, over every answer position of the category's prompts
    (MT-Bench's eight categories differ by 2x for the demo draft: where new training data helps)."""
    sums: dict[str, tuple[float, int]] = {}
    for category, answer in zip(categories, betas, strict=True):
        total, count = sums.get(category, (0.0, 0))
        sums[category] = (total + sum(answer), count + len(answer))
    return {category: round(total / max(count, 1), 4) for category, (total, count) in sums.items()}


def format_table(rows: list[Row]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"{'dataset':<10} {'draft':<22} {'T':>4} {'K':>2} {'conf':>4} {'positions':>9} {'beta':>6} "
             f"{'accept':>6} {'alpha':>6} {'tok/pass':>8} {'drafts':>6} {'est.x':>5}"]
    for r in rows:
        lines.append(f"{r.dataset:<10} {r.draft:<22} {r.temperature:>4g} {r.k:>2} {r.draft_confidence:>4g} "
                     f"{r.positions:>9} {r.beta:>6.3f} {cell(r.acceptance_rate):>6} {cell(r.alpha):>6} "
                     f"{r.tokens_per_pass:>8.3f} {cell(r.drafts_per_pass):>6} {cell(r.est_speedup):>5}")
    return "\n".join(lines)


LEGEND = ("beta = mean sum_x min(p, q) per answer position; greedy: accept = accepted/drafted, alpha = accepted/"
          "tests run, tok/pass = replayed windows (bonus included), conf = windows end after a draft the draft "
          "gives less than this, drafts = draft steps per pass, est.x = speedup over target-only under the "
          "adaptive-K cost model (no prompt lookup, no clock); sampled: tok/pass = (1 - beta^(K+1)) / "
          "(1 - beta), i.i.d. estimate")


def build_parser(prog: str = "python -m benchmarks.acceptance") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_replay_flags(p)
    p.add_argument("--k", type=csv_of(window_k), default=[2, 4, 8], help="window sizes to replay (default 2,4,8)")
    p.add_argument("--temperatures", type=csv_of(sampling_temperature), default=[0.0, 0.7],
                   help="comma-separated; 0 = greedy (default 0,0.7)")
    p.add_argument("--draft-confidence", type=csv_of(draft_confidence), default=[0.0, DEFAULT_DRAFT_CONFIDENCE],
                   help="greedy: thresholds to replay windows with, each a row; 0 = no confidence stop "
                        f"(default 0,{DEFAULT_DRAFT_CONFIDENCE})")
    add_run_flags(p)
    p.add_argument("--draft", type=csv_of(draft_spec), default=["demo-draft"],
                   help="draft models, comma-separated, each replayed along the same target answers: demo-draft "
                        "(default), demo-draft weights (a .safetensors from mirrorspec demo --rebuild --out), a "
                        "path / hub id sharing the target's tokenizer, or truncate:N (see python -m benchmarks --help)")
    p.add_argument("--draft-quantize", type=csv_of(one_of(QUANTIZATIONS, "quantization")),
                   default=[DEFAULT_DRAFT_QUANTIZE], help=f"one row per value, e.g. int8,none "
                                                          f"(default {DEFAULT_DRAFT_QUANTIZE})")
    p.add_argument("--proposal-top-k", type=integer_at_least(0), default=0,
                   help="the draft's q kept to its top-k tokens, as drafters with --proposal-top-k propose (0 = dense, "
                        "the default here; `mirrorspec serve` and `generate --local` use 32)")
    return p


def load_target(name: str, parser: argparse.ArgumentParser) -> LoadedModel:
    """``--target`` loaded, with the tokenizer the prompts are encoded with; refused by its flag."""
    try:
        target = load_causal_lm(name)
    except (InvalidRequest, OSError) as err:
        parser.error(f"--target: {err}")
    if target.tokenizer is None:
        parser.error("--target: the target has no tokenizer; prompts cannot be encoded")
    return target


def _load(args: argparse.Namespace,
          parser: argparse.ArgumentParser) -> tuple[LoadedModel, dict[str, DraftModelDrafter]]:
    if "none" in args.draft:
        parser.error("--draft: 'none' leaves nothing to measure; name a draft model")
    target = load_target(args.target, parser)
    drafters = {}
    for spec in args.draft:
        try:
            drafts = load_draft(spec, target, args.draft_quantize)
        except (InvalidRequest, OSError, ValueError) as err:
            parser.error(f"--draft {spec}: {err}")
        models = {args.draft_quantize[0]: drafts.model, **drafts.others}
        drafters |= {f"{spec}@{q}": DraftModelDrafter(model, proposal_top_k=args.proposal_top_k)
                     for q, model in models.items()}
    return target, drafters


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.acceptance") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    with torch_threads(args.threads), torch.inference_mode():
        return _run(args, parser)


Betas = dict[tuple[str, str, float], list[list[float]]]  # (dataset, draft, T) -> per answer, per position
Confidences = dict[tuple[str, str], list[list[float]]]  # (dataset, draft) -> per answer, per position


@dataclass
class Replayed:
    """Every draft's betas and greedy confidences along the target's answers, and the answers."""

    betas: Betas = field(default_factory=dict)
    confidences: Confidences = field(default_factory=dict)
    answers: dict[str, list[dict]] = field(default_factory=dict)


def greedy_answers(target: LoadedModel, prompts: dict[str, list], max_tokens: int,
                   progress: bool) -> Iterator[tuple[str, object, list[int], list[int]]]:
    """(dataset, prompt, its ids, the target's greedy answer) for every prompt, in order: the text a
    greedy speculative run writes, whatever it drafts, so drafts can be replayed along it."""
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=target.stop_token_ids())
    total = sum(len(p) for p in prompts.values())
    with tqdm(total=total, desc="replaying drafts on target answers", disable=not progress) as bar:
        for dataset, items in prompts.items():
            for prompt in items:
                ids = encode_prompt(target.tokenizer, prompt.text)
                yield dataset, prompt, ids, list(generate(target.model, None, ids, params).token_ids)
                bar.update(1)


def replay_prompts(target: LoadedModel, drafters: dict[str, DraftModelDrafter], prompts: dict[str, list],
                   max_tokens: int, temperatures: Sequence[float], progress: bool) -> Replayed:
    """Every draft's betas and greedy confidences along the target's greedy answer to every
    prompt; and the answers."""
    replayed = Replayed()
    for dataset, prompt, ids, answer in greedy_answers(target, prompts, max_tokens, progress):
        record = {"prompt_id": prompt.prompt_id, "category": prompt.category, "answer_ids": answer, "beta": {}}
        for name, drafter in drafters.items():
            for temperature, values in answer_betas(target.model, drafter, ids, answer, temperatures).items():
                replayed.betas.setdefault((dataset, name, temperature), []).append(values)
                record["beta"][f"{name} T={temperature:g}"] = values
            confidences = answer_confidences(drafter, ids, answer)
            replayed.confidences.setdefault((dataset, name), []).append(confidences)
            record.setdefault("confidence", {})[name] = confidences
        replayed.answers.setdefault(dataset, []).append(record)
    return replayed


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    target, drafters = _load(args, parser)
    prompts = {name: load_prompts(name, args.num_prompts) for name in args.datasets}
    replayed = replay_prompts(target, drafters, prompts, args.max_tokens, args.temperatures,
                              progress=not args.no_progress)
    betas, answers = replayed.betas, replayed.answers
    rows = [row for (dataset, name, temperature), values in betas.items()
            for row in summarize(dataset, name, temperature, values, args.k, replayed.confidences[dataset, name],
                                 args.draft_confidence, drafters[name].step_cost)]
    by_category = {f"{dataset} {name} T={temperature:g}":
                   category_betas([a["category"] for a in answers[dataset]], values)
                   for (dataset, name, temperature), values in betas.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / time.strftime("acceptance-%Y%m%d-%H%M%S.json")
    config = args_config(args)
    out.write_text(json.dumps({"config": config, "rows": [asdict(r) for r in rows], "beta_by_category": by_category,
                               "answers": answers}, indent=1))
    print(format_table(rows))
    for key, categories in by_category.items():
        if len(categories) > 1:
            print(f"beta by category, {key}: " + ", ".join(f"{c} {b:.3f}" for c, b in categories.items()))
    print(f"\n{LEGEND}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
