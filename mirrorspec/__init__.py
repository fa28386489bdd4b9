"""mirrorspec: disaggregated, exact speculative decoding.

The public in-process API::

    from mirrorspec import generate, SamplingParams
    result = generate(target_model, draft_model, input_ids, SamplingParams(temperature=0.7),
                      num_speculative_tokens=4, seed=1)
    result.token_ids, result.stats.acceptance_rate

and the client of a running server (``mirrorspec serve``)::

    from mirrorspec import Client   # or AsyncClient, for asyncio
    with Client("127.0.0.1:50051") as client:
        print(client.generate("Hello", max_tokens=32).text)
"""

from mirrorspec.config import (AdaptiveKConfig, InvalidRequest, MirrorConfig, OutOfRange, SamplingParams,
                               SpeculationConfig)
from mirrorspec.engine import GenerationResult, GenerationStats, decode_windows, generate
from mirrorspec.sampling import NonFiniteLogits

__all__ = [
    "AdaptiveKConfig",
    "AsyncClient",
    "Client",
    "ClientClosed",
    "GenerationResult",
    "GenerationStats",
    "InvalidRequest",
    "MirrorConfig",
    "NonFiniteLogits",
    "NotAFrontDoor",
    "OutOfRange",
    "RequestRefused",
    "SamplingParams",
    "SpeculationConfig",
    "decode_windows",
    "generate",
]
__version__ = "0.1.0"
CLIENT_NAMES = ("Client", "AsyncClient", "NotAFrontDoor", "RequestRefused", "ClientClosed")


def __getattr__(name: str):
    """The gRPC clients, imported on first use: the in-process API needs no gRPC stack."""
    if name in CLIENT_NAMES:
        from mirrorspec import client

        return getattr(client, name)
    raise AttributeError(f"module 'mirrorspec' has no attribute {name!r}")
