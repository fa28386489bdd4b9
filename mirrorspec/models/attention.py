"""A CPU attention implementation for verify passes, bit-identical to transformers' ``sdpa``.

A verify pass feeds K + 1 tokens on top of a cached context, so it needs a causal mask with an
offset, and there transformers' ``sdpa`` path pays twice in every layer on CPU:

- with a mask it does not let SDPA read grouped key/value heads (``enable_gqa``), so it copies
  the whole cached K and V out to one head per query head (``repeat_kv``);
- it hands SDPA a boolean mask, which SDPA turns into an additive one (``where``) in every layer.

On the demo target (30 layers, 9 query heads over 3 key/value heads, a 400-token context, one
thread) those two cost 8-9% of a 2- to 9-token pass: passes got 2.5-4 ms cheaper, while a
one-token step (no mask) is untouched. Speculation is paid for in verify passes, so every
speculative mode gains this much over target-only decoding, which runs one-token steps.

``mirrorspec_sdpa`` builds the additive mask once per forward, in exactly the values SDPA would
(0 and -inf), and lets SDPA index the grouped heads itself. The kernel and its inputs are the
same, so the logits are bit for bit those of ``sdpa`` (``tests/models/test_attention.py``), and
greedy output stays token-identical to target-only decoding. Everything else goes to
transformers' own function unchanged: no mask (a prefill, a one-token step), one query row
(``sdpa`` already reads grouped heads there, by folding them into the query, and a different
layout would round differently), position bias, softcapping, dropout. It is for CPU only: on
CUDA a mask with grouped heads sends SDPA to its slow math kernel, so GPU models keep ``sdpa``.
And only for the model types listed below, whose code does not branch on the implementation's
name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

if TYPE_CHECKING:  # transformers' modeling and masking code take seconds to import: only where a model loads
    from transformers import PreTrainedModel

IMPLEMENTATION = "mirrorspec_sdpa"


def masked_gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention call: query [batch, heads, q, dim], key and value
    [batch, kv_heads, kv, dim], mask [batch, 1, q, kv] or None; returns [batch, q, heads, dim]."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = dropout == 0.0 and not kwargs.get("softcap") and kwargs.get("position_bias") is None
    one_query = query.shape[2] == 1  # sdpa folds the grouped heads into the query there: no copy to save
    if attention_mask is None or one_query or groups == 1 or not plain or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           scale=scaling, enable_gqa=True)  # [batch, heads, q, dim]
    return out.transpose(1, 2).contiguous(), None


def additive_sdpa_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """``sdpa``'s mask (None wherever ``sdpa`` would go without one), made additive once per
    forward with the values SDPA itself gives a boolean mask: 0 where attended, -inf elsewhere."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.full_like(zero, float("-inf")))


# Model types whose modeling code reads the attention implementation only to look it up in
# AttentionInterface and masking_utils. Others may branch on its name: Gemma 4's KV-shared layers
# slice their input only where it is "sdpa", so on any other name a first window (prompt and drafts
# into an empty cache) came out misaligned and greedy output left target-only's (found in review).
SWITCHED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def use_cpu_verify_attention(model: PreTrainedModel) -> bool:
    """Switch a CPU model that runs ``sdpa`` to ``mirrorspec_sdpa`` where its type is known to
    allow it (``SWITCHED_MODEL_TYPES``); whether it switched."""
    if (model.device.type != "cpu" or model.config._attn_implementation != "sdpa"
            or model.config.model_type not in SWITCHED_MODEL_TYPES):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, masked_gqa_sdpa)  # idempotent: the same function each time
    AttentionMaskInterface.register(IMPLEMENTATION, additive_sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
    return True
