"""Command line for the benchmark: ``python -m benchmarks ...`` (later ``mirrorspec bench``).

Every flag is validated by argparse before any model is loaded, so a typo costs nothing and the
error names the flag (``argument --k: K must be >= 1, got 0``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mirrorspec.config import (DEFAULT_DRAFT_QUANTIZE, DTYPE_HELP, DTYPE_NAMES, QUANTIZATIONS, InvalidRequest,
                               check_shared_vocabulary)
from mirrorspec.models.loading import (LoadedModel, device_flag, load_causal_lm, quiet_transformers, same_tokenizer,
                                       try_load_tokenizer)
from mirrorspec.models.prepack import is_prepacked, prepack_linears
from mirrorspec.models.quantize import apply_quantization

from benchmarks.flags import (TRUNCATE_PREFIX, add_run_flags, csv_of, draft_spec, one_of, positive,
                              sampling_temperature, seed_flag, torch_threads, window_k)
from benchmarks.harness import MODES, BenchPlan, Drafts, RunRecord, identity_failures, run_benchmark, select_modes
from benchmarks.metrics import summarize
from benchmarks.prompts import DATASETS, fewer_prompts_than_asked, load_prompts
from benchmarks.served import ServedStacks
from benchmarks.report import (LEGEND, cpu_sample, environment, format_table, others_busy_fraction, plot,
                               write_json)



def args_config(args: argparse.Namespace) -> dict:
    """A run's flags as its JSON records them (paths as strings)."""
    return {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}


def first_paragraph(text: str) -> str:
    """A docstring's first paragraph on one line (a first line alone can stop mid-sentence)."""
    return " ".join(text.split("\n\n")[0].split()).rstrip(".")


def build_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark mirrorspec's decoding modes side by side on real prompt sets.",
        epilog="Modes: " + "; ".join(f"{m.name}: {first_paragraph(m.description)}" for m in MODES.values()),
    )
    p.add_argument("--datasets", type=csv_of(one_of(list(DATASETS), "dataset")), default=list(DATASETS),
                   help=f"comma-separated, from {','.join(DATASETS)} (default: all)")
    p.add_argument("--num-prompts", type=positive, default=4, help="first N prompts of each dataset (default 4)")
    p.add_argument("--max-tokens", type=positive, default=64, help="max new tokens per prompt (default 64)")
    p.add_argument("--k", type=csv_of(window_k), default=[2, 4], help="draft tokens per window, comma-separated (default 2,4)")
    p.add_argument("--temperatures", type=csv_of(sampling_temperature), default=[0.0, 0.7],
                   help="comma-separated; 0 = greedy (default 0,0.7)")
    p.add_argument("--modes", type=csv_of(one_of(list(MODES), "mode")), default=list(MODES),
                   help="comma-separated (default: all); target-only always runs as the baseline")
    p.add_argument("--draft", type=draft_spec, default="demo-draft",
                   help="'demo-draft' (default: the draft mirrorspec distils from the demo target), 'none' "
                        "(draft-model modes are skipped), a model path / hub id sharing the target's tokenizer, "
                        "or 'truncate:N' = the target cut to its first N layers (a smoke/debug draft: it runs "
                        "the draft-model paths but accepts little)")
    p.add_argument("--draft-quantize", type=csv_of(one_of(QUANTIZATIONS, "quantization")),
                   default=[DEFAULT_DRAFT_QUANTIZE],
                   help=f"how the draft model's weights are loaded (default {DEFAULT_DRAFT_QUANTIZE}, as mirrorspec "
                        "runs it); more values, e.g. int8,none, also run each in-process draft-model mode on the "
                        "draft loaded the other way, as MODE@none, side by side")
    add_run_flags(p, threads_default=len(os.sched_getaffinity(0)),
                  threads_help="torch intra-op threads (default: all usable cores)")
    p.add_argument("--device", default="auto", type=device_flag, help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help=DTYPE_HELP)
    p.add_argument("--seed", type=seed_flag, default=0, help="base seed; prompt i uses seed + i in every mode")
    p.add_argument("--reprint", type=Path, metavar="JSON",
                   help="print the table of an earlier run's JSON (recomputed from its records) and exit")
    return p


# ------------------------------------------------------------------------------ model loading

