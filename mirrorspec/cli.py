"""The ``mirrorspec`` command line: the face of the project.

Bad values are reported as ``mirrorspec <command>: error: --flag: what is wrong and how to fix
it`` with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from mirrorspec.config import InvalidRequest, SamplingParams, SpeculationConfig

# Which flag carries which validated field, so errors from deep inside name what the user typed.
FLAG_FOR_FIELD = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "max_new_tokens": "--max-tokens",
    "num_speculative_tokens": "--k",
    "proposal_top_k": "--proposal-top-k",
    "prompt": "PROMPT",
    "input_ids": "PROMPT",
    "model": "--target",
    "target": "--target",
    "draft": "--draft",
    "dtype": "--dtype",
    "ngram": "--draft",
    "threads": "--threads",
    "local": "--local",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirrorspec", description="Exact, disaggregated speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt", help="the user message (chat template applied for instruct models)")
    gen.add_argument("--local", action="store_true", help="run the in-process engine instead of calling a server")
    gen.add_argument("--target", default="demo-target", help="target model: hub id, path, .gguf, or demo-target")
    gen.add_argument("--draft", default="ngram",
                     help="draft: 'ngram' (prompt lookup), a model path / hub id, or 'none'")
    gen.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--k", type=int, default=4, help="speculative tokens per window")
    gen.add_argument("--proposal-top-k", type=int, default=0, help="draft-model q restricted to its top-k (0 = dense)")
    gen.add_argument("--no-speculate", action="store_true", help="target-only decoding (the baseline)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print text, token ids and statistics as JSON")
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    gen.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    gen.set_defaults(handler=cmd_generate, subparser=gen)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except InvalidRequest as err:
        flag = FLAG_FOR_FIELD.get(err.field or "")
        args.subparser.error(f"{flag}: {err}" if flag else str(err))
    except KeyboardInterrupt:
        return 130


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _check_generate_flags(args: argparse.Namespace) -> None:
    if args.threads is not None and args.threads < 1:
        raise InvalidRequest(f"must be >= 1, got {args.threads}", field="threads")
    if not args.local:
        raise InvalidRequest(
            "no server to talk to yet: pass --local to run the in-process engine "
            "(the gRPC front door arrives with `mirrorspec serve`)", field="local")


def cmd_generate(args: argparse.Namespace) -> int:
    # validate every flag before the (slow) model load
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_tokens)
    SpeculationConfig(num_speculative_tokens=args.k, proposal_top_k=args.proposal_top_k)
    _check_generate_flags(args)
    import torch

    from mirrorspec.engine import generate
    from mirrorspec.models import encode_prompt, load_causal_lm

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    _quiet_transformers()
    target = load_causal_lm(args.target, dtype=args.dtype, device=args.device)
    draft = None if args.no_speculate or args.draft == "none" else _load_draft(args)
    ids = encode_prompt(target.tokenizer, args.prompt, chat=not args.raw)
    params = dataclasses.replace(params, stop_token_ids=target.stop_token_ids())
    printer = None if args.json else _StreamPrinter(target.tokenizer)
    result = generate(target.model, draft, ids, params, num_speculative_tokens=0 if draft is None else args.k,
                      seed=args.seed, proposal_top_k=args.proposal_top_k,
                      on_tokens=printer.push if printer else None)
    text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
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
              f"acceptance {s.acceptance_rate:.2f}, {s.mean_accepted_length:.2f} tokens/pass, seed {result.seed}]",
              file=sys.stderr)
    return 0


def _load_draft(args: argparse.Namespace):
    if args.draft == "ngram":
        return "ngram"
    from mirrorspec.models import load_causal_lm

    return load_causal_lm(args.draft, dtype=args.dtype, device=args.device, tokenizer=False).model


class _StreamPrinter:
    """Prints text as tokens are committed; decoding the whole output each time keeps multi-byte
    characters that span tokens intact."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.printed = ""

    def push(self, tokens: list[int]) -> None:
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text

    def finish(self) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
