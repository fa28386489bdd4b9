from mirrorspec import SamplingParams
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
