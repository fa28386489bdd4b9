"""Per-window cost of the network path: gRPC + codec overhead and bytes, sparse vs dense q.

    python -m benchmarks.data_plane [--windows 300] [--k 4] [--out benchmarks/results]

Runs real drafter and target gRPC servers on loopback with a tiny Llama that has the demo
target's vocabulary size (49,152), so q rows are full size while model compute is small, and
drives them with the orchestrator's own RemoteDrafter / RemoteVerifier. Overhead per window is
client-side call time minus the compute time the servers report, for both calls of the window.
Measured twice: servers as threads of this process (sharing its GIL), and as separate processes
(`python -m target_service`, `python -m drafter_service`).

Beside it, the floor: two empty unary round trips per window (a health check on each server),
each sent after its server idled as long as it does in the window loop. That is what this
machine charges any unary gRPC call to a server that has been waiting, whatever the payload and
the servicer; on a VM, waking an idle core is most of it. Window calls go as messages on a
stream per session (``orchestrator/window_stream.py``), which costs less than a call: the
overhead can fall below this floor.

Sparse q is measured a third way too: windows run on the target (``TargetService.RunWindows``),
which calls the drafter itself, one round trip per window; the front door only reads results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.flags import output_dir, thread_count
from mirrorspec.config import DEFAULT_DRAFT_QUANTIZE

VOCAB = 49_152


def tiny_model(path: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def start_in_process(target_dir: Path, draft_dir: Path, proposal_top_k: int):
    """Both servers as threads of this process: (target address, drafter address, stop)."""
    from drafter_service.servicer import DrafterConfig
    from drafter_service.servicer import serve as serve_drafter
    from mirrorspec.serving.server import BackgroundServer
    from target_service.servicer import TargetConfig
    from target_service.servicer import serve as serve_target

    target = BackgroundServer(lambda: serve_target(TargetConfig(model=str(target_dir)))).start()
    drafter = BackgroundServer(lambda: serve_drafter(DrafterConfig(strategy="draft-model", model=str(draft_dir),
                                                                   proposal_top_k=proposal_top_k))).start()
    return f"127.0.0.1:{target.port}", f"127.0.0.1:{drafter.port}", lambda: (drafter.stop(), target.stop())


def start_processes(target_dir: Path | str, draft_dir: Path | str | None, proposal_top_k: int,
                    target_args: tuple = (), threads: int = 1, pin: bool = True, prompt_lookup: int = 0,
                    draft_confidence: float = 0.0, quantize: str = DEFAULT_DRAFT_QUANTIZE, drafter_args: tuple = ()):
    """Each server in its own process with ``threads`` torch threads (an n-gram drafter where
    ``draft_dir`` is None; a draft model with ``prompt_lookup``, ``draft_confidence`` and ``quantize`` otherwise): (target address,
    drafter address, stop). With ``pin``, and cores enough, the target and the drafter get
    disjoint cores (``--cpus``), as deployed on one machine."""
    import subprocess
    import sys

    from mirrorspec.serving.placement import cpu_list, disjoint_cores

    drafter = (["--strategy", "ngram"] if draft_dir is None else
               ["--strategy", "draft-model", "--model", str(draft_dir), "--proposal-top-k", str(proposal_top_k),
                "--prompt-lookup", str(prompt_lookup), "--draft-confidence", str(draft_confidence),
                "--quantize", quantize])
    commands = [[sys.executable, "-m", "target_service", "--model", str(target_dir), *target_args],
                [sys.executable, "-m", "drafter_service", *drafter, *drafter_args]]
    cores = disjoint_cores(threads) if pin else None
    placements = [["--cpus", cpu_list(c)] for c in cores] if cores else [[], []]
    logs = [_server_log(c[2]) for c in commands]  # stderr, for the reason a server did not start
    procs = [subprocess.Popen([*c, "--threads", str(threads), *where], stdout=subprocess.PIPE, stderr=log, text=True)
             for c, where, log in zip(commands, placements, logs)]

    def stop():
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        for log in logs:
            log.close()

    try:  # a server that does not come up takes the other one down with it
        ports = [_listening_port(proc, log) for proc, log in zip(procs, logs)]
    except BaseException:
        stop()
        raise
    return f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", stop


def _server_log(module: str):
    """A server's stderr: a temporary file, or a kept one in ``$MIRRORSPEC_SERVER_LOGS`` (for
    runs nobody watches, such as a timed GPU lease, where a hang must leave its trace)."""
    keep = os.environ.get("MIRRORSPEC_SERVER_LOGS")
    if not keep:
        return tempfile.TemporaryFile(mode="w+")
    Path(keep).mkdir(parents=True, exist_ok=True)
    return open(Path(keep) / f"{module}-{time.strftime('%H%M%S')}-{os.getpid()}-{time.monotonic_ns()}.log", "w+")


def _listening_port(proc, log) -> int:
    line = ""
    while "listening on port" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{proc.args[2]} exited before listening (code {proc.returncode}):\n{log.read()[-2000:]}")
    return int(line.rsplit(" ", 1)[1])


def round_trip_floor(target_address: str, drafter_address: str, target_idle_s: float, drafter_idle_s: float,
                     windows: int) -> list[float]:
    """Seconds per window of two empty round trips (health checks), the target's after it idled
    ``target_idle_s`` and the drafter's after ``drafter_idle_s``, as in the window loop."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = [grpc.insecure_channel(a) for a in (target_address, drafter_address)]
    try:
        target, drafter = (health_pb2_grpc.HealthStub(c) for c in channels)
        check = health_pb2.HealthCheckRequest()
        target.Check(check, timeout=10)
        drafter.Check(check, timeout=10)
        floors = []
        for _ in range(windows):
            time.sleep(target_idle_s)  # the target waits while the drafter drafts
            started = time.perf_counter()
            target.Check(check, timeout=10)
            spent = time.perf_counter() - started
            time.sleep(drafter_idle_s)  # and the drafter while the target verifies
            started = time.perf_counter()
            drafter.Check(check, timeout=10)
            floors.append(spent + time.perf_counter() - started)
        return floors
    finally:
        for channel in channels:
            channel.close()


