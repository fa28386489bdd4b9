"""The flags of every command, and which flag carries which validated field."""

from __future__ import annotations

import argparse
from pathlib import Path

from mirrorspec.cli.demo import cmd_demo
from mirrorspec.cli.deployment import cmd_scale, cmd_status, cmd_stop
from mirrorspec.cli.flags import deployment_name, ray_address
from mirrorspec.cli.generate import GENERATE_MAX_TOKENS, cmd_generate
from mirrorspec.cli.serve import cmd_serve
from mirrorspec.config import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_K,
    DEFAULT_K_CONFIDENT,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_PROMPT_LOOKUP,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PROPOSAL_TOP_K,
    DTYPE_HELP,
    HINT_LENSES,
    DEFAULT_DRAFT_QUANTIZE,
    QUANTIZATIONS,
    PREFILL_CHUNK_HELP,
)


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


# Which flag carries which validated field, so errors from deep inside name what the user typed.
FLAG_FOR_FIELD = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "max_new_tokens": "--max-tokens",
    "max_tokens": "--max-tokens",  # the client's name for it (--server)
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
    "max_concurrent_requests": "--max-concurrent-requests",
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
    srv.add_argument("--draft", default="auto", help=DRAFT_HELP + " (with --in-process only: on Ray a "
                     "deployment serves with a draft)")
    srv.add_argument("--drafters", type=int, default=1, help="drafter replicas (Ray)")
    srv.add_argument("--targets", type=int, default=1, help="target replicas (Ray)")
    srv.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per target replica (Ray; Llama family)")
    srv.add_argument("--replica-cpus", type=float, default=1.0,
                     help="CPUs each replica (each target rank) asks Ray for")
    srv.add_argument("--drafter-gpus", type=float, default=0.0,
                     help="GPUs per drafter replica: 0 (CPU) or a fraction of a small GPU")
    srv.add_argument("--target-gpus", type=float, default=None,
                     help="GPUs per target rank (default: 1 where the Ray cluster or this machine has GPUs, else 0)")
    srv.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: this machine's)")
    srv.add_argument("--name", default="mirrorspec", type=deployment_name,
                     help="deployment name (Ray): scale and status find it by it")
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
                          "own prompt lookup; --mirror and --adaptive run there too). Windows stay at the front "
                          "door with hinted mirror (--hint-layer), --speculation-off-above, or an n-gram pool (its "
                          "lookup runs at the front door, with no drafter call to save)")
    srv.add_argument("--mirror", action="store_true",
                     help="by default, draft the next window's likely branches while the target verifies "
                          "(a request's `mirror` field overrides; the output is the same either way)")
    srv.add_argument("--speculation-off-above", type=int, default=None, metavar="N",
                     help="stop drafting while more than N requests are in flight (saturated targets; like vLLM's "
                          "speculative_disable_by_batch_size). Exact and greedy-identical, but a seeded sampled "
                          "request's tokens then depend on the load: a paused window is a K=0 one")
    srv.add_argument("--hint-layer", type=int, default=None,
                     help="targets early-exit hints read off this decoder layer (1-based) during each verify: "
                          "mirror requests steer their branches with them")
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
    srv.add_argument("--draft-quantize", choices=QUANTIZATIONS, default=DEFAULT_DRAFT_QUANTIZE,
                     help=DRAFT_QUANTIZE_HELP)
    srv.add_argument("--max-sessions", type=int, default=64, help="sessions per replica (default %(default)s)")
    srv.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS, metavar="N",
                     help="requests the front door decodes at once (like vLLM's --max-num-seqs); the rest wait their "
                          "turn, first come first served (default %(default)s)")
    srv.add_argument("--stall-timeout", type=float, default=180.0, dest="stall_timeout_s", metavar="SECONDS",
                     help="seconds a replica's compute lane may spend on one job (a forward, a collective) before "
                          "its health check answers NOT_SERVING and Ray replaces it (default 180)")
    srv.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, dest="prefill_chunk_tokens",
                     metavar="TOKENS", help=PREFILL_CHUNK_HELP)
    srv.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                     help="on Ctrl-C, SIGTERM or SIGHUP, the front door refuses new requests and gives those in "
                          "flight this long to finish before the replicas stop (default 30; a second signal stops "
                          "at once)")
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
    scale.add_argument("--name", default="mirrorspec", type=deployment_name, help="deployment name")
    scale.add_argument("--wait", type=float, default=300.0, help="seconds to wait for new replicas to serve")
    scale.set_defaults(handler=cmd_scale, subparser=scale)

    status = commands.add_parser("status", help="a deployment's replicas and front door: state, node, resources, "
                                                 "sessions, requests, acceptance rate, metrics URL")
    status.add_argument("--address", default="auto", type=ray_address,
                        help="the Ray cluster ('auto' = the local Ray of a running `serve --name NAME`, else the "
                             "one on this machine)")
    status.add_argument("--name", default="mirrorspec", type=deployment_name, help="deployment name")
    status.add_argument("--json", action="store_true", help="print the rows as JSON")
    status.set_defaults(handler=cmd_status, subparser=status)

    stop = commands.add_parser("stop", help="stop a deployment on Ray gracefully: no new requests, those in "
                                            "flight finish, then its replicas and controller go")
    stop.add_argument("--address", default="auto", type=ray_address,
                      help="the Ray cluster ('auto' = the local Ray of a running `serve --name NAME`, else the one on "
                           "this machine)")
    stop.add_argument("--name", default="mirrorspec", type=deployment_name, help="deployment name")
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
                      help="retrain the draft from the target by the shipped recipe (teacher data for its 20,480 prompts "
                           "~2.3 h on 2 CPU cores, then ~50 min of distillation)")
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
