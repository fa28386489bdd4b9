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


def test_stacking_joins_cpu_lookup_rows_with_a_model_on_another_device():
    """Prompt lookup builds its one-hot rows on the CPU; a draft model on a GPU makes its rows
    there. The join must not mix devices (the GPU bench hit exactly this). The meta device
    stands in for the GPU, so the test runs on any machine."""
    lookup = ProposalRows.one_hot([5])
    sparse = ProposalRows(probs=torch.full((1, 3), 1 / 3, device="meta"), ids=torch.ones(1, 3, dtype=torch.int64,
                                                                                           device="meta"))
    dense = ProposalRows(probs=torch.full((1, 8), 1 / 8, device="meta"))
    for rows in ([lookup, sparse], [sparse, lookup], [lookup, dense]):
        stacked = ProposalRows.stack(rows)
        assert stacked.probs.device.type == "meta" and stacked.probs.shape[0] == 2
        assert stacked.ids is None or stacked.ids.device.type == "meta"
