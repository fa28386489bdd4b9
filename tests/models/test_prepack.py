"""oneDNN weight prepacking: same function as nn.Linear, swapped in only where it applies."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mirrorspec.models import KVSession, load_causal_lm
from mirrorspec.models.prepack import PackedLinear, can_prepack, is_prepacked, prepack_linears
from support import load

needs_onednn = pytest.mark.skipif(not can_prepack(torch.ones(1)), reason="this CPU/build has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (1, 3, 24), (2, 4, 24)])
def test_packed_linear_computes_what_nn_linear_does(shape):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    packed = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        got, want = packed(x), linear(x)
    assert packed.packed and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_calls_the_packed_weight_does_not_fit_run_f_linear_on_the_original():
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    packed = PackedLinear(weight)
    x = torch.randn(3, 24, requires_grad=True)
    y = packed(x)  # gradients wanted: the packed op has no backward, so this must be the plain path
    assert torch.equal(y, F.linear(x, weight))
    y.sum().backward()
    assert x.grad is not None
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # autocast must still apply
        got = packed(x.detach())
        assert got.dtype == torch.bfloat16 and torch.equal(got, F.linear(x.detach(), weight))
    assert not PackedLinear(weight, pack=False).packed


@needs_onednn
def test_a_prepacked_model_gives_the_same_logits_and_keeps_its_weights(tiny_dir):
    plain, model = load(tiny_dir["target16"]), load(tiny_dir["target16"])
    keys = set(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert is_prepacked(model) and not any(type(m) is nn.Linear for m in model.modules())
    assert set(model.state_dict()) == keys  # the packed copies are not state
    ids = torch.tensor([[0, 5, 9, 3, 14, 2]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-5)


@needs_onednn
def test_tied_embeddings_stay_tied(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    prepack_linears(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_prepacking_leaves_models_it_does_not_apply_to_alone(tiny_dir):
    bf16 = load(tiny_dir["target16"]).bfloat16()
    assert prepack_linears(bf16) == 0 and not is_prepacked(bf16)


@needs_onednn
def test_load_causal_lm_prepacks_unless_told_not_to(tiny_dir):
    assert is_prepacked(load_causal_lm(str(tiny_dir["target16"]), tokenizer=False).model)
    assert not is_prepacked(load_causal_lm(str(tiny_dir["target16"]), tokenizer=False, prepack=False).model)


@needs_onednn
def test_a_sub_vocabulary_session_of_a_prepacked_model_scores_the_same_rows(tiny_dir):
    model = load_causal_lm(str(tiny_dir["target16"]), tokenizer=False).model
    rows = torch.tensor([1, 4, 7, 15])
    full, sub = KVSession(model), KVSession(model, output_rows=rows)
    context = [0, 5, 9, 3]
    torch.testing.assert_close(sub.logits_for(context, 2), full.logits_for(context, 2)[:, rows], rtol=1e-4, atol=1e-5)
