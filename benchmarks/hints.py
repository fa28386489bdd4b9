"""What an early-exit hint costs the verify, and how often its branches hit, by hint vocabulary.

    python -m benchmarks.hints [--hint-layer 27] [--datasets humaneval,mtbench] [--num-prompts 3]
                               [--max-tokens 64] [--k 4] [--max-branches 4] [--alternatives 7]
                               [--prompt-lookup 2] [--draft-confidence 0.3] [--runner-up] [--reps 60]

Part 1 times the very call a hinted verify makes (``KVSession.logits_for`` over K + 1 positions
inside ``EarlyExitProbe.watching``) with no hint, a hint over the whole vocabulary, one over
the draft's declared sub-vocabulary, and one over the sub-vocabulary read through the target's
tuned lens (``mirrorspec.models.lens``, what the servers run by default), interleaved so a slow
stretch of a shared machine hits all four alike; one torch thread, as a target replica runs.

Part 2 decodes the same prompts greedily in process with mirror always branching (up to
``--max-branches`` per window) and counts how many windows' verdicts a branch held, with the
draft's own guesses alone and with either hint, and sorts the misses: the rejection point was
guessed but not the target's token there, or not even the point (``--runner-up``: windows also
offer the draft's runner-up, as ``serve`` does, and its wins are counted apart). The drafter is
what the servers run by default: prompt lookup in front of the draft model (``--prompt-lookup
0``: the model alone), its windows ending at its first unsure token (``--draft-confidence 0``:
always K). Greedy decoding makes these counts exact and repeatable, so the vocabularies compare
without timing noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.flags import output_dir
from benchmarks.prompts import checked_datasets, load_prompts
from mirrorspec import SamplingParams, SpeculationConfig
from mirrorspec.config import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_PROMPT_LOOKUP,
    DEFAULT_PROPOSAL_TOP_K,
    InvalidRequest,
    MirrorConfig,
    check_draft_confidence,
    check_prompt_lookup,
    refuse_setting,
)
from mirrorspec.drafting.draft_model import declared_vocabulary
from mirrorspec.engine import GenerationStats, TargetVerifier, decode_windows, make_drafter
from mirrorspec.mirror import MirrorPipeline, Prefetch, branch_key
from mirrorspec.models import KVSession, LoadedModel, encode_prompt, load_causal_lm
from mirrorspec.models.loading import check_models
from mirrorspec.models.early_exit import EarlyExitProbe
from mirrorspec.models.lens import LensRecipe, tuned_lens

NO_HINT = "none"


def verify_cost(model: torch.nn.Module, context: list[int], probes: dict[str, EarlyExitProbe | None], k: int,
                reps: int) -> dict[str, float]:
    """Median seconds of a verify pass over ``k`` drafts under each probe."""
    session = KVSession(model)
    session.logits_for(context, 1)
    window = context + context[-k:]  # any k tokens: the cost does not depend on which
    times: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(reps):
        for name, probe in probes.items():
            session.rollback(len(context))
            started = time.perf_counter()
            if probe is None:
                session.logits_for(window, k + 1)
            else:
                with probe.watching(k + 1, lambda hint: None):
                    session.logits_for(window, k + 1)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(ts) for name, ts in times.items()}


OUTCOMES = ("held", "length guessed, token missed", "length not guessed", "runner-up won, held",
            "runner-up won, missed")
HELD = ("held", "runner-up won, held")


def window_outcome(prefetch: Prefetch) -> str:
    """Why a branched window's verdict was or was not held: where the misses come from says
    whether better guesses of the rejection point or of the target's token there would pay."""
    verdict = prefetch.verdict
    held = branch_key(verdict.num_accepted, verdict.next_token, verdict.runner_up) in prefetch.branches
    if verdict.runner_up is not None:
        return "runner-up won, held" if held else "runner-up won, missed"
    if held:
        return "held"
    lengths = {branch.num_accepted for branch in prefetch.branches.values() if branch.runner_up is None}
    return "length guessed, token missed" if verdict.num_accepted in lengths else "length not guessed"


class CountingPipeline(MirrorPipeline):
    """A mirror pipeline that also counts its branched windows by ``window_outcome``."""

    def __init__(self, config: MirrorConfig, outcomes: Counter):
        super().__init__(config)
        self.outcomes = outcomes

    def verify_while_drafting(self, *args, **kwargs) -> Prefetch:
        prefetch = super().verify_while_drafting(*args, **kwargs)
        if prefetch.branched:
            self.outcomes[window_outcome(prefetch)] += 1
        return prefetch


