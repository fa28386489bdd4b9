import torch

from mirrorspec.sampling import ProposalRows


def test_stacking_rows_of_different_widths_keeps_every_rows_mass():
    """A one-hot lookup row (width 1) beside a model's top-3 row: the narrow row is padded, and
    padding that repeats id 0 must not wipe a real mass on id 0 (as a plain scatter would)."""
    lookup = ProposalRows.one_hot([0])
    model = ProposalRows(probs=torch.tensor([[0.5, 0.3, 0.2]]), ids=torch.tensor([[4, 0, 2]]))
    stacked = ProposalRows.stack([lookup, model])
    assert stacked.ids.shape == (2, 3)
    torch.testing.assert_close(stacked.dense(5), torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0], [0.3, 0.0, 0.2, 0.0, 0.5]]))


def test_stacking_sparse_beside_dense_rows_gives_dense_rows():
    dense = ProposalRows(probs=torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    stacked = ProposalRows.stack([ProposalRows.one_hot([2, 1]), dense])
    assert stacked.ids is None
    torch.testing.assert_close(stacked.probs, torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0],
                                                           [0.1, 0.2, 0.3, 0.4]]))
