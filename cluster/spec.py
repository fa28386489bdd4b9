"""What a deployment on Ray is: typed, validated up front, and the same for every launcher."""

from __future__ import annotations

from dataclasses import dataclass, field

from mirrorspec.config import (
    DEFAULT_DRAFT_QUANTIZE,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PROPOSAL_TOP_K,
    AdaptiveKConfig,
    InvalidRequest,
    MirrorConfig,
    check_draft_confidence,
    check_max_concurrent_requests,
    check_prompt_lookup,
    check_quantization,
    check_prefill_chunk,
    check_stall_timeout,
)

POOLS = ("drafter", "target")
CONTROLLER_NAMESPACE = "mirrorspec"
# per pool: each replica is a placement group and actors the controller launches and checkpoints
# one by one; a million (a typo) wedged it for good, and with it `status`, `scale` and `stop`
MAX_REPLICAS = 256


def check_replicas(pool: str, replicas: int, field: str) -> int:
    """A pool's replica count: at least one target, no fewer than 0 drafters, at most ``MAX_REPLICAS``."""
    least = 1 if pool == "target" else 0
    if not least <= replicas <= MAX_REPLICAS:
        raise InvalidRequest(f"the {pool} pool takes {least} to {MAX_REPLICAS} replicas, got {replicas}", field=field)
    return replicas


@dataclass(frozen=True)
class PoolResources:
    """What one replica (one rank, for targets) asks Ray for, besides its role resource."""

    cpus: float = 1.0
    gpus: float = 0.0  # drafters: 0 (CPU) or a fraction of a small GPU; target ranks: 0 or 1


@dataclass(frozen=True)
class StackSpec:
    target: str = "demo-target"
    draft: str = "demo-draft"  # a draft model, or "ngram"
    drafters: int = 1
    targets: int = 1
    tp: int = 1  # target ranks per replica, one STRICT_PACK placement group of tp bundles
    drafter_resources: PoolResources = field(default_factory=lambda: PoolResources(cpus=1.0))
    target_resources: PoolResources = field(default_factory=lambda: PoolResources(cpus=1.0))
    threads: int = 1  # torch threads per replica process
    dtype: str = "auto"
    device: str = "auto"
    num_speculative_tokens: int | None = None  # None: the front door's default for the drafters it finds
    adaptive: AdaptiveKConfig | None = None
    mirror: MirrorConfig | None = None  # the front door's default for requests that do not say
    runner_up: bool = False  # windows offer the draft's runner-up too (OrchestratorConfig.runner_up)
    windows_on_target: bool = False  # windows run on the targets (OrchestratorConfig.windows_on_target)
    hint_layer: int | None = None  # targets send early-exit hints read off this layer (tp=1 only)
    hint_vocab: str | None = None  # hints scored over the sub-vocabulary this draft declares; None = all
    hint_lens: str = "tuned"  # hints read through a tuned lens fitted to the target, or "logit"
    speculation_off_above: int | None = None  # the front door stops drafting past this many requests
    proposal_top_k: int = DEFAULT_PROPOSAL_TOP_K
    prompt_lookup: int = 0  # draft-model replicas: prompt lookup drafts first on matches this long
    draft_confidence: float = 0.0  # draft-model replicas: a window ends after the model's first token below this
    draft_quantize: str = DEFAULT_DRAFT_QUANTIZE  # draft-model replicas: int8 weights for their linear layers on CPU (models.quantize)
    max_sessions: int = 64
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS  # requests the front door decodes at once
    host: str = "127.0.0.1"  # the front door
    port: int = 50051
    metrics_port: int | None = None  # Prometheus text endpoint of the front door
    replica_host: str = "auto"  # where replicas bind: "auto" = their node's IP
    name: str = "mirrorspec"  # the controller actor is "<name>-controller"
    drain_timeout_s: float = 60.0
    stall_timeout_s: float = 180.0  # a replica whose compute lane is on one job this long is replaced (ReplicaConfig)
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK  # targets prefill long prompts this many tokens per lane job

    def __post_init__(self) -> None:
        check_replicas("drafter", self.drafters, "drafters")
        check_replicas("target", self.targets, "targets")
        if self.tp < 1:
            raise InvalidRequest(f"tp must be >= 1, got {self.tp}", field="tp")
        if self.hint_layer is not None and self.tp > 1:
            raise InvalidRequest("early-exit hints need unsharded targets: use tp=1 or drop the hint layer",
                                 field="hint_layer")
        check_prompt_lookup(self.prompt_lookup)
        check_draft_confidence(self.draft_confidence)
        check_quantization(self.draft_quantize, field="draft_quantize")
        if self.threads < 1:
            raise InvalidRequest(f"threads must be >= 1, got {self.threads}", field="threads")
        check_stall_timeout(self.stall_timeout_s)
        check_prefill_chunk(self.prefill_chunk_tokens)
        check_max_concurrent_requests(self.max_concurrent_requests)

    @property
    def controller_name(self) -> str:
        return f"{self.name}-controller"


def check_pool(pool: str) -> str:
    if pool not in POOLS:
        raise InvalidRequest(f"unknown pool {pool!r}; choose one of {', '.join(POOLS)}", field="pool")
    return pool
