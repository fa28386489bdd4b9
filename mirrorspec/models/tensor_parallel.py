"""Tensor-parallel targets: a Llama-family model split over ``world`` ranks with torch.distributed.

Attention is split by key/value head groups (column parallel q/k/v, row parallel o_proj), the
MLP by intermediate columns (gate/up column parallel, down_proj row parallel), and the LM head by
vocabulary rows, gathered so every rank sees whole logits. Embeddings and norms are replicated.
Splits may be uneven: SmolLM2-135M has 9 query heads in 3 KV groups, which two ranks take as 6 + 3.
When there are fewer KV heads than ranks, each KV head is replicated and its query heads split.

Rank 0 serves; the other ranks follow. Every session operation rank 0 performs (``logits_for``,
``logits_with_runner_up``, ``rollback``, ``close``) is broadcast first and replayed by the
followers on their own shards and KV caches, in the same order, so the collectives inside the
forward pass line up. Gloo on CPU, NCCL on GPU: the same code, chosen by ``backend_for``.

A follower waits for its next operation inside a collective, and collectives time out (gloo
after 30 minutes by default, NCCL after 10): an idle replica's followers failed, and the replica
with them. So rank 0 broadcasts a no-op whenever it has been idle ``KEEPALIVE_S``, and the group's
timeout, which bounds how long a rank that hangs holds the others, is set explicitly.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mirrorspec.config import InvalidRequest
from mirrorspec.models.session import KVSession
from mirrorspec.serving.errors import ReplicaLost

SUPPORTED_ARCHITECTURES = ("llama",)
GROUP_TIMEOUT_S = 600.0  # how long a collective waits for a rank (NCCL's default; gloo's is 30 min)
KEEPALIVE_S = 30.0  # rank 0 idle this long broadcasts a no-op, well inside GROUP_TIMEOUT_S


class UnsupportedForTensorParallel(InvalidRequest):
    """A target this tp cannot shard: the caller's choice, so a launcher stops relaunching its
    replicas at once (``cluster.controller``) and the CLI names ``--tp``."""

    def __init__(self, message: str):
        super().__init__(message, field="tp")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def split_range(total: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share when ``total`` items are dealt as evenly as possible."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class HeadShare:
    """Which query and KV heads one rank computes."""

    q: tuple[int, int]
    kv: tuple[int, int]

    @property
    def groups(self) -> int:
        return (self.q[1] - self.q[0]) // (self.kv[1] - self.kv[0])


def head_share(num_q: int, num_kv: int, world: int, rank: int) -> HeadShare:
    groups = num_q // num_kv
    if num_kv >= world:  # whole KV groups per rank
        kv = split_range(num_kv, world, rank)
        return HeadShare((kv[0] * groups, kv[1] * groups), kv)
    ranks_per_kv = world // num_kv
    if world % num_kv or groups % ranks_per_kv:
        raise UnsupportedForTensorParallel(
            f"tp={world} cannot split {num_q} query heads in {num_kv} KV groups evenly; "
            f"use a tp that divides {num_kv} or is a multiple of it dividing {num_q}")
    kv_head = rank // ranks_per_kv
    q = split_range(groups, ranks_per_kv, rank % ranks_per_kv)
    return HeadShare((kv_head * groups + q[0], kv_head * groups + q[1]), (kv_head, kv_head + 1))


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's slice of the input features; partial sums are all-reduced,
    then the (unsplit) bias is added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class GatheredHead(nn.Module):
    """The LM head over this rank's vocabulary rows; the rows of all ranks are gathered (padded
    to equal size, as collectives need) so every rank returns whole logits."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int], group):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self.sizes = sizes
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight, self.bias)  # [..., my rows]
        width = max(self.sizes)
        padded = F.pad(local, (0, width - local.shape[-1]))
        parts = [torch.empty_like(padded) for _ in self.sizes]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, self.sizes)], dim=-1)  # [..., vocab]


