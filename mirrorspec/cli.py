"""The ``mirrorspec`` command line: the face of the project.

Bad values are reported as ``mirrorspec <command>: error: --flag: what is wrong and how to fix
it`` with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mirrorspec.config import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_K,
    DEFAULT_K_CONFIDENT,
    DEFAULT_PROMPT_LOOKUP,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PROPOSAL_TOP_K,
    DTYPE_HELP,
    HINT_LENSES,
    AdaptiveKConfig,
    DEFAULT_DRAFT_QUANTIZE,
    QUANTIZATIONS,
    InvalidRequest,
    MAX_WAIT_S,
    PREFILL_CHUNK_HELP,
    MirrorConfig,
    SamplingParams,
    SpeculationConfig,
    check_max_sessions,
    check_writable_folder,
    check_seed,
    check_prefill_chunk,
    check_stall_timeout,
    default_k,
    field_named,
)
from mirrorspec.serving.placement import check_threads

if TYPE_CHECKING:  # the services are imported when used, so `mirrorspec --help` stays fast
    from drafter_service.servicer import DrafterConfig
    from mirrorspec.models import LoadedModel
    from mirrorspec.serving.server import BackgroundServer
    from target_service.servicer import TargetConfig

PROMPT_LOOKUP_HELP = ("with a draft model: prompt lookup drafts first wherever the context's last N tokens "
                      "occurred before, the model drafts the rest (exact either way; 0 = the model alone)")

DRAFT_CONFIDENCE_HELP = ("with a draft model: a window ends after the first token the model gives less than "
                         "probability P, the drafts after it being likely rejections (exact either way; "
                         "0 = always draft K)")

DRAFT_QUANTIZE_HELP = ("with a draft model: int8 runs its linear layers on int8 weights, ~1.7x faster per "
                       "drafted token on CPU (exact either way; a no-op on GPU or for a bf16/fp16 model)")

K_HELP = (f"speculative tokens per window (default {DEFAULT_K_CONFIDENT}: windows end early on their own, prompt "
          f"lookup's with its match, a draft model's at its first unsure token; {DEFAULT_K} with --draft-confidence 0)")

DRAFT_HELP = ("draft: 'auto' (the demo draft for the demo target, else 'ngram'), 'demo-draft', 'ngram' "
              "(prompt lookup), a model path / hub id sharing the target's tokenizer, or 'none'")

GENERATE_MAX_TOKENS = 128  # generate --local's default; a server's default is its own

# Which flag carries which validated field, so errors from deep inside name what the user typed.
FLAG_FOR_FIELD = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "max_new_tokens": "--max-tokens",
    "num_speculative_tokens": "--k",
    "proposal_top_k": "--proposal-top-k",
    "prompt_lookup": "--prompt-lookup",
    "draft_confidence": "--draft-confidence",
    "draft_quantize": "--draft-quantize",
    "quantize": "--draft-quantize",
    "prompt": "PROMPT",
    "input_ids": "PROMPT",
    "text": "PROMPT",  # a front door names the prompt by its kind of input
    "raw_text": "PROMPT",
    "token_ids": "PROMPT",
    "chat": "PROMPT",
    "model": "--target",
    "target": "--target",
    "draft": "--draft",
    "drafter": "--draft",  # a front door's drafter servers, started here from --draft
    "dtype": "--dtype",
    "device": "--device",
    "runner_up": "--no-runner-up",
    "ngram": "--draft",
    "threads": "--threads",
    "local": "--local",
    "teacher_prompts": "--teacher-prompts",
    "epochs": "--epochs",
    "out": "--out",
    "server": "--server",
    "hint_layer": "--hint-layer",
    "hint_vocab": "--hint-vocab",
    "hint_lens": "--hint-lens",
    "speculation_off_above": "--speculation-off-above",
    "windows_on_target": "--windows-on-target",
    "address": "--address",
    "name": "--name",
    "drafters": "--drafters",
    "targets": "--targets",
    "tp": "--tp",
    "replicas": "REPLICAS",
    "detach": "--detach",
    "replica_cpus": "--replica-cpus",
    "drafter_gpus": "--drafter-gpus",
    "target_gpus": "--target-gpus",
    "start_timeout": "--start-timeout",
    "shutdown_grace": "--shutdown-grace",
    "timeout": "--timeout",
    "num_cpus": "--num-cpus",
    "wait": "--wait",
    "max_sessions": "--max-sessions",
    "stall_timeout_s": "--stall-timeout",
    "prefill_chunk_tokens": "--prefill-chunk",
    "seed": "--seed",
    "host": "--host",
    "port": "--port",
    "metrics_port": "--metrics-port",
    "adaptive": "--adaptive",
    "k": "--k",
    "mirror": "--mirror",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirrorspec", description="Exact, disaggregated speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt", help="the user message (chat template applied for instruct models)")
    gen.add_argument("--local", action="store_true", help="run the in-process engine instead of calling a server")
    gen.add_argument("--server", default="127.0.0.1:50051",
                     help="front door address (without --local; default %(default)s)")
    gen.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="without --local: the request's gRPC deadline; past it the request is cancelled on the "
                          "server and its sessions freed (default: none)")
    gen.add_argument("--target", default="demo-target", help="target model: hub id, path, .gguf, or demo-target")
    gen.add_argument("--draft", default="auto", help=DRAFT_HELP)
    gen.add_argument("--max-tokens", type=int, default=None,
                     help=f"maximum new tokens (default {GENERATE_MAX_TOKENS}, or with --server the server's "
                          "default, cut to the room the prompt leaves in the context window)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--k", type=int, default=None, help=K_HELP + " (without --local: the server's default)")
    gen.add_argument("--proposal-top-k", type=int, default=None, metavar="M",
                     help=f"with --local: a draft model's q restricted to its top M tokens, renormalised (0 = dense; "
                          f"default {DEFAULT_PROPOSAL_TOP_K}, as a server's drafters, so a seeded request gives the "
                          "same tokens either way)")
    gen.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                     help=f"with --local: {PROMPT_LOOKUP_HELP} (default {DEFAULT_PROMPT_LOOKUP}; a server's drafters "
                          "are set with `mirrorspec serve --prompt-lookup`)")
    gen.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                     help=f"with --local: {DRAFT_CONFIDENCE_HELP} (default {DEFAULT_DRAFT_CONFIDENCE}; a server's "
                          "drafters are set with `mirrorspec serve --draft-confidence`)")
    gen.add_argument("--draft-quantize", choices=QUANTIZATIONS, default=None,
                     help=f"with --local: {DRAFT_QUANTIZE_HELP} (default {DEFAULT_DRAFT_QUANTIZE}; a server's drafters "
                          "are set with `mirrorspec serve --draft-quantize`)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="the model's end-of-sequence ids do not end the output: it runs to --max-tokens "
                          "(fixed-length outputs, for timing)")
    gen.add_argument("--no-speculate", action="store_true", help="target-only decoding (the baseline)")
    gen.add_argument("--adaptive", action="store_true",
                     help="with --local: choose K per window in [0, --k] from acceptance (off where it does not pay)")
    mirror = gen.add_mutually_exclusive_group()
    mirror.add_argument("--mirror", action="store_true",
                        help="draft the next window while the target verifies this one (same output; "
                             "without --local: asks the server for it)")
    mirror.add_argument("--no-mirror", action="store_true",
                        help="without --local: asks a server started with --mirror to draft this request in turn "
                             "(the default with --local)")
    gen.add_argument("--no-runner-up", action="store_true",
                     help="with --local: verify chains only. By default windows also offer the draft's runner-up "
                          "for their first draft, in the same target pass (same output distribution)")
    gen.add_argument("--hint-layer", type=int, default=None,
                     help="with --local --mirror: the target sends early-exit hints read off this layer")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print text, token ids and statistics as JSON")
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    gen.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    gen.set_defaults(handler=cmd_generate, subparser=gen)

    srv = commands.add_parser("serve", help="serve on Ray (a local one by default): drafter and target replicas "
                                            "as actors, and the orchestrator's front door")
    srv.add_argument("--address", default=None, type=ray_address,
                     help="join this Ray cluster ('auto' = the one on this machine) instead of starting a local one")
    srv.add_argument("--in-process", action="store_true",
                     help="no Ray: the three servers as threads of this process (one replica each)")
    srv.add_argument("--host", default="127.0.0.1", help="front door host")
    srv.add_argument("--port", type=int, default=50051, help="front door port (default %(default)s)")
    srv.add_argument("--target", default="demo-target", help="target model: hub id, path, .gguf, or demo-target")
    srv.add_argument("--draft", default="auto", help=DRAFT_HELP)
    srv.add_argument("--drafters", type=int, default=1, help="drafter replicas (Ray)")
    srv.add_argument("--targets", type=int, default=1, help="target replicas (Ray)")
    srv.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per target replica (Ray; Llama family)")
    srv.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica (each target rank) asks Ray for")
    srv.add_argument("--drafter-gpus", type=float, default=0.0,
                     help="GPUs per drafter replica: 0 (CPU) or a fraction of a small GPU")
    srv.add_argument("--target-gpus", type=float, default=None,
                     help="GPUs per target rank (default: 1 where the Ray cluster or this machine has GPUs, else 0)")
    srv.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: this machine's)")
    srv.add_argument("--name", default="mirrorspec", help="deployment name (Ray): scale and status find it by it")
    srv.add_argument("--detach", action="store_true",
                     help="with --address: leave the deployment running on the cluster and exit")
    srv.add_argument("--start-timeout", type=float, default=600.0,
                     help="seconds to wait for the first replicas (on a fresh cluster: for the autoscaler's nodes)")
    srv.add_argument("--k", type=int, default=None, help="requests' default " + K_HELP)
    srv.add_argument("--adaptive", action="store_true", help="choose K per window in [0, K] from acceptance")
    srv.add_argument("--no-runner-up", action="store_true",
                     help="verify chains only. By default windows also offer the targets the draft's runner-up "
                          "for their first draft, in the same pass (same output distribution)")
    srv.add_argument("--windows-on-target", action="store_true",
                     help="windows run on the targets, which ask the drafters for drafts themselves: one "
                          "round trip per window instead of two through the front door (the drafters run their "
                          "own prompt lookup; --mirror and --adaptive run there too, but hinted mirror "
                          "(--hint-layer) stays at the front door)")
    srv.add_argument("--mirror", action="store_true",
                     help="by default, draft the next window's likely branches while the target verifies "
                          "(a request's `mirror` field overrides; the output is the same either way)")
    srv.add_argument("--speculation-off-above", type=int, default=None, metavar="N",
                     help="stop drafting while more than N requests are in flight (saturated targets; like vLLM's "
                          "speculative_disable_by_batch_size). Exact and greedy-identical, but a seeded sampled request's "
                          "tokens then depend on the load: a paused window is a K=0 one")
    srv.add_argument("--hint-layer", type=int, default=None,
                     help="targets early-exit hints read off this decoder layer (1-based) during each verify: mirror requests steer their branches with them")
    srv.add_argument("--hint-vocab", default="auto", metavar="auto|full|DRAFT",
                     help="with --hint-layer: score hints over a draft's declared sub-vocabulary (auto: the served "
                          "draft's, if it declares one; full: the whole vocabulary)")
    srv.add_argument("--hint-lens", choices=HINT_LENSES, default="tuned",
                     help="with --hint-layer: read hints through a tuned lens fitted to the target (default; "
                          "fitted once, about a minute on CPU for the demo target, then cached) or as the final "
                          "norm and head see the layer (logit)")
    srv.add_argument("--proposal-top-k", type=int, default=DEFAULT_PROPOSAL_TOP_K, metavar="M",
                     help=f"sparse q width for draft models (0 = dense; default {DEFAULT_PROPOSAL_TOP_K})")
    srv.add_argument("--prompt-lookup", type=int, default=DEFAULT_PROMPT_LOOKUP, metavar="N", help=PROMPT_LOOKUP_HELP)
    srv.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE, metavar="P",
                     help=DRAFT_CONFIDENCE_HELP)
    srv.add_argument("--draft-quantize", choices=QUANTIZATIONS, default=DEFAULT_DRAFT_QUANTIZE, help=DRAFT_QUANTIZE_HELP)
    srv.add_argument("--max-sessions", type=int, default=64, help="sessions per replica (default %(default)s)")
    srv.add_argument("--stall-timeout", type=float, default=180.0, dest="stall_timeout_s", metavar="SECONDS",
                     help="seconds a replica's compute lane may spend on one job (a forward, a collective) before "
                          "its health check answers NOT_SERVING and Ray replaces it (default 180)")
    srv.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, dest="prefill_chunk_tokens",
                     metavar="TOKENS", help=PREFILL_CHUNK_HELP)
    srv.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                     help="on Ctrl-C, SIGTERM or SIGHUP, the front door refuses new requests and gives those in flight this "
                          "long to finish before the replicas stop (default 30; a second signal stops at once)")
    srv.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    srv.add_argument("--threads", type=int, default=None,
                     help="torch threads per replica (default: 1 on Ray, all cores in-process)")
    srv.add_argument("--device", default="auto", help="where the replicas run: auto, cpu, cuda, cuda:1 ...")
    srv.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    srv.set_defaults(handler=cmd_serve, subparser=srv)

    scale = commands.add_parser("scale", help="grow or shrink a pool of a deployment on Ray (drains on the way down)")
    scale.add_argument("pool", choices=["drafter", "target"], help="which pool")
    scale.add_argument("replicas", type=int, help="replicas wanted")
    scale.add_argument("--address", default="auto", type=ray_address,
                       help="the Ray cluster ('auto' = the local Ray of a running `serve --name NAME`, else the one on "
                            "this machine)")
    scale.add_argument("--name", default="mirrorspec", help="deployment name")
    scale.add_argument("--wait", type=float, default=300.0, help="seconds to wait for new replicas to serve")
    scale.set_defaults(handler=cmd_scale, subparser=scale)

    status = commands.add_parser("status", help="a deployment's replicas: state, node, resources, sessions")
    status.add_argument("--address", default="auto", type=ray_address,
                        help="the Ray cluster ('auto' = the local Ray of a running `serve --name NAME`, else the one on "
                             "this machine)")
    status.add_argument("--name", default="mirrorspec", help="deployment name")
    status.add_argument("--json", action="store_true", help="print the rows as JSON")
    status.set_defaults(handler=cmd_status, subparser=status)

    stop = commands.add_parser("stop", help="stop a deployment on Ray gracefully: no new requests, those in "
                                            "flight finish, then its replicas and controller go")
    stop.add_argument("--address", default="auto", type=ray_address,
                      help="the Ray cluster ('auto' = the local Ray of a running `serve --name NAME`, else the one on "
                           "this machine)")
    stop.add_argument("--name", default="mirrorspec", help="deployment name")
    stop.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                      help="how long requests in flight have to finish before the replicas stop (default 30; "
                           "Ctrl-C stops at once)")
    stop.set_defaults(handler=cmd_stop, subparser=stop)

    demo = commands.add_parser("demo", help="the demo draft: provenance, a side-by-side run, or --rebuild it")
    demo.add_argument("--prompt", default="Write a Python function that checks whether a string is a palindrome.",
                      help="the prompt of the side-by-side run")
    demo.add_argument("--max-tokens", type=int, default=96, help="maximum new tokens of the side-by-side run")
    demo.add_argument("--k", type=int, default=DEFAULT_K, help="speculative tokens per window of the draft's own runs "
                                                               "(the `generate --local` run uses its defaults)")
    demo.add_argument("--rebuild", action="store_true",
                      help="retrain the draft from the target (teacher data ~1 h on 2 CPU cores, then distillation)")
    demo.add_argument("--teacher-prompts", type=int, default=None, help="with --rebuild: training prompts to use")
    demo.add_argument("--epochs", type=float, default=None, help="with --rebuild: distillation epochs")
    demo.add_argument("--out", type=Path, default=None,
                      help="with --rebuild: where to write draft.safetensors (default: the cache)")
    demo.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    demo.set_defaults(handler=cmd_demo, subparser=demo)

    # listed for --help; main() hands everything after "bench" to the harness's own parser
    commands.add_parser("bench", help="benchmark decoding modes side by side (mirrorspec bench --help); "
                                      "`mirrorspec bench mirror` compares serial and mirror over gRPC and "
                                      "draws a timeline PNG; `mirrorspec bench acceptance` replays the draft "
                                      "along the target's answers: acceptance with no timing noise")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "mirror"]:
        from benchmarks.mirror import main as mirror_main

        return _interruptible(lambda: mirror_main(argv[2:]))
    if argv[:2] == ["bench", "acceptance"]:
        from benchmarks.acceptance import main as acceptance_main

        return _interruptible(lambda: acceptance_main(argv[2:], prog="mirrorspec bench acceptance"))
    if argv[:1] == ["bench"]:
        from benchmarks.run import main as bench_main

        return bench_main(argv[1:], prog="mirrorspec bench")
    args = parse_command_line(argv)
    try:
        return args.handler(args)
    except InvalidRequest as err:
        flag = FLAG_FOR_FIELD.get(err.field or "")
        args.subparser.error(f"{flag}: {err}" if flag else str(err))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): not an error of ours
        sys.stdout = open(os.devnull, "w")
        return 0


def _interruptible(run: Callable[[], int]) -> int:
    """Ctrl-C ends a benchmark with 130 and a line, as `bench` and `demo` do, not a traceback
    from wherever it fell (review 24 of stop 48); what it started stops on its way out."""
    try:
        return run()
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130


def parse_command_line(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed, with ``given``: the flags the command line itself sets. A flag given its
    default value is given all the same: `generate --server ... --target demo-target` against a
    server running another target was ignored, as if never typed."""
    args = build_parser().parse_args(argv)
    bare = build_parser()  # the same flags with no defaults: what parses is what was typed
    for command in next(a for a in bare._actions if isinstance(a, argparse._SubParsersAction)).choices.values():
        for action in command._actions:
            action.default = argparse.SUPPRESS
    args.given = frozenset(vars(bare.parse_args(argv)))
    return args


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# generate's flags that set up the engine --local runs; a server was set up by `mirrorspec serve`,
# so without --local they would change nothing: refused, rather than silently ignored.
# (flag's dest, field it is reported as, who sets it on a server)
SERVER_SETTINGS = (
    ("target", "target", "the server's target (`mirrorspec serve --target`)"),
    ("draft", "draft", "the server's draft (`mirrorspec serve --draft`)"),
    ("prompt_lookup", "prompt_lookup", "set on the server's drafters (`mirrorspec serve --prompt-lookup N`)"),
    ("draft_confidence", "draft_confidence", "set on the server's drafters (`mirrorspec serve --draft-confidence P`)"),
    ("draft_quantize", "draft_quantize", "set on the server's drafters (`mirrorspec serve --draft-quantize`)"),
    ("proposal_top_k", "proposal_top_k", "set on the server's drafters (`mirrorspec serve --proposal-top-k`)"),
    ("adaptive", "adaptive", "set on the server's front door (`mirrorspec serve --adaptive`)"),
    ("no_runner_up", "runner_up", "set on the server's front door (`mirrorspec serve --no-runner-up`)"),
    ("threads", "threads", "set on the server's processes (`mirrorspec serve --threads`)"),
    ("device", "device", "where the server placed its models (`mirrorspec serve --device`)"),
    ("dtype", "dtype", "set on the server's models (`mirrorspec serve --dtype`)"),
)


