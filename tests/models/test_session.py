"""KV-cache roll-back correctness: the cached session must agree with full uncached forwards."""

import inspect
import random

import pytest
import torch

from mirrorspec.models import KVSession, common_prefix_length
from support import MemoSession


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2]) == 2
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9, 8]) == 2  # a mirror branch forks here
    assert common_prefix_length([1, 2, 3, 4], [1, 2]) == 2
    assert common_prefix_length([5, 2], [1, 2, 3]) == 0


def test_random_append_score_and_rollback_match_full_forwards(tiny_dir):
    import support

    model = support.load(tiny_dir["target16"])
    session, reference = KVSession(model), MemoSession(model)
    rng = random.Random(0)
    context = [0, 5, 9]
    for _ in range(60):
        op = rng.choice(["append", "score", "rollback", "diverge"])
        if op == "rollback" and len(context) > 2:
            context = context[: rng.randint(1, len(context) - 1)]
        elif op == "diverge" and len(context) > 3:
            cut = rng.randint(1, len(context) - 1)
            context = context[:cut] + [rng.randrange(16) for _ in range(rng.randint(1, 4))]
        else:
            context = context + [rng.randrange(16) for _ in range(rng.randint(1, 5))]
        n = rng.randint(1, min(len(context), 6))
        got = session.logits_for(context, n)
        want = reference.logits_for(context, n)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert session.tokens == context and len(session) == len(context)


def test_explicit_rollback_then_rescoring_is_consistent(tiny_target):
    session = KVSession(tiny_target)
    full = session.logits_for([0, 1, 2, 3, 4, 5], 3)
    session.rollback(3)
    assert session.tokens == [0, 1, 2]
    torch.testing.assert_close(session.logits_for([0, 1, 2, 3, 4, 5], 3), full)
    session.rollback(0)
    assert session.tokens == []
    torch.testing.assert_close(session.logits_for([0, 1, 2, 3, 4, 5], 3), full)


def test_a_forward_that_fails_leaves_the_session_consistent(tiny_target):
    """The session used to record the fed tokens before the forward ran: after a failure (here a
    negative id) it claimed cache entries it did not hold, and the next call cropped
    real ones, scoring later positions against the wrong context without an error."""
    session = KVSession(tiny_target)
    expected = KVSession(tiny_target).logits_for([0, 1, 2, 3, 4, 5], 3)
    session.logits_for([0, 1, 2, 3], 1)
    with pytest.raises(IndexError):
        session.logits_for([0, 1, 2, 3, 4, -1], 2)
    torch.testing.assert_close(session.logits_for([0, 1, 2, 3, 4, 5], 3), expected)


def test_an_id_past_the_models_table_is_fed_as_id_0(padded_pair):
    """A draft with a narrower table than its target's (one tokenizer padded to two sizes) is fed
    the target's padding ids: as id 0, in single forwards and in branch batches alike."""
    import support

    model = support.load(padded_pair["draft"])  # 12 rows
    torch.testing.assert_close(KVSession(model).logits_for([3, 14, 5], 2), KVSession(model).logits_for([3, 0, 5], 2))
    batch = KVSession(model).fork([3, 5], [13, 4])
    torch.testing.assert_close(batch.step(), KVSession(model).fork([3, 5], [0, 4]).step())


def test_rows_forked_at_different_points_see_only_their_own_prefix(tiny_dir):
    """A batch of branches that fork at different points of one cached prefix: every row's logits,
    step after step, are those of its own sequence scored alone."""
    import support

    model = support.load(tiny_dir["target16"])
    session = KVSession(model)
    prefix, next_tokens, forks = [0, 5, 9, 3, 7, 2], [4, 11, 6, 4], [6, 2, 4, 1]
    batch = session.fork(prefix, next_tokens, forks)
    rows = [[*prefix[:f], c] for f, c in zip(forks, next_tokens)]
    for step in range(3):
        logits = batch.step()  # [4, vocab]
        for b, row in enumerate(rows):
            torch.testing.assert_close(logits[b], MemoSession(model).logits_for(row, 1)[0], rtol=1e-4, atol=1e-5)
        fed = [(b * 3 + step) % 16 for b in range(len(rows))]
        batch.feed(fed)
        rows = [[*row, t] for row, t in zip(rows, fed)]
    assert session.tokens == prefix  # the session itself is unchanged
    with pytest.raises(ValueError, match="fork points"):
        session.fork(prefix, next_tokens, [7, 2, 4, 1])  # past the prefix


