"""Pool shapes on a local Ray: aggregate tokens/s and request latency under concurrent streams,
and what a scale event costs the requests in flight.

    python -m benchmarks.cluster [--streams 1 4 16] [--shapes 1x1 2x1 1x2] [--max-tokens 32]
                                 [--target demo-target --draft demo-draft] [--out benchmarks/results]

One deployment is scaled from shape to shape (drafters x targets), so the run also exercises
scaling. Every replica runs one torch thread and asks Ray for one CPU: on a 2-core machine the
extra replicas of 2x1 and 1x2 share the same two cores, which is exactly what the figures show.
Prompts are MT-Bench first turns and HumanEval prompts, alternated, greedy. Run it inside a
loopback-only network namespace on shared machines (it starts Ray).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from benchmarks.data_plane import percentile
from benchmarks.flags import output_dir
from benchmarks.prompts import load_prompts
from cluster.deploy import connect, deploy, teardown
from cluster.spec import StackSpec
from mirrorspec.client import Client


@dataclass
class LoadResult:
    shape: str
    streams: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    acceptance_rate: float
    errors: int


def run_streams(address: str, prompts: list[str], streams: int, requests_per_stream: int, max_tokens: int,
                stop: threading.Event | None = None) -> list[dict]:
    """``streams`` clients sending requests back to back; each record has start, end, tokens."""
    records: list[dict] = []
    lock = threading.Lock()

    def client_loop(index: int) -> None:
        with Client(address) as client:
            n = 0
            while (stop is None and n < requests_per_stream) or (stop is not None and not stop.is_set()):
                text = prompts[(index * 7 + n) % len(prompts)]
                started = time.perf_counter()
                try:
                    done = client.generate(text, max_tokens=max_tokens)
                    record = dict(start=started, end=time.perf_counter(), tokens=len(done.token_ids),
                                  drafted=done.stats.drafted, accepted=done.stats.accepted, error=None)
                except Exception as err:  # noqa: BLE001 - counted and reported
                    record = dict(start=started, end=time.perf_counter(), tokens=0, drafted=0, accepted=0,
                                  error=str(err))
                with lock:
                    records.append(record)
                n += 1

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def summarize(shape: str, streams: int, records: list[dict]) -> LoadResult:
    ok = [r for r in records if r["error"] is None]
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    latencies = [r["end"] - r["start"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    drafted = sum(r["drafted"] for r in ok)
    return LoadResult(shape, streams, len(records), tokens, wall, tokens / wall, percentile(latencies, 0.5),
                      percentile(latencies, 0.99), sum(r["accepted"] for r in ok) / drafted if drafted else 0.0,
                      len(records) - len(ok))


def scale_event_cost(controller, address: str, prompts: list[str], max_tokens: int, pool: str) -> dict:
    """Four streams on 1x1; the pool grows to 2 and shrinks back (draining) while they run.
    Latency of requests that overlapped either event against those that did not."""
    stop = threading.Event()
    box: dict = {}
    runner = threading.Thread(target=lambda: box.update(r=run_streams(address, prompts, 4, 0, max_tokens, stop)))
    runner.start()
    time.sleep(15)  # steady state before, between and after the events
    events = []
    try:
        for replicas in (2, 1):
            started = time.perf_counter()
            scaled_to(controller, pool, replicas, 300)
            events.append((started, time.perf_counter()))
            time.sleep(15)
    finally:
        stop.set()
        runner.join()
    records = [r for r in box["r"] if r["error"] is None]
    overlapped = [r for r in records if any(r["start"] < end and r["end"] > start for start, end in events)]
    steady = [r for r in records if r not in overlapped]
    latency = lambda rs: percentile([r["end"] - r["start"] for r in rs], 0.5) if rs else None  # noqa: E731
    return {"pool": pool, "scale_up_s": events[0][1] - events[0][0], "scale_down_s": events[1][1] - events[1][0],
            "requests": len(box["r"]), "errors": len(box["r"]) - len(records),
            "overlapping_p50_s": latency(overlapped), "steady_p50_s": latency(steady),
            "overlapping_requests": len(overlapped)}


def scaled_to(controller, pool: str, replicas: int, wait_s: float) -> None:
    """Scale, and fail where the pool did not get there: a replica that never came up was timed as
    the scale event's cost (review 26 of stop 49)."""
    rows = ray.get(controller.scale.remote(pool, replicas, wait_s))
    serving = sum(r["pool"] == pool and r["state"] == "serving" for r in rows)
    if serving != replicas:
        raise RuntimeError(f"the {pool} pool has {serving} of {replicas} replicas serving after {wait_s:g} s")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--shapes", nargs="+", default=["1x1", "2x1", "1x2"], help="drafters x targets")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16, help="requests per (shape, streams), at least 1 per stream")
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", type=output_dir, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    prompts = [p.text for pair in zip(load_prompts("mtbench", 8), load_prompts("humaneval", 8)) for p in pair]

    most = max(3, *(d + t for d, t in shapes))  # 3: the scale events grow 1x1 by one replica
    connect(num_cpus=most)
    spec = StackSpec(target=args.target, draft=args.draft, drafters=shapes[0][0], targets=shapes[0][1], port=0,
                     num_speculative_tokens=args.k)
    controller, address = deploy(spec)
    results, scale_costs = [], []
    try:
        run_streams(address, prompts, 1, 1, 8)  # warm-up
        for drafters, targets in shapes:
            scaled_to(controller, "drafter", drafters, 600)
            scaled_to(controller, "target", targets, 600)
            for streams in args.streams:
                per_stream = max(1, args.requests // streams)
                result = summarize(f"{drafters}x{targets}", streams,
                                   run_streams(address, prompts, streams, per_stream, args.max_tokens))
                results.append(result)
                print(f"{result.shape} streams={streams:2d}: {result.tokens_per_s:6.1f} tok/s, "
                      f"p50 {result.latency_p50_s:5.2f} s, p99 {result.latency_p99_s:5.2f} s, "
                      f"acceptance {result.acceptance_rate:.2f}, errors {result.errors}", flush=True)
        scaled_to(controller, "drafter", 1, 600)
        scaled_to(controller, "target", 1, 600)
        for pool in ("drafter", "target"):
            cost = scale_event_cost(controller, address, prompts, args.max_tokens, pool)
            scale_costs.append(cost)
            print(f"scale {pool} 1->2->1 under 4 streams: up {cost['scale_up_s']:.1f} s, down (drain) "
                  f"{cost['scale_down_s']:.1f} s; p50 latency {_seconds(cost['overlapping_p50_s'])} overlapping "
                  f"({cost['overlapping_requests']} requests) vs {_seconds(cost['steady_p50_s'])} steady; "
                  f"errors {cost['errors']} of {cost['requests']}", flush=True)
    finally:
        teardown(controller, spec.name)
    base = {r.streams: r.tokens_per_s for r in results if r.shape == f"{shapes[0][0]}x{shapes[0][1]}"}
    print("\nshape   streams  tok/s  vs first shape")
    for r in results:
        print(f"{r.shape:6s}  {r.streams:7d}  {r.tokens_per_s:5.1f}  {r.tokens_per_s / base[r.streams]:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"target": args.target, "draft": args.draft, "k": args.k, "max_tokens": args.max_tokens,
                               "replica_threads": 1, "results": [asdict(r) for r in results],
                               "scale_events": scale_costs}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
