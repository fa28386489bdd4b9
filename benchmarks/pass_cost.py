"""What a target pass over K drafts costs, in one-token steps: the table adaptive K plans with.

    python -m benchmarks.pass_cost [--target demo-target] [--threads 2] [--max-k 8] [--reps 30] [--context-tokens N]
                                   [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|float16]
                                   [--busy-neighbor] [--sync-debug]

For each K it times the very call verification makes (``KVSession.logits_for`` over the last
K + 1 positions of a cached context, then the roll-back), interleaving K values so a slow stretch
of a shared machine hits them all alike, and prints medians over a one-token step plus the tuple
to put in ``AdaptiveKConfig.pass_costs``. On CPU it measures the model twice in one run, as
``from_pretrained`` leaves it (``nn.Linear``) and with its linears prepacked for oneDNN (what
``load_causal_lm`` serves with, see ``mirrorspec.models.prepack``), and prints their ratio. The
prepacked model is timed twice, pass by pass: on ``mirrorspec_sdpa`` (what ``load_causal_lm``
runs CPU models on, see ``mirrorspec.models.attention``) and on transformers' own ``sdpa``, with
their ratio and a check that both give the same logits.
Unpacked, the table is far from linear: kernels change with the shape, so a 2-token pass can
cost as much as a 5-token one. On CUDA each timed call ends with a device synchronisation (kernels
run asynchronously, so the clock would otherwise stop at the last launch, not the last result).

Two leads on the H200 (stop 57), where a bf16 pass of the demo target cost 55 ms in process and
28 ms in a served mirror run while the drafter drafted on the CPU beside it: ``--busy-neighbor``
times the passes again beside a process that keeps one other core busy, and ``--sync-debug``
counts the operations in one pass that make the host wait for the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.flags import output_dir, thread_count
from mirrorspec.config import DTYPE_HELP, InvalidRequest, field_named, refuse_setting
from mirrorspec.models import KVSession, encode_prompt, load_causal_lm
from mirrorspec.models.attention import IMPLEMENTATION as ATTENTION
from mirrorspec.models.loading import device_flag
from mirrorspec.models.prepack import prepack_linears


def filler_drafts(context: list[int], max_k: int) -> list[int]:
    """K draft tokens to time passes with (taken from the context: any real tokens cost the same)."""
    return [context[i % len(context)] for i in range(max_k)]


def measure(model: torch.nn.Module, context: list[int], max_k: int, reps: int,
            vocab_ids: torch.Tensor | None = None) -> dict[int, float]:
    """Median seconds of a pass over k + 1 tokens, for k = 0..max_k (``vocab_ids``: a draft's
    sub-vocabulary head, as it drafts)."""
    return measure_implementations(model, context, max_k, reps, (None,), vocab_ids)[0][None]


def measure_implementations(model: torch.nn.Module, context: list[int], max_k: int, reps: int,
                            implementations: tuple[str | None, ...], vocab_ids: torch.Tensor | None = None
                            ) -> tuple[dict[str | None, dict[int, float]], bool]:
    """``measure`` on each attention implementation (None: the model's own), interleaved pass by
    pass so that a slow stretch of a shared machine hits them all alike; and whether every
    implementation gave the same logits, bit for bit, on the same pass."""
    session = KVSession(model, vocab_ids)
    session.logits_for(context, 1)  # prefill once
    times = {name: {k: [] for k in range(max_k + 1)} for name in implementations}
    same = True
    drafts = filler_drafts(context, max_k)
    sync = torch.cuda.synchronize if session.device.type == "cuda" else (lambda: None)
    for _ in range(reps):
        for k in range(max_k + 1):
            first = None
            for name in implementations:
                if name is not None:
                    model.set_attn_implementation(name)
                sync()
                started = time.perf_counter()
                logits = session.logits_for(context + drafts[:k], k + 1)
                sync()
                times[name][k].append(time.perf_counter() - started)
                session.rollback(len(context) - 1)  # the next call re-feeds the last context token too
                first = logits if first is None else first
                same = same and torch.equal(logits, first)
    medians = {name: {k: statistics.median(v) for k, v in by_k.items()} for name, by_k in times.items()}
    return medians, same


@contextmanager
def busy_neighbor():
    """A process that spins on one core for as long as the block runs, from the moment it spins
    (its interpreter's start is not the busy neighbour being measured)."""
    spinner = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                               stdout=subprocess.PIPE, text=True)
    try:
        spinner.stdout.readline()
        yield
    finally:
        spinner.kill()
        spinner.wait()
        spinner.stdout.close()


def count_syncs(model: torch.nn.Module, context: list[int], max_k: int) -> dict[int, int]:
    """The operations in a pass over k + 1 tokens, for k = 0..max_k, that make the host wait for
    a CUDA device (``torch.cuda.set_sync_debug_mode``): each costs a round trip, and a launch-bound
    pass with many of them pays for the host's wake-ups too."""
    session = KVSession(model)
    session.logits_for(context, 1)
    drafts = filler_drafts(context, max_k)
    counts = {}
    for k in range(max_k + 1):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                session.logits_for(context + drafts[:k], k + 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts[k] = sum("synchroniz" in str(w.message) for w in caught)
        session.rollback(len(context) - 1)
    return counts


def table(medians: dict[int, float]) -> tuple[float, ...]:
    return tuple(round(medians[k] / medians[0], 2) for k in sorted(medians) if k > 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pass_cost", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="demo-target")
    p.add_argument("--threads", type=thread_count, default=2)
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--context-tokens", type=int, default=0,
                   help="cached context before each pass: the prompt repeated to this many tokens (default: "
                        "the prompt alone); attention's share of a pass grows with it")
    p.add_argument("--device", default="auto", type=device_flag, help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--busy-neighbor", action="store_true",
                   help="time the passes again beside a process that keeps one other core busy")
    p.add_argument("--sync-debug", action="store_true",
                   help="on CUDA, count the operations in each pass that make the host wait for the device")
    p.add_argument("--out", type=output_dir, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        with field_named("target"):
            target = load_causal_lm(args.target, prepack=False, device=args.device, dtype=args.dtype)
    except InvalidRequest as err:
        refuse_setting(p, err)
    if args.sync_debug and target.model.device.type != "cuda":
        p.error(f"--sync-debug: counts waits for a CUDA device, and the target is on {target.model.device}; "
                "add --device cuda, or leave --sync-debug out")
    context = encode_prompt(target.tokenizer, "Write a Python function that merges two sorted lists.")
    context = (context * (args.context_tokens // len(context) + 1))[:max(args.context_tokens, len(context))]
    runs = {"plain": measure(target.model, context, args.max_k, args.reps)}
    if args.busy_neighbor:
        with busy_neighbor():
            runs["plain, a core busy beside it"] = measure(target.model, context, args.max_k, args.reps)
    syncs = count_syncs(target.model, context, args.max_k) if args.sync_debug else None
    if prepack_linears(target.model):
        if target.model.config._attn_implementation == ATTENTION:  # and on transformers' own sdpa, side by side
            both, same = measure_implementations(target.model, context, args.max_k, args.reps, (ATTENTION, "sdpa"))
            runs["prepacked"], runs["transformers sdpa"] = both[ATTENTION], both["sdpa"]
            print(f"{ATTENTION} logits bit-identical to sdpa's on every timed pass: {same}")
        else:
            runs["prepacked"] = measure(target.model, context, args.max_k, args.reps)
    for k in range(args.max_k + 1):
        cells = [f"{name} {m[k] * 1e3:6.1f} ms {m[k] / m[0]:4.2f} steps" for name, m in runs.items()]
        ratio = f"  plain/prepacked {runs['plain'][k] / runs['prepacked'][k]:.2f}x" if "prepacked" in runs else ""
        if "transformers sdpa" in runs:
            ratio += f"  sdpa/{ATTENTION} {runs['transformers sdpa'][k] / runs['prepacked'][k]:.2f}x"
        print(f"K={k}: " + "   ".join(cells) + ratio + (f"  {syncs[k]} host waits" if syncs else ""))
    tables = {name: table(m) for name, m in runs.items()}
    for name, t in tables.items():
        print(f"{name}: AdaptiveKConfig(pass_costs={t})")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"pass-cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"target": args.target, "threads": args.threads, "context_tokens": len(context),
                               "device": str(target.model.device),
                               "dtype": str(target.model.dtype), "host_waits_per_pass": syncs,
                               "runs": {name: {"step_s": m[0], "median_s": m, "pass_costs": tables[name]}
                                        for name, m in runs.items()}}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
