"""How a pooled session works out what to send: the fork point of what it holds and the new context."""

from orchestrator.remote import fork_point


def test_fork_point_of_an_extension_is_all_that_is_held():
    assert fork_point([1, 2, 3], [1, 2, 3, 4, 5]) == 3
    assert fork_point([], [7]) == 0
    assert fork_point([1, 2], [1, 2]) == 2


def test_fork_point_of_a_branch_is_where_it_leaves_the_held_context():
    assert fork_point([1, 2, 3, 4], [1, 2, 9, 8]) == 2  # a mirror branch: two drafts kept, then c
    assert fork_point([1, 2, 3, 4], [1, 2]) == 2  # a shorter context: rewind only
    assert fork_point([5, 2], [1, 2, 3]) == 0
