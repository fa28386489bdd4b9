"""Edge cases of modified rejection sampling, plus a vectorised statistical test of one window."""

import pytest
import torch
from scipy import stats

import mirrorspec.sampling.rejection as rejection_module
from mirrorspec.sampling import (
    ProposalRows,
    Stream,
    greedy_verify,
    recovery_distribution,
    rejection_sample,
    runner_up_sample,
    sample_categorical,
    sample_proposal,
    uniforms,
)


def u(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_p_equal_q_accepts_everything_and_draws_the_bonus_from_p():
    p = torch.tensor([[0.5, 0.3, 0.2]]).repeat(4, 1)  # [k + 1, vocab]
    draft = torch.tensor([[0, 1, 2]])
    u_next = torch.tensor([[0.0, 0.0, 0.0, 0.9]], dtype=torch.float64)
    n, nxt = rejection_sample(draft, p[:3].unsqueeze(0), p.unsqueeze(0), u(1, 3), u_next)
    assert n.tolist() == [3] and nxt.tolist() == sample_categorical(p[3:], u_next[0, 3:]).tolist()  # the bonus slot's draw


def test_disjoint_supports_reject_at_once_and_recover_from_p():
    q = torch.tensor([[[1.0, 0.0, 0.0]]])  # [1, k=1, vocab]
    p = torch.tensor([[[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]]])
    recovered = set()
    for uu in torch.rand(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64).tolist():
        n, nxt = rejection_sample(torch.tensor([[0]]), q, p, torch.tensor([[0.0]]),
                                  torch.tensor([[uu, 0.0]], dtype=torch.float64))
        assert n.item() == 0 and nxt.item() == sample_categorical(p[0, :1], torch.tensor([uu], dtype=torch.float64))
        recovered.add(nxt.item())
    assert recovered == {1, 2}  # from p's own support, never the rejected token


def test_residual_never_picks_a_token_with_zero_residual():
    p = torch.tensor([0.6, 0.4, 0.0])
    q = torch.tensor([0.0, 0.5, 0.5])  # q has zeros; residual = [0.6, 0, 0]
    r = recovery_distribution(p, q)
    assert torch.allclose(r, torch.tensor([1.0, 0.0, 0.0]))


def test_residual_mass_near_zero_falls_back_to_p():
    p = torch.tensor([0.5, 0.5])
    q = p + torch.tensor([1e-9, -1e-9])
    assert torch.allclose(recovery_distribution(p, q), p)


def test_a_nan_q_is_always_rejected_and_the_token_drawn_from_p():
    """A draft whose logits overflowed has a NaN q: every accept test fails, and the residual's
    mass is NaN, which now falls back to p (it drew column 0 every time)."""
    p = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]])  # [1, k + 1, vocab]
    q = torch.full((1, 1, 4), float("nan"))
    assert torch.equal(recovery_distribution(p[:, 0], q[:, 0]), p[:, 0])
    for seed in range(20):
        u_next = uniforms(seed, [0, 1], Stream.NEXT).unsqueeze(0)
        n, token = rejection_sample(torch.tensor([[0]]), q, p, torch.full((1, 1), 0.5), u_next)
        assert n.item() == 0 and token.item() == sample_categorical(p[:, 0], u_next[:, 0]).item()


def test_one_hot_q_accepts_with_probability_p_of_the_draft():
    batch = 200_000
    p = torch.tensor([0.3, 0.5, 0.2])
    q = torch.tensor([0.0, 1.0, 0.0])  # deterministic proposal of token 1
    n, nxt = rejection_sample(torch.ones(batch, 1, dtype=torch.long), q.expand(batch, 1, 3),
                              torch.stack([p, p]).expand(batch, 2, 3), u(batch, 1), u(batch, 2, seed=1))
    assert abs(n.float().mean().item() - 0.5) < 0.005
    rejected = nxt[n == 0]
    assert not (rejected == 1).any()  # the residual excludes the proposed token
    assert abs((rejected == 0).float().mean().item() - 0.6) < 0.01  # 0.3 / (0.3 + 0.2)


def test_greedy_accepts_while_draft_equals_argmax():
    argmax = torch.tensor([[4, 2, 7, 1], [4, 2, 7, 1]])  # [batch, k + 1]
    draft = torch.tensor([[4, 2, 7], [4, 3, 7]])
    n, nxt = greedy_verify(draft, argmax)
    assert n.tolist() == [3, 1] and nxt.tolist() == [1, 2]  # bonus; recovered


def test_sample_categorical_never_returns_zero_probability_or_out_of_range():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]])
    u = torch.cat([torch.tensor([0.0, 0.5, 1.0 - 2**-53], dtype=torch.float64), torch.rand(20_000, dtype=torch.float64)])
    idx = sample_categorical(probs.expand(len(u), 5), u)
    assert set(idx.tolist()) == {1, 3} and abs((idx == 1).double().mean().item() - 0.3) < 0.015


