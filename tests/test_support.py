"""The test helpers the statistical tests lean on: splitting their samples over two processes must
give the list one process would, whatever happens to the forked half."""

import os
import warnings

import pytest
import torch

from support import run_halves_in_two_processes


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
