"""Protobuf <-> domain conversions that carry more than one field's worth of meaning."""

from mirrorspec.drafting import RankedTokens
from mirrorspec.serving.convert import ranked_from_proto, ranked_to_proto
from mirrorspec.v1 import drafter_pb2


def test_ranked_tokens_round_trip_with_rows_that_have_no_probabilities():
    ranked = RankedTokens(ids=((4, 1, 7), (9,), (2, 3)), probs=((0.5, 0.25, 0.125), (), (0.75, 0.25)))
    assert ranked_from_proto(ranked_to_proto(ranked)) == ranked  # these floats are exact in float32
    assert ranked_from_proto(ranked_to_proto(RankedTokens(ids=((4, 1),)))) == RankedTokens(ids=((4, 1),), probs=((),))


def test_a_row_whose_probabilities_do_not_match_its_ids_is_ranked_by_order_alone():
    """A replica's malformed row must not shift probabilities onto the wrong tokens: it is dropped,
    and mirror ranks that position's runner-ups by their order, as for a replica that sends none."""
    rows = [drafter_pb2.TokenAlternatives(ids=[4, 1, 7], probs=[0.5, 0.25]),
            drafter_pb2.TokenAlternatives(ids=[9, 2], probs=[0.5, 0.25])]
    ranked = ranked_from_proto(rows)
    assert ranked.ids == ((4, 1, 7), (9, 2))
    assert ranked.probs_at(0) is None and ranked.probs_at(1) == (0.5, 0.25)


def test_a_proposal_whose_alternatives_leave_the_vocabulary_is_refused():
    """A runner-up among them would reach the target's verify; refused at the front door, the
    drafter's answer turns drafting off for the request (target-only) instead of failing it."""
    import pytest
    import torch

    from mirrorspec.codec import encode_tensor
    from mirrorspec.config import InvalidRequest
    from mirrorspec.serving.convert import proposal_from_proto
    from mirrorspec.v1 import common_pb2

    q = common_pb2.ProposalDistribution(probs=common_pb2.TensorFrame(frame=encode_tensor(torch.eye(16)[[3]])))
    good = [drafter_pb2.TokenAlternatives(ids=[3, 5])]
    assert proposal_from_proto([3], q, 16, good).runner_up() == 5
    with pytest.raises(InvalidRequest) as err:
        proposal_from_proto([3], q, 16, [drafter_pb2.TokenAlternatives(ids=[3, 16])])
    assert err.value.field == "alternatives" and "[16]" in str(err.value)
