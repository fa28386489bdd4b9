"""python -m drafter_service --model PATH --port 50062 (a draft model; without --model, n-gram prompt lookup)"""

import argparse

from drafter_service.servicer import DrafterConfig, serve
from mirrorspec.config import (DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DRAFT_QUANTIZE, DEFAULT_PROMPT_LOOKUP,
                               DEFAULT_PROPOSAL_TOP_K, QUANTIZATIONS,
                               InvalidRequest, refuse_setting)
from mirrorspec.models.loading import device_flag
from mirrorspec.serving.placement import add_placement_args, apply_placement
from mirrorspec.serving.server import run_until_terminated

parser = argparse.ArgumentParser(prog="python -m drafter_service")
parser.add_argument("--strategy", default=None, choices=["ngram", "draft-model"],
                    help="default: draft-model where --model names one, else ngram")
parser.add_argument("--model", default=None, help="draft model path or hub id (strategy draft-model), e.g. demo-draft")
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--dtype", default="auto")
parser.add_argument("--device", default="auto", type=device_flag)
parser.add_argument("--max-sessions", type=int, default=64)
parser.add_argument("--proposal-top-k", type=int, default=DEFAULT_PROPOSAL_TOP_K, metavar="M",
                    help="strategy draft-model: q restricted to the model's top M tokens, renormalised "
                         f"(0 = dense; default {DEFAULT_PROPOSAL_TOP_K})")
parser.add_argument("--prompt-lookup", type=int, default=DEFAULT_PROMPT_LOOKUP, metavar="N",
                    help="strategy draft-model: prompt lookup drafts first wherever the context's last N tokens "
                         "occurred before (0 = the model alone)")
parser.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE, metavar="P",
                    help="strategy draft-model: a window ends after the first token the model gives less than "
                         "probability P (0 = always draft K)")
parser.add_argument("--quantize", default=DEFAULT_DRAFT_QUANTIZE, choices=QUANTIZATIONS,
                    help="strategy draft-model: int8 = int8 weights for the draft's linear layers on CPU (exact "
                         "either way; a no-op on GPU)")
add_placement_args(parser)
args = parser.parse_args()
apply_placement(parser, args)
if args.strategy == "ngram" and args.model:  # it served n-gram drafts, the model silently unused (review 26)
    parser.error(f"--model: strategy ngram drafts by prompt lookup and uses no model; drop --model {args.model}, "
                 "or leave out --strategy (a --model implies draft-model)")
args.strategy = args.strategy or ("draft-model" if args.model else "ngram")
try:
    config = DrafterConfig(strategy=args.strategy, model=args.model, host=args.host, port=args.port, dtype=args.dtype,
                           device=args.device, max_sessions=args.max_sessions, proposal_top_k=args.proposal_top_k,
                           prompt_lookup=args.prompt_lookup, draft_confidence=args.draft_confidence,
                           quantize=args.quantize)
except InvalidRequest as err:
    refuse_setting(parser, err)
run_until_terminated(lambda: serve(config), "drafter_service", parser)