def load_draft(spec: str, target: LoadedModel, quantizations: Sequence[str] = (DEFAULT_DRAFT_QUANTIZE,)) -> Drafts:
    """The draft model named by ``--draft``, loaded once per ``--draft-quantize`` value (the first
    is the main draft); raises InvalidRequest(field="draft") on a bad one."""
    if spec == "none":
        return Drafts()
    first, *others = quantizations
    models = {q: _load_draft_model(spec, target, q) for q in quantizations}
    return Drafts(model=models[first], name=spec, server_source=None if spec.startswith(TRUNCATE_PREFIX) else spec,
                  services=ServedStacks(draft_quantize=first), others={q: models[q] for q in others})


def _load_draft_model(spec: str, target: LoadedModel, quantize: str) -> torch.nn.Module:
    if spec.startswith(TRUNCATE_PREFIX):
        model = truncated_target(target, int(spec.removeprefix(TRUNCATE_PREFIX)))
        apply_quantization(model, quantize)
    else:
        model = load_causal_lm(spec, dtype=target.dtype_name,
                               device=str(target.model.device), tokenizer=False, quantize=quantize).model
    check_shared_vocabulary(model.config.vocab_size, target.model.config.vocab_size, same_tokenizer=lambda: same_tokenizer(
        try_load_tokenizer(spec), target.tokenizer, model.config.vocab_size))
    return model


def truncated_target(target: LoadedModel, layers: int) -> torch.nn.Module:
    """The target's first ``layers`` decoder layers plus its embeddings, norm and head.

    A draft that needs no training and shares the tokenizer by construction: good for
    exercising the draft-model code paths end to end, useless for speed (it predicts poorly).
    """
    from transformers import AutoModelForCausalLM

    total = int(target.model.config.num_hidden_layers)
    if not 1 <= layers < total:
        raise InvalidRequest(f"truncate:N needs 1 <= N < {total} (the target's layer count), got {layers}",
                             field="draft")
    model = AutoModelForCausalLM.from_pretrained(target.source, num_hidden_layers=layers, dtype=target.model.dtype)
    model = model.to(target.model.device).eval()
    if is_prepacked(target.model):  # the same kernels as the target it is compared with
        prepack_linears(model)
    return model


# ------------------------------------------------------------------------------ main

BUSY_FRACTION = 0.2


def contention_note(busy: float | None, when: str, device: str) -> list[str]:
    """A warning when other processes used the CPU: on a small machine one busy core can stall
    every multi-threaded matmul and swing tokens/s by 10x, which no ratio fully corrects."""
    if busy is None or busy < BUSY_FRACTION or not device.startswith("cpu"):
        return []
    return [f"other processes used {busy:.0%} of the CPUs {when}: timings are noisy "
            f"(compare ratios within this run only; on a shared machine try --threads 1)"]


def shared_process_note(modes: Sequence[str], threads: int, device: str, drafts: Drafts) -> list[str]:
    """A warning when a served mode's servers must run as threads of this process (a draft no
    server process can load) beside multi-threaded in-process modes: the servers' compute
    threads then keep OpenMP pools beside the main thread's, the process's OpenMP threads
    outnumber the cores, and libgomp stops spinning between parallel regions, so every mode after
    the first served call runs slower (the demo target by ~35% on 2 cores)."""
    shared = "served-draft" in modes and drafts.model is not None and drafts.server_source is None
    if threads < 2 or not device.startswith("cpu") or not shared:
        return []
    return [f"served-draft serves {drafts.name} from threads of this process, beside {threads}-thread in-process "
            "modes, so every mode after its first call is slowed (OpenMP pools oversubscribe the cores); "
            "compare it with in-process modes at --threads 1"]


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.reprint is not None:
        return reprint(args.reprint, parser)
    try:
        with torch_threads(args.threads):
            return _run(args, parser)
    except KeyboardInterrupt:  # records are written once the run is done
        print("interrupted: nothing written", file=sys.stderr)
        return 130


