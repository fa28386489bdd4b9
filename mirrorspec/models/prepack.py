"""CPU weight prepacking: linear layers run on oneDNN with their weights reordered once, at load.

Why: speculation pays only if a target pass over K + 1 tokens costs little more than a one-token
step. On CPU, ``aten::mm`` re-packs the weight for every call and its small-M kernels scale with
M, so on the 2-core CI machine a 2-token pass of the demo target cost 1.7-2.1 one-token steps and
a 5-token pass ~1.5: most of what speculation saves was spent again in verification. A weight
reordered once into oneDNN's blocked layout makes a 2-5 token pass cost about one step's weight
traffic, and makes the one-token step itself faster (``python -m benchmarks.pass_cost`` measures
both side by side). It is the same transformation PyTorch Inductor's freezing pass applies to
CPU linears.

Exactness does not depend on it: it changes float rounding (~1e-4 on logits) the same way for
every path that uses the model, and every window is verified against whatever logits the target
produces. It applies to float32 CPU models only (bf16 is slow on CPUs without AMX); anything else,
and any CPU whose oneDNN cannot run the op, keeps ``nn.Linear`` unchanged.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether this build and CPU run oneDNN's prepacked linear for ``weight``'s device and dtype."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_linear_runs()


@cache
def _onednn_linear_runs() -> bool:
    """A fact about this build and CPU, so it is probed once per process."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), probe, None, "none", [], "")
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return True


class PackedLinear(nn.Module):
    """``nn.Linear``'s inference forward over a weight packed once for oneDNN.

    The original ``weight`` (the same Parameter, so tied embeddings stay tied) and ``bias`` stay
    on the module for code that reads them (sub-vocabulary heads, early-exit probes). The packed
    copy is a plain attribute, not a buffer: ``state_dict`` and ``.to()`` never see it, and any
    call it does not fit (another device or dtype, autocast, gradients), or ``pack=False``, runs
    ``F.linear`` on the original weight. Pack only once the weights are final: the copy does not follow later edits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self._packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
                        if pack and can_prepack(weight) else None)

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fits(x):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _fits(self, x: torch.Tensor) -> bool:
        return (self._packed is not None and x.device.type == "cpu" and x.dtype == torch.float32
                and not torch.is_autocast_enabled("cpu")
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed}"


def prepack_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of an inference model for a ``PackedLinear``, in place; the count
    packed (0 where prepacking does not apply: GPU, bf16, no oneDNN)."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_prepack(child.weight):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                swapped += 1
    return swapped


def is_prepacked(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) and m.packed for m in model.modules())
