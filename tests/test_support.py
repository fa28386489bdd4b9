"""The test helpers the statistical tests lean on: splitting their samples over two processes must
give the list one process would, whatever happens to the forked half."""

import os

import pytest

from support import run_halves_in_two_processes


def squares(first: int, count: int) -> list[int]:
    return [i * i for i in range(first, first + count)]


@pytest.mark.parametrize("first, count", [(0, 0), (5, 1), (3, 2), (7, 1001)])
def test_the_halves_come_back_in_order_and_whole(first, count):
    assert run_halves_in_two_processes(squares, first, count) == squares(first, count)


def test_a_forked_half_that_fails_is_drawn_in_the_parent_and_said_so():
    """A child that raises (or dies) sends nothing back: its half is drawn here instead, with a
    warning, rather than lost or left out of the list."""
    parent = os.getpid()

    def fails_in_the_child(first: int, count: int) -> list[int]:
        if os.getpid() != parent:
            raise RuntimeError("a child that cannot draw")
        return squares(first, count)

    with pytest.warns(RuntimeWarning, match="the forked half of samples 50..99 came back empty"):
        assert run_halves_in_two_processes(fails_in_the_child, 0, 100) == squares(0, 100)
