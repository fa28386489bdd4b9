import numpy as np
import pytest
import torch

from mirrorspec import InvalidRequest, SamplingParams
from mirrorspec.sampling import NonFiniteLogits, finite_logits, target_probs
from support import reference_probs


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (0.7, 5, 0.9), (2.0, 1, 1.0),
])
def test_matches_independent_reference(temperature, top_k, top_p):
    logits = torch.randn(20, 32, generator=torch.Generator().manual_seed(0)) * 3  # [rows, vocab]
    p = target_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert p.dtype == torch.float32
    for row, probs in zip(logits, p):
        np.testing.assert_allclose(probs.numpy(), reference_probs(row.numpy(), temperature, top_k, top_p), atol=1e-6)


def test_top_p_can_keep_a_single_token():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 5e-324])
def test_a_top_p_below_float32_s_range_keeps_the_top_token(top_p):
    """Such a top_p compares as 0 in float32: it dropped every token before (NaN rows)."""
    logits = torch.tensor([[1.0, 5.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


def test_numpy_and_torch_numbers_are_taken_as_plain_ones():
    import numpy as np

    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9),
                            max_new_tokens=torch.tensor(4), stop_token_ids=np.array([2, 7]))
    assert params == SamplingParams(temperature=0.5, top_k=3, top_p=0.9, max_new_tokens=4, stop_token_ids=(2, 7))
    assert type(params.top_k) is int and type(params.max_new_tokens) is int and type(params.temperature) is float


def test_a_0_d_tensor_or_array_is_taken_as_a_number_and_other_shapes_are_refused():
    """A temperature computed with torch or numpy is a 0-d tensor or array: it was "must be a number"."""
    params = SamplingParams(temperature=torch.tensor(0.5), top_p=np.array(0.9))
    assert params == SamplingParams(temperature=0.5, top_p=0.9) and type(params.temperature) is float
    for value in (torch.tensor([0.5]), np.array([0.5]), torch.tensor(True), torch.tensor(1j)):
        with pytest.raises(InvalidRequest, match="temperature must be a number"):
            SamplingParams(temperature=value)


def test_finite_logits_pass_untouched():
    logits = torch.tensor([[1.0, float("-inf"), 0.5], [0.0, 2.0, -1.0]])
    assert finite_logits(logits) is logits


def test_a_positive_infinity_is_the_softmax_s_limit_and_keeps_the_argmax():
    """A float16 head that overflows gives +inf: p was all NaN, and sampling drew column 0."""
    logits = torch.tensor([[0.0, float("inf"), 3.0, float("inf")], [0.0, 1.0, 2.0, 3.0]], dtype=torch.float16)
    fixed = finite_logits(logits)
    p = target_probs(fixed, SamplingParams(temperature=0.7))
    assert p[0].tolist() == [0.0, 0.5, 0.0, 0.5]
    assert torch.equal(fixed[1], logits[1]) and fixed.argmax(-1).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("row", [[0.0, float("nan"), 1.0], [float("-inf")] * 3], ids=["nan", "all-minus-inf"])
def test_logits_with_no_distribution_are_refused_naming_the_model(row):
    with pytest.raises(NonFiniteLogits, match="the draft model's logits hold NaN"):
        finite_logits(torch.tensor([[0.0, 1.0, 2.0], row]), model="draft")


def test_top_k_with_ties_keeps_exactly_k():
    p = target_probs(torch.zeros(1, 6), SamplingParams(temperature=1.0, top_k=2))
    assert int((p > 0).sum()) == 2
    assert torch.allclose(p.sum(), torch.tensor(1.0))


def test_greedy_is_one_hot_argmax_even_from_bf16():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]], dtype=torch.bfloat16)
    assert target_probs(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    # the wrong type: each said "temperature is NaN", or raised a bare TypeError or ValueError, or
    # passed True as 1 and 1.5 as token 1
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_p": "0.5"}, "top_p"),
    ({"top_k": True}, "top_k"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": "2"}, "stop_token_ids"),
    ({"stop_token_ids": ("a",)}, "stop_token_ids"),
    ({"stop_token_ids": (1.5,)}, "stop_token_ids"),
])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert field in str(err.value)
