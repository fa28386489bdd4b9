"""python -m target_service --model demo-target --port 50061"""

import argparse

from mirrorspec.config import DEFAULT_PREFILL_CHUNK, HINT_LENSES, PREFILL_CHUNK_HELP, InvalidRequest, refuse_setting
from mirrorspec.models.loading import device_flag
from mirrorspec.serving.placement import add_placement_args, apply_placement
from mirrorspec.serving.server import run_until_terminated
from target_service.servicer import TargetConfig, serve

parser = argparse.ArgumentParser(prog="python -m target_service")
parser.add_argument("--model", default="demo-target")
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--dtype", default="auto")
parser.add_argument("--device", default="auto", type=device_flag)
parser.add_argument("--max-sessions", type=int, default=64)
parser.add_argument("--hint-layer", type=int, default=None,
                    help="send early-exit hints read off this decoder layer (1-based) during each verify: mirror requests steer their branches with them")
parser.add_argument("--hint-vocab", default=None, metavar="DRAFT",
                    help="score hints over the sub-vocabulary this draft declares (e.g. demo-draft): cheaper verifies "
                         "(default: the whole vocabulary; `mirrorspec serve` names its draft by itself)")
parser.add_argument("--hint-lens", choices=HINT_LENSES, default="tuned",
                    help="read hints through a tuned lens fitted to the target (once, cached) or as the layer is (logit)")
parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, dest="prefill_chunk_tokens",
                    metavar="TOKENS", help=PREFILL_CHUNK_HELP)
add_placement_args(parser)
args = parser.parse_args()
apply_placement(parser, args)
try:
    config = TargetConfig(model=args.model, host=args.host, port=args.port, dtype=args.dtype, device=args.device,
                          max_sessions=args.max_sessions, hint_layer=args.hint_layer, hint_vocab=args.hint_vocab,
                          hint_lens=args.hint_lens, prefill_chunk_tokens=args.prefill_chunk_tokens)
except InvalidRequest as err:
    refuse_setting(parser, err, {"prefill_chunk_tokens": "--prefill-chunk"})
run_until_terminated(lambda: serve(config), "target_service", parser)