def _is_set(args: argparse.Namespace, dest: str) -> bool:
    """Whether the command line gave this flag (``parse_command_line``), whatever its value."""
    return dest in args.given


# what sets speculation up, in generate and serve: refused where speculation is off, not ignored
SPECULATION_SETTINGS = ("k", "adaptive", "mirror", "no_runner_up", "windows_on_target", "speculation_off_above",
                        "hint_layer")


def refuse_speculation_settings(args: argparse.Namespace, off: str, also: tuple[str, ...] = ()) -> None:
    """``off`` (a flag) decodes target-only: a flag that sets speculation up would be ignored."""
    for dest in (*SPECULATION_SETTINGS, *also):
        if hasattr(args, dest) and _is_set(args, dest):
            raise InvalidRequest(f"sets speculation, which {off} turns off: drop one of the two",
                                 field="runner_up" if dest == "no_runner_up" else dest)


def cmd_generate(args: argparse.Namespace) -> int:
    # validate every flag before the (slow) model load
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=GENERATE_MAX_TOKENS if args.max_tokens is None else args.max_tokens)
    check_seed(args.seed)
    if not args.local:
        for dest, field, owner in SERVER_SETTINGS:
            if _is_set(args, dest):
                raise InvalidRequest(f"is {owner}; here it needs --local", field=field)
    if args.no_speculate or args.draft == "none":  # target-only: a speculation setting would be ignored
        refuse_speculation_settings(args, "--no-speculate" if args.no_speculate else "--draft none",
                                    also=DRAFT_MODEL_SETTINGS)
        if args.no_speculate and args.draft != "none" and _is_set(args, "draft"):
            raise InvalidRequest("names a draft, and --no-speculate decodes without one: drop one of the two",
                                 field="draft")
    if args.k == 0 and args.adaptive:
        raise InvalidRequest("chooses K per window in [0, --k], and --k 0 leaves it nothing to choose (it is "
                             "target-only); give --k the largest K to try", field="adaptive")
    if args.k == 0 and args.mirror:  # it ran, target-only, and said nothing (user review of stop 55)
        raise InvalidRequest("drafts the next window while the target verifies this one, and --k 0 drafts none (it "
                             "is target-only); give --k > 0, or drop --mirror", field="mirror")
    if args.local:
        refuse_draft_model_settings_without_a_model(args, resolve_draft(args.draft, args.target))
    args.draft_quantize = args.draft_quantize or DEFAULT_DRAFT_QUANTIZE
    args.proposal_top_k = DEFAULT_PROPOSAL_TOP_K if args.proposal_top_k is None else args.proposal_top_k
    args.prompt_lookup = DEFAULT_PROMPT_LOOKUP if args.prompt_lookup is None else args.prompt_lookup
    args.draft_confidence = DEFAULT_DRAFT_CONFIDENCE if args.draft_confidence is None else args.draft_confidence
    if args.local and args.k is None:
        args.k = default_k(_is_draft_model(resolve_draft(args.draft, args.target)), args.draft_confidence)
    SpeculationConfig(num_speculative_tokens=DEFAULT_K if args.k is None else args.k, proposal_top_k=args.proposal_top_k,
                      prompt_lookup=args.prompt_lookup, draft_confidence=args.draft_confidence)
    check_threads(args.threads)
    if args.local and _is_set(args, "server"):
        raise InvalidRequest("is a front door's address, and --local runs the engine in this process: drop one "
                             "of the two", field="server")
    if args.timeout is not None:
        if args.local:
            raise InvalidRequest("is a server request's deadline; the in-process engine (--local) has none: "
                                 "drop one of the two", field="timeout")
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise InvalidRequest(f"must be a finite number of seconds > 0, got {args.timeout}", field="timeout")
    if args.hint_layer is not None and not (args.local and args.mirror):
        raise InvalidRequest("needs --local and --mirror (a server's targets send hints if they were started "
                             "with `mirrorspec serve --hint-layer`)", field="hint_layer")
    if not args.local:
        return _generate_remote(args)
    import torch

    from mirrorspec.engine import generate
    from mirrorspec.models import encode_prompt, load_causal_lm
    from mirrorspec.models.detokenize import decode_text

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    _quiet_transformers()
    args.draft = resolve_draft(args.draft, args.target)
    target = load_causal_lm(args.target, dtype=args.dtype, device=args.device)
    draft = None if args.no_speculate or args.draft == "none" else _load_draft(args)
    ids = encode_prompt(target.tokenizer, args.prompt, chat=not args.raw)
    params = dataclasses.replace(params, stop_token_ids=() if args.ignore_eos else target.stop_token_ids())
    if args.max_tokens is None:  # the default, cut to the room the prompt leaves, as a server cuts its own: a
        # long prompt was refused naming --max-tokens, which the user had not given (user review of stop 55)
        params = dataclasses.replace(params, max_new_tokens=max(min(params.max_new_tokens,
                                                                    target.max_context - len(ids)), 1))
    printer = None if args.json else _StreamPrinter(target.tokenizer)
    result = generate(target.model, draft, ids, params, num_speculative_tokens=0 if draft is None else args.k,
                      seed=args.seed, proposal_top_k=args.proposal_top_k, prompt_lookup=args.prompt_lookup,
                      draft_confidence=args.draft_confidence, adaptive=args.adaptive,
                      mirror=args.mirror, hint_layer=args.hint_layer, hint_lens=_hint_lens(target, args.hint_layer),
                      on_tokens=printer.push if printer else None, runner_up=not args.no_runner_up)
    text = decode_text(target.tokenizer, result.token_ids)
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": result.token_ids,
            "prompt_tokens": len(ids),
            "finish_reason": result.finish_reason,
            "seed": result.seed,
            "target": args.target,
            "draft": "none" if draft is None else args.draft,
            "k": 0 if draft is None else args.k,
            "wall_time_s": result.wall_time_s,
            "tokens_per_second": result.tokens_per_second,
            "stats": result.stats.to_dict(),
        }, indent=2))
    else:
        printer.finish()
        s = result.stats
        print(f"[{len(result.token_ids)} tokens, {result.tokens_per_second:.1f} tok/s, "
              f"{speculation_summary(s)}, seed {result.seed}]", file=sys.stderr)
    return 0


def speculation_summary(stats) -> str:
    """The end-of-generation figures, for in-process stats and a server's ``RequestStats`` alike."""
    won = f", runner-up won {stats.runner_up_hits} windows" if stats.runner_up_hits else ""
    on_target = f", {stats.windows_on_target} of {stats.windows} windows run on the target" \
        if stats.windows_on_target else ""
    off = f", adaptive K drafted nothing in {stats.adaptive_off_windows} of {stats.windows} windows" \
        if stats.adaptive_off_windows else ""
    return (f"acceptance {stats.acceptance_rate:.2f}, {stats.mean_accepted_length:.2f} tokens/pass"
            f"{won}{on_target}{off}")


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from mirrorspec.client import Client, NotAFrontDoor, check_target

    check_target(args.server, "server")
    options = dict(raw=args.raw, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, k=0 if args.no_speculate else args.k, ignore_eos=args.ignore_eos,
                   mirror=True if args.mirror else False if args.no_mirror else None)
    try:
        with Client(args.server, timeout_s=args.timeout) as client:
            if args.json:
                c = client.generate(args.prompt, **options)
                from google.protobuf.json_format import MessageToDict

                print(json.dumps({"text": c.text, "token_ids": c.token_ids, "prompt_tokens": c.prompt_tokens,
                                  "finish_reason": c.finish_reason, "seed": c.seed,
                                  "stats": MessageToDict(c.stats, preserving_proto_field_name=True,
                                                         always_print_fields_with_no_presence=True)}, indent=2))
                return 0
            for chunk in client.stream(args.prompt, **options):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:  # the text's line ends, as --local's does, before the summary
                    print(flush=True)
                    print(f"[{chunk.finish_reason}; {speculation_summary(chunk.stats)}, seed {chunk.seed}]",
                          file=sys.stderr)
    except NotAFrontDoor as err:  # the client names its own argument, ``address``
        raise InvalidRequest(str(err), field="server") from None
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            raise InvalidRequest(f"no mirrorspec server answers at {args.server}; start one with "
                                 f"`mirrorspec serve`, or pass --local", field="server") from None
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and args.timeout is not None:
            raise InvalidRequest(f"{args.server} did not finish the request within {args.timeout:g} s (any output "
                                 f"above is its start) and it was cancelled, which frees its sessions on the server. "
                                 f"Raise --timeout, or lower --max-tokens", field="timeout") from None
        from mirrorspec.serving.errors import FIELD_METADATA

        field = dict(err.trailing_metadata() or ()).get(FIELD_METADATA)  # which setting, as the server names it
        raise InvalidRequest(f"the server refused the request: {err.details()}", field=field) from None
    return 0


