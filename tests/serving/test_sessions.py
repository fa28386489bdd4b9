import pytest

from mirrorspec import SamplingParams
from mirrorspec.config import InvalidRequest
from mirrorspec.serving.errors import ContextMismatch, SessionIdTaken, SessionLimitReached, SessionNotFound
from mirrorspec.serving.sessions import SequenceState, SessionStore


def test_bound_ttl_and_close():
    now = [0.0]
    evicted = []
    store = SessionStore(max_sessions=2, ttl_s=10, on_evict=evicted.append, clock=lambda: now[0])
    a, b = store.open("a"), store.open("b")
    with pytest.raises(SessionLimitReached, match="max-sessions"):
        store.open("c")
    now[0] = 5
    assert store.get(a) == "a"  # touching a keeps it alive
    now[0] = 12
    assert store.evict_expired() == 1 and evicted == ["b"]
    with pytest.raises(SessionNotFound, match="OpenSession"):
        store.get(b)
    assert store.close(a) and not store.close(a) and len(store) == 0


def test_an_orphaned_session_goes_after_the_short_ttl_unless_called_again():
    now = [0.0]
    evicted = []
    store = SessionStore(max_sessions=3, ttl_s=600, orphan_ttl_s=30, on_evict=evicted.append, clock=lambda: now[0])
    orphan, revived, kept = store.open("orphan"), store.open("revived"), store.open("kept")
    now[0] = 100
    store.orphan(orphan)
    store.orphan(revived)
    store.orphan("closed-already")  # nothing to do
    now[0] = 120
    assert store.get(revived) == "revived"  # its caller came back: the full TTL again
    now[0] = 131
    assert store.evict_expired() == 1 and evicted == ["orphan"]
    now[0] = 721
    assert store.evict_expired() == 2 and sorted(evicted) == ["kept", "orphan", "revived"]


def test_a_caller_chosen_id_is_taken_once_and_a_close_that_overtakes_its_open_refuses_the_open():
    """A front door whose open failed as the replica opened the session (a deadline that passed
    then) closes the id it chose; the close may reach the replica before the open does."""
    now = [0.0]
    store = SessionStore(max_sessions=2, orphan_ttl_s=30, clock=lambda: now[0])
    assert store.open("a", "cafe01") == "cafe01" and store.get("cafe01") == "a"
    with pytest.raises(SessionIdTaken, match="is already open here"):  # ALREADY_EXISTS
        store.open("b", "cafe01")
    for bad in ("x" * 65, "caf\u00e9", "a\nb"):
        with pytest.raises(InvalidRequest, match="at most 64 printable ASCII"):
            store.open("b", bad)
    assert not store.close("beef02")  # its open has not arrived yet
    with pytest.raises(SessionIdTaken, match="was closed before it opened"):
        store.open("b", "beef02")
    assert len(store) == 1 and store.open("b", "beef02") == "beef02"  # the refusal used the close up
    assert store.close("cafe01") and store.close("beef02") and len(store) == 0
    assert not store.close("dead03")
    now[0] = 31  # a close older than the orphan TTL is forgotten: an open after it left an orphan
    store.evict_expired()
    assert store.open("c", "dead03") == "dead03"


def test_the_closes_remembered_for_opens_yet_to_come_are_bounded():
    store = SessionStore(max_sessions=1, clock=lambda: 0.0)
    for i in range(store.max_remembered_closes + 10):
        store.close(f"id{i}")
    assert store.open("late", f"id{store.max_remembered_closes + 5}")  # past the bound: not remembered
    with pytest.raises(SessionIdTaken, match="closed before it opened"):
        store.open("early", "id0")


def test_a_close_remembered_again_moves_to_the_back_and_ids_no_open_would_take_are_not_remembered():
    now = [0.0]
    store = SessionStore(max_sessions=1, orphan_ttl_s=30, clock=lambda: now[0])
    store.close("a")
    now[0] = 10
    store.close("b")
    now[0] = 20
    store.close("a")  # again, later: it must outlive b, which the scan from the oldest then finds first
    store.close("caf\u00e9" * 20)  # an open would refuse it anyway: it takes no room
    now[0] = 45  # b's close is 35 s old, a's last 25 s
    store.evict_expired()
    assert list(store._closed_unopened) == ["a"]


def test_sequence_commit_checks_the_callers_view():
    seq = SequenceState([1, 2], SamplingParams(), seed=0)
    seq.commit([3, 4], expected_length=4)
    assert seq.context == [1, 2, 3, 4]
    with pytest.raises(ContextMismatch, match="reopen"):
        seq.commit([5], expected_length=9)
    assert seq.context == [1, 2, 3, 4]


def test_a_refused_commit_with_keep_leaves_the_session_as_it_was():
    """The drafter's forks rewind to ``keep`` first; they used to rewind before the length check,
    so a refused call had already cut the session, and the caller's next correct call failed too."""
    seq = SequenceState([1, 2, 3, 4], SamplingParams(), seed=0)
    with pytest.raises(ContextMismatch, match="keeping 1 committing 0 gives 1, but the caller expects 9"):
        seq.commit([], expected_length=9, keep=1)
    with pytest.raises(ContextMismatch, match="keep=7 exceeds the 4 tokens"):
        seq.commit([], expected_length=7, keep=7)
    with pytest.raises(InvalidRequest, match="would hold no tokens") as err:
        seq.commit([], expected_length=0, keep=0)
    assert err.value.field == "keep"
    assert seq.context == [1, 2, 3, 4]
    seq.commit([9], expected_length=3, keep=2)
    assert seq.context == [1, 2, 9]
