"""The target writes the draft's training data: answers to training prompts, with its top-k.

Distilling on text the target itself writes is what makes a tiny draft agree with it: the draft
sees exactly the continuations it will be asked to predict. For every generated position we keep
the target's top-k log-probabilities, so the student learns the whole shape of p (what sampled
decoding needs), not just the argmax (what greedy needs).

Generation is batched (many prompts per forward, rows leave the batch as they finish) and runs in
bfloat16 where the CPU supports it; half of the batches decode greedily, half at temperature 0.7,
from a seeded generator. Shards are written as they complete, so an interrupted run keeps its
data and a resumed one skips what is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from mirrorspec.models.demo_target import write_atomically
from mirrorspec.models.features import FeatureTap
from mirrorspec.models.session import cache_argument


@dataclass
class TeacherShard:
    """Sequences the target wrote, and its top-k at every generated position.

    tokens:    list of [prompt + answer] int32 tensors
    starts:    where each answer begins (index of the first generated token)
    top_ids:   [total_generated, k] int32, row order = answers concatenated
    top_logp:  [total_generated, k] float16, the target's log-probabilities (temperature 1)
    features:  where kept, one [len(tokens) - 1, hidden] float16 tensor per sequence: the target's
               top-layer feature at every position it read (``models.features``), for a
               feature-conditioned head (``distill.eagle``); None otherwise
    """

    tokens: list[torch.Tensor]
    starts: list[int]
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    features: list[torch.Tensor] | None = None

    def save(self, path: Path) -> None:
        torch.save({"tokens": self.tokens, "starts": self.starts, "top_ids": self.top_ids,
                    "top_logp": self.top_logp, "features": self.features}, path)

    @staticmethod
    def load(path: Path) -> TeacherShard:
        return TeacherShard(**torch.load(path, weights_only=True))

    @property
    def num_generated(self) -> int:
        return int(self.top_ids.shape[0])


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def generate_batch(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   stop_ids: Sequence[int], temperature: float, top_k: int, generator: torch.Generator,
                   pad_id: int = 0, features: bool = False) -> TeacherShard:
    """Decode a batch of prompts; finished rows leave the batch (and its KV cache) at once.
    ``features`` also keeps the target's top-layer feature at every position it reads."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in _left_pad(prompts, pad_id))  # [b, width]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    alive = list(range(len(prompts)))  # original row of each live batch row
    answers: list[list[int]] = [[] for _ in prompts]
    tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    kept: list[list[torch.Tensor]] = [[] for _ in prompts]
    stop = torch.tensor(list(stop_ids), device=device)
    step_ids = ids
    tap = FeatureTap(model) if features else nullcontext()
    for _ in range(max_new_tokens):
        with tap:
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **cache_argument(model, cache))
        if features:
            _keep_features(kept, tap.take(), alive, [len(p) for p in prompts] if step_ids is ids else None)
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [b, vocab]
        top = logp.topk(top_k, dim=-1)  # [b, k]
        if temperature > 0:  # drawn on the CPU from a CPU generator: same draws on any device
            probs = torch.softmax(logp / temperature, -1).cpu()
            chosen = torch.multinomial(probs, 1, generator=generator)[:, 0].to(device)
        else:
            chosen = top.indices[:, 0]
        keep = []
        for row, orig in enumerate(alive):
            answers[orig].append(int(chosen[row]))
            tops[orig].append((top.indices[row].to("cpu", torch.int32), top.values[row].to("cpu", torch.float16)))
            if not torch.isin(chosen[row], stop) and len(answers[orig]) < max_new_tokens:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(alive):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, positions, chosen = mask[index], positions[index], chosen[index]
            alive = [alive[r] for r in keep]
        step_ids = chosen.unsqueeze(-1)  # [b, 1]
        mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=-1)
        positions = positions[:, -1:] + 1
    return TeacherShard(
        tokens=[torch.tensor(list(p) + a, dtype=torch.int32) for p, a in zip(prompts, answers)],  # CPU
        starts=[len(p) for p in prompts],
        top_ids=torch.stack([i for row in tops for i, _ in row]),
        top_logp=torch.stack([v for row in tops for _, v in row]),
        features=[torch.cat(rows) for rows in kept] if features else None,
    )


def _keep_features(kept: list[list[torch.Tensor]], step: torch.Tensor, alive: Sequence[int],
                   prompt_lengths: Sequence[int] | None) -> None:
    """Append one forward's features [live rows, positions, hidden] to each live row's list: the
    whole unpadded prompt at the first step (rows are left-padded), the one new position after."""
    for row, orig in enumerate(alive):
        width = step.shape[1] if prompt_lengths is None else prompt_lengths[orig]
        kept[orig].append(step[row, step.shape[1] - width:].to("cpu", torch.float16))


def write_teacher_data(model: torch.nn.Module, encoded: Sequence[Sequence[int]], out_dir: Path, *,
                       batch_size: int, max_new_tokens: int, stop_ids: Sequence[int], top_k: int, seed: int,
                       shard_batches: int = 8, on_progress: Callable[[int, int], None] | None = None,
                       features: bool = False) -> list[Path]:
    """Run the teacher over ``encoded`` prompts, one shard per ``shard_batches`` batches.

    Batches are formed from length-sorted groups (little padding) in a fixed order; batch i
    decodes greedily when i is even and at temperature 0.7 when odd, from generator seed
    (seed, i), so each shard is reproducible on its own and a resumed run matches a fresh one.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = _length_grouped_batches(encoded, batch_size)
    shards = []
    for first in range(0, len(batches), shard_batches):
        path = out_dir / f"shard-{first // shard_batches:05d}.pt"
        shards.append(path)
        if path.is_file():
            continue
        parts = []
        for i in range(first, min(first + shard_batches, len(batches))):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
            parts.append(generate_batch(model, [encoded[j] for j in batches[i]], max_new_tokens=max_new_tokens,
                                        stop_ids=stop_ids, temperature=0.0 if i % 2 == 0 else 0.7, top_k=top_k,
                                        generator=generator, features=features))
            if on_progress is not None:
                on_progress(i + 1, parts[-1].num_generated)
        merged = TeacherShard(tokens=[t for p in parts for t in p.tokens], starts=[s for p in parts for s in p.starts],
                              top_ids=torch.cat([p.top_ids for p in parts]),
                              top_logp=torch.cat([p.top_logp for p in parts]),
                              features=[f for p in parts for f in p.features] if features else None)
        write_atomically(path, merged.save)
    return shards


LENGTH_GROUP = 16  # batches per length-sorted span


def _length_grouped_batches(encoded: Sequence[Sequence[int]], batch_size: int,
                            group: int = LENGTH_GROUP) -> list[list[int]]:
    """Batches of similar-length prompts, keeping the seeded prompt order at the coarse level."""
    batches = []
    span = batch_size * group
    for start in range(0, len(encoded), span):
        chunk = sorted(range(start, min(start + span, len(encoded))), key=lambda j: len(encoded[j]))
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches
