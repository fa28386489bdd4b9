"""argparse types shared by the benchmark commands: each raises ArgumentTypeError, so the error
names the flag (``argument --k: K must be in [1, 8], got 0``) before any model is loaded."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from mirrorspec.config import (InvalidRequest, SamplingParams, SpeculationConfig, check_draft_confidence,
                               check_writable_folder)
from mirrorspec.serving.placement import check_threads

TRUNCATE_PREFIX = "truncate:"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def output_dir(text: str) -> Path:
    """``--out``: a folder the user names is made as the flags are read, so one that cannot be
    written is refused naming the flag before the run, not with a traceback after it (its results
    lost). A command's default (a ``Path``, which argparse leaves unconverted) is made only when
    results are written: ``--reprint`` writes nothing, and an installed copy may be read-only."""
    try:
        return check_writable_folder(Path(text), "out")
    except InvalidRequest as err:
        raise argparse.ArgumentTypeError(str(err)) from None


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """``--threads``: set deliberately before any model work, and restored on exit, so a command
    run from a test or the CLI leaves its caller's thread count as it found it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def csv_of(item: Callable[[str], object]) -> Callable[[str], list]:
    """An argparse type for comma-separated lists; ArgumentTypeError names the flag for us."""
    def parse(text: str) -> list:
        values = [item(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("needs at least one value")
        return list(dict.fromkeys(values))  # de-duplicate, keep order
    return parse


def one_of(options: Sequence[str], what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose from {', '.join(options)}")
        return text
    return parse


def window_k(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"K must be an integer, got {text!r}") from None
    upper = SpeculationConfig().max_speculative_tokens  # the engine's own bound
    if not 1 <= k <= upper:
        raise argparse.ArgumentTypeError(f"K must be in [1, {upper}], got {k} (drafts per window; K=0 is "
                                         "target-only decoding, which the benchmark runs anyway)")
    return k


def sampling_temperature(text: str) -> float:
    try:
        return SamplingParams(temperature=float(text)).temperature
    except (ValueError, InvalidRequest) as err:
        raise argparse.ArgumentTypeError(f"bad temperature {text!r}: {err}") from None


def draft_confidence(text: str) -> float:
    try:
        threshold = float(text)
        check_draft_confidence(threshold)
    except (ValueError, InvalidRequest) as err:
        raise argparse.ArgumentTypeError(f"bad threshold {text!r}: {err}") from None
    return threshold


def integer_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


positive = integer_at_least(1)


def thread_count(text: str) -> int:
    """``--threads``: what ``mirrorspec generate`` takes. Unbounded, 1500 loaded a 2-core machine
    to 70 and the run hung at exit; 99999 failed inside OpenBLAS."""
    threads = positive(text)
    try:
        check_threads(threads)
    except InvalidRequest as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return threads


def positive_float(text: str) -> float:
    """A finite number above 0 (a count of epochs, a scale)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def seed_flag(text: str) -> int:
    """A seed as requests take it, [0, 2**64): checked here, not at the first prompt after loading."""
    value = integer_at_least(0)(text)
    if value >= 1 << 64:
        raise argparse.ArgumentTypeError(f"must be below 2**64, got {value}")
    return value


def draft_spec(text: str) -> str:
    layers = text.removeprefix(TRUNCATE_PREFIX)
    if text.startswith(TRUNCATE_PREFIX) and not (layers.isdigit() and int(layers) >= 1):
        raise argparse.ArgumentTypeError(f"truncate:N needs an integer N >= 1, got {layers!r}")
    return text


def add_run_flags(parser: argparse.ArgumentParser, *, threads_default: int = 2,
                  threads_help: str = "torch intra-op threads (default 2)") -> None:
    """--target, --threads, --out and --no-progress: every command that loads the target in its own
    process and writes a JSON of its results takes them, with one meaning and one help text."""
    parser.add_argument("--target", default="demo-target", help="hub id, local path, .gguf, or demo-target (default)")
    parser.add_argument("--threads", type=thread_count, default=threads_default, help=threads_help)
    parser.add_argument("--out", type=output_dir, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