@dataclass
class LocalStack:
    """Target replicas, drafter replicas and the front door, each a gRPC server in this process."""

    targets: list[BackgroundServer]
    drafters: list[BackgroundServer]
    front: BackgroundServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.front.port}"

    @property
    def target(self) -> BackgroundServer:
        return self.targets[0]

    @property
    def drafter(self) -> BackgroundServer | None:
        return self.drafters[0] if self.drafters else None

    def stop(self) -> None:
        for server in (self.front, *self.drafters, *self.targets):
            server.stop()


def start_local_stack(target: TargetConfig, drafter: DrafterConfig | None, *, target_model: LoadedModel | None = None,
                      draft_model: LoadedModel | None = None, target_replicas: int = 1, drafter_replicas: int = 1,
                      **front_options) -> LocalStack:
    """Start target and drafter replicas (no drafter if None) and the orchestrator routing over
    them; ``front_options`` are OrchestratorConfig fields (host, port, num_speculative_tokens, ...).
    Models already loaded in this process can be shared instead of loaded again."""
    from drafter_service.servicer import serve as serve_drafter
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import OrchestratorConfig
    from orchestrator.servicer import serve as serve_orchestrator
    from target_service.servicer import serve as serve_target

    started: list[BackgroundServer] = []

    def start(factory, name: str) -> BackgroundServer:
        started.append(BackgroundServer(factory, name))
        return started[-1].start()

    try:
        targets = [start(lambda: serve_target(target, loaded=target_model), "target") for _ in range(target_replicas)]
        drafters = [start(lambda: serve_drafter(drafter, loaded=draft_model), "drafter")
                    for _ in range(drafter_replicas if drafter is not None else 0)]
        front = OrchestratorConfig(target=",".join(f"127.0.0.1:{t.port}" for t in targets),
                                   drafter=",".join(f"127.0.0.1:{d.port}" for d in drafters) or None, **front_options)
        return LocalStack(targets, drafters, start(lambda: serve_orchestrator(front), "orchestrator"))
    except BaseException:  # one that failed to start: the rest stop too, rather than serve on, unreachable
        for server in reversed(started):
            server.stop()
        raise


