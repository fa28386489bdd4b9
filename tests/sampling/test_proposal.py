import pytest
import torch

from mirrorspec.sampling import ProposalRows, sample_categorical
from support import chi_square_pvalue


def test_the_race_draws_each_index_with_its_probability():
    probs = torch.tensor([[0.05, 0.0, 0.15, 0.3, 0.5]])
    u = torch.rand(100_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    draws = sample_categorical(probs.expand(len(u), 5), u).tolist()
    assert chi_square_pvalue([(d,) for d in draws], {(i,): float(p) for i, p in enumerate(probs[0]) if p > 0}) > 1e-4
    assert sample_categorical(2 * probs.expand(3, 5), u[:3]).tolist() == draws[:3]  # unnormalised rows too


def inverse_cdf(probs, u):
    """The draw this module used before the race: where u lands in the cumulative sum."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True).squeeze(-1)


@pytest.mark.parametrize("sample, stable", [(sample_categorical, True), (inverse_cdf, False)])
def test_a_last_bit_change_in_the_logits_leaves_the_draw_where_it_was(sample, stable):
    """The same logits computed in another grouping of forward passes differ in their last bits
    (a served target's own prefill against prompt-and-window in one pass: up to ~5e-5 on the demo
    target). A seeded draw must not move for that. The inverse CDF does, wherever u lands in the
    long tail: a head token's tiny change shifts every cumulative sum after it by more than a tail
    token's whole mass (here 12 heavy tokens hold 88% at T=0.7, 49,140 others the rest)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 49_152, generator=generator)
    logits[0, torch.randint(0, 49_152, (12,), generator=generator)] += 7.0
    nudged = logits + 2e-5 * torch.randn(logits.shape, generator=generator)
    probs, nudged_probs = (torch.softmax(row / 0.7, -1) for row in (logits, nudged))
    u = torch.rand(1000, generator=generator, dtype=torch.float64)
    moved = sum(int(sample(probs, u[i:i + 1]) != sample(nudged_probs, u[i:i + 1])) for i in range(len(u)))
    assert (moved == 0) if stable else (moved > 20)  # 64 of 1000 moved by the inverse CDF


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


def test_dense_rows_of_a_narrower_draft_table_give_the_ids_past_it_no_mass():
    """A draft with 3 rows where the target has 5 (one tokenizer padded to two sizes)."""
    narrow = ProposalRows(probs=torch.tensor([[0.5, 0.3, 0.2]]))
    torch.testing.assert_close(narrow.dense(5), torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0]]))
    assert narrow.widened(3) is narrow and narrow.widened(5).probs.shape == (1, 5)
    with pytest.raises(ValueError, match="dense q has 3 columns, more than the vocabulary's 2"):
        narrow.dense(2)


def test_stacking_a_lookup_row_past_a_narrower_draft_table_keeps_its_mass():
    """Prompt lookup copies a target's padding id (4) that the draft's 3-row table lacks: a
    scatter into the draft's width failed with an index error."""
    stacked = ProposalRows.stack([ProposalRows.one_hot([4]), ProposalRows(probs=torch.tensor([[0.5, 0.3, 0.2]]))])
    torch.testing.assert_close(stacked.dense(5), torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0], [0.5, 0.3, 0.2, 0.0, 0.0]]))


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
