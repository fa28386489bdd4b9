"""The test helpers the statistical tests lean on: splitting their samples over two processes must
give the list one process would, whatever happens to the forked half."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from support import live_threads, run_halves_in_two_processes


def squares(first: int, count: int) -> list[int]:
    return [i * i for i in range(first, first + count)]


@pytest.mark.parametrize("first, count", [(0, 0), (5, 1), (3, 2), (7, 1001)])
def test_the_halves_come_back_in_order_and_whole(first, count):
    assert run_halves_in_two_processes(squares, first, count) == squares(first, count)


def test_a_forked_half_that_fails_is_drawn_in_the_parent_and_said_so():
    """A child that raises sends its traceback, not its half: the half is drawn here instead, with a
    warning that says why, rather than lost or left out of the list (CI's log once said only
    "came back empty")."""
    parent = os.getpid()

    def fails_in_the_child(first: int, count: int) -> list[int]:
        if os.getpid() != parent:
            raise RuntimeError("a child that cannot draw")
        return squares(first, count)

    with pytest.warns(RuntimeWarning, match="the forked half of samples 50..99 came back empty, drawn here "
                                             "instead: Traceback(.|\n)*RuntimeError: a child that cannot draw"):
        assert run_halves_in_two_processes(fails_in_the_child, 0, 100) == squares(0, 100)


def test_a_forked_half_that_dies_is_drawn_in_the_parent_and_said_so():
    """A child that dies sends not even its traceback: the warning says it died."""
    parent = os.getpid()

    def dies_in_the_child(first: int, count: int) -> list[int]:
        if os.getpid() != parent:
            os._exit(3)
        return squares(first, count)

    with pytest.warns(RuntimeWarning, match=r"50\.\.99 came back empty, drawn here instead \(it died or outlasted"):
        assert run_halves_in_two_processes(dies_in_the_child, 0, 100) == squares(0, 100)


def test_a_process_that_has_used_cuda_draws_both_halves_itself(monkeypatch):
    """CUDA cannot be initialised again in a forked child, so forking after CUDA is in use only
    wastes a child and warns: the parent draws every sample, in one process, with no warning."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    parent = os.getpid()

    def marks_a_child(first: int, count: int) -> list[int]:  # a forked child's half would come back marked
        return squares(first, count) if os.getpid() == parent else [-1] * count

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_halves_in_two_processes(marks_a_child, 0, 100) == squares(0, 100)


def test_live_threads_names_python_threads_by_their_names():
    import threading

    release = threading.Event()
    waiting = threading.Thread(target=release.wait, name="a-named-waiter")
    waiting.start()
    try:
        census = live_threads()
    finally:
        release.set()
        waiting.join()
    assert "1 a-named-waiter" in census and "1 MainThread" in census


A_TEST_FILE = """
import warnings

def test_passes():
    pass

def test_fails():
    assert False

def test_warns():
    warnings.warn(UserWarning("a warning pytest counts"))
"""


def _pytest_in_a_subprocess(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """pytest on a file of its own, with this suite's conftest as a plugin, from a driver that
    registered an atexit handler before pytest began."""
    (tmp_path / "test_a_file.py").write_text(A_TEST_FILE)
    args = ["-p", "conftest", "-p", "no:cacheprovider", "-q", *argv]
    driver = ("import atexit, sys, pytest; atexit.register(lambda: print('the atexit handler ran', flush=True)); "
              f"sys.exit(pytest.main({args!r}))")
    environment = {key: value for key, value in os.environ.items() if key != "MIRRORSPEC_TEST_FULL_TEARDOWN"}
    environment["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    return subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**environment, **env})


@pytest.mark.parametrize("argv, status", [
    (["test_a_file.py::test_passes"], pytest.ExitCode.OK),
    (["test_a_file.py::test_fails"], pytest.ExitCode.TESTS_FAILED),
    # the terminal reporter sets this status after every plugin's sessionfinish
    (["test_a_file.py::test_warns", "--max-warnings", "0"], pytest.ExitCode.MAX_WARNINGS_ERROR),
    (["test_a_file.py", "-k", "no_test_is_called_this"], pytest.ExitCode.NO_TESTS_COLLECTED),
], ids=["passed", "failed", "too-many-warnings", "nothing-collected"])
def test_the_test_process_leaves_with_pytests_status_after_its_atexit_handlers_and_says_what_was_alive(
        tmp_path, argv, status):
    """conftest ends the process with ``os._exit`` (CI's run died with SIGSEGV in native teardown
    after every test had passed): the status must still be pytest's final one, and the atexit
    handlers (Ray's shutdown, multiprocessing's reaping) must still run."""
    run = _pytest_in_a_subprocess(tmp_path, *argv)
    assert run.returncode == status, run.stdout + run.stderr
    assert "the atexit handler ran" in run.stdout and "threads alive at exit: " in run.stderr


def test_what_pytest_prints_after_unconfigure_is_not_cut_off_and_the_teardown_can_be_kept(tmp_path):
    missing = _pytest_in_a_subprocess(tmp_path, "no_such_file.py")  # a usage error, printed after unconfigure
    assert missing.returncode == pytest.ExitCode.USAGE_ERROR
    assert "file or directory not found" in missing.stdout + missing.stderr
    kept = _pytest_in_a_subprocess(tmp_path, "test_a_file.py::test_passes", MIRRORSPEC_TEST_FULL_TEARDOWN="1")
    assert kept.returncode == pytest.ExitCode.OK and "threads alive" not in kept.stderr
    assert "the atexit handler ran" in kept.stdout
