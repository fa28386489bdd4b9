"""Int8 weight-only linears: every inference call on the int8 weights, one row computed the same in
any batch, and the guards that keep the private kernel away from shapes and CPUs it gets wrong."""

import pytest
import torch
from torch import nn

import mirrorspec.models.quantize as quantize_module
from mirrorspec.config import InvalidRequest
from mirrorspec.models import KVSession, load_causal_lm
from mirrorspec.models.prepack import PackedLinear
from mirrorspec.models.quantize import (Int8Linear, can_quantize, int8_linear, is_quantized, quantize_linears,
                                        quantize_rows)
from support import load

needs_int8 = pytest.mark.skipif(not can_quantize(torch.ones(4, 32)), reason="this build has no int8 weight kernel")


def _linear(out_features: int, in_features: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias)


def test_rows_are_quantized_symmetrically_to_127():
    weight = torch.tensor([[0.5, -1.0, 0.25], [2.0, 0.0, -0.5]])
    q, scales = quantize_rows(weight)
    assert q.dtype == torch.int8 and q.tolist() == [[64, -127, 32], [127, 0, -32]]
    assert torch.allclose(q.float() * scales.float()[:, None], weight, atol=0.02)


@needs_int8
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (1, 2, 64), (3, 1, 64), (40, 64), (2, 9, 64)])
def test_calls_of_any_width_run_the_int8_weights(shape):
    linear = _linear(48, 64)
    quantized = int8_linear(linear)
    assert isinstance(quantized, Int8Linear)
    x = torch.randn(shape)
    q, scales = quantize_rows(linear.weight)
    with torch.inference_mode():
        got = quantized(x)
        # what the int8 path computes: bf16 activations against the dequantized rows, plus the bias
        want = x.to(torch.bfloat16).float() @ (q.float() * scales.float()[:, None]).T + linear.bias
        assert got.shape == linear(x).shape
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert not torch.equal(got, linear(x))  # it really is another path than float32


@needs_int8
@pytest.mark.parametrize("in_features, out_features", [(64, 48), (576, 1536), (1536, 576), (576, 8192)])
def test_a_row_is_computed_the_same_alone_and_in_any_batch(in_features, out_features):
    """What keeps a seeded request reproducible with an int8 draft: a position's logits must not
    depend on whether it was stepped alone, caught up with others, prefilled, or batched with other
    branches (the demo draft's shapes, and a small one)."""
    quantized = int8_linear(_linear(out_features, in_features))
    x = torch.randn(70, in_features)
    with torch.inference_mode():
        wide = quantized(x)
        for rows in (1, 2, 3, 5, 17):
            assert torch.equal(quantized(x[:rows]), wide[:rows])
        assert all(torch.equal(quantized(x[i:i + 1]), wide[i:i + 1]) for i in range(0, 70, 9))


@needs_int8
def test_gradients_run_the_float32_weights():
    linear = _linear(48, 64)
    quantized = int8_linear(linear)
    x = torch.randn(1, 64, requires_grad=True)
    y = quantized(x)
    assert torch.equal(y, linear(x))
    y.sum().backward()
    assert x.grad is not None


def test_shapes_the_kernel_misreads_keep_their_linear():
    """in_features not a multiple of 16 made the kernel read past its rows (a segfault at 8, 12,
    20 and 40 on the CI CPU): such a layer must never reach it."""
    for in_features in (8, 12, 20, 40):
        linear = _linear(16, in_features)
        assert not can_quantize(linear.weight)
        assert int8_linear(linear) is linear
    bf16 = _linear(16, 32).to(torch.bfloat16)
    assert int8_linear(bf16) is bf16  # a GPU-style bf16 model stays as it is


@needs_int8
def test_a_kernel_that_disagrees_with_float32_at_load_is_not_used(monkeypatch):
    """The load-time probe: a kernel computing garbage for a shape (as the op has done) leaves the
    layer on float32 instead of silently wrecking the draft."""
    linear = _linear(48, 64)
    assert isinstance(int8_linear(linear), Int8Linear)
    monkeypatch.setattr(quantize_module, "_int8_matmul", lambda x, q, scales: torch.zeros(x.shape[0], q.shape[0]))
    assert int8_linear(linear) is linear


@needs_int8
def test_a_quantized_model_keeps_its_head_state_and_close_logits(tiny_dir):
    plain, model = load(tiny_dir["target16"]), load(tiny_dir["target16"])
    keys = set(model.state_dict())
    decoder_linears = sum(type(m) is nn.Linear for m in model.get_decoder().modules())
    assert quantize_linears(model) == decoder_linears > 0
    assert is_quantized(model) and type(model.get_output_embeddings()) is nn.Linear  # tied head left alone
    assert set(model.state_dict()) == keys  # the int8 copies are not state
    ids = torch.tensor([[0, 5, 9, 3, 14, 2]])
    with torch.inference_mode():
        got, reference = model(ids).logits, plain(ids).logits
        torch.testing.assert_close(got, reference, rtol=0.02, atol=0.1)  # logits span +-16 here
        assert not torch.equal(got, reference)  # the int8 path, not float32


@needs_int8
def test_a_sub_vocabulary_head_follows_the_model_into_int8(tiny_dir):
    model = load(tiny_dir["target16"])
    assert type(KVSession(model, torch.tensor([1, 3, 4]))._head) is PackedLinear
    quantize_linears(model)
    session = KVSession(model, torch.tensor([1, 3, 4]))
    assert isinstance(session._head, Int8Linear)
    logits = session.logits_for([0, 5, 9], 1)
    assert logits.shape == (1, 3) and torch.isfinite(logits).all()


def test_an_unknown_quantization_is_refused_naming_the_field(tiny_dir):
    from cluster.spec import StackSpec
    from drafter_service.servicer import DrafterConfig

    with pytest.raises(InvalidRequest, match="quantize must be one of none, int8") as err:
        load_causal_lm(str(tiny_dir["draft16"]), tokenizer=False, quantize="int4")
    assert err.value.field == "quantize"
    with pytest.raises(InvalidRequest) as err:
        DrafterConfig(strategy="draft-model", model="x", quantize="fp8")
    assert err.value.field == "quantize"
    with pytest.raises(InvalidRequest) as err:
        StackSpec(draft_quantize="int4")
    assert err.value.field == "draft_quantize"


@needs_int8
def test_adaptive_k_counts_an_int8_draft_step_as_cheaper(tiny_dir):
    from mirrorspec.config import DRAFT_MODEL_STEP_COST, INT8_DRAFT_MODEL_STEP_COST
    from mirrorspec.drafting import DraftModelDrafter, HybridDrafter

    model = load(tiny_dir["draft16"])
    assert DraftModelDrafter(model).step_cost == DRAFT_MODEL_STEP_COST
    quantize_linears(model)
    assert DraftModelDrafter(model).step_cost == INT8_DRAFT_MODEL_STEP_COST < DRAFT_MODEL_STEP_COST
    assert HybridDrafter(DraftModelDrafter(model)).step_cost == INT8_DRAFT_MODEL_STEP_COST


@needs_int8
def test_sessions_on_one_model_share_its_sub_vocabulary_head(tiny_dir):
    """The head is built (packed, rounded to int8, probed) once per model and sub-vocabulary, not
    per session: a session is opened per request."""
    model = load(tiny_dir["target16"])
    quantize_linears(model)
    rows = torch.tensor([1, 3, 4])
    first, second = KVSession(model, rows), KVSession(model, rows)
    assert first._head is second._head
    assert KVSession(model, torch.tensor([1, 3, 5]))._head is not first._head
