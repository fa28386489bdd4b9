"""The target's top-layer features: its last hidden state after the final norm, per position.

A feature-conditioned draft head (EAGLE, Li et al. 2024; ``mirrorspec.distill.eagle``) drafts
from these rather than from tokens alone: the target has already done the work of reading the
context, and the head only has to carry it one token further. The target computes them in every
forward it runs anyway (they are what its LM head reads), so a forward hook on the final norm
takes them as they go by and costs the pass nothing.
"""

from __future__ import annotations

import torch


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The norm whose output the LM head reads, of an HF decoder-only model (Llama, Qwen, ...)."""
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__} has no decoder.norm to read features from")
    return norm


class FeatureTap:
    """While entered, keeps the final norm's output of every forward the model runs.

    ``take()`` returns what was kept since the last call, [batch, positions, hidden], the
    positions of each forward in order; a forward over positions s..e gives their features.
    """

    def __init__(self, model: torch.nn.Module):
        self._norm = final_norm(model)
        self._kept: list[torch.Tensor] = []
        self._handle = None

    def __enter__(self) -> FeatureTap:
        self._handle = self._norm.register_forward_hook(self._keep)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _keep(self, module, args, output) -> None:
        self._kept.append((output[0] if isinstance(output, tuple) else output).detach())

    def take(self) -> torch.Tensor:
        if not self._kept:
            raise RuntimeError("no forward ran since the last take()")
        kept, self._kept = self._kept, []
        return kept[0] if len(kept) == 1 else torch.cat(kept, dim=1)
