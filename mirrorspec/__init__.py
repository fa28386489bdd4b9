"""mirrorspec: disaggregated, exact speculative decoding.

The public in-process API::

    from mirrorspec import generate, SamplingParams
    result = generate(target_model, draft_model, input_ids, SamplingParams(temperature=0.7),
                      num_speculative_tokens=4, seed=1)
    result.token_ids, result.stats.acceptance_rate
"""

from mirrorspec.config import InvalidRequest, OutOfRange, SamplingParams, SpeculationConfig
from mirrorspec.engine import GenerationResult, GenerationStats, decode_windows, generate

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "InvalidRequest",
    "OutOfRange",
    "SamplingParams",
    "SpeculationConfig",
    "decode_windows",
    "generate",
]
__version__ = "0.1.0"
