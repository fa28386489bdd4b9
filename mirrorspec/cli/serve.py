"""`mirrorspec serve`: a deployment on Ray (local or a cluster), or three servers in this process."""

from __future__ import annotations

import argparse
import contextlib
import math
import os

from mirrorspec.cli.flags import (
    check_finite_amount,
    check_wait,
    is_draft_model,
    is_set,
    refuse_draft_model_settings_without_a_model,
    refuse_speculation_settings,
    resolve_draft,
)
from mirrorspec.cli.lifecycle import (
    ReplicaEvents,
    drain_and_tear_down,
    finish_in_flight,
    interrupted_by_termination,
    stopped_elsewhere,
    wait_for_stop,
)
from mirrorspec.cli.local_stack import start_local_stack
from mirrorspec.config import (
    AdaptiveKConfig,
    InvalidRequest,
    MirrorConfig,
    SpeculationConfig,
    check_max_concurrent_requests,
    check_max_sessions,
    check_prefill_chunk,
    check_stall_timeout,
    default_k,
    field_named,
)
from mirrorspec.serving.placement import check_threads


# serve's flags that place replicas on Ray; --in-process runs one target and one drafter server
# in this process, where they would change nothing: refused, rather than silently ignored
# ...but these at 1 say what --in-process runs: one target, unsplit, and one drafter
ONE_OF_EACH = ("tp", "drafters", "targets")


RAY_SETTINGS = ("address", "detach", "name", "drafters", "targets", "tp", "replica_cpus", "drafter_gpus",
                "target_gpus", "num_cpus", "start_timeout")


def _check_tp_split(target: str, tp: int, local: bool) -> None:
    """A --tp the target cannot be cut into: every rank would fail to shard it, and the pool would
    relaunch them until --start-timeout. A cluster's head may not hold the target's files (its
    workers load it): there an unreadable config is left to the replicas to report."""
    if tp <= 1:
        return
    from mirrorspec.models.loading import read_config
    from mirrorspec.models.tensor_parallel import check_shardable

    try:
        config = read_config(target)
    except InvalidRequest:
        if local:
            raise
        return
    check_shardable(config, tp)