def _rows(linear: nn.Linear, start: int, end: int) -> None:
    linear.weight = nn.Parameter(linear.weight.data[start:end].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _row_parallel(linear: nn.Linear, start: int, end: int, group) -> RowParallelLinear:
    return RowParallelLinear(linear.weight.data[:, start:end].clone(), linear.bias, group)


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedForTensorParallel(
            f"tensor parallelism supports {', '.join(SUPPORTED_ARCHITECTURES)} models; this target is "
            f"{config.model_type!r}. Serve it with tp=1, or add its layer names to mirrorspec/models/tensor_parallel.py")


def check_shardable(config, world: int) -> None:
    """What ``shard_causal_lm`` refuses, read off a config alone: a launcher checks it before it
    starts ranks that would each load the model and fail."""
    if world > 1:
        check_supported(config)
        for rank in range(world):
            head_share(config.num_attention_heads, config.num_key_value_heads, world, rank)
        if config.intermediate_size < world:  # a rank with no MLP columns failed as it loaded, ranks up
            raise UnsupportedForTensorParallel(
                f"the MLP's {config.intermediate_size} columns cannot be split over tp={world} ranks; "
                f"use tp <= {config.intermediate_size}")


@torch.no_grad()
def shard_causal_lm(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Cut ``model`` (loaded whole on every rank) down to rank's shard, in place."""
    config = model.config
    check_supported(config)
    check_shardable(config, world)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    share = head_share(config.num_attention_heads, config.num_key_value_heads, world, rank)
    mlp = split_range(config.intermediate_size, world, rank)
    for layer in model.model.layers:
        attn = layer.self_attn
        _rows(attn.q_proj, share.q[0] * head_dim, share.q[1] * head_dim)
        _rows(attn.k_proj, share.kv[0] * head_dim, share.kv[1] * head_dim)
        _rows(attn.v_proj, share.kv[0] * head_dim, share.kv[1] * head_dim)
        attn.o_proj = _row_parallel(attn.o_proj, share.q[0] * head_dim, share.q[1] * head_dim, group)
        attn.num_key_value_groups = share.groups
        _rows(layer.mlp.gate_proj, *mlp)
        _rows(layer.mlp.up_proj, *mlp)
        layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj, *mlp, group)
    head = model.get_output_embeddings()
    sizes = [end - start for start, end in (split_range(config.vocab_size, world, r) for r in range(world))]
    start, end = split_range(config.vocab_size, world, rank)
    bias = None if head.bias is None else head.bias.data[start:end].clone()
    model.lm_head = GatheredHead(head.weight.data[start:end].clone(), bias, sizes, group)
    return model


class ShardDriver:
    """Rank 0's end of the lockstep: sessions whose every operation the followers replay.

    One lock orders all broadcasts and forwards, so sessions used from several threads (a
    compute lane, an eviction on the event loop) never interleave their collectives.
    """

    def __init__(self, model: nn.Module, group=None, keepalive_s: float | None = KEEPALIVE_S):
        self.model = model
        self.group = group
        self.lock = threading.Lock()
        self.lost: str | None = None  # why the lockstep broke, once it has
        self._last_op = time.monotonic()
        self._stopped = threading.Event()
        if keepalive_s is not None:
            threading.Thread(target=self._keep_followers_waiting, args=(keepalive_s,), daemon=True,
                             name="tp-keepalive").start()

    def _keep_followers_waiting(self, every_s: float) -> None:
        while not self._stopped.wait(every_s / 4) and self.lost is None:
            if time.monotonic() - self._last_op >= every_s:
                try:
                    self.run(("keepalive", ""))
                except ReplicaLost:  # the replica answers so from now on, and awaits replacement
                    return

    def session(self) -> DrivenSession:
        return DrivenSession(self, uuid.uuid4().hex)

    def run(self, op: tuple, local=None):
        """``op`` on every rank. A failure part-way (a follower that died: gloo's "Connection reset
        by peer") leaves the ranks out of step for good, so this replica answers ``ReplicaLost``
        from then on, and the callers' sessions move to another replica until it is replaced."""
        with self.lock:
            if self.lost is not None:
                raise ReplicaLost(f"this tensor-parallel target lost a rank earlier ({self.lost}) and awaits "
                                  f"replacement")
            try:
                dist.broadcast_object_list([op], src=0, group=self.group)
                self._last_op = time.monotonic()
                return local() if local is not None else None
            except Exception as err:
                self.lost = " ".join(str(err).split())[:300] or type(err).__name__
                raise ReplicaLost(f"a tensor-parallel rank failed mid-operation ({self.lost})") from err

    def stop(self) -> None:
        self._stopped.set()
        self.run(("stop", ""))


class DrivenSession:
    """A ``LogitSession`` on rank 0 whose operations are replayed on every follower rank."""

    def __init__(self, driver: ShardDriver, key: str):
        self.driver = driver
        self.key = key
        self.local = KVSession(driver.model)
        self.vocab_size = self.local.vocab_size
        self.reach = self.local.reach

    def logits_for(self, context: Sequence[int], num_positions: int) -> torch.Tensor:
        context = list(context)
        return self.driver.run(("logits_for", self.key, context, num_positions),
                               lambda: self.local.logits_for(context, num_positions))

    def logits_with_runner_up(self, context: Sequence[int], num_positions: int, runner_up: int) -> torch.Tensor:
        """``KVSession.logits_with_runner_up`` on every rank: its 4D mask covers all heads, so each
        rank's share of them sees the tree as the whole model would."""
        context = list(context)
        return self.driver.run(("logits_with_runner_up", self.key, context, num_positions, runner_up),
                               lambda: self.local.logits_with_runner_up(context, num_positions, runner_up))

    def rollback(self, length: int) -> None:
        self.driver.run(("rollback", self.key, length), lambda: self.local.rollback(length))

    def close(self) -> None:
        self.driver.run(("close", self.key), self.local.reset)


def follow(model: nn.Module, group=None) -> None:
    """A follower rank's loop: replay rank 0's session operations until it says stop."""
    sessions: dict[str, KVSession] = {}
    while True:
        received = [None]
        dist.broadcast_object_list(received, src=0, group=group)
        op, key, *args = received[0]
        if op == "stop":
            return
        if op == "keepalive":
            continue
        if op == "close":
            sessions.pop(key, None)
            continue
        if key not in sessions:  # not setdefault: that built a cache for every operation, to drop it
            sessions[key] = KVSession(model)
        getattr(sessions[key], op)(*args)


def init_rank(init_method: str, rank: int, world: int, device: torch.device,
              timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """Join the target's process group (one per replica; every rank calls this)."""
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))


def load_shard(source: str, rank: int, world: int, init_method: str, dtype: str = "auto", device: str = "auto",
               group_timeout_s: float = GROUP_TIMEOUT_S):
    """Load the target whole, join the group and keep this rank's shard: what every rank runs."""
    from mirrorspec.models.loading import load_causal_lm, resolve_device
    from mirrorspec.models.prepack import prepack_linears

    init_rank(init_method, rank, world, resolve_device(device), group_timeout_s)
    loaded = load_causal_lm(source, dtype=dtype, device=device, tokenizer=False, prepack=False)
    shard_causal_lm(loaded.model, rank, world)
    prepack_linears(loaded.model)  # the column shards; row-parallel layers and the head stay plain
    return loaded


def run_follower(source: str, rank: int, world: int, init_method: str, threads: int = 1,
                 dtype: str = "auto", device: str = "auto", group_timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """The whole life of a follower rank (a Ray actor's method, or a spawned process in tests)."""
    torch.set_num_threads(threads)
    loaded = load_shard(source, rank, world, init_method, dtype, device, group_timeout_s)
    try:
        follow(loaded.model)
    finally:
        dist.destroy_process_group()
