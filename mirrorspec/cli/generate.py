"""`mirrorspec generate`: one prompt, in this process (``--local``) or sent to a front door."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from mirrorspec.cli.flags import (
    DRAFT_MODEL_SETTINGS,
    is_draft_model,
    is_set,
    refuse_draft_model_settings,
    refuse_draft_model_settings_without_a_model,
    refuse_speculation_settings,
    resolve_draft,
)
from mirrorspec.config import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_K,
    DEFAULT_PROMPT_LOOKUP,
    DEFAULT_PROPOSAL_TOP_K,
    DEFAULT_DRAFT_QUANTIZE,
    InvalidRequest,
    SamplingParams,
    SpeculationConfig,
    check_seed,
    default_k,
    field_named,
)
from mirrorspec.serving.placement import check_threads


GENERATE_MAX_TOKENS = 128  # generate --local's default; a server's default is its own


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


def cmd_generate(args: argparse.Namespace) -> int:
    # validate every flag before the (slow) model load
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=GENERATE_MAX_TOKENS if args.max_tokens is None else args.max_tokens)
    check_seed(args.seed)
    if not args.local:
        for dest, field, owner in SERVER_SETTINGS:
            if is_set(args, dest):
                raise InvalidRequest(f"is {owner}; here it needs --local", field=field)
    if args.no_speculate or args.draft == "none":  # target-only: a speculation setting would be ignored
        refuse_speculation_settings(args, "--no-speculate" if args.no_speculate else "--draft none",
                                    also=DRAFT_MODEL_SETTINGS)
        if args.no_speculate and args.draft != "none" and is_set(args, "draft"):
            raise InvalidRequest("names a draft, and --no-speculate decodes without one: drop one of the two",
                                 field="draft")
    if args.k == 0 and args.adaptive:
        raise InvalidRequest("chooses K per window in [0, --k], and --k 0 leaves it nothing to choose (it is "
                             "target-only); give --k the largest K to try", field="adaptive")
    if args.k == 0 and args.mirror:  # it ran, target-only, and said nothing (user review of stop 55)
        raise InvalidRequest("drafts the next window while the target verifies this one, and --k 0 drafts none (it "
                             "is target-only); give --k > 0, or drop --mirror", field="mirror")
    if args.k == 0:  # the draft loaded, and these ignored (a review)
        refuse_draft_model_settings(args, "--k 0 drafts nothing (it is target-only)")
    if args.local:
        refuse_draft_model_settings_without_a_model(args, resolve_draft(args.draft, args.target))
    args.draft_quantize = args.draft_quantize or DEFAULT_DRAFT_QUANTIZE
    args.proposal_top_k = DEFAULT_PROPOSAL_TOP_K if args.proposal_top_k is None else args.proposal_top_k
    args.prompt_lookup = DEFAULT_PROMPT_LOOKUP if args.prompt_lookup is None else args.prompt_lookup
    args.draft_confidence = DEFAULT_DRAFT_CONFIDENCE if args.draft_confidence is None else args.draft_confidence
    if args.local and args.k is None:
        args.k = default_k(is_draft_model(resolve_draft(args.draft, args.target)), args.draft_confidence)
    SpeculationConfig(num_speculative_tokens=DEFAULT_K if args.k is None else args.k,
                      proposal_top_k=args.proposal_top_k, prompt_lookup=args.prompt_lookup,
                      draft_confidence=args.draft_confidence)
    check_threads(args.threads)
    if args.local and is_set(args, "server"):
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
    from mirrorspec.models.loading import quiet_transformers

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    quiet_transformers()
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
                      mirror=args.mirror, hint_layer=args.hint_layer, hint_lens=hint_lens(target, args.hint_layer),
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
    won = f", runner-up won {stats.runner_up_hits} window{'s' * (stats.runner_up_hits != 1)}" \
        if stats.runner_up_hits else ""
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


def hint_lens(target, hint_layer: int | None):
    """The tuned lens in-process hints read through (fitted once per target and layer, cached)."""
    if hint_layer is None:
        return None
    from mirrorspec.models.lens import LensRecipe, tuned_lens

    return tuned_lens(target, LensRecipe(layer=hint_layer), log=lambda line: print(line, file=sys.stderr))


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