# how a draft model drafts: an n-gram drafter has no model, and would ignore them
DRAFT_MODEL_SETTINGS = ("prompt_lookup", "draft_confidence", "proposal_top_k", "draft_quantize")


def refuse_draft_model_settings_without_a_model(args: argparse.Namespace, draft: str) -> None:
    why = {"ngram": "--draft ngram has none (it proposes what followed the context's last tokens where they "
                    "occurred before)",
           "none": "--draft none has none (it decodes with the target alone)"}.get(draft)
    if why is None:
        return
    for dest in DRAFT_MODEL_SETTINGS:
        if _is_set(args, dest):
            raise InvalidRequest(f"sets how a draft model drafts, and {why}: drop one of the two", field=dest)


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
            if _is_set(args, dest) and not (dest in ONE_OF_EACH and getattr(args, dest) == 1):
                raise InvalidRequest("places replicas on Ray, which --in-process does not use (it runs one target "
                                     "and one drafter server in this process): drop one of the two", field=dest)
    draft = resolve_draft(args.draft, args.target)
    if draft == "none":  # --in-process only: on Ray it is refused below
        # the banner and ModelInfo said K=4 (K=8 with --mirror) for a server that drafts nothing
        refuse_speculation_settings(args, "--draft none")
        args.k = 0
    if args.k is None:
        args.k = default_k(_is_draft_model(draft), args.draft_confidence)
    SpeculationConfig(num_speculative_tokens=args.k, proposal_top_k=args.proposal_top_k,
                      prompt_lookup=args.prompt_lookup, draft_confidence=args.draft_confidence)
    from mirrorspec.models.loading import check_models
    from mirrorspec.serving.server import check_port_free

    check_max_sessions(args.max_sessions)
    check_stall_timeout(args.stall_timeout_s)
    check_prefill_chunk(args.prefill_chunk_tokens)
    check_wait(args.shutdown_grace, "shutdown_grace")
    for field in ("port", "metrics_port"):  # the front door listens here, on a local Ray as on a cluster's head
        check_port_free(args.host, getattr(args, field), field)
    if args.metrics_port and args.metrics_port == args.port:
        raise InvalidRequest(f"is --port too ({args.port}): the metrics endpoint needs a port of its own",
                             field="metrics_port")
    refuse_draft_model_settings_without_a_model(args, draft)
    for dest, what in (("hint_lens", "how the targets read"), ("hint_vocab", "what vocabulary scores")):
        if _is_set(args, dest) and args.hint_layer is None:
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
          f"{spec.targets} target replicas, tp={spec.tp}, target {spec.target}, draft {spec.draft}, K={spec.num_speculative_tokens}{' adaptive' if spec.adaptive else ''}{' mirror' if spec.mirror else ''}); "
          + ("detached" if args.detach else "Ctrl-C stops"), flush=True)
    if args.detach:
        return 0
    with contextlib.ExitStack() as announced:
        if args.address is None:  # status, scale and stop find this Ray by the deployment's name
            announced.enter_context(announced_local_ray(spec.name, ray.get_runtime_context().gcs_address))
        if not _wait_for_stop(lambda: _stopped_elsewhere(spec.name)):
            print(f"mirrorspec: deployment {spec.name!r} was stopped (`mirrorspec stop`)", flush=True)
            return 0
        _drain_and_tear_down(spec.name, controller, args.shutdown_grace)
    return 0


