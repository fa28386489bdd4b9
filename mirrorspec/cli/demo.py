"""`mirrorspec demo`: the shipped demo draft next to the target alone, or its rebuild."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

from mirrorspec.cli.flags import is_set
from mirrorspec.config import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_PROMPT_LOOKUP,
    DEFAULT_DRAFT_QUANTIZE,
    InvalidRequest,
    SamplingParams,
    SpeculationConfig,
    check_writable_folder,
    default_k,
)
from mirrorspec.serving.placement import check_threads


def cmd_demo(args: argparse.Namespace) -> int:
    """Show the shipped demo draft at work next to the target alone, or rebuild it."""
    check_threads(args.threads)
    SpeculationConfig(num_speculative_tokens=args.k)
    params = SamplingParams(max_new_tokens=args.max_tokens)
    if args.teacher_prompts is not None and args.teacher_prompts < 1:
        raise InvalidRequest(f"must be >= 1, got {args.teacher_prompts}", field="teacher_prompts")
    if args.epochs is not None and not (math.isfinite(args.epochs) and args.epochs > 0):
        raise InvalidRequest(f"must be a finite number > 0, got {args.epochs}", field="epochs")
    for field in ("teacher_prompts", "epochs", "out"):
        if getattr(args, field) is not None and not args.rebuild:
            raise InvalidRequest("sets up a rebuild, so it needs --rebuild", field=field)
    for field in ("prompt", "max_tokens", "k"):  # the side-by-side run's, which a rebuild does not make
        if is_set(args, field) and args.rebuild:  # named here: generate's prompt is positional
            raise InvalidRequest(f"--{field.replace('_', '-')}: sets up the side-by-side run, which --rebuild does "
                                 f"not make: drop one of the two")
    if args.out is not None:
        _check_rebuild_out(args.out)
    import torch

    from mirrorspec.models.loading import quiet_transformers

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    quiet_transformers()
    if args.rebuild:
        return _rebuild_demo_draft(args)
    from mirrorspec.engine import generate
    from mirrorspec.models import DEMO_DRAFT, encode_prompt, load_causal_lm
    from mirrorspec.models.demo_draft import SHIPPED_WEIGHTS
    from mirrorspec.models.detokenize import decode_text

    provenance = json.loads(SHIPPED_WEIGHTS.with_suffix(".json").read_text())
    print(f"demo draft: {SHIPPED_WEIGHTS} ({SHIPPED_WEIGHTS.stat().st_size / 1e6:.1f} MB), "
          f"{provenance['recipe']['student_layers']} layers over the target's embedding and head, "
          f"{provenance['recipe']['draft_vocab_size']}-token sub-vocabulary; distilled from "
          f"{provenance['teacher_tokens']:,} target-written tokens; held-out top-1 agreement "
          f"{provenance['held_out_top1_agreement']['after']:.2f}")
    target = load_causal_lm("demo-target")
    draft = load_causal_lm(DEMO_DRAFT, tokenizer=False, quantize=DEFAULT_DRAFT_QUANTIZE).model  # as generate --local
    ids = encode_prompt(target.tokenizer, args.prompt)
    params = dataclasses.replace(params, stop_token_ids=target.stop_token_ids())
    generate(target.model, draft, ids, dataclasses.replace(params, max_new_tokens=4))  # warm-up
    alone = generate(target.model, None, ids, params)
    spec = generate(target.model, draft, ids, params, num_speculative_tokens=args.k)
    lookup = generate(target.model, draft, ids, params, num_speculative_tokens=args.k,
                      prompt_lookup=DEFAULT_PROMPT_LOOKUP)
    cli_k = default_k(True, DEFAULT_DRAFT_CONFIDENCE)  # what `mirrorspec generate --local` runs
    confident = generate(target.model, draft, ids, params, num_speculative_tokens=cli_k,
                         prompt_lookup=DEFAULT_PROMPT_LOOKUP, draft_confidence=DEFAULT_DRAFT_CONFIDENCE)
    runner_up = generate(target.model, draft, ids, params, num_speculative_tokens=cli_k, runner_up=True,
                         prompt_lookup=DEFAULT_PROMPT_LOOKUP, draft_confidence=DEFAULT_DRAFT_CONFIDENCE)
    print(decode_text(target.tokenizer, spec.token_ids))
    print(f"\n{'target alone':<19} {alone.tokens_per_second:6.1f} tok/s")
    for name, run, k in (("with demo draft", spec, args.k), ("+ prompt lookup", lookup, args.k),
                         ("+ stop when unsure", confident, cli_k), ("+ runner-up", runner_up, cli_k)):
        s = run.stats
        speedup = run.tokens_per_second / alone.tokens_per_second
        print(f"{name:<19} {run.tokens_per_second:6.1f} tok/s  ({speedup:.2f}x), K={k}, "
              f"alpha {s.token_acceptance_rate:.2f}, {s.mean_accepted_length:.2f} tokens/pass")
    print(f"(the last is `mirrorspec generate --local`'s default: windows end after the draft's first token "
          f"below p={DEFAULT_DRAFT_CONFIDENCE}, and the target also scores the draft's runner-up for the first)")
    identical = spec.token_ids == alone.token_ids == lookup.token_ids == confident.token_ids == runner_up.token_ids
    print(f"greedy output identical to the target alone: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


def _rebuild_demo_draft(args: argparse.Namespace) -> int:
    from mirrorspec.config import DistillRecipe
    from mirrorspec.distill.build import student_stage, teacher_stage
    from mirrorspec.distill.prompts import PromptsRanOut
    from mirrorspec.models.demo_draft import SHIPPED_WEIGHTS, weights_digest
    from mirrorspec.models.demo_target import cache_root

    shipped = json.loads(SHIPPED_WEIGHTS.with_suffix(".json").read_text())["recipe"]
    overrides = {k: v for k, v in (("teacher_prompts", args.teacher_prompts), ("epochs", args.epochs)) if v is not None}
    recipe = dataclasses.replace(DistillRecipe(**shipped), **overrides)
    out = args.out or cache_root() / "demo-draft-rebuild" / "draft.safetensors"
    try:
        shards = teacher_stage(recipe, threads=args.threads)
    except PromptsRanOut as err:
        raise InvalidRequest(str(err), field="teacher_prompts") from None
    provenance = student_stage(recipe, shards, out, threads=args.threads)
    same = weights_digest(out) == weights_digest(SHIPPED_WEIGHTS)
    print(f"wrote {out}: held-out top-1 agreement {provenance['held_out_top1_agreement']['after']:.3f}; "
          f"{'bit-identical to' if same else 'differs from'} the shipped {SHIPPED_WEIGHTS.name}")
    if not same:
        print(f"use it with --draft {out}; compare it with the shipped draft, with no timing noise:\n"
              f"  mirrorspec bench acceptance --draft demo-draft,{out} --num-prompts 80")
    return 0


def _check_rebuild_out(out: Path) -> None:
    """Before hours of teacher data: the weights must land where ``--draft OUT`` finds them (a
    .safetensors file; any other name is read as a model directory) and the directory must take them."""
    if out.suffix != ".safetensors":
        raise InvalidRequest(f"must name a .safetensors file (so --draft {out} reads it back as demo-draft weights), "
                             f"got {out}", field="out")
    if out.exists() and not out.is_file():
        raise InvalidRequest(f"{out} exists and is not a file (a folder?); name a file in it", field="out")
    check_writable_folder(out.parent, "out")