def reprint(path: Path, parser: argparse.ArgumentParser) -> int:
    """Re-derive the table from stored records, so old runs gain columns added since."""
    try:
        payload = json.loads(path.read_text())
        records = [RunRecord(**r) for r in payload["records"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        parser.error(f"--reprint: cannot read records from {path}: {type(err).__name__} {err} (it takes the JSON a "
                     f"`mirrorspec bench` run wrote, not a `bench mirror` or `bench acceptance` one)")
    config = payload.get("config", {})
    print(f"# {path.name}: target={config.get('target')} draft={config.get('draft')} "
          f"threads={payload.get('environment', {}).get('torch_threads')}")
    print(format_table(summarize(records)))
    print(f"\n{LEGEND}")
    for note in payload.get("notes", []):
        print(f"note: {note}")
    return 0


def _load(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[LoadedModel, Drafts]:
    quiet_transformers()
    try:
        target = load_causal_lm(args.target, dtype=args.dtype, device=args.device)
    except (InvalidRequest, OSError) as err:
        parser.error(f"--target: {err}")
    if target.tokenizer is None:
        parser.error("--target: the target has no tokenizer; prompts cannot be encoded")
    try:
        return target, load_draft(args.draft, target, args.draft_quantize)
    except (InvalidRequest, OSError) as err:
        parser.error(f"--draft: {err}")


def _check_room(args: argparse.Namespace, parser: argparse.ArgumentParser, target: LoadedModel,
                prompts: dict) -> None:
    """Before the warm-up and the first mode: every prompt plus --max-tokens must fit the context
    window (it was an OutOfRange traceback at the first prompt)."""
    from mirrorspec.models.loading import encode_prompt

    longest = max(len(encode_prompt(target.tokenizer, p.text)) for ps in prompts.values() for p in ps)
    if longest + args.max_tokens > target.max_context:
        parser.error(f"argument --max-tokens: the longest prompt ({longest} tokens) + {args.max_tokens} exceeds the "
                     f"target's context window of {target.max_context}; lower it to at most "
                     f"{target.max_context - longest}")


def _timed_run(plan: BenchPlan, env: dict) -> tuple[list[RunRecord], float]:
    """The benchmark proper, recording how much CPU other processes took meanwhile."""
    started, cpu_before = time.perf_counter(), cpu_sample()
    records = run_benchmark(plan)
    elapsed = time.perf_counter() - started
    plan.drafts.services.close()  # reap the served modes' server processes, so their CPU counts as ours
    env["others_cpu_busy_during_run"] = others_busy_fraction(cpu_before, cpu_sample())
    env["load_average_end"] = os.getloadavg()
    return records, elapsed


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.seed + args.num_prompts - 1 >= 1 << 64:
        parser.error(f"argument --seed: prompt i runs with seed + i, and {args.seed} + {args.num_prompts - 1} "
                     f"passes 2**64")
    prompts = {name: load_prompts(name, args.num_prompts) for name in args.datasets}
    target, drafts = _load(args, parser)
    _check_room(args, parser, target, prompts)
    modes, notes = select_modes(args.modes, drafts, int(target.model.config.vocab_size))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    notes += [fewer_prompts_than_asked(name, len(ps), args.num_prompts)  # load_prompts said it on stderr
              for name, ps in prompts.items() if len(ps) < args.num_prompts]
    plan = BenchPlan(target=target, drafts=drafts, prompts=prompts, modes=modes, ks=args.k,
                     temperatures=args.temperatures, max_new_tokens=args.max_tokens, seed=args.seed,
                     progress=not args.no_progress)
    env = environment(target.model.device, target.model.dtype)
    notes += contention_note(env["others_cpu_busy_before_run"], "just before the run", env["device"])
    notes += shared_process_note([m.name for m in modes], args.threads, env["device"], drafts)
    try:
        records, elapsed = _timed_run(plan, env)
    finally:
        drafts.services.close()  # the served modes' loopback servers, if any were started
    notes += contention_note(env["others_cpu_busy_during_run"], "during the run", env["device"])
    broken = identity_failures(records)
    notes += [f"NOT EXACT: {line}" for line in broken]
    rounding = target.model.dtype in (torch.bfloat16, torch.float16)  # a near-tie may go the other way
    if broken and rounding:
        notes.append(f"the target runs in {env['dtype']}: a pass over a window rounds otherwise than a one-token "
                     f"step, and at a near-tie greedy picks may differ from target-only's; rerun in float32 to tell "
                     f"that from a bug")
    summaries = summarize(records)

    config = args_config(args)
    config.update(target_source=target.source, modes_run=[m.name for m in modes], elapsed_s=elapsed,
                  prompts_run={name: len(ps) for name, ps in prompts.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / time.strftime("bench-%Y%m%d-%H%M%S")
    write_json(stem.with_suffix(".json"), env, config, notes, summaries, records)
    title = (f"target={args.target} draft={args.draft} threads={env['torch_threads']} device={env['device']} "
             f"max_tokens={args.max_tokens} prompts/dataset={max(len(ps) for ps in prompts.values())}")
    plot(stem.with_suffix(".png"), summaries, title)

    print(f"# {title}  ({elapsed:.0f} s)")
    print(format_table(summaries))
    print(f"\n{LEGEND}")
    for note in notes:
        print(f"note: {note}")
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    if broken and not rounding:  # a speed figure beside these is no figure: the run fails
        print(f"{len(broken)} runs were not token-identical where they must be (the NOT EXACT notes above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