def _drain_and_tear_down(name: str, controller, grace_s: float) -> None:
    """How a deployment on Ray stops, from `serve` or `stop`: its front door drains for up to
    ``grace_s`` (a second Ctrl-C ends that), then every replica and the controller go."""
    from cluster.deploy import drain_front_door, teardown

    _finish_in_flight(lambda: drain_front_door(name, grace_s), grace_s)
    teardown(controller, name)


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
                     max_sessions=args.max_sessions, host=args.host, port=args.port, name=args.name,
                     metrics_port=args.metrics_port, stall_timeout_s=args.stall_timeout_s,
                     prefill_chunk_tokens=args.prefill_chunk_tokens)


def _hint_lens(target, hint_layer: int | None):
    """The tuned lens in-process hints read through (fitted once per target and layer, cached)."""
    if hint_layer is None:
        return None
    from mirrorspec.models.lens import LensRecipe, tuned_lens

    return tuned_lens(target, LensRecipe(layer=hint_layer), log=lambda line: print(line, file=sys.stderr))


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


def check_finite_amount(value: float | None, field: str) -> None:
    """A count, resource share or wait that must be a finite number >= 0 (``nan`` passes ``< 0``
    and ``inf`` overflows Ray's and threading's arithmetic, both as tracebacks)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise InvalidRequest(f"must be a finite number >= 0, got {value}", field=field)


def ray_address(text: str) -> str:
    """``--address``: an empty one (an unset ``"$HEAD"``) was a cluster's to some checks and a local
    Ray's to others (a review's find): `serve --address ""` started a local Ray, skipping the checks
    of one, and waited out --start-timeout for a GPU it would never have."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give the Ray cluster's head (HOST:6379, or 'auto' for the one on "
                                         "this machine), or leave --address out")
    return text.strip()


def check_wait(seconds: float | None, field: str) -> None:
    """A finite wait of at most ``MAX_WAIT_S``: threading's waits and gRPC's deadlines overflow a
    little past 9.2e9 s, and a stop given ``--shutdown-grace 1e10`` raised inside its replicas,
    leaving the deployment half stopped (a review's find)."""
    check_finite_amount(seconds, field)
    if seconds is not None and seconds > MAX_WAIT_S:
        raise InvalidRequest(f"must be at most {MAX_WAIT_S:g} seconds (about four months), got {seconds:g}",
                             field=field)


def _local_cpus(args: argparse.Namespace, spec) -> int:
    """A local Ray big enough for what was asked (CPUs are Ray's accounting, threads are ours)."""
    return args.num_cpus or max(len(os.sched_getaffinity(0)), math.ceil(_cpus_wanted(spec)))


def _cpus_wanted(spec) -> float:
    return spec.drafters * spec.drafter_resources.cpus + spec.targets * spec.tp * spec.target_resources.cpus


