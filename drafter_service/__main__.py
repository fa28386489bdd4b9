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
# how a draft model drafts: None until given, so that strategy ngram can refuse them rather than ignore them
DRAFT_MODEL_DEFAULTS = {"proposal_top_k": DEFAULT_PROPOSAL_TOP_K, "prompt_lookup": DEFAULT_PROMPT_LOOKUP,
                        "draft_confidence": DEFAULT_DRAFT_CONFIDENCE, "quantize": DEFAULT_DRAFT_QUANTIZE}
parser.add_argument("--proposal-top-k", type=int, default=None, metavar="M",
                    help="strategy draft-model: q restricted to the model's top M tokens, renormalised "
                         f"(0 = dense; default {DEFAULT_PROPOSAL_TOP_K})")
parser.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                    help="strategy draft-model: prompt lookup drafts first wherever the context's last N tokens "
                         f"occurred before (0 = the model alone; default {DEFAULT_PROMPT_LOOKUP})")
parser.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                    help="strategy draft-model: a window ends after the first token the model gives less than "
                         f"probability P (0 = always draft K; default {DEFAULT_DRAFT_CONFIDENCE})")
parser.add_argument("--quantize", default=None, choices=QUANTIZATIONS,
                    help="strategy draft-model: int8 = int8 weights for the draft's linear layers on CPU (exact "
                         f"either way; a no-op on GPU; default {DEFAULT_DRAFT_QUANTIZE})")
add_placement_args(parser)
args = parser.parse_args()
apply_placement(parser, args)
if args.strategy == "ngram" and args.model:  # it served n-gram drafts, the model silently unused (review 26)
    parser.error(f"--model: strategy ngram drafts by prompt lookup and uses no model; drop --model {args.model}, "
                 "or leave out --strategy (a --model implies draft-model)")
args.strategy = args.strategy or ("draft-model" if args.model else "ngram")
for dest, default in DRAFT_MODEL_DEFAULTS.items():
    if getattr(args, dest) is None:
        setattr(args, dest, default)
    elif args.strategy == "ngram":  # it served n-gram drafts, the setting silently unused (review of stop 60)
        parser.error(f"--{dest.replace('_', '-')}: sets how a draft model drafts, and strategy ngram has no model "
                     "(it drafts by prompt lookup); drop the flag, or pass --model to draft with a model")
try:
    config = DrafterConfig(strategy=args.strategy, model=args.model, host=args.host, port=args.port, dtype=args.dtype,
                           device=args.device, max_sessions=args.max_sessions, proposal_top_k=args.proposal_top_k,
                           prompt_lookup=args.prompt_lookup, draft_confidence=args.draft_confidence,
                           quantize=args.quantize)
except InvalidRequest as err:
    refuse_setting(parser, err)
run_until_terminated(lambda: serve(config), "drafter_service", parser)