def test_sparse_proposal_samples_the_id_not_the_slot():
    rows = ProposalRows(probs=torch.tensor([[0.0, 1.0]]), ids=torch.tensor([[9, 4]]))
    assert sample_proposal(rows, torch.tensor([0.3], dtype=torch.float64)).tolist() == [4]
    assert rows.dense(10)[0, 4] == 1.0 and rows.dense(10).sum() == 1.0


def one_window_pvalue(k: int, seed: int) -> float:
    """Marginal of the first emitted token of one window vs p, over 200k windows in one call."""
    g = torch.Generator().manual_seed(seed)
    vocab, batch = 6, 200_000
    p1 = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)  # [k, vocab]
    p = torch.cat([p1.unsqueeze(0), torch.softmax(torch.randn(k, vocab, generator=g), -1)])  # [k + 1, vocab]
    drafts = torch.multinomial(q, batch, replacement=True, generator=g).T  # [batch, k]
    n, nxt = rejection_sample(drafts, q.expand(batch, k, vocab), p.expand(batch, k + 1, vocab),
                              u(batch, k, seed=seed + 1), u(batch, k + 1, seed=seed + 2))
    first = torch.where(n > 0, drafts[:, 0], nxt)
    observed = torch.bincount(first, minlength=vocab).double()
    expected = p1.double() / p1.double().sum() * batch
    return float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_first_token_of_a_window_is_distributed_as_p(k):
    assert one_window_pvalue(k, seed=k) > 1e-4


def test_the_window_test_catches_a_residual_bug(monkeypatch):
    monkeypatch.setattr(rejection_module, "recovery_distribution", lambda p, q: p)
    assert one_window_pvalue(3, seed=3) < 1e-6


def first_slot_with_runner_up_pvalue(seed: int, sampler=runner_up_sample) -> float:
    """Marginal of a window's first token where its first draft, once rejected, gets a second round
    against a runner-up that depends on the first draft (the next id: any rule that does not look
    at the target will do), over 200k windows in one call."""
    g = torch.Generator().manual_seed(seed)
    vocab, batch = 6, 200_000
    p = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)  # [k + 1, vocab]
    q = torch.softmax(torch.randn(1, vocab, generator=g) * 1.5, -1)  # [k, vocab]
    drafts = torch.multinomial(q, batch, replacement=True, generator=g).T  # [batch, 1]
    n, nxt = rejection_sample(drafts, q.expand(batch, 1, vocab), p.expand(batch, 2, vocab),
                              u(batch, 1, seed=seed + 1), u(batch, 2, seed=seed + 2))
    runner_up = (drafts[:, 0] + 1) % vocab  # [batch]
    taken, recovered = sampler(p[0].expand(batch, vocab), q[0].expand(batch, vocab), runner_up,
                               u(batch, seed=seed + 3), u(batch, 2, seed=seed + 2)[:, 0])
    first = torch.where(n > 0, drafts[:, 0], torch.where(taken, runner_up, recovered))
    assert 0 < int(taken.sum()) < int((n == 0).sum())  # both outcomes of the second round happen
    observed = torch.bincount(first, minlength=vocab).double()
    return float(stats.chisquare(observed.numpy(), (p[0].double() / p[0].double().sum() * batch).numpy()).pvalue)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_runner_up_keeps_the_first_token_distributed_as_p(seed):
    assert first_slot_with_runner_up_pvalue(seed) > 1e-4


def test_a_runner_up_is_kept_with_its_residual_probability():
    p, q = torch.tensor([[0.1, 0.3, 0.6]]), torch.tensor([[0.7, 0.3, 0.0]])  # residual [0, 0, 1]
    taken, _ = runner_up_sample(p, q, torch.tensor([2]), torch.tensor([1.0 - 2**-53], dtype=torch.float64),
                                torch.tensor([0.5], dtype=torch.float64))
    assert taken.tolist() == [True]
    p, q = torch.tensor([[0.1, 0.5, 0.4]]), torch.tensor([[0.6, 0.0, 0.4]])  # residual [0, 1, 0]
    for uu in (0.0, 0.99):
        taken, recovered = runner_up_sample(p, q, torch.tensor([2]), torch.tensor([uu], dtype=torch.float64),
                                            torch.tensor([uu], dtype=torch.float64))
        assert taken.tolist() == [False] and recovered.tolist() == [1]


def kept_with_p(p_first, q_first, runner_up, u_runner_up, u_next):
    """Planted bug: the runner-up judged as if it were a first draft, against p rather than the
    residual the rejected first draft left: that draft's mass is then spent twice."""
    return runner_up_sample(p_first, torch.zeros_like(q_first), runner_up, u_runner_up, u_next)


def test_the_runner_up_test_catches_a_runner_up_kept_with_p():
    assert first_slot_with_runner_up_pvalue(1, sampler=kept_with_p) < 1e-6
