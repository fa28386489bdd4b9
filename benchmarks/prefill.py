"""What a long prompt's prefill does to a stream already running on the same target, with the
target prefilling in chunks of each size asked for, side by side in one run.

    python -m benchmarks.prefill [--long-tokens 2048] [--chunks 0,512,256] [--out benchmarks/results]

A target server process (``python -m target_service --prefill-chunk N``, one torch thread, its
own core where there are two) and a target-only front door in this process. Stream A (an
MT-Bench question) is decoding when request B arrives with a prompt of ``--long-tokens`` tokens
(HumanEval stubs, one after another). The target's compute lane serves one job at a time, first
come first served: unchunked (``0``), A's next window waits for B's whole prefill; chunked, for
one chunk. Reported per chunk size: A's longest gap between tokens while B prefills, A's median
gap, and B's time to first token. Writes JSON and a PNG of A's token arrivals beside B's prefill.

Run it inside a loopback-only network namespace on shared machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.data_plane import _listening_port, _server_log
from benchmarks.flags import output_dir
from benchmarks.prompts import load_humaneval, load_mtbench

NO_CHUNKS = 1 << 30  # a chunk longer than any prompt: one job per prefill, as before chunking


def long_prompt(tokenizer, tokens: int) -> list[int]:
    """HumanEval stubs one after another under one instruction, cut to ``tokens`` tokens."""
    text = "Summarize what each of these functions does:\n\n"
    ids: list[int] = []
    for stub in load_humaneval(164):
        text += stub.text + "\n"
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"HumanEval's stubs hold fewer than {tokens} tokens; ask for fewer (--long-tokens)")


def start_target(model: str, chunk: int) -> tuple[str, callable]:
    from mirrorspec.serving.placement import cpu_list, disjoint_cores

    cores = disjoint_cores(1)
    where = ["--cpus", cpu_list(cores[0])] if cores else []
    log = _server_log("target_service")
    proc = subprocess.Popen([sys.executable, "-m", "target_service", "--model", model, "--threads", "1",
                             "--prefill-chunk", str(chunk), *where], stdout=subprocess.PIPE, stderr=log, text=True)

    def stop():
        proc.terminate()
        proc.wait(timeout=30)
        log.close()

    try:
        return f"127.0.0.1:{_listening_port(proc, log)}", stop
    except BaseException:
        stop()
        raise


def one_run(model: str, chunk: int, short_ids: list[int], long_ids: list[int], short_tokens: int,
            long_after: int) -> dict:
    """Stream A of ``short_tokens`` tokens; B (``long_ids``, 4 tokens) sent once A has ``long_after``."""
    from mirrorspec.client import Client
    from mirrorspec.serving.server import BackgroundServer
    from orchestrator.servicer import OrchestratorConfig
    from orchestrator.servicer import serve as serve_orchestrator

    target, stop_target = start_target(model, chunk)
    front = BackgroundServer(lambda: serve_orchestrator(OrchestratorConfig(target=target, drafter=None, port=0))).start()
    arrivals: list[float] = []
    span: dict[str, float] = {}
    try:
        with Client(f"127.0.0.1:{front.port}", timeout_s=600) as client:
            client.generate(short_ids, max_tokens=4)  # warm: both processes have run a forward

            def send_long():
                span["sent"] = time.perf_counter()
                result = client.generate(long_ids, max_tokens=4)
                span["first_token"] = span["sent"] + result.stats.time_to_first_token_s
                span["done"] = time.perf_counter()

            long_request = threading.Thread(target=send_long)
            started = time.perf_counter()
            for chunk_msg in client.stream(short_ids, max_tokens=short_tokens):
                now = time.perf_counter()
                arrivals += [now] * len(chunk_msg.token_ids)
                if len(arrivals) >= long_after and not long_request.is_alive() and "sent" not in span:
                    long_request.start()
            if "sent" not in span:
                raise RuntimeError(f"stream A ended after {len(arrivals)} tokens, before the long prompt was sent")
            long_request.join()
    finally:
        front.stop()
        stop_target()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > a]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > a and a < span["first_token"] and b > span["sent"]]
    return {"chunk": chunk if chunk != NO_CHUNKS else 0, "long_prompt_tokens": len(long_ids),
            "short_gap_ms_p50": 1e3 * statistics.median(gaps),
            "short_gap_ms_max_during_prefill": 1e3 * max(during, default=0.0),
            "long_ttft_s": span["first_token"] - span["sent"],
            "arrivals_s": [a - started for a in arrivals],
            "long_prefill_s": [span["sent"] - started, span["first_token"] - started]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.6 * len(rows) + 0.6), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        start, end = row["long_prefill_s"]
        ax.axvspan(start, end, color="tab:orange", alpha=0.3, label=f"B: {row['long_prompt_tokens']}-token prompt, sent to first token")
        ax.eventplot(row["arrivals_s"], lineoffsets=0.5, linelengths=0.8, color="tab:blue")
        ax.set_yticks([])
        ax.set_ylabel("unchunked" if row["chunk"] == 0 else f"chunk {row['chunk']}", rotation=0, ha="right", va="center")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since stream A started (a tick per token of A)")
    fig.suptitle("A stream's tokens while another request's long prompt is prefilled on the same target")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo-target")
    parser.add_argument("--long-tokens", type=int, default=2048, help="the long prompt's length (default 2048)")
    parser.add_argument("--short-tokens", type=int, default=96, help="tokens stream A decodes (default 96)")
    parser.add_argument("--chunks", default="0,512,256", help="prefill chunk sizes to compare; 0 = unchunked")
    parser.add_argument("--out", type=output_dir, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
        if any(c < 0 for c in chunks):
            raise ValueError
    except ValueError:
        parser.error(f"argument --chunks: comma-separated whole numbers >= 0 (0 = unchunked), got {args.chunks!r}")
    if args.long_tokens < 1:
        parser.error(f"argument --long-tokens: must be >= 1, got {args.long_tokens}")
    if args.short_tokens < 16:
        parser.error(f"argument --short-tokens: must be >= 16 (the long prompt is sent after 8), got {args.short_tokens}")
    torch.set_num_threads(1)
    from mirrorspec.models import encode_prompt
    from mirrorspec.models.loading import try_load_tokenizer

    tokenizer = try_load_tokenizer(args.model)
    if tokenizer is None:
        parser.error(f"argument --model: {args.model} has no tokenizer to encode the prompts with")
    short_ids = encode_prompt(tokenizer, load_mtbench(1)[0].text)
    long_ids = long_prompt(tokenizer, args.long_tokens)
    rows = [one_run(args.model, c or NO_CHUNKS, short_ids, long_ids, args.short_tokens, long_after=8) for c in chunks]
    print(f"{'prefill chunk':>13s} {'A gap p50 ms':>13s} {'A max gap during B prefill ms':>30s} {'B TTFT s':>9s}")
    for r in rows:
        print(f"{r['chunk'] or 'unchunked':>13} {r['short_gap_ms_p50']:13.1f} "
              f"{r['short_gap_ms_max_during_prefill']:30.0f} {r['long_ttft_s']:9.2f}")
    base = rows[0]
    for r in rows[1:]:
        print(f"chunk {r['chunk']} vs {base['chunk'] or 'unchunked'}: A's longest stall "
              f"{r['short_gap_ms_max_during_prefill'] / base['short_gap_ms_max_during_prefill']:.2f}x, "
              f"B's TTFT {r['long_ttft_s'] / base['long_ttft_s']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out / f"prefill-{stamp}.json"
    out.write_text(json.dumps({"model": args.model, "torch": torch.__version__, "rows": rows}, indent=1))
    plot(rows, args.out / f"prefill-{stamp}.png")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
