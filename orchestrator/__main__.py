"""python -m orchestrator --target 127.0.0.1:50061 --drafter 127.0.0.1:50062 --port 50051"""

import argparse

from mirrorspec.cli.flags import check_wait
from mirrorspec.config import DEFAULT_MAX_CONCURRENT_REQUESTS, AdaptiveKConfig, InvalidRequest, MirrorConfig, refuse_setting
from mirrorspec.serving.server import run_until_terminated
from orchestrator.servicer import OrchestratorConfig, serve

parser = argparse.ArgumentParser(prog="python -m orchestrator")
parser.add_argument("--target", required=True, help="host:port of a TargetService, or several comma-separated (a pool)")
parser.add_argument("--drafter", default=None,
                    help="host:port of a DrafterService, or several comma-separated (omit: target-only)")
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=50051)
parser.add_argument("--k", type=int, default=None,
                    help="requests' default speculative tokens per window (default: as mirrorspec serve picks for "
                         "the drafters found: 8 for n-gram or a draft model with a confidence cut, else 4)")
parser.add_argument("--adaptive", action="store_true", help="choose K per window in [0, K] from acceptance")
parser.add_argument("--mirror", action="store_true",
                    help="by default, draft the next window while the target verifies (requests may override)")
parser.add_argument("--speculation-off-above", type=int, default=None, metavar="N",
                    help="stop drafting while more than N requests are in flight (saturated targets; like vLLM's speculative_disable_by_batch_size)")
parser.add_argument("--no-front-door-lookup", action="store_true",
                    help="leave the drafters' prompt lookup to them (default: run it here, on the token log, "
                         "and call a drafter only where lookup finds nothing)")
parser.add_argument("--runner-up", action="store_true",
                    help="windows also offer the targets the draft's runner-up for their first draft")
parser.add_argument("--windows-on-target", action="store_true",
                    help="windows run on the targets, which ask the drafters for drafts themselves: one "
                         "round trip per window instead of two through here (mirror's too, unhinted)")
parser.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS, metavar="N",
                    help="requests decoded at once (like vLLM's --max-num-seqs); the rest wait their turn, first "
                         "come first served (default %(default)s)")
parser.add_argument("--metrics-port", type=int, default=None)
parser.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                    help="on SIGTERM, SIGHUP or Ctrl-C, refuse new requests and give those in flight this long to finish "
                         "(default 30; a second signal stops at once)")
args = parser.parse_args()
try:
    check_wait(args.shutdown_grace, "shutdown_grace")
    config = OrchestratorConfig(target=args.target, drafter=args.drafter, host=args.host, port=args.port,
                                num_speculative_tokens=args.k, metrics_port=args.metrics_port,
                                adaptive=AdaptiveKConfig() if args.adaptive else None,
                                mirror=MirrorConfig() if args.mirror else None,
                                speculation_off_above=args.speculation_off_above,
                                front_door_lookup=not args.no_front_door_lookup, runner_up=args.runner_up,
                                windows_on_target=args.windows_on_target,
                                max_concurrent_requests=args.max_concurrent_requests)
except InvalidRequest as err:
    refuse_setting(parser, err, {"num_speculative_tokens": "--k"})
run_until_terminated(lambda: serve(config), "orchestrator", parser, grace_s=args.shutdown_grace)
