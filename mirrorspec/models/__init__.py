"""Model loading, the demo target, and the KV-cache session the engine drives."""

from mirrorspec.models.loading import (
    DEMO_DRAFT,
    DEMO_TARGET,
    LoadedModel,
    encode_chat,
    encode_prompt,
    load_causal_lm,
    resolve_device,
    resolve_dtype,
)
from mirrorspec.models.session import KVSession, LogitSession, common_prefix_length

__all__ = [
    "DEMO_DRAFT",
    "DEMO_TARGET",
    "KVSession",
    "LoadedModel",
    "LogitSession",
    "common_prefix_length",
    "encode_chat",
    "encode_prompt",
    "load_causal_lm",
    "resolve_device",
    "resolve_dtype",
]
