"""The optimisation loop both distilled drafts share (``student.py``, ``eagle.py``).

AdamW with a short linear warm-up and cosine decay over a number of passes (fractional allowed).
Each pass asks for its batches afresh, so a seeded shuffle gives every epoch its own order and the
run stays reproducible from the seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

StepLoss = Callable[[list], tuple[torch.Tensor, int, int]]  # batch -> (loss, top-1 matches, positions)


def train_epochs(module: torch.nn.Module, params: Sequence[torch.nn.Parameter], epoch_batches: Callable[[], list],
                 step_loss: StepLoss, *, epochs: float, learning_rate: float,
                 on_step: Callable[[int, int, float, float], None] | None = None) -> None:
    if not (math.isfinite(epochs) and epochs > 0):
        raise ValueError(f"epochs must be a finite number above 0, got {epochs}")
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    first = epoch_batches()
    total = max(1, int(len(first) * epochs))
    warmup = min(100, total // 10 + 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, total) / total)))
    module.train()
    step = 0
    while step < total:
        for batch in first if step == 0 else epoch_batches():
            if step >= total:
                break
            loss, matches, n = step_loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            if on_step is not None:
                on_step(step, total, loss.item(), matches / max(n, 1))
    module.eval()