def test_sessions_pass_the_cache_under_the_name_the_installed_transformers_uses(tiny_target):
    """transformers 5.24 renamed forward's past_key_values to cache: the old name warns on every
    run (users saw a FutureWarning from `mirrorspec generate`) and goes in 5.40."""
    import warnings

    from mirrorspec.models.session import cache_argument

    [keyword] = cache_argument(tiny_target, None)
    assert keyword in inspect.signature(type(tiny_target).forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        session = KVSession(tiny_target)
        session.logits_for([0, 1, 2], 2)
        session.logits_for([0, 1, 2, 3, 4], 3)
        session.fork([0, 1, 2], [3, 4]).step()


@pytest.mark.parametrize("cached", [0, 4, 8], ids=lambda c: f"cached{c}")
@pytest.mark.parametrize("k", [1, 3])
def test_the_runner_up_row_is_a_forward_over_the_runner_up_in_place_of_the_first_draft(tiny_dir, cached, k):
    """One pass scores the window's chain and, in a last row under a 4D mask, the runner-up for
    its first draft; rolled back, the session continues along either branch."""
    import support

    model = support.load(tiny_dir["target16"])
    reference = MemoSession(model)
    context = [1, 5, 3, 9, 2, 7, 4, 11, 6]  # its last k tokens are the window's drafts
    first = len(context) - k
    session = KVSession(model)
    if cached:
        session.logits_for(context[:cached], 1)
    rows = session.logits_with_runner_up(context, k + 1, runner_up=13)  # [k + 2, vocab]
    torch.testing.assert_close(rows[:k + 1], reference.logits_for(context, k + 1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rows[k + 1], reference.next_logits(context[:first] + [13]), rtol=1e-4, atol=1e-5)
    session.rollback(first)  # the runner-up won: its branch is fed afresh
    branch = context[:first] + [13, 8]
    torch.testing.assert_close(session.logits_for(branch, 2), reference.logits_for(branch, 2), rtol=1e-4, atol=1e-5)
    session.logits_with_runner_up(context, k + 1, runner_up=13)
    session.rollback(len(context) - 1)  # a chain verdict keeps a prefix of the drafts
    torch.testing.assert_close(session.logits_for(context, 1), reference.logits_for(context, 1), rtol=1e-4, atol=1e-5)
    assert session.tokens == context


def test_attention_reach_is_the_narrowest_window_any_layer_has():
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    from mirrorspec.models.session import attention_reach

    assert attention_reach(MistralConfig(sliding_window=8)) == 8
    assert attention_reach(MistralConfig(sliding_window=None)) is None
    assert attention_reach(Gemma2Config(sliding_window=16)) == 16  # alternating sliding and full layers
    assert attention_reach(Gemma2Config(sliding_window=16, layer_types=["full_attention"] * 26)) is None
    assert attention_reach(Qwen2Config(sliding_window=8, use_sliding_window=False)) is None
    assert attention_reach(LlamaConfig()) is None


def test_a_runner_up_past_a_sliding_window_is_refused_rather_than_scored_wrong(tmp_path):
    """Its 4D mask sees the whole context, and a model uses a 4D mask as it is, sliding layers too."""
    import support

    session = KVSession(support.load(support.save_tiny_llama(tmp_path / "m", seed=0, layers=2, sliding_window=8)))
    assert session.reach == 8
    assert session.logits_with_runner_up([1, 2, 3, 4, 5, 6, 7, 1], 3, 5).shape[0] == 4
    with pytest.raises(ValueError, match=r"a runner-up in a 9-token sequence is past this model's attention "
                                         r"reach \(8\)"):
        session.logits_with_runner_up([1, 2, 3, 4, 5, 6, 7, 1, 2], 3, 5)


@pytest.mark.parametrize("kind", ["bloom", "falcon-alibi", "falcon"])
def test_models_with_alibi_verify_the_chain_alone_rather_than_crash_on_a_runner_up(tmp_path, kind):
    """A runner-up is scored under a 4D mask at its own position ids, which ALiBi models build
    their bias without (Bloom: a bare ValueError from transformers' ``build_alibi_tensor`` on
    every runner-up window, a review's find). They verify chains, and their output stays the
    target's; Falcon without ALiBi (rotary) scores runner-ups as a Llama does."""
    from transformers import AutoModelForCausalLM, BloomConfig, FalconConfig

    from mirrorspec import SamplingParams, generate

    # weights drawn wide enough that greedy output does not repeat one token
    config = (BloomConfig(vocab_size=32, hidden_size=32, n_head=4, n_layer=2, initializer_range=0.3) if kind == "bloom"
              else FalconConfig(vocab_size=32, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                initializer_range=0.3, alibi=kind == "falcon-alibi", new_decoder_architecture=False))
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        paths.append(tmp_path / f"m{seed}")
        AutoModelForCausalLM.from_config(config).save_pretrained(paths[-1])
    target, draft = (AutoModelForCausalLM.from_pretrained(p) for p in paths)
    session = KVSession(target)
    assert session.reach == (None if kind == "falcon" else 0)
    params = SamplingParams(max_new_tokens=24)
    alone = generate(target, None, [1, 5, 9, 3], params)
    # the draft is the target with noise, so its drafts are sometimes rejected and a runner-up offered
    with torch.no_grad():
        for name, weight in draft.named_parameters():
            weight.copy_(dict(target.named_parameters())[name] + 0.1 * torch.randn_like(weight))
    spec = generate(target, draft, [1, 5, 9, 3], params, num_speculative_tokens=4, runner_up=True)
    assert spec.token_ids == alone.token_ids and spec.stats.rejected > 0 and len(set(alone.token_ids)) > 2
    if kind != "falcon":
        assert spec.stats.runner_up_hits == 0
        with pytest.raises(ValueError, match="cannot score a runner-up: it takes no 4D attention mask"):
            session.logits_with_runner_up([1, 5, 9, 3], 2, 7)
    else:
        assert session.logits_with_runner_up([1, 5, 9, 3], 2, 7).shape[0] == 3