def cmd_serve(args: argparse.Namespace) -> int:
    check_threads(args.threads)
    if args.in_process:
        for dest in RAY_SETTINGS:
            if is_set(args, dest) and not (dest in ONE_OF_EACH and getattr(args, dest) == 1):
                raise InvalidRequest("places replicas on Ray, which --in-process does not use (it runs one target "
                                     "and one drafter server in this process): drop one of the two", field=dest)
    draft = resolve_draft(args.draft, args.target)
    if draft == "none":  # --in-process only: on Ray it is refused below
        # the banner and ModelInfo said K=4 (K=8 with --mirror) for a server that drafts nothing
        refuse_speculation_settings(args, "--draft none")
        args.k = 0
    if args.k is None:
        args.k = default_k(is_draft_model(draft), args.draft_confidence)
    SpeculationConfig(num_speculative_tokens=args.k, proposal_top_k=args.proposal_top_k,
                      prompt_lookup=args.prompt_lookup, draft_confidence=args.draft_confidence)
    from mirrorspec.models.loading import check_models
    from mirrorspec.serving.server import check_port_free

    check_max_sessions(args.max_sessions)
    check_stall_timeout(args.stall_timeout_s)
    check_prefill_chunk(args.prefill_chunk_tokens)
    check_max_concurrent_requests(args.max_concurrent_requests)
    check_wait(args.shutdown_grace, "shutdown_grace")
    for field in ("port", "metrics_port"):  # the front door listens here, on a local Ray as on a cluster's head
        check_port_free(args.host, getattr(args, field), field)
    if args.metrics_port and args.metrics_port == args.port:
        raise InvalidRequest(f"is --port too ({args.port}): the metrics endpoint needs a port of its own",
                             field="metrics_port")
    refuse_draft_model_settings_without_a_model(args, draft)
    for dest, what in (("hint_lens", "how the targets read"), ("hint_vocab", "what vocabulary scores")):
        if is_set(args, dest) and args.hint_layer is None:
            raise InvalidRequest(f"sets {what} their early-exit hints, and they send none without --hint-layer: "
                                 f"give one, or drop --{dest.replace('_', '-')}", field=dest)
    if args.in_process or args.address is None:  # a local Ray's replicas load from this machine's paths
        check_models(args.target, None if draft in ("ngram", "none") else draft)
    _check_tp_split(args.target, args.tp, args.in_process or args.address is None)
    args.hint_vocab = _hint_vocab(args.hint_vocab, args.hint_layer, draft)
    if args.in_process:
        return _serve_in_process(args)
    if args.detach and not args.address:
        raise InvalidRequest("needs --address: a local Ray ends with this process", field="detach")
    for flag, value in (("replica_cpus", args.replica_cpus), ("drafter_gpus", args.drafter_gpus),
                        ("target_gpus", args.target_gpus), ("speculation_off_above", args.speculation_off_above)):
        check_finite_amount(value, flag)
        if value and flag in RESOURCE_FLAGS and round(value, 4) != value:
            raise InvalidRequest(f"Ray counts resources in steps of 0.0001, got {value}", field=flag)
    check_wait(args.start_timeout, "start_timeout")
    if args.address is not None and is_set(args, "num_cpus"):  # it was ignored there
        raise InvalidRequest("sizes the local Ray that serve starts without --address; a cluster's nodes say their "
                             "own CPUs (`ray start --num-cpus`): drop one of the two", field="num_cpus")
    if args.num_cpus is not None and args.num_cpus < 1:
        raise InvalidRequest(f"must be >= 1 (or left out for this machine's), got {args.num_cpus}", field="num_cpus")
    spec = _stack_spec(args, target_gpus=0.0)  # validates counts before Ray starts
    from cluster.local_ray import check_name_free
    from mirrorspec.models.loading import parse_device, resolve_device

    # a local Ray's replicas see this machine's devices; a cluster's GPU nodes may not be up yet
    (resolve_device if args.address is None else parse_device)(args.device)
    if args.address is None:
        check_local_ray_fits(args, spec)
        check_name_free(args.name)
    import ray

    from cluster.deploy import connect, deploy
    from cluster.local_ray import announced_local_ray

    with interrupted_by_termination():  # a stop while replicas start tears the deployment down
        connect(args.address, num_cpus=_local_cpus(args, spec))
        spec = _stack_spec(args, target_gpus=_target_gpus(args.target_gpus))
        try:
            controller, address = deploy(spec, timeout_s=args.start_timeout)
        except TimeoutError as err:
            raise InvalidRequest(str(err), field="start_timeout") from None
    print(f"mirrorspec: serving on {address} (Ray; deployment {spec.name!r}: {spec.drafters} drafter x "
          f"{spec.targets} target replicas, tp={spec.tp}, target {spec.target}, draft {spec.draft}, "
          f"K={spec.num_speculative_tokens}{' adaptive' if spec.adaptive else ''}{' mirror' if spec.mirror else ''}); "
          + ("detached" if args.detach else "Ctrl-C stops"), flush=True)
    if args.detach:
        return 0
    with contextlib.ExitStack() as announced:
        if args.address is None:  # status, scale and stop find this Ray by the deployment's name
            announced.enter_context(announced_local_ray(spec.name, ray.get_runtime_context().gcs_address))
        events = ReplicaEvents(lambda seen: ray.get(controller.events_since.remote(seen), timeout=5))
        if not wait_for_stop(lambda: stopped_elsewhere(spec.name), each_tick=events.print_new):
            print(f"mirrorspec: deployment {spec.name!r} was stopped (`mirrorspec stop`)", flush=True)
            return 0
        drain_and_tear_down(spec.name, controller, args.shutdown_grace)
    return 0


def _stack_spec(args: argparse.Namespace, target_gpus: float):
    from cluster.spec import PoolResources, StackSpec

    draft = resolve_draft(args.draft, args.target)
    if draft == "none":
        raise InvalidRequest("on Ray, serve with a draft; use --in-process for target-only", field="draft")
    return StackSpec(target=args.target, draft=draft, drafters=args.drafters, targets=args.targets, tp=args.tp,
                     drafter_resources=PoolResources(cpus=args.replica_cpus, gpus=args.drafter_gpus),
                     target_resources=PoolResources(cpus=args.replica_cpus, gpus=target_gpus),
                     threads=args.threads or 1, dtype=args.dtype, device=args.device,
                     num_speculative_tokens=args.k, adaptive=AdaptiveKConfig() if args.adaptive else None,
                     mirror=MirrorConfig() if args.mirror else None, runner_up=not args.no_runner_up,
                     windows_on_target=args.windows_on_target, hint_layer=args.hint_layer,
                     hint_vocab=args.hint_vocab, hint_lens=args.hint_lens,
                     speculation_off_above=args.speculation_off_above,
                     proposal_top_k=args.proposal_top_k, prompt_lookup=args.prompt_lookup,
                     draft_confidence=args.draft_confidence, draft_quantize=args.draft_quantize,
                     max_sessions=args.max_sessions, max_concurrent_requests=args.max_concurrent_requests,
                     host=args.host, port=args.port, name=args.name,
                     metrics_port=args.metrics_port, stall_timeout_s=args.stall_timeout_s,
                     prefill_chunk_tokens=args.prefill_chunk_tokens)


