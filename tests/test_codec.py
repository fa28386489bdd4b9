import msgpack
import pytest
import torch

from mirrorspec import InvalidRequest
from mirrorspec.codec import decode_proposal, decode_tensor, encode_proposal, encode_tensor
from mirrorspec.sampling import ProposalRows


@pytest.mark.parametrize("tensor", [torch.rand(3, 5), torch.arange(12, dtype=torch.int64).reshape(3, 4),
                                    torch.tensor([], dtype=torch.float32), torch.ones(2, 2, dtype=torch.float16)])
def test_round_trip_is_exact(tensor):
    back = decode_tensor(encode_tensor(tensor))
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_sparse_q_is_small_and_round_trips():
    q = ProposalRows(probs=torch.softmax(torch.randn(4, 32), -1), ids=torch.randint(0, 49152, (4, 32)))
    probs, ids = encode_proposal(q)
    assert len(probs) + len(ids) < 8 * 1024  # the data-plane goal: <= 8 KB per window with sparse q
    back = decode_proposal(probs, ids, num_tokens=4, vocab_size=49152)
    assert torch.equal(back.probs, q.probs) and torch.equal(back.ids, q.ids)


def frame(array: torch.Tensor) -> bytes:
    return encode_tensor(array)


@pytest.mark.parametrize("probs,ids,num_tokens,message", [
    (b"garbage", None, 1, "not a valid tensor frame"),
    (msgpack.packb({"dtype": "float32", "shape": [2, 2], "data": b"1234"}), None, 2, "carries 4 bytes"),
    (frame(torch.full((1, 4), 0.25)), None, 2, "one row per draft token"),
    (frame(torch.tensor([[float("nan"), 1.0, 0.0, 0.0]])), None, 1, "NaN"),
    (frame(torch.tensor([[-0.5, 1.5, 0.0, 0.0]])), None, 1, "negative"),
    (frame(torch.tensor([[0.5, 0.2, 0.0, 0.0]])), None, 1, "sum to 1"),
    (frame(torch.tensor([[0.5, 0.5]])), frame(torch.tensor([[1, 9]], dtype=torch.int32)), 1, "q.ids must lie"),
    (frame(torch.tensor([[0.5, 0.5]])), None, 1, "columns"),
    (frame(torch.tensor([[1.0, 0.0, 0.0, 0.0]])), None, 1, "zero probability"),  # draft token 2 has q = 0
    # malformed headers: each was INTERNAL with a Python error (and a server traceback) before
    (msgpack.packb({"dtype": ["float32"], "shape": [1, 4], "data": b""}), None, 1, "unsupported dtype"),
    (msgpack.packb({"dtype": "float32", "shape": 4, "data": b"\0" * 16}), None, 1, "shape of non-negative ints"),
    (msgpack.packb({"dtype": "float32", "shape": [1, 4], "data": "x" * 16}), None, 1, "data of type str"),
    (msgpack.packb({"dtype": "float32", "shape": [1.0, 4], "data": b"\0" * 16}), None, 1, "shape of non-negative"),
    (msgpack.packb({"dtype": "float32", "shape": [1 << 32, 1 << 32], "data": b""}), None, 1, "carries 0 bytes"),
    # a float ids frame was truncated to other ids without a word
    (frame(torch.tensor([[0.5, 0.5]])), frame(torch.tensor([[2.9, 3.7]])), 1, "q.ids must be int32 or int64"),
], ids=lambda value: "frame" if isinstance(value, bytes) else None)
def test_malformed_q_is_rejected_with_a_reason(probs, ids, num_tokens, message):
    with pytest.raises(InvalidRequest, match=message):
        decode_proposal(probs, ids, num_tokens=num_tokens, vocab_size=4, draft_tokens=[2] * num_tokens)


def test_dense_rows_of_a_narrower_draft_table_are_checked_against_its_width():
    """A draft whose table has 3 rows where the target's vocabulary has 5: its dense rows are 3
    wide, its sparse ids (a lookup's copies) may be any target id, and a draft token past the
    dense width has no mass (an IndexError in the mass check, had the width not been read). A
    lookup's copy of id 3 joined with dense model rows makes them 4 wide (``ProposalRows.stack``:
    refused, it turned a replica's drafting off; review of stop 60)."""
    dense, _ = encode_proposal(ProposalRows(probs=torch.tensor([[0.5, 0.3, 0.2]])))
    rows = decode_proposal(dense, None, num_tokens=1, vocab_size=5, draft_tokens=[1], min_dense_width=3)
    torch.testing.assert_close(rows.widened(5).probs, torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0]]))
    with pytest.raises(InvalidRequest, match="a draft token has zero probability under its own q row"):
        decode_proposal(dense, None, num_tokens=1, vocab_size=5, draft_tokens=[4], min_dense_width=3)
    with pytest.raises(InvalidRequest, match=r"dense q.probs must have 5 columns \(the vocabulary\), got 3"):
        decode_proposal(dense, None, num_tokens=1, vocab_size=5, draft_tokens=[1])
    probs, ids = encode_proposal(ProposalRows.one_hot([4]))
    assert decode_proposal(probs, ids, num_tokens=1, vocab_size=5, draft_tokens=[4],
                           min_dense_width=3).ids.tolist() == [[4]]
    joined, _ = encode_proposal(ProposalRows.stack([ProposalRows.one_hot([3]), ProposalRows(probs=torch.tensor(
        [[0.5, 0.3, 0.2]]))]))
    rows = decode_proposal(joined, None, num_tokens=2, vocab_size=5, draft_tokens=[3, 0], min_dense_width=3)
    torch.testing.assert_close(rows.widened(5).probs, torch.tensor([[0, 0, 0, 1.0, 0], [0.5, 0.3, 0.2, 0, 0]]))
    for width in (2, 6):
        narrow_or_wide, _ = encode_proposal(ProposalRows(probs=torch.full((1, width), 1 / width)))
        with pytest.raises(InvalidRequest, match=r"must have 3 \(the draft table\) to 5 \(the vocabulary\) columns"):
            decode_proposal(narrow_or_wide, None, num_tokens=1, vocab_size=5, draft_tokens=[0], min_dense_width=3)


def test_a_q_row_off_by_more_than_rounding_is_divided_by_its_sum_and_one_within_it_kept_bit_for_bit():
    """A row off by up to the tolerance biased the accept test by as much (review 3: p = [.5, .5] and
    q = [1.0009, 0] kept token 0 with probability 0.49955). float32 softmax rows sum within ~5e-6."""
    off = torch.tensor([[0.6 * 1.0009, 0.4 * 1.0009], [0.5, 0.5]])  # [k, vocab]: rows sum to 1.0009 and 1
    q = decode_proposal(encode_tensor(off), None, num_tokens=2, vocab_size=2)
    assert torch.allclose(q.probs[0], torch.tensor([0.6, 0.4]), atol=1e-7) and torch.equal(q.probs[1], off[1])
    near = torch.softmax(torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)) * 4, dim=-1)
    assert torch.equal(decode_proposal(encode_tensor(near), None, num_tokens=3, vocab_size=49152).probs, near)
