"""Mirror against serial speculative decoding over gRPC, with the drafter and the target in
their own processes, one torch thread each (each side has its own core on a 2-core machine).

    mirrorspec bench mirror [--datasets humaneval,mtbench] [--num-prompts 3] [--max-tokens 64]
                                [--k 4] [--hint-layer 27 [--hint-vocab draft|full]]
                                [--max-branches 4] [--alternatives 7]
                                [--target demo-target --draft demo-draft] [--dtype auto]
                                [--out benchmarks/results]

Modes, all greedy, through front doors in this process, interleaved prompt by prompt after one
untimed warm-up each: ``target-only`` (K=0), ``serial`` (K drafts, then verify), ``mirror``
(branches drafted during the verify) and, with ``--hint-layer``, ``mirror+hints`` (the target
streams early-exit hints and the branches follow them; scored over the draft's sub-vocabulary
unless ``--hint-vocab full``). With ``--on-target``, ``serial-on-target`` and ``mirror-on-target``
run the windows on the target, which calls the drafter itself (``serve --windows-on-target``):
one round trip per window, and a hit window none; their ``x serial`` is against
``serial-on-target``. Windows offer the draft's runner-up as ``mirrorspec serve`` does
(``--no-runner-up``: chains only; hinted windows verify the chain alone). Greedy output must be
identical in every mode; the run checks it.

Bounds from the measured figures (per dataset): with m tokens per target pass, t1 the
target-only time per token, tv the verify time per window and td the draft time per drafted
token (both measured in the serial mode), serial can reach m t1 / (tv + K td) and mirror, with h
the share of all windows whose draft was ready, m t1 / (tv + (1 - h) K td): a hit takes the
drafting off the critical path.

Writes ``mirror-<time>.json`` and ``mirror-<time>-timeline.png`` (the first prompt's windows in
serial and mirror mode: drafting on and off the critical path, verifies, and the gaps where one
side waits). Run it inside a loopback-only network namespace on shared machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.data_plane import start_processes
from benchmarks.flags import integer_at_least, output_dir, positive, thread_count, window_k
from benchmarks.prompts import checked_datasets, load_prompts
from benchmarks.report import cpu_busy_before_run
from mirrorspec.client import Client
from mirrorspec.config import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_DRAFT_QUANTIZE,
    DEFAULT_PROMPT_LOOKUP,
    DEFAULT_PROPOSAL_TOP_K,
    DTYPE_HELP,
    DTYPE_NAMES,
    QUANTIZATIONS,
    InvalidRequest,
    MirrorConfig,
    check_draft_confidence,
    check_prompt_lookup,
    refuse_setting,
)
from mirrorspec.models.loading import check_models, device_flag, read_config
from mirrorspec.serving.server import BackgroundServer
from orchestrator.servicer import OrchestratorConfig, serve

MODES = ("target-only", "serial", "mirror", "mirror+hints")
ON_TARGET_MODES = ("serial-on-target", "mirror-on-target")  # --on-target: the windows run by the target


@dataclass
class ModeTotals:
    """One mode on one dataset, summed over its prompts."""

    tokens: int = 0
    wall_s: float = 0.0
    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    verify_s: float = 0.0
    draft_s: float = 0.0  # on the critical path
    draft_off_path_s: float = 0.0
    network_s: float = 0.0  # call time beyond the servers' compute, both services
    mirror_windows: int = 0
    branch_hits: int = 0
    runner_up_hits: int = 0
    windows_on_target: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, token_ids: list[int], wall_s: float, stats) -> None:
        self.tokens += len(token_ids)
        self.wall_s += wall_s
        self.windows += stats.windows
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.rejected += stats.rejected
        self.verify_s += stats.verify_time_s
        self.draft_s += stats.draft_time_s
        self.draft_off_path_s += stats.draft_time_off_path_s
        self.network_s += stats.network_time_s
        self.mirror_windows += stats.mirror_windows
        self.branch_hits += stats.branch_hits
        self.runner_up_hits += stats.runner_up_hits
        self.windows_on_target += stats.windows_on_target
        self.outputs.append(list(token_ids))

    def summary(self) -> dict:
        ratio = lambda a, b: a / b if b else 0.0  # noqa: E731
        return {
            "tokens": self.tokens, "wall_s": self.wall_s, "tokens_per_s": ratio(self.tokens, self.wall_s),
            "alpha": ratio(self.accepted, self.accepted + self.rejected),
            "tokens_per_pass": ratio(self.tokens, self.windows),
            "branch_hit_rate": ratio(self.branch_hits, self.mirror_windows),
            "branched_share": ratio(self.mirror_windows, self.windows),  # windows that drafted branches
            "runner_up_share": ratio(self.runner_up_hits, self.windows),  # windows the runner-up won
            "on_target_share": ratio(self.windows_on_target, self.windows),  # windows the target ran
            "verify_s_per_window": ratio(self.verify_s, self.windows),
            # what the calls cost beyond compute: tells a slow verify's transport from its pass
            "network_s_per_window": ratio(self.network_s, self.windows),
            "draft_s_per_token": ratio(self.draft_s + self.draft_off_path_s, self.drafted),
            "draft_on_path_s": self.draft_s, "draft_off_path_s": self.draft_off_path_s,
        }


def bounds(base: dict, serial: dict, hit_rate: float, k: int) -> dict:
    """The speedups the measured figures allow (see the module docstring)."""
    t1 = base["wall_s"] / base["tokens"]
    m, tv, td = serial["tokens_per_pass"], serial["verify_s_per_window"], serial["draft_s_per_token"]
    return {"serial": m * t1 / (tv + k * td), "mirror": m * t1 / (tv + (1 - hit_rate) * k * td),
            "mirror_all_hits": m * t1 / tv}


def front_door(target: str, drafter: str, mirror: MirrorConfig, k: int, runner_up: bool,
               windows_on_target: bool = False) -> BackgroundServer:
    config = OrchestratorConfig(target=target, drafter=drafter, port=0, num_speculative_tokens=k, mirror=mirror,
                                default_max_new_tokens=64, runner_up=runner_up, windows_on_target=windows_on_target)
    return BackgroundServer(lambda: serve(config), "orchestrator").start(timeout=300)


def plot_timeline(path: Path, timelines: dict[str, list], title: str, window_s: float = 2.0) -> None:
    """Two lanes per mode (drafter, target) over the first ``window_s`` seconds of one request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"draft": "C3", "branches": "C2", "verify": "C0"}
    labels = {"draft": "drafting on the critical path", "branches": "branch drafting (off the path)",
              "verify": "verify"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.6 * len(timelines) + 0.8), squeeze=False,
                             sharex=True)
    for ax, (mode, spans) in zip(axes[:, 0], timelines.items()):
        t0 = min((s.start_s for s in spans), default=0.0)
        for span in spans:
            if span.start_s - t0 > window_s:
                continue
            lane = 1 if span.what == "verify" else 0
            ax.broken_barh([(span.start_s - t0, span.end_s - span.start_s)], (lane - 0.35, 0.7),
                           color=colors[span.what], label=labels[span.what])
        ax.set_yticks([0, 1], ["drafter", "target"])
        ax.set_title(mode, loc="left", fontsize=10)
        handles = {h.get_label(): h for h in ax.get_legend_handles_labels()[0]}
        ax.legend(handles.values(), handles.keys(), loc="upper right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("seconds since the first span (white: that side waits)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mirrorspec bench mirror", description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="humaneval,mtbench",
                        help="comma-separated, from mtbench,humaneval,code-edit (default: humaneval,mtbench)")
    parser.add_argument("--num-prompts", type=int, default=3, help="first N prompts of each dataset (default 3)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max new tokens per prompt (default 64)")
    parser.add_argument("--k", type=window_k, default=4, help="draft tokens per window (default 4)")
    parser.add_argument("--hint-layer", type=positive, default=None, help="also run mirror+hints, hints off this layer")
    parser.add_argument("--hint-vocab", choices=("draft", "full"), default="draft",
                        help="score hints over the draft's sub-vocabulary (cheap) or the whole vocabulary")
    parser.add_argument("--target", default="demo-target", help="the target model (default demo-target)")
    parser.add_argument("--draft", default="demo-draft", help="the draft model (default demo-draft)")
    parser.add_argument("--proposal-top-k", type=integer_at_least(0), default=DEFAULT_PROPOSAL_TOP_K,
                        help=f"q rows the drafter sends: its top-k (0: dense; default {DEFAULT_PROPOSAL_TOP_K})")
    parser.add_argument("--prompt-lookup", type=int, default=DEFAULT_PROMPT_LOOKUP, metavar="N",
                        help="the drafter's prompt lookup before its draft model (0 = the model alone)")
    parser.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE, metavar="P",
                        help="the drafter's windows end after its first token below probability P (0 = always K)")
    parser.add_argument("--draft-quantize", choices=QUANTIZATIONS, default=DEFAULT_DRAFT_QUANTIZE,
                        help="how the drafter server loads its draft model (default %(default)s)")
    parser.add_argument("--max-branches", type=int, default=MirrorConfig.max_branches,
                        help="branches drafted per window at most (default %(default)s)")
    parser.add_argument("--alternatives", type=int, default=MirrorConfig.alternatives,
                        help="the drafter's runner-up tokens guessed per rejection point (default %(default)s)")
    parser.add_argument("--every-window", action="store_true",
                        help="mirror modes branch every window whatever the timings say (MirrorConfig."
                             "stop_at_verdict=False): how often branches hold the verdict, without the policy")
    parser.add_argument("--on-target", action="store_true",
                        help="also run serial and mirror with the windows run by the target (serve --windows-on-target), "
                             "its mirror against its own serial")
    parser.add_argument("--no-runner-up", action="store_true",
                        help="windows verify chains only (default: they offer the draft's runner-up too, as "
                             "`mirrorspec serve` does)")
    parser.add_argument("--target-device", default="auto", type=device_flag,
                        help="where the target server runs: auto (CUDA if present), cpu, cuda, cuda:1 ...")
    parser.add_argument("--drafter-device", default="auto", type=device_flag,
                        help="where the drafter server runs, e.g. cpu beside a target on cuda (its own compute)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                        help=f"both servers' dtype: {DTYPE_HELP}")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch threads per server process (default 1)")
    parser.add_argument("--no-pin", action="store_true",
                        help="let the scheduler place drafter and target (default: one core each, apart)")
    parser.add_argument("--out", type=output_dir, default=Path(__file__).resolve().parent / "results",
                        help="where the JSON and the timeline PNG go (default benchmarks/results)")
    args = parser.parse_args(argv)
    datasets = checked_datasets(parser, args, positive=("num_prompts", "max_tokens", "k", "threads"))
    try:
        check_prompt_lookup(args.prompt_lookup)
        check_draft_confidence(args.draft_confidence)
    except InvalidRequest as err:
        refuse_setting(parser, err)
    try:
        mirror = MirrorConfig(max_branches=args.max_branches, alternatives=args.alternatives,
                              stop_at_verdict=not args.every_window)
    except InvalidRequest as err:
        parser.error(f"--max-branches / --alternatives: {err}")
    try:
        check_models(args.target, args.draft)  # here, not as a server process's exit status
    except InvalidRequest as err:
        refuse_setting(parser, err)
    layers = read_config(args.target).num_hidden_layers
    if args.hint_layer is not None and args.hint_layer >= layers:  # the target server's own bound (lens.py)
        parser.error(f"--hint-layer: must be in [1, {layers - 1}] for this {layers}-layer target, got {args.hint_layer}")

    target_args = ("--device", args.target_device, "--dtype", args.dtype)
    if args.hint_layer:
        target_args += ("--hint-layer", str(args.hint_layer),
                        *(("--hint-vocab", args.draft) if args.hint_vocab == "draft" else ()))
    print(f"starting the target ({args.target_device}) and drafter ({args.drafter_device}) servers", file=sys.stderr,
          flush=True)
    target, drafter, stop = start_processes(args.target, args.draft, args.proposal_top_k, target_args,
                                            threads=args.threads, pin=not args.no_pin,
                                            prompt_lookup=args.prompt_lookup, draft_confidence=args.draft_confidence,
                                            quantize=args.draft_quantize,
                                            drafter_args=("--device", args.drafter_device, "--dtype", args.dtype))
    runner_up = not args.no_runner_up
    doors = {}
    try:  # a front door that fails to start leaves no server process behind
        doors["plain"] = front_door(target, drafter, replace(mirror, use_hints=False), args.k, runner_up)
        if args.hint_layer:
            doors["hinted"] = front_door(target, drafter, mirror, args.k, runner_up)
        if args.on_target:
            doors["on-target"] = front_door(target, drafter, replace(mirror, use_hints=False), args.k, runner_up,
                                            windows_on_target=True)
    except BaseException:
        for door in doors.values():
            door.stop()
        stop()
        raise
    modes = [m for m in MODES if m != "mirror+hints" or args.hint_layer] + list(ON_TARGET_MODES if args.on_target else ())
    request = {"target-only": ("plain", dict(k=0)), "serial": ("plain", dict(mirror=False)),
               "mirror": ("plain", dict(mirror=True)), "mirror+hints": ("hinted", dict(mirror=True)),
               "serial-on-target": ("on-target", dict(mirror=False)), "mirror-on-target": ("on-target", dict(mirror=True))}
    clients = {name: Client(f"127.0.0.1:{door.port}") for name, door in doors.items()}
    results, timelines = {}, {}
    busy = cpu_busy_before_run()  # during the run the servers are this benchmark's own processes
    try:
        for dataset in datasets:
            prompts = [p.text for p in load_prompts(dataset, args.num_prompts)]
            totals = {mode: ModeTotals() for mode in modes}
            print(f"{dataset}: warm-up", file=sys.stderr, flush=True)
            for mode in modes:  # warm-up: connections, allocators, the first KV caches
                door, options = request[mode]
                clients[door].generate(prompts[0], max_tokens=8, **options)
            for i, prompt in enumerate(prompts):
                for mode in modes:
                    door, options = request[mode]
                    print(f"{dataset} prompt {i + 1}/{len(prompts)}: {mode}", file=sys.stderr, flush=True)
                    started = time.perf_counter()
                    # a request with a timeline keeps its windows at the front door
                    done = clients[door].generate(prompt, max_tokens=args.max_tokens, timeline=door != "on-target",
                                                  **options)
                    totals[mode].add(done.token_ids, time.perf_counter() - started, done.stats)
                    if i == 0 and dataset == datasets[0] and mode != "target-only" and done.stats.timeline:
                        timelines[mode] = list(done.stats.timeline)
            summary = {mode: t.summary() for mode, t in totals.items()}
            base = summary["target-only"]
            for mode, s in summary.items():
                s["x_target_only"] = s["tokens_per_s"] / base["tokens_per_s"]
                s["identical_to_target_only"] = totals[mode].outputs == totals["target-only"].outputs
            for mode in modes[2:]:
                serial = "serial-on-target" if mode.endswith("on-target") else "serial"  # each against its own path
                summary[mode]["x_serial"] = summary[mode]["tokens_per_s"] / summary[serial]["tokens_per_s"]
                hit_share = summary[mode]["branch_hit_rate"] * summary[mode]["branched_share"]  # of all windows
                summary[mode]["bounds"] = bounds(base, summary[serial], hit_share, args.k)
            results[dataset] = summary
    finally:
        for client in clients.values():
            client.close()
        for door in doors.values():
            door.stop()
        stop()

    print(f"{'dataset':10s} {'mode':16s} {'tok/s':>6s} {'x base':>6s} {'x serial':>8s} {'alpha':>5s} "
          f"{'tok/pass':>8s} {'branched':>8s} {'hits':>5s} {'r-up':>5s} {'bound':>6s} {'verify ms':>9s} {'net ms':>6s} identical")
    for dataset, summary in results.items():
        for mode, s in summary.items():
            bound = s.get("bounds", {}).get("mirror") if mode.startswith("mirror") else None
            print(f"{dataset:10s} {mode:16s} {s['tokens_per_s']:6.1f} {s['x_target_only']:6.2f} "
                  f"{s.get('x_serial', 1.0 if mode.startswith('serial') else 0.0):8.2f} {s['alpha']:5.2f} "
                  f"{s['tokens_per_pass']:8.2f} {s['branched_share']:8.2f} {s['branch_hit_rate']:5.2f} "
                  f"{s['runner_up_share']:5.2f} "
                  f"{bound if bound is not None else float('nan'):6.2f} {1e3 * s['verify_s_per_window']:9.1f} "
                  f"{1e3 * s['network_s_per_window']:6.1f} {s['identical_to_target_only']}")
    if busy is not None and busy > 0.1:
        print(f"note: other processes used {busy:.0%} of the CPUs just before the run; timings are noisy")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out / f"mirror-{stamp}.json"
    out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "others_cpu_busy": busy,
                               "drafter_threads": args.threads, "target_threads": args.threads, "results": results,
                               "timeline_modes": {m: [asdict_span(s) for s in spans] for m, spans in timelines.items()}},
                              indent=2))
    png = args.out / f"mirror-{stamp}-timeline.png"
    plot_timeline(png, timelines, f"one request's windows ({datasets[0]}, K={args.k}, drafter ({args.drafter_device}) "
                                  f"and target ({args.target_device}) in their own processes, {args.threads} thread(s) each)")
    print(f"wrote {out} and {png}")
    return 0


def asdict_span(span) -> dict:
    return {"what": span.what, "start_s": span.start_s, "end_s": span.end_s}


if __name__ == "__main__":
    raise SystemExit(main())
