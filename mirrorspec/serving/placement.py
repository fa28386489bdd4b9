"""CPU placement for a server process: which cores its threads may run on.

A target and a drafter in their own processes on one machine each need their own compute, or
mirror mode's overlap of drafting and verifying is lost to time-sharing. Pinning each process to
its own cores makes that explicit, like the core binding of vLLM's CPU backend
(``VLLM_CPU_OMP_THREADS_BIND``). On the 2-core CI machine, with one torch thread each, pinning
made no difference the noise there could show: served n-gram decoding ran at 0.860x in-process
pinned and 0.874x unpinned, interleaved in one run; so it is a placement guarantee, not a speed
claim.

Pinning is set for the whole process, before torch starts its threads, so every thread
(compute lane, OpenMP workers, event loop, gRPC) inherits it.
"""

from __future__ import annotations

import argparse
import os

from mirrorspec.config import InvalidRequest, refuse_setting


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """``--threads`` and ``--cpus`` for a server's ``python -m`` entry point."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads for this process")
    parser.add_argument("--cpus", default=None, metavar="LIST",
                        help="run on these cores only (taskset -c syntax: 1, 0,2, 2-3), apart from a drafter "
                             "or target on the same machine")


def apply_placement(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Pin (if asked), then size torch's thread pool: before any torch work starts threads."""
    import torch

    try:
        check_threads(args.threads)
        if args.cpus is not None:
            pin_process(parse_cpu_list(args.cpus), args.threads)
    except InvalidRequest as err:
        refuse_setting(parser, err)
    torch.set_num_threads(args.threads)


# torch starts this many OpenMP threads at once: 100,000 failed ("can't start new thread") and
# then crashed the process with a segfault; a CPU with more cores than this is yet to be sold
MAX_THREADS = 1024


def check_threads(threads: int | None) -> None:
    """A torch thread count, where one is given (None: the caller's default)."""
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise InvalidRequest(f"must be in [1, {MAX_THREADS}] (torch threads for this process; one per core it "
                             f"may use is best), got {threads}", field="threads")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"1"``, ``"0,2"``, ``"2-3"`` or ``"0-1,4"`` (the ``taskset -c`` syntax) -> sorted cores."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            low, dash, high = part.partition("-")
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise InvalidRequest(f"{text!r} is not a CPU list; write it like taskset -c: 1, 0,2 or 2-3",
                                 field="cpus") from None
        if first < 0 or last < first:
            raise InvalidRequest(f"{part!r} is not a CPU range; write low-high with 0 <= low <= high", field="cpus")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def pin_process(cpus: tuple[int, ...], threads: int) -> None:
    """Bind this process to ``cpus`` (a subset of the cores it may use now)."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise InvalidRequest(f"CPUs {missing} are not available to this process (it may use "
                             f"{cpu_list(tuple(sorted(allowed)))}); pick cores from those", field="cpus")
    if threads > len(cpus):
        raise InvalidRequest(f"{threads} torch threads on {len(cpus)} pinned CPU(s) would time-share cores; "
                             f"give at least as many CPUs as threads, or lower the thread count", field="cpus")
    os.sched_setaffinity(0, cpus)


def disjoint_cores(threads: int, count: int = 2) -> list[tuple[int, ...]] | None:
    """``count`` disjoint sets of ``threads`` cores each from those this process may use, the
    first set from the top (where the target goes), or None when there are too few cores."""
    top_first = sorted(os.sched_getaffinity(0), reverse=True)
    if len(top_first) < threads * count:
        return None
    return [tuple(sorted(top_first[i * threads:(i + 1) * threads])) for i in range(count)]


def cpu_list(cpus: tuple[int, ...]) -> str:
    """The inverse of ``parse_cpu_list``, for command lines."""
    return ",".join(str(c) for c in cpus)