def branch_hits(target: LoadedModel, draft: torch.nn.Module, prompts: list[list[int]],
                probe: EarlyExitProbe | None, args: argparse.Namespace) -> tuple[int, int, Counter]:
    """(windows whose verdict a branch held, windows that branched, branched windows by
    ``window_outcome``) over ``prompts``."""
    hits = windows = 0
    outcomes: Counter = Counter()
    params = SamplingParams(max_new_tokens=args.max_tokens, stop_token_ids=target.stop_token_ids())
    for ids in prompts:
        stats = GenerationStats()
        pipeline = CountingPipeline(MirrorConfig(stop_at_verdict=False, max_branches=args.max_branches,
                                                 alternatives=args.alternatives, use_hints=probe is not None),
                                    outcomes)
        drafter = make_drafter(draft, proposal_top_k=DEFAULT_PROPOSAL_TOP_K, prompt_lookup=args.prompt_lookup,
                               draft_confidence=args.draft_confidence)
        verifier = TargetVerifier(KVSession(target.model), probe, runner_up=args.runner_up)
        try:
            for _ in decode_windows(drafter, verifier, ids, params, SpeculationConfig(num_speculative_tokens=args.k),
                                    0, stats, pipeline):
                pass
        finally:
            pipeline.close()
            drafter.release()
        hits += stats.branch_hits
        windows += stats.mirror_windows
    return hits, windows, outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hints", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hint-layer", type=int, default=27)
    parser.add_argument("--datasets", default="humaneval,mtbench")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-branches", type=int, default=MirrorConfig.max_branches)
    parser.add_argument("--alternatives", type=int, default=MirrorConfig.alternatives)
    parser.add_argument("--prompt-lookup", type=int, default=DEFAULT_PROMPT_LOOKUP, metavar="N",
                        help="prompt lookup before the draft model, as the servers run it (0 = the model alone)")
    parser.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE, metavar="P",
                        help="a draft window ends after the draft's first token below P (0 = off)")
    parser.add_argument("--runner-up", action="store_true",
                        help="windows also offer the draft's runner-up for their first draft, as `serve` does "
                             "(hinted windows too)")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--out", type=output_dir, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    datasets = checked_datasets(parser, args, positive=("num_prompts", "max_tokens", "k", "max_branches", "reps"))
    try:
        check_prompt_lookup(args.prompt_lookup)
    except InvalidRequest as err:
        parser.error(f"--prompt-lookup: {err}")
    try:
        check_draft_confidence(args.draft_confidence)
    except InvalidRequest as err:
        parser.error(f"--draft-confidence: {err}")
    if args.alternatives < 0:
        parser.error(f"--alternatives must be >= 0, got {args.alternatives}")

    torch.set_num_threads(1)
    try:
        check_models(args.target, args.draft)  # names --target or --draft
    except InvalidRequest as err:
        refuse_setting(parser, err)
    target = load_causal_lm(args.target, dtype="float32")
    vocab = declared_vocabulary(args.draft)
    if vocab is None:
        parser.error(f"--draft: {args.draft} declares no sub-vocabulary to compare with the full one")
    lens = tuned_lens(target, LensRecipe(layer=args.hint_layer))
    probes = {NO_HINT: None, "full": EarlyExitProbe(target.model, args.hint_layer),
              "sub-vocabulary": EarlyExitProbe(target.model, args.hint_layer, vocab_ids=vocab),
              "tuned sub-vocabulary": EarlyExitProbe(target.model, args.hint_layer, vocab_ids=vocab, lens=lens)}
    prompts = {d: [encode_prompt(target.tokenizer, p.text) for p in load_prompts(d, args.num_prompts)]
               for d in datasets}
    cost = verify_cost(target.model, prompts[datasets[0]][0], probes, args.k, args.reps)
    print(f"verify over {args.k} drafts, hint at layer {args.hint_layer} (1 thread, median of {args.reps}):")
    for name, seconds in cost.items():
        print(f"  {name:15s} {seconds * 1e3:7.1f} ms  {seconds / cost[NO_HINT]:.3f}x no hint")
    draft = load_causal_lm(args.draft, dtype="float32", tokenizer=False).model
    hits = {}
    print(f"windows whose verdict a branch held (greedy, <= {args.max_branches} branches, K={args.k}):")
    for d in datasets:
        hits[d] = {}
        for name, probe in probes.items():
            hit, windows, outcomes = branch_hits(target, draft, prompts[d], probe, args)
            hits[d][name] = {"hits": hit, "windows": windows, "hit_rate": hit / max(windows, 1),
                             "outcomes": {o: outcomes[o] for o in OUTCOMES}}
            shares = ", ".join(f"{o} {outcomes[o] / max(windows, 1):.2f}" for o in OUTCOMES
                               if o not in HELD and outcomes[o])
            print(f"  {d:10s} {'own guesses' if probe is None else name + ' hints':28s} "
                  f"{hit:4d}/{windows:<4d} = {hit / max(windows, 1):.2f}   misses: {shares}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"hints-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                               "verify_s": cost, "vocab_size": {"full": int(target.model.config.vocab_size),
                                                                "sub-vocabulary": len(vocab)},
                               "branch_hits": hits}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
