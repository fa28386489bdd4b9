"""From logits to the distribution p that plain sampling would draw from.

Speculative decoding is exact with respect to *this* p, so it must be formed exactly as a
non-speculative sampler would: temperature, then top-k, then top-p (nucleus) over the renormalised
top-k set, the order Hugging Face's logits processors use. Everything is float32 regardless of the
model dtype, because bf16 probabilities are too coarse for the acceptance ratio p/q.
"""

from __future__ import annotations

import torch

from mirrorspec.config import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p over the vocabulary for each row of logits.  # [..., vocab] -> [..., vocab] float32

    Greedy (temperature 0) yields the one-hot of the argmax, which makes the greedy rule a special
    case of rejection sampling; the engine still takes the cheaper ``greedy_verify`` path.
    """
    logits = logits.float()
    if params.greedy:
        return one_hot_argmax(logits)
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        scaled = _mask_outside_top_k(scaled, params.top_k)
    if params.top_p < 1.0:
        scaled = _mask_outside_top_p(scaled, params.top_p)
    return torch.softmax(scaled, dim=-1)


class NonFiniteLogits(RuntimeError):
    """A model's logits hold NaN, or a row with nothing above -inf: no distribution to draw from."""


def finite_logits(logits: torch.Tensor, model: str = "target") -> torch.Tensor:
    """``logits`` as the samplers can take them.  # [..., vocab] -> [..., vocab]

    One reduction where all is finite, the usual case. A +inf (a float16 head that overflowed) is
    the softmax's limit: the draw is uniform over a row's +inf entries, and the argmax their first,
    as before. NaN, or a row of -inf, is refused: sampling from it drew column 0 every time, silently."""
    if bool(torch.isfinite(logits.sum(dtype=torch.float32))):
        return logits
    if bool(torch.isnan(logits).any()) or bool((logits == float("-inf")).all(dim=-1).any()):
        raise NonFiniteLogits(f"the {model} model's logits hold NaN (or a row of -inf): its forward pass overflowed "
                              f"or its weights are broken; load it in bfloat16 or float32 (--dtype)")
    top = torch.isposinf(logits)
    if not bool(top.any()):  # finite but for -inf entries (masked tokens)
        return logits
    return torch.where(top.any(dim=-1, keepdim=True), torch.where(top, 0.0, float("-inf")).to(logits.dtype), logits)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """# [..., vocab] -> [..., vocab] float32, 1.0 at the (first) argmax."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _mask_outside_top_k(scaled: torch.Tensor, k: int) -> torch.Tensor:
    # Mask by index, not by threshold, so ties at the k-th value keep exactly k tokens.
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    keep.scatter_(-1, scaled.topk(k, dim=-1).indices, True)
    return scaled.masked_fill(~keep, float("-inf"))


def _mask_outside_top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of the sorted distribution whose mass reaches top_p."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exclusive cumulative sum
    drop_sorted = mass_before >= top_p
    # the first token is always kept: its mass_before is 0, but a top_p below float32's smallest
    # (~1e-45) compares as 0 too, and dropped every token (NaN rows, garbage tokens)
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))