@contextlib.contextmanager
def interrupted_by_termination():
    """SIGTERM and SIGHUP (a service manager's stop, a closed terminal) raise KeyboardInterrupt
    inside, as Ctrl-C does. ``deploy`` tears its detached controller down on any exception; killed
    by the default handlers instead, a deployment still starting stayed on the cluster, and the next
    ``serve`` found its name taken. A signal the process was started ignoring stays ignored: the
    `ray up` configs start `serve --detach` under nohup, to outlive the SSH session that starts it,
    and its SIGHUP would have torn the deployment down (a review's find)."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
              if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _wait_for_stop(gone: Callable[[], bool] = lambda: False, every_s: float = 2.0) -> bool:
    """Until Ctrl-C, SIGTERM or SIGHUP, each ending serving alike: the caller then tears the
    deployment down (a closed terminal used to kill the process before that, leaving it running).
    False where ``gone()`` said first that the deployment was stopped from elsewhere (``mirrorspec
    stop``): nothing is left to tear down, and a ``serve`` left waiting would never end."""
    import threading

    tick = threading.Event()
    try:
        with interrupted_by_termination():
            while not gone():
                tick.wait(every_s)
    except KeyboardInterrupt:
        return True
    return False


def _finish_in_flight(drain: Callable[[], None], grace_s: float) -> None:
    """After the first stop signal, ``drain``: the front door refuses new requests and lets those in
    flight finish, for up to ``grace_s``, before the replicas stop (they used to be cut off at once,
    UNAVAILABLE mid-stream). A second signal ends the wait."""
    if grace_s <= 0:
        return
    print(f"mirrorspec: stopping: no new requests; those in flight have up to {grace_s:g} s to finish "
          "(Ctrl-C again stops at once)", flush=True)
    try:
        with interrupted_by_termination():
            drain()
    except KeyboardInterrupt:
        print("mirrorspec: stopping at once", flush=True)


def _serve_in_process(args: argparse.Namespace) -> int:
    """Three servers in this process: target, drafter, and the front door."""
    import torch

    from drafter_service.servicer import DrafterConfig
    from mirrorspec.models import load_causal_lm
    from target_service.servicer import TargetConfig

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    _quiet_transformers()
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
                                  windows_on_target=args.windows_on_target)
    where = f"{target.model.device} in {target.dtype_name}"  # what auto chose
    print(f"mirrorspec: serving on {args.host}:{stack.front.port} (in-process; target {args.target} on {where}, "
          f"draft {args.draft}, K={args.k}{' mirror' if args.mirror else ''}); Ctrl-C stops", flush=True)
    _wait_for_stop()
    _finish_in_flight(lambda: stack.front.stop(grace=args.shutdown_grace), args.shutdown_grace)
    stack.stop()
    return 0


def join_deployment_ray(args: argparse.Namespace) -> bool:
    """Joins the Ray that deployment ``--name`` runs on, for `scale`, `status` and `stop`; returns
    whether it is the local Ray a running `serve` announced. Where none was announced and no Ray
    runs here, the deployment is named: a second `stop` blamed an --address nobody gave."""
    from cluster.local_ray import local_ray_file, use_announced_ray

    address = use_announced_ray(args.address, args.name)  # before Ray is imported
    local = address == "auto" and local_ray_file(args.name).exists()
    from cluster.deploy import AutoFindsASilentRay, connect

    try:
        connect(address)
    except InvalidRequest as err:
        if address != "auto" or _is_set(args, "address") or isinstance(err, AutoFindsASilentRay):
            raise
        raise InvalidRequest(f"no deployment named {args.name!r} runs on this machine (stopped already?), and no Ray "
                             f"cluster runs here to look for it on; pass --address of the cluster it runs on",
                             field="name") from None
    return local


def cmd_scale(args: argparse.Namespace) -> int:
    from cluster.spec import check_replicas

    check_replicas(args.pool, args.replicas, "replicas")
    check_wait(args.wait, "wait")
    local = join_deployment_ray(args)
    from cluster.deploy import ask_controller

    if local:
        rows = _scaled_on_local_ray(args.name, args.pool, args.replicas, args.wait)
    else:
        rows = ask_controller(args.name, lambda controller: controller.scale.remote(args.pool, args.replicas,
                                                                                    args.wait))
    print(format_status(rows))
    mine = [r for r in rows if r["pool"] == args.pool]
    serving, pending = (sum(r["state"] == state for r in mine) for state in ("serving", "pending"))
    if serving != args.replicas:
        when, why = f" after {args.wait:g} s", "the rest wait for resources (see `ray status`)"
        if local and pending:  # no autoscaler will ever add the node they wait for
            when, why = "", (f"{pending} cannot be placed: a local Ray has no autoscaler, and its CPUs are taken; "
                             f"scale down again, or serve with more --num-cpus or less --replica-cpus")
        print(f"mirrorspec scale: {serving} of {args.replicas} {args.pool} replicas serve{when}; {why}",
              file=sys.stderr)
    return 0


def _scaled_on_local_ray(name: str, pool: str, replicas: int, wait_s: float, settle_s: float = 3.0) -> list[dict]:
    """A local Ray has no autoscaler: once a pool's only replicas not serving are ones Ray could not
    place (for ``settle_s``, as a new one is placed in a moment), no wait makes them serve. `scale`
    stood silent for all of --wait (300 s) before saying so (review 26 of stop 49)."""
    from cluster.deploy import ask_controller

    rows = ask_controller(name, lambda controller: controller.scale.remote(pool, replicas, 0))
    deadline, unplaced_since = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        states = [r["state"] for r in rows if r["pool"] == pool]
        if states.count("serving") >= replicas and _front_door_routes_current_membership(rows):
            break
        unplaced = "pending" in states and "starting" not in states
        unplaced_since = (unplaced_since or time.monotonic()) if unplaced else None
        if unplaced_since is not None and time.monotonic() - unplaced_since >= settle_s:
            break
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
        rows = ask_controller(name, lambda controller: controller.status.remote())
    return rows


def _front_door_routes_current_membership(rows: list[dict]) -> bool:
    """Whether new replicas already get requests. Not known (None) for a front door that does not
    answer, nor from a controller from before stop 51: no wait for what may never come."""
    return all(r.get("membership") != "updating" for r in rows if r["pool"] == "orchestrator")


def cmd_status(args: argparse.Namespace) -> int:
    join_deployment_ray(args)
    from cluster.deploy import ask_controller

    rows = ask_controller(args.name, lambda controller: controller.status.remote())
    print(json.dumps(rows, indent=2) if args.json else format_status(rows))
    return 0


def _stopped_elsewhere(name: str) -> bool:
    """Whether deployment ``name`` is gone from its Ray; not where Ray cannot say just now (a head
    that is restarting must not end a `serve` that should tear its deployment down later)."""
    from cluster.deploy import deployed

    try:
        return not deployed(name)
    except Exception:  # noqa: BLE001 - a GCS hiccup: ask again at the next tick
        return False


def cmd_stop(args: argparse.Namespace) -> int:
    """What Ctrl-C does to a `serve` that waits for it, for a deployment that has none (``--detach``)
    or from another shell: the front door refuses new requests, those in flight get
    ``--shutdown-grace`` to finish, then the controller stops every replica and itself. A `serve`
    still waiting on the deployment sees it gone and exits."""
    check_wait(args.shutdown_grace, "shutdown_grace")
    join_deployment_ray(args)
    from cluster.deploy import find_controller

    _drain_and_tear_down(args.name, find_controller(args.name), args.shutdown_grace)
    print(f"mirrorspec: deployment {args.name!r} stopped", flush=True)
    return 0


def format_status(rows: list[dict]) -> str:
    columns = ["replica", "pool", "state", "address", "node", "resources", "sessions", "requests", "acceptance_rate"]
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _is_draft_model(draft: str) -> bool:
    """A resolved ``--draft`` that names a model (not prompt lookup alone, not none)."""
    return draft not in ("ngram", "none")


def resolve_draft(draft: str, target: str) -> str:
    """``auto``: the trained demo draft for the demo target, prompt lookup for any other target."""
    from mirrorspec.models import DEMO_DRAFT, DEMO_TARGET

    if draft != "auto":
        return draft
    return DEMO_DRAFT if target == DEMO_TARGET else "ngram"


def cmd_demo(args: argparse.Namespace) -> int:
    """Show the shipped demo draft at work next to the target alone, or rebuild it."""
    check_threads(args.threads)
    SpeculationConfig(num_speculative_tokens=args.k)
    params = SamplingParams(max_new_tokens=args.max_tokens)
    if args.teacher_prompts is not None and args.teacher_prompts < 1:
        raise InvalidRequest(f"must be >= 1, got {args.teacher_prompts}", field="teacher_prompts")
    if args.epochs is not None and not (math.isfinite(args.epochs) and args.epochs > 0):
        raise InvalidRequest(f"must be a finite number > 0, got {args.epochs}", field="epochs")
    for field in ("teacher_prompts", "epochs", "out"):
        if getattr(args, field) is not None and not args.rebuild:
            raise InvalidRequest("sets up a rebuild, so it needs --rebuild", field=field)
    for field in ("prompt", "max_tokens", "k"):  # the side-by-side run's, which a rebuild does not make
        if _is_set(args, field) and args.rebuild:  # named here: generate's prompt is positional
            raise InvalidRequest(f"--{field.replace('_', '-')}: sets up the side-by-side run, which --rebuild does "
                                 f"not make: drop one of the two")
    if args.out is not None:
        _check_rebuild_out(args.out)
    import torch

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    _quiet_transformers()
    if args.rebuild:
        return _rebuild_demo_draft(args)
    from mirrorspec.engine import generate
    from mirrorspec.models import DEMO_DRAFT, encode_prompt, load_causal_lm
    from mirrorspec.models.demo_draft import SHIPPED_WEIGHTS
    from mirrorspec.models.detokenize import decode_text

    provenance = json.loads(SHIPPED_WEIGHTS.with_suffix(".json").read_text())
    print(f"demo draft: {SHIPPED_WEIGHTS} ({SHIPPED_WEIGHTS.stat().st_size / 1e6:.1f} MB), "
          f"{provenance['recipe']['student_layers']} layers over the target's embedding and head, "
          f"{provenance['recipe']['draft_vocab_size']}-token sub-vocabulary; distilled from "
          f"{provenance['teacher_tokens']:,} target-written tokens; held-out top-1 agreement "
          f"{provenance['held_out_top1_agreement']['after']:.2f}")
    target = load_causal_lm("demo-target")
    draft = load_causal_lm(DEMO_DRAFT, tokenizer=False, quantize=DEFAULT_DRAFT_QUANTIZE).model  # as generate --local
    ids = encode_prompt(target.tokenizer, args.prompt)
    params = dataclasses.replace(params, stop_token_ids=target.stop_token_ids())
    generate(target.model, draft, ids, dataclasses.replace(params, max_new_tokens=4))  # warm-up
    alone = generate(target.model, None, ids, params)
    spec = generate(target.model, draft, ids, params, num_speculative_tokens=args.k)
    lookup = generate(target.model, draft, ids, params, num_speculative_tokens=args.k,
                      prompt_lookup=DEFAULT_PROMPT_LOOKUP)
    cli_k = default_k(True, DEFAULT_DRAFT_CONFIDENCE)  # what `mirrorspec generate --local` runs
    confident = generate(target.model, draft, ids, params, num_speculative_tokens=cli_k,
                         prompt_lookup=DEFAULT_PROMPT_LOOKUP, draft_confidence=DEFAULT_DRAFT_CONFIDENCE)
    runner_up = generate(target.model, draft, ids, params, num_speculative_tokens=cli_k, runner_up=True,
                         prompt_lookup=DEFAULT_PROMPT_LOOKUP, draft_confidence=DEFAULT_DRAFT_CONFIDENCE)
    print(decode_text(target.tokenizer, spec.token_ids))
    print(f"\n{'target alone':<19} {alone.tokens_per_second:6.1f} tok/s")
    for name, run, k in (("with demo draft", spec, args.k), ("+ prompt lookup", lookup, args.k),
                         ("+ stop when unsure", confident, cli_k), ("+ runner-up", runner_up, cli_k)):
        s = run.stats
        speedup = run.tokens_per_second / alone.tokens_per_second
        print(f"{name:<19} {run.tokens_per_second:6.1f} tok/s  ({speedup:.2f}x), K={k}, "
              f"alpha {s.token_acceptance_rate:.2f}, {s.mean_accepted_length:.2f} tokens/pass")
    print(f"(the last is `mirrorspec generate --local`'s default: windows end after the draft's first token "
          f"below p={DEFAULT_DRAFT_CONFIDENCE}, and the target also scores the draft's runner-up for the first)")
    identical = spec.token_ids == alone.token_ids == lookup.token_ids == confident.token_ids == runner_up.token_ids
    print(f"greedy output identical to the target alone: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


def _rebuild_demo_draft(args: argparse.Namespace) -> int:
    from mirrorspec.config import DistillRecipe
    from mirrorspec.distill.build import student_stage, teacher_stage
    from mirrorspec.distill.prompts import PromptsRanOut
    from mirrorspec.models.demo_draft import SHIPPED_WEIGHTS, weights_digest
    from mirrorspec.models.demo_target import cache_root

    shipped = json.loads(SHIPPED_WEIGHTS.with_suffix(".json").read_text())["recipe"]
    overrides = {k: v for k, v in (("teacher_prompts", args.teacher_prompts), ("epochs", args.epochs)) if v is not None}
    recipe = dataclasses.replace(DistillRecipe(**shipped), **overrides)
    out = args.out or cache_root() / "demo-draft-rebuild" / "draft.safetensors"
    try:
        shards = teacher_stage(recipe, threads=args.threads)
    except PromptsRanOut as err:
        raise InvalidRequest(str(err), field="teacher_prompts") from None
    provenance = student_stage(recipe, shards, out, threads=args.threads)
    same = weights_digest(out) == weights_digest(SHIPPED_WEIGHTS)
    print(f"wrote {out}: held-out top-1 agreement {provenance['held_out_top1_agreement']['after']:.3f}; "
          f"{'bit-identical to' if same else 'differs from'} the shipped {SHIPPED_WEIGHTS.name}")
    if not same:
        print(f"use it with --draft {out}; compare it with the shipped draft, with no timing noise:\n"
              f"  mirrorspec bench acceptance --draft demo-draft,{out} --num-prompts 80")
    return 0


def _check_rebuild_out(out: Path) -> None:
    """Before an hour of teacher data: the weights must land where ``--draft OUT`` finds them (a
    .safetensors file; any other name is read as a model directory) and the directory must take them."""
    if out.suffix != ".safetensors":
        raise InvalidRequest(f"must name a .safetensors file (so --draft {out} reads it back as demo-draft weights), "
                             f"got {out}", field="out")
    if out.exists() and not out.is_file():
        raise InvalidRequest(f"{out} exists and is not a file (a folder?); name a file in it", field="out")
    check_writable_folder(out.parent, "out")


def _load_draft(args: argparse.Namespace):
    if args.draft == "ngram":
        return "ngram"
    from mirrorspec.models import load_causal_lm

    with field_named("draft"):
        return load_causal_lm(args.draft, dtype=args.dtype, device=args.device, tokenizer=False,
                              quantize=args.draft_quantize).model


class _StreamPrinter:
    """Prints text as windows commit tokens."""

    def __init__(self, tokenizer):
        from mirrorspec.models.detokenize import IncrementalDetokenizer

        self.detokenizer = IncrementalDetokenizer(tokenizer)

    def push(self, tokens: list[int]) -> None:
        sys.stdout.write(self.detokenizer.push(tokens))
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write(self.detokenizer.flush() + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