def _hint_vocab(choice: str, hint_layer: int | None, draft: str) -> str | None:
    """``--hint-vocab``, checked before anything starts: auto scores hints over the served draft's
    sub-vocabulary where it has one."""
    if hint_layer is None and choice != "auto":
        raise InvalidRequest("scores early-exit hints, so it needs --hint-layer too", field="hint_vocab")
    if hint_layer is None or choice == "full":
        return None
    from mirrorspec.drafting.draft_model import declared_vocabulary, hint_vocabulary

    if choice != "auto":
        hint_vocabulary(choice)  # fails now, naming the flag, rather than in a replica later
        return choice
    return draft if draft not in ("ngram", "none") and declared_vocabulary(draft) is not None else None


def _target_gpus(requested: float | None) -> float:
    """Called once Ray is up. A cluster whose GPU nodes the autoscaler has not started yet shows
    none: pass --target-gpus 1 there (the ray up configs do)."""
    if requested is not None:
        return requested
    import ray
    import torch

    return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 or torch.cuda.is_available() else 0.0


RESOURCE_FLAGS = ("replica_cpus", "drafter_gpus", "target_gpus")


def check_local_ray_fits(args: argparse.Namespace, spec) -> None:
    """A local Ray has no autoscaler: replicas that ask for more GPUs than this machine has, or
    more CPUs than --num-cpus gives it, would wait out --start-timeout (10 minutes by default)
    and then be blamed on it."""
    import torch

    gpus = torch.cuda.device_count()
    for flag, replicas in (("target_gpus", spec.targets * spec.tp), ("drafter_gpus", spec.drafters)):
        wanted = replicas * (getattr(args, flag) or 0.0)
        if wanted > gpus:
            raise InvalidRequest(f"the replicas ask for {wanted:g} GPUs in all and a local Ray on this machine has "
                                 f"{gpus}; lower it, or pass --address of a cluster with GPU nodes", field=flag)
    wanted = _cpus_wanted(spec)
    if args.num_cpus is not None and args.num_cpus < wanted:
        raise InvalidRequest(f"a local Ray of {args.num_cpus} CPUs cannot place the replicas, which ask for "
                             f"{wanted:g} (--replica-cpus each); raise it, or lower --replica-cpus", field="num_cpus")


def _local_cpus(args: argparse.Namespace, spec) -> int:
    """A local Ray big enough for what was asked (CPUs are Ray's accounting, threads are ours)."""
    return args.num_cpus or max(len(os.sched_getaffinity(0)), math.ceil(_cpus_wanted(spec)))


def _cpus_wanted(spec) -> float:
    return spec.drafters * spec.drafter_resources.cpus + spec.targets * spec.tp * spec.target_resources.cpus


def _serve_in_process(args: argparse.Namespace) -> int:
    """Three servers in this process: target, drafter, and the front door."""
    import torch

    from drafter_service.servicer import DrafterConfig
    from mirrorspec.models import load_causal_lm
    from mirrorspec.models.loading import quiet_transformers
    from target_service.servicer import TargetConfig

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    quiet_transformers()
    args.draft = resolve_draft(args.draft, args.target)
    target = load_causal_lm(args.target, dtype=args.dtype, device=args.device)
    drafter = None
    if args.draft != "none":
        drafter = DrafterConfig.for_draft(args.draft, dtype=args.dtype, device=args.device,
                                          max_sessions=args.max_sessions, proposal_top_k=args.proposal_top_k,
                                          prompt_lookup=args.prompt_lookup, draft_confidence=args.draft_confidence,
                                          quantize=args.draft_quantize, stall_timeout_s=args.stall_timeout_s)
    with field_named("draft"):  # the target is loaded above: a model the stack fails to load is the draft
        stack = start_local_stack(TargetConfig(model=target.source, max_sessions=args.max_sessions,
                                               hint_layer=args.hint_layer,
                                               hint_vocab=args.hint_vocab, hint_lens=args.hint_lens,
                                               stall_timeout_s=args.stall_timeout_s,
                                               prefill_chunk_tokens=args.prefill_chunk_tokens),
                                  drafter,
                                  target_model=target, host=args.host, port=args.port, num_speculative_tokens=args.k,
                                  metrics_port=args.metrics_port,
                                  adaptive=AdaptiveKConfig() if args.adaptive else None,
                                  mirror=MirrorConfig() if args.mirror else None,
                                  speculation_off_above=args.speculation_off_above, runner_up=not args.no_runner_up,
                                  windows_on_target=args.windows_on_target,
                                  max_concurrent_requests=args.max_concurrent_requests)
    where = f"{target.model.device} in {target.dtype_name}"  # what auto chose
    metrics_port = stack.front.servicer.metrics.port
    metrics = f"; metrics on http://{args.host}:{metrics_port}/metrics" if metrics_port is not None else ""
    print(f"mirrorspec: serving on {args.host}:{stack.front.port} (in-process; target {args.target} on {where}, "
          f"draft {args.draft}, K={args.k}{' mirror' if args.mirror else ''}{metrics}); Ctrl-C stops", flush=True)
    wait_for_stop()
    finish_in_flight(lambda: stack.front.stop(grace=args.shutdown_grace), args.shutdown_grace)
    stack.stop()
    return 0
