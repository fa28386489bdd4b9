"""Which dtype a model computes in (``resolve_dtype``, ``stored_dtype``)."""

import pytest
import torch
from transformers import LlamaForCausalLM

import support
from mirrorspec.config import InvalidRequest
from mirrorspec.models.loading import resolve_dtype, stored_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("stored", [None, torch.float32, torch.bfloat16, torch.float16])
def test_auto_is_float32_on_cpu_whatever_the_checkpoint_holds(stored):
    assert resolve_dtype("auto", CPU, stored) == torch.float32


@pytest.mark.parametrize("stored, want", [(None, torch.float32), (torch.float32, torch.float32),
                                          (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_auto_on_cuda_keeps_a_half_precision_checkpoint_and_computes_the_rest_in_float32(stored, want):
    # a float32 checkpoint (the demo pair) stays float32 on a GPU: in bf16 its greedy speculative
    # output drifted from target-only's (H200), and it ran slower
    assert resolve_dtype("auto", CUDA, stored) == want


def test_a_named_dtype_wins_over_the_checkpoint_and_a_bad_name_names_the_field():
    assert resolve_dtype("bfloat16", CPU, torch.float32) == torch.bfloat16
    assert resolve_dtype("float32", CUDA, torch.bfloat16) == torch.float32
    with pytest.raises(InvalidRequest, match="dtype must be auto, float32, bfloat16 or float16") as err:
        resolve_dtype("fp8", CUDA)
    assert err.value.field == "dtype"


def test_stored_dtype_reads_what_the_checkpoint_was_saved_in(tmp_path):
    fp32 = support.save_tiny_llama(tmp_path / "fp32", seed=0)
    assert stored_dtype(str(fp32)) == torch.float32
    bf16 = tmp_path / "bf16"
    LlamaForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(bf16)
    assert stored_dtype(str(bf16)) == torch.bfloat16
