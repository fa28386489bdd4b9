"""Distil a few-layer draft from the target's cached top-k (stage 2 of the demo draft recipe).

The student is a plain Llama of ``student_layers`` decoder layers that *shares the target's
embedding and tied head* (frozen): only its layers and final norm are trained and shipped, a few
MB, and the full checkpoint is reassembled from the target on first use. It is trained, and later
proposes, over a frequent-token sub-vocabulary: the tokens the target itself chose most often.
That shrinks the head, the largest cost of a 2-layer draft over a 49k vocabulary, ~6×.

Loss: cross-entropy against the target's top-k distribution renormalised over the
sub-vocabulary (soft labels carry what greedy *and* sampled decoding need).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from mirrorspec.config import DistillRecipe
from mirrorspec.distill.teacher import TeacherShard
from mirrorspec.distill.training import train_epochs
from mirrorspec.drafting.draft_model import DRAFT_VOCAB_KEY
from mirrorspec.models.demo_draft import VOCAB_TENSOR
from mirrorspec.models.demo_target import save_tensors_atomically


@dataclass(frozen=True)
class Example:
    """One target-written sequence: tokens [L], answer start s, teacher rows for t[s:]."""

    tokens: torch.Tensor  # [L] int64
    start: int
    top_ids: torch.Tensor  # [L - s, k] int64
    top_logp: torch.Tensor  # [L - s, k] float32


def load_examples(shards: Sequence[Path]) -> list[Example]:
    out = []
    for path in shards:
        shard = TeacherShard.load(path)
        row = 0
        for tokens, start in zip(shard.tokens, shard.starts):
            n = len(tokens) - start
            out.append(Example(tokens.long(), start, shard.top_ids[row:row + n].long(),
                               shard.top_logp[row:row + n].float()))
            row += n
    return out


def choose_draft_vocabulary(examples: Sequence[Example], size: int, vocab_size: int,
                            always: Sequence[int] = ()) -> list[int]:
    """The ``size`` ids the target ranked first most often (ties by id), plus ``always``."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ex in examples:
        counts.index_add_(0, ex.top_ids[:, 0], torch.ones(len(ex.top_ids), dtype=torch.float64))
    counts[list(always)] = math.inf
    order = sorted(range(vocab_size), key=lambda i: (-counts[i].item(), i))
    return sorted(order[:size])


def init_student(target: PreTrainedModel, layers: int) -> PreTrainedModel:
    """A ``layers``-deep copy of the target: evenly spaced target layers, its norm, embedding and head."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    # trained on transformers' own sdpa, as the shipped draft was: the target may run
    # mirrorspec_sdpa (models.attention), whose logits match but whose gradients round differently
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    picks = [round(i * (target.config.num_hidden_layers - 1) / max(layers - 1, 1)) for i in range(layers)]
    for mine, theirs in zip(student.model.layers, picks):
        mine.load_state_dict(target.model.layers[theirs].state_dict())
    student.model.norm.load_state_dict(target.model.norm.state_dict())
    student.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data.float())
    if not config.tie_word_embeddings:
        student.lm_head.weight.data.copy_(target.lm_head.weight.data.float())
    student.tie_weights()
    student.model.embed_tokens.weight.requires_grad_(False)
    student.lm_head.weight.requires_grad_(False)
    return student


def sub_vocabulary_head(student: PreTrainedModel, vocab: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen head rows of ``vocab`` [m, h], and each vocabulary id's column (-1 if absent) [V]."""
    column_of = torch.full((student.config.vocab_size,), -1, dtype=torch.long)
    column_of[torch.tensor(vocab)] = torch.arange(len(vocab))
    return student.get_output_embeddings().weight[torch.tensor(vocab)].detach(), column_of


def trained_state(student: PreTrainedModel) -> dict[str, torch.Tensor]:
    """What the draft ships: every weight except the (target's) embedding and head."""
    return {k: v for k, v in student.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}


def _batches(examples: list[Example], batch_sequences: int, rng: random.Random) -> list[list[Example]]:
    """Length-grouped batches in a seeded order (little padding, no order bias)."""
    order = sorted(examples, key=lambda e: len(e.tokens))
    batches = [order[i:i + batch_sequences] for i in range(0, len(order), batch_sequences)]
    rng.shuffle(batches)
    return batches