def measure(target_dir: Path, draft_dir: Path, proposal_top_k: int, k: int, windows: int, separate: bool,
            on_target: bool = False) -> dict:
    """``on_target``: the windows run on the target, which calls the drafter itself (RunWindows)."""
    from mirrorspec import SamplingParams, SpeculationConfig
    from mirrorspec.engine import GenerationStats, decode_windows
    from mirrorspec.serving.convert import proposal_to_proto
    from mirrorspec.v1 import drafter_pb2_grpc, target_pb2_grpc
    from orchestrator.pool import ReplicaPool
    from orchestrator.direct import windows_on_target
    from orchestrator.remote import RemoteDrafter, RemoteVerifier

    start = start_processes if separate else start_in_process
    target_address, drafter_address, stop = start(target_dir, draft_dir, proposal_top_k)
    targets = ReplicaPool("target", [target_address], target_pb2_grpc.TargetServiceStub)
    drafters = ReplicaPool("drafter", [drafter_address], drafter_pb2_grpc.DrafterServiceStub)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=windows * (k + 1))
        prompt = [1, 2, 3, 4]
        for _ in range(2):  # the first pass warms up connections and allocators
            overheads, path_overheads, verify_calls, draft_calls = [], [], [], []
            v = RemoteVerifier(targets, prompt, params, 0, VOCAB)
            d = RemoteDrafter(drafters, prompt, params, 0, VOCAB)
            spec = SpeculationConfig(num_speculative_tokens=k)
            stats = GenerationStats()
            events = (windows_on_target(d, d, v, prompt, params, spec, 0, stats, runner_up=False) if on_target
                      else decode_windows(d, v, prompt, params, spec, 0, stats))
            last = (time.perf_counter(), 0.0, 0.0, 0.0, 0.0)
            for i, _event in enumerate(events):
                now = (time.perf_counter(), v.times.server_s + d.times.server_s,
                       v.times.network_s + d.times.network_s, v.times.call_s, d.times.call_s)
                wall, compute, overhead, verify_call, draft_call = (a - b for a, b in zip(now, last))
                if i > 0:  # the first window's wall time holds the sessions' opening
                    path_overheads.append(wall - compute)
                overheads.append(overhead)
                verify_calls.append(verify_call)
                draft_calls.append(draft_call)
                last = now
                if i + 1 >= windows:
                    break
            events.close()
            if on_target and stats.windows_on_target != len(overheads):
                raise RuntimeError(f"only {stats.windows_on_target} of {len(overheads)} windows ran on the target")
            v.release()
            d.release()
        floors = round_trip_floor(target_address, drafter_address, statistics.median(draft_calls),
                                  statistics.median(verify_calls), len(overheads))
        # bytes of q on the wire for one full window, as the drafter and the target see it
        session = RemoteDrafter(drafters, prompt, params, 0, VOCAB)
        proposal = session.propose(prompt, k, params, 0)
        session.release()
        q_bytes = proposal_to_proto(proposal.q).ByteSize()
        return {
            "servers": "separate processes" if separate else "in this process",
            "windows run by": "the target" if on_target else "the front door",
            "q": "dense" if proposal_top_k == 0 else f"sparse top-{proposal_top_k}",
            "windows": len(overheads),
            "overhead_ms_p50": 1000 * statistics.median(overheads),
            "overhead_ms_p99": 1000 * percentile(overheads, 0.99),
            # everything on a window's critical path but the servers' compute: the front door's own
            # loop and codec too; with windows on the target, the interval between its results
            "path_overhead_ms_p50": 1000 * statistics.median(path_overheads),
            "floor_ms_p50": 1000 * statistics.median(floors),
            "above_floor_ms_p50": 1000 * (statistics.median(overheads) - statistics.median(floors)),
            "q_bytes_per_window": q_bytes,
            "acceptance_rate": stats.acceptance_rate,
        }
    finally:
        targets.close()
        drafters.close()
        stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_plane")
    parser.add_argument("--windows", type=int, default=300)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument("--out", type=output_dir, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.windows < 10:
        parser.error("--windows: need at least 10 windows for a p99")
    if not 1 <= args.k <= 16:
        parser.error(f"--k: drafts per window must be in [1, 16], got {args.k}")
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp())
    target_dir, draft_dir = tiny_model(root / "target", 0), tiny_model(root / "draft", 1)
    rows = [measure(target_dir, draft_dir, top_k, args.k, args.windows, separate, on_target)
            for separate in (False, True) for top_k, on_target in ((32, False), (0, False), (32, True))]
    print(f"{'servers':20s} {'windows run by':16s} {'q':16s} {'p50 ms':>8s} {'p99 ms':>8s} {'path p50':>9s} "
          f"{'floor ms':>9s} {'above':>7s} {'q bytes/window':>15s}")
    for r in rows:
        print(f"{r['servers']:20s} {r['windows run by']:16s} {r['q']:16s} {r['overhead_ms_p50']:8.3f} "
              f"{r['overhead_ms_p99']:8.3f} {r['path_overhead_ms_p50']:9.3f} {r['floor_ms_p50']:9.3f} "
              f"{r['above_floor_ms_p50']:7.3f} {r['q_bytes_per_window']:15,d}")
    print("p50/p99: call time minus the servers' compute (network and codec); path: a window's wall time minus "
          "the servers' compute (with the front door's own work; on the target, between its results). floor: two "
          "empty unary round trips per window (health checks), each after its server idled as in the window loop; "
          "above: p50 minus the floor (below 0 where the windows' stream beats a unary call)")
    print(f"dense/sparse bytes ratio: {rows[1]['q_bytes_per_window'] / rows[0]['q_bytes_per_window']:.0f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"data_plane-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"k": args.k, "vocab": VOCAB, "threads": args.threads, "torch": torch.__version__,
                               "machine": platform.machine(), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
