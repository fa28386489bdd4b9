import os
import subprocess
import sys

import pytest

from mirrorspec import InvalidRequest
from mirrorspec.serving.placement import cpu_list, disjoint_cores, parse_cpu_list, pin_process


@pytest.mark.parametrize("text,cpus", [("1", (1,)), ("0,2", (0, 2)), ("2-3", (2, 3)), ("0-1,4", (0, 1, 4)),
                                       (" 3 , 1 ", (1, 3)), ("1,1", (1,))])
def test_cpu_lists_read_like_taskset(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text,needle", [("a", "not a CPU list"), ("", "not a CPU list"), ("3-1", "not a CPU range"),
                                         ("-1", "not a CPU list"), ("1-", "not a CPU list")])
def test_bad_cpu_lists_say_how_to_write_one(text, needle):
    with pytest.raises(InvalidRequest, match=needle):
        parse_cpu_list(text)


def test_pinning_refuses_cores_the_process_may_not_use_and_more_threads_than_cores():
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(InvalidRequest, match="not available"):
        pin_process((max(allowed) + 1,), 1)
    with pytest.raises(InvalidRequest, match="time-share"):
        pin_process((allowed[0],), 2)
    assert sorted(os.sched_getaffinity(0)) == allowed  # a refused pin changes nothing


def test_disjoint_cores_give_the_target_the_top_ones(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert disjoint_cores(1) == [(5,), (3,)]
    assert disjoint_cores(2) == [(3, 5), (1, 2)]
    assert disjoint_cores(3) is None  # 6 cores wanted, 5 there


def _server(module: str, *args: str) -> subprocess.CompletedProcess:
    """Starts a server entry point that must fail on its arguments, before loading any model."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["target_service", "drafter_service"])
def test_server_entry_points_name_the_flag_of_a_bad_placement(module):
    first = min(os.sched_getaffinity(0))
    bad = _server(module, "--cpus", "x")
    assert bad.returncode == 2 and "--cpus" in bad.stderr and "taskset" in bad.stderr
    too_many = _server(module, "--cpus", str(first), "--threads", "2")
    assert too_many.returncode == 2 and "--cpus" in too_many.stderr and "time-share" in too_many.stderr
    no_threads = _server(module, "--threads", "0")
    assert no_threads.returncode == 2 and "--threads" in no_threads.stderr


def test_a_pinned_process_and_its_threads_stay_on_its_cores():
    first = min(os.sched_getaffinity(0))
    code = ("import os, threading; from mirrorspec.serving.placement import pin_process; "
            f"pin_process(({first},), 1); seen = []; "
            "t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); t.start(); t.join(); "
            "print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [f"[{first}]", f"[{first}]"]
