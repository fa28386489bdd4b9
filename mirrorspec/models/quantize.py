"""Int8 weight-only linears for a CPU draft.

Why: a draft step is memory-bound. The demo draft reads ~47 MB of float32 weights per token (two
layers and an 8k-row head), more than this CPU's 32 MB L3, so a drafted token costs about as much
as streaming its weights. The same weights in int8 are a quarter of the bytes, and PyTorch's
``_weight_int8pack_mm`` (int8 weights, one scale per output row, bf16 activations) turns that
into time: measured on the 2-core CI machine, one thread, a 1-row call of the 8192x576 head takes
0.28 ms against 0.71 ms prepacked float32, and the whole draft step 3.1 ms against 5.4 ms.

Every call runs the int8 weights, however many rows it has, although from 4 rows up the int8
kernel is slower than prepacked float32 (1536x576, one thread: 4 rows 104 us against 99 us, 64
rows 1.55 ms against 1.03 ms). Which kernel computes a position must not depend on how positions
are grouped into calls: a live session steps a context one token at a time, a replica that takes
over after a failure replays it in one prefill, a mirror branch is one row of a batch. With one
kernel per row (the op computes each row alone, bit for bit whatever the batch), a seeded sampled
request stays reproducible across all of these; switching to float32 for wide calls broke that,
since int8 moves logits by ~1%, enough to flip a sampled token now and then. The price is the
draft's prefill (about 1.4x slower, a few ms next to the target's) and wide branch batches.

Exactness does not depend on it. The draft only proposes: whatever logits it computes, the
proposal q is the distribution its tokens were drawn from, and the target verifies every token.
It costs acceptance only where int8 changes the draft's choice (the demo draft's top-1 agreed
with its float32 self at 94.8% of 631 prompt positions).

The op is private, and unsafe on some shapes: with in_features not a multiple of 16 it reads
past its rows (a segfault at 8, 12, 20 and 40 on this CPU). So a weight is quantized only where
the shape is of the kind measured safe and a probe at load agrees with float32; anything else
(GPU, bf16, another shape, a build without the op) keeps its linear unchanged.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from mirrorspec.config import check_quantization
from mirrorspec.models.prepack import PackedLinear

PROBE_ROWS = (1, 2, 3, 4, 17, 64)  # a row, small batches, and wide calls that may take other code paths
INT8_ROW_BLOCK = 16  # in_features must be a multiple of this: the kernel reads 16-wide blocks
PROBE_TOLERANCE = 0.02  # of the output's largest magnitude: int8 rounding is ~0.5%, a broken kernel ~100%


@cache
def _op_available() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: the row's largest magnitude maps to 127.

    # [out, in] float -> ([out, in] int8, [out] bfloat16 scales)
    """
    scales = weight.detach().float().abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
    q = torch.round(weight.detach().float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(torch.bfloat16)


def _int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """# [rows, in] float32 -> [rows, out] float32"""
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).float()


def _probe_agrees(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether this CPU's kernel computes what it should for this shape, at ``PROBE_ROWS`` rows:
    the op is private and has read garbage on shapes it does not expect."""
    dequantized = q.float() * scales.float()[:, None]  # [out, in]
    probe = torch.Generator().manual_seed(0)
    for rows in PROBE_ROWS:
        x = torch.randn(rows, q.shape[1], generator=probe).to(torch.bfloat16).float()  # exactly representable
        expected = x @ dequantized.T
        error = (_int8_matmul(x, q, scales) - expected).abs().max()
        if not error <= PROBE_TOLERANCE * expected.abs().max():
            return False
    return True


def can_quantize(weight: torch.Tensor) -> bool:
    return (_op_available() and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.shape[1] % INT8_ROW_BLOCK == 0)


class Int8Linear(PackedLinear):
    """A linear whose inference calls run on an int8 copy of its weight.

    Calls the int8 path does not fit (gradients, autocast, another device or dtype) run
    ``F.linear`` on the float32 weight. It is a ``PackedLinear`` left unpacked, so ``weight``,
    ``bias`` and the state dict are the original linear's, and no packed float32 copy is kept.
    """

    def __init__(self, linear: nn.Module, q: torch.Tensor, scales: torch.Tensor):
        super().__init__(linear.weight, linear.bias, pack=False)
        self.q = q  # [out, in] int8; plain attributes, like a packed copy: not state, not moved by .to()
        self.scales = scales  # [out] bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fits_int8(x):
            return super().forward(x)
        rows = x.numel() // self.in_features
        out = _int8_matmul(x.reshape(rows, self.in_features), self.q, self.scales)  # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _fits_int8(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8=True"


def int8_linear(linear: nn.Module) -> nn.Module:
    """``linear`` with an int8 path, or ``linear`` itself where its weight cannot take one."""
    weight = linear.weight
    if not can_quantize(weight):
        return linear
    q, scales = quantize_rows(weight)
    return Int8Linear(linear, q, scales) if _probe_agrees(q, scales) else linear


def quantize_linears(model: nn.Module) -> int:
    """Give every linear layer of an inference model's decoder an int8 path, in place; the count
    quantized. The output head is left alone: it is tied to the embedding, and a sub-vocabulary
    head (``models.session``) is built and quantized on its own."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if child is head or type(child) not in (nn.Linear, PackedLinear):  # not twice: Int8Linear is a PackedLinear
                continue
            quantized = int8_linear(child)
            if quantized is not child:
                setattr(parent, name, quantized)
                swapped += 1
    return swapped


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def apply_quantization(model: nn.Module, name: str) -> int:
    """``quantize_linears`` for ``name == 'int8'``; 0 for 'none'."""
    return quantize_linears(model) if check_quantization(name) == "int8" else 0


__all__ = ["Int8Linear", "apply_quantization", "can_quantize", "int8_linear", "is_quantized",
           "quantize_linears", "quantize_rows"]
