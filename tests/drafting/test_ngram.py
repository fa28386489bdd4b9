import pytest

from mirrorspec import SamplingParams
from mirrorspec.config import InvalidRequest
from mirrorspec.drafting import NgramDrafter


def test_proposes_the_continuation_of_the_latest_longest_match():
    drafter = NgramDrafter(max_ngram=3)
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 1, 2, 3]
    assert drafter.lookup(context, 2) == [7, 7]  # latest earlier occurrence of [1, 2, 3]


def test_no_match_proposes_nothing():
    proposal = NgramDrafter().propose([1, 2, 3, 4], 4, SamplingParams(), seed=0)
    assert proposal.tokens == () and proposal.q is None


def test_q_is_one_hot_on_the_proposed_tokens():
    proposal = NgramDrafter(max_ngram=1).propose([5, 6, 7, 5], 3, SamplingParams(temperature=1.0), seed=0)
    assert proposal.tokens == (6, 7, 5)
    dense = proposal.q.dense(8)
    assert dense.sum(-1).tolist() == [1.0, 1.0, 1.0]
    assert dense.argmax(-1).tolist() == [6, 7, 5]


def test_a_one_token_match_drafts_at_most_weak_match_tokens():
    """One-token matches are found almost anywhere and predict little: their windows are short.
    Longer matches draft all k."""
    drafter = NgramDrafter(max_ngram=3, weak_match_tokens=2)
    assert drafter.lookup([4, 1, 2, 3, 5, 6, 4], 5) == [1, 2]  # only [4] matches
    assert drafter.lookup([9, 4, 1, 2, 3, 5, 6, 9, 4], 5) == [1, 2, 3, 5, 6]  # [9, 4] matches
    assert NgramDrafter(max_ngram=1, weak_match_tokens=4).lookup([5, 6, 7, 8, 9, 5], 8) == [6, 7, 8, 9]


def test_weak_match_tokens_must_be_positive():
    with pytest.raises(InvalidRequest, match="weak_match_tokens"):
        NgramDrafter(weak_match_tokens=0)



# ids whose 8 bytes are zeros but one, at different places: runs of zeros that span two ids
SHIFTED_ONES = [0] + [1 << (8 * byte) for byte in range(6)]


@pytest.mark.parametrize("alphabet", [range(3), range(49152), SHIFTED_ONES], ids=["3", "49152", "shifted-ones"])
def test_the_byte_search_finds_what_a_slice_by_slice_scan_finds(alphabet):
    """The lookup searches the context's bytes: a hit that does not start on an id's first byte
    (zeros of one id and the next) must be passed over, not read as a match."""
    import random

    rng = random.Random(len(alphabet))
    for drafter in (NgramDrafter(), NgramDrafter(max_ngram=5, min_ngram=2, lookback=40, weak_match_tokens=1)):
        for _ in range(1500):
            context = [rng.choice(alphabet) for _ in range(rng.randint(0, 120))]
            k = rng.randint(1, 8)
            assert drafter.lookup(context, k) == drafter.scan(context, k), (context, k)
            assert drafter.lookup(tuple(context), k) == drafter.scan(context, k)


def test_ids_no_int64_holds_are_scanned_as_before():
    """They raised OverflowError or TypeError from the byte search (review 21); no model has them."""
    drafter = NgramDrafter()
    assert drafter.lookup([2 ** 63, 5, 2 ** 63, 6, 2 ** 63], 4) == [6, 2 ** 63]
    assert drafter.lookup([1.0, 2.0, 1.0, 3.0], 4) == []
