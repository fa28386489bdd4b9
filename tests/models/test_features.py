import pytest
import torch
from transformers import DynamicCache

from mirrorspec.models.features import FeatureTap, final_norm
from mirrorspec.models.session import cache_argument


def base_features(model, ids):
    """The post-norm last hidden state, straight from the decoder (what the LM head reads)."""
    with torch.inference_mode():
        return model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]


def test_the_tap_keeps_what_the_lm_head_reads_for_every_position(tiny_target):
    ids = [0, 3, 5, 2, 6, 1]
    with torch.inference_mode(), FeatureTap(tiny_target) as tap:
        logits = tiny_target(torch.tensor([ids])).logits[0]
        features = tap.take()[0]
        head_logits = tiny_target.lm_head(features)
    torch.testing.assert_close(features, base_features(tiny_target, ids))
    torch.testing.assert_close(head_logits, logits)


def test_incremental_forwards_give_the_features_of_the_positions_they_read(tiny_target):
    ids = [0, 3, 5, 2, 6, 1]
    cache = DynamicCache()
    with torch.inference_mode(), FeatureTap(tiny_target) as tap:
        tiny_target(torch.tensor([ids[:4]]), **cache_argument(tiny_target, cache), use_cache=True)
        tiny_target(torch.tensor([ids[4:]]), **cache_argument(tiny_target, cache), use_cache=True, logits_to_keep=1)
        features = tap.take()[0]  # both forwards, in order; logits_to_keep does not thin them
    torch.testing.assert_close(features, base_features(tiny_target, ids), atol=1e-5, rtol=1e-5)


def test_the_tap_lets_go_of_the_model_on_exit_and_take_needs_a_forward(tiny_target):
    with FeatureTap(tiny_target) as tap:
        with pytest.raises(RuntimeError, match="no forward"):
            tap.take()
    with torch.inference_mode():
        tiny_target(torch.tensor([[1, 2]]))
    assert not final_norm(tiny_target)._forward_hooks
    with pytest.raises(RuntimeError):
        tap.take()  # nothing was kept outside the block