def batch_loss(student: PreTrainedModel, head: torch.Tensor, column_of: torch.Tensor,
               batch: list[Example]) -> tuple[torch.Tensor, int, int]:
    """Soft cross-entropy over the sub-vocabulary; also (top-1 matches, positions) for agreement."""
    width = max(len(e.tokens) for e in batch)
    device = head.device
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    rows, cols, top_ids, top_logp = [], [], [], []
    for b, e in enumerate(batch):
        ids[b, :len(e.tokens)] = e.tokens
        mask[b, :len(e.tokens)] = 1
        positions = torch.arange(e.start - 1, len(e.tokens) - 1)  # student position predicting t[s + j]
        rows.append(torch.full_like(positions, b))
        cols.append(positions)
        top_ids.append(e.top_ids)
        top_logp.append(e.top_logp)
    hidden = student.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # [b, L, h]
    picked = hidden[torch.cat(rows).to(device), torch.cat(cols).to(device)]  # [n, h]
    logp = torch.log_softmax(picked.float() @ head.float().T, dim=-1)  # [n, m]
    teacher_cols = column_of.to(device)[torch.cat(top_ids).to(device)]  # [n, k], -1 outside the sub-vocabulary
    teacher_p = torch.cat(top_logp).to(device).exp() * (teacher_cols >= 0)  # [n, k]
    mass = teacher_p.sum(-1, keepdim=True)
    keep = mass[:, 0] > 0
    teacher_p = teacher_p[keep] / mass[keep]
    picked_logp = logp[keep].gather(-1, teacher_cols[keep].clamp_min(0))  # [n', k]
    loss = -(teacher_p * picked_logp).sum(-1).mean()
    matches = int((logp[keep].argmax(-1) == teacher_cols[keep][:, 0]).sum())
    return loss, matches, int(keep.sum())


def distill(student: PreTrainedModel, vocab: list[int], train: list[Example], recipe: DistillRecipe, *,
            on_step: Callable[[int, int, float, float], None] | None = None) -> None:
    """AdamW with warm-up and cosine decay over ``recipe.epochs`` passes (fractional allowed)."""
    if not train:
        raise ValueError("no training sequences: the teacher shards are missing or empty")
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    head, column_of = sub_vocabulary_head(student, vocab)
    params = [p for p in student.parameters() if p.requires_grad]

    def step_loss(batch: list[Example]) -> tuple[torch.Tensor, int, int]:
        with torch.autocast(head.device.type, dtype=torch.bfloat16, enabled=recipe.train_dtype == "bfloat16"):
            return batch_loss(student, head, column_of, batch)

    train_epochs(student, params, lambda: _batches(train, recipe.batch_sequences, rng), step_loss,
                 epochs=recipe.epochs, learning_rate=recipe.learning_rate, on_step=on_step)


@torch.inference_mode()
def agreement(student: PreTrainedModel, vocab: list[int], examples: list[Example], batch_sequences: int = 16) -> float:
    """How often the student's argmax (over its sub-vocabulary) is the target's: ~ greedy α."""
    head, column_of = sub_vocabulary_head(student, vocab)
    matched = total = 0
    for i in range(0, len(examples), batch_sequences):
        _, m, n = batch_loss(student, head, column_of, examples[i:i + batch_sequences])
        matched, total = matched + m, total + n
    return matched / max(total, 1)


def save_draft_weights(student: PreTrainedModel, vocab: list[int], path: Path) -> None:
    """The shippable part: trained weights (bfloat16) and the sub-vocabulary, in one safetensors file."""
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in trained_state(student).items()}
    tensors[VOCAB_TENSOR] = torch.tensor(vocab, dtype=torch.int32)
    save_tensors_atomically(path, tensors, {"layers": str(student.config.num_hidden_layers)})


def assemble_draft(target: PreTrainedModel, weights: Path, out_dir: Path) -> None:
    """A plain checkpoint (``from_pretrained``-loadable, HF-assisted-generation-ready) from the
    shipped weights plus the target's own embedding and head."""
    tensors = load_file(str(weights))
    vocab = tensors.pop(VOCAB_TENSOR).tolist()
    layers = 1 + max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))
    student = init_student(target, layers)
    missing, unexpected = student.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if unexpected or [m for m in missing if "embed_tokens" not in m and "lm_head" not in m]:
        raise RuntimeError(f"draft weights do not fit the target: missing={missing} unexpected={unexpected}")
    setattr(student.config, DRAFT_VOCAB_KEY, vocab)
    student.generation_config = copy.deepcopy(target.generation_config)
    student.save_pretrained(out_dir)
