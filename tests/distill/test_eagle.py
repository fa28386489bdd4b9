import pytest
import torch
from transformers import DynamicCache

from mirrorspec.distill.eagle import (
    EagleHead,
    EagleRecipe,
    FeatureExample,
    agreement,
    draft_chain,
    load_feature_examples,
    train_head,
)
from mirrorspec.distill.teacher import write_teacher_data


def feature_examples(target, tmp_path, n=48, new_tokens=10):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16, (5,), generator=generator).tolist() for _ in range(n)]
    shards = write_teacher_data(target, prompts, tmp_path / "teacher", batch_size=8, max_new_tokens=new_tokens,
                                stop_ids=[], top_k=4, seed=0, features=True)
    return load_feature_examples(shards)


def test_training_raises_agreement_and_leaves_the_target_untouched(tiny_dir, tmp_path):
    import support

    target = support.load(tiny_dir["target16"])
    examples = feature_examples(target, tmp_path)
    head = EagleHead(target, list(range(16)))
    before = agreement(head, examples)
    losses = []
    train_head(head, examples, EagleRecipe(epochs=40, batch_tokens=120, learning_rate=3e-3),
               on_step=lambda step, total, loss, match: losses.append(loss))
    after = agreement(head, examples)
    assert after > before + 0.2, (before, after)
    assert sum(losses[-5:]) < sum(losses[:5])
    assert torch.equal(head.body.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(head.head_rows, target.lm_head.weight)


def test_chained_drafts_with_a_cache_equal_a_recompute_from_scratch(tiny_dir):
    """``draft_chain`` keeps the head's cache across windows, appending true inputs and dropping
    the drafts' own: every window must draft what a fresh pass over the whole history drafts."""
    import support

    target = support.load(tiny_dir["target16"])
    head = EagleHead(target, [1, 2, 3, 5, 8, 13, 15]).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))  # a head with opinions of its own
    tokens = torch.tensor([0, 4, 9, 2, 7, 7, 1, 12, 3, 5, 6, 11, 14, 2])
    with torch.inference_mode():
        features = target.get_decoder()(input_ids=tokens[None, :-1]).last_hidden_state[0]
    cache, fed = DynamicCache(), 0
    for committed, k in [(4, 3), (6, 1), (7, 4), (11, 2), (12, 3)]:
        drafts, fed = draft_chain(head, features, tokens, committed, k, cache, fed)
        fresh, _ = draft_chain(head, features, tokens, committed, k, DynamicCache(), 0)
        assert drafts == fresh and len(drafts) == k
        assert set(drafts) <= set(head.vocab.tolist())
        assert fed == committed - 1 and cache.get_seq_length() == fed


def test_trained_state_round_trips_without_the_targets_embedding(tiny_dir):
    import support

    target = support.load(tiny_dir["target16"])
    head = EagleHead(target, [0, 3, 4])
    with torch.no_grad():
        head.fc.bias.add_(1.0)
    state = head.trained_state()
    assert "body.embed_tokens.weight" not in state and "vocab" in state
    again = EagleHead(target, [0, 1, 2, 5, 6])  # built over another sub-vocabulary, of another size
    again.load_trained_state(state)
    assert torch.equal(again.fc.bias, head.fc.bias) and again.vocab.tolist() == [0, 3, 4]
    assert torch.equal(again.head_rows, target.lm_head.weight[[0, 3, 4]])
    with pytest.raises(ValueError, match="vocab"):
        again.load_trained_state({k: v for k, v in state.items() if k != "vocab"})
    with pytest.raises(ValueError, match="unexpected"):
        again.load_trained_state({**state, "body.layers.1.mlp.up_proj.weight": torch.zeros(1)})


def test_misfits_are_clear_errors(tiny_dir):
    """A head deeper than its target, a sub-vocabulary beyond the target's ids, a chain with no
    feature to start from, a training run of no epochs: each a ValueError that says which."""
    import support

    target = support.load(tiny_dir["target16"])  # 2 layers, 16 ids
    with pytest.raises(ValueError, match="layers must be in"):
        EagleHead(target, [0, 1], layers=3)
    with pytest.raises(ValueError, match="sub-vocabulary"):
        EagleHead(target, [0, 16])
    head = EagleHead(target, [0, 1])
    with pytest.raises(ValueError, match="another target"):
        head.load_trained_state({**head.trained_state(), "vocab": torch.tensor([3, 40])})
    with pytest.raises(ValueError, match="at least 2 committed"):
        draft_chain(head, torch.zeros(0, 16), torch.tensor([5]), 1, 2, DynamicCache(), 0)
    for epochs in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="epochs"):
            train_head(head, [FeatureExample(torch.arange(6), 2, torch.zeros(5, 16, dtype=torch.float16))],
                       EagleRecipe(epochs=epochs))
