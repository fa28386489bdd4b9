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

