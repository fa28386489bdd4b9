"""Which dtype a model computes in (``resolve_dtype``, ``stored_dtype``), and what a source that is
not a model gets: ``InvalidRequest`` naming it, never a transformers traceback."""

import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

import support
from mirrorspec.config import InvalidRequest
from mirrorspec.models.loading import load_causal_lm, read_config, resolve_dtype, stored_dtype

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
    assert stored_dtype(read_config(str(fp32))) == torch.float32
    bf16 = tmp_path / "bf16"
    LlamaForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(bf16)
    assert stored_dtype(read_config(str(bf16))) == torch.bfloat16
    assert load_causal_lm(str(bf16), dtype="auto", device="cpu", tokenizer=False).model.dtype == torch.float32


def _not_models(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_type = tmp_path / "no-model-type"
    no_type.mkdir()
    (no_type / "config.json").write_text("{}")
    no_weights = tmp_path / "no-weights"
    support.save_tiny_llama(tmp_path / "whole", seed=0)
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tmp_path / "whole" / "config.json").read_text())
    cut_short = tmp_path / "cut-short"  # an interrupted download or copy
    cut_short.mkdir()
    (cut_short / "config.json").write_text((tmp_path / "whole" / "config.json").read_text())
    (cut_short / "model.safetensors").write_bytes((tmp_path / "whole" / "model.safetensors").read_bytes()[:3000])
    not_weights = tmp_path / "not-weights"
    not_weights.mkdir()
    (not_weights / "config.json").write_text((tmp_path / "whole" / "config.json").read_text())
    (not_weights / "pytorch_model.bin").write_bytes(b"not a pickle of tensors")
    return {"an empty directory": (empty, "config.json"), "a config without model_type": (no_type, "model_type"),
            "a config without weights": (no_weights, "no-weights"),
            # these two were a SafetensorError and an UnpicklingError traceback from each server in turn
            "weights cut short": (cut_short, "cut-short"), "weights that are not weights": (not_weights, "not-weights")}


WEIGHTS_ONLY = ("a config without weights", "weights cut short", "weights that are not weights")


@pytest.mark.parametrize("case", ["an empty directory", "a config without model_type", *WEIGHTS_ONLY])
def test_a_source_that_is_not_a_model_is_an_invalid_request_that_says_what_would_load(tmp_path, case):
    source, says = _not_models(tmp_path)[case]
    with pytest.raises(InvalidRequest, match=says) as err:
        load_causal_lm(str(source), device="cpu", tokenizer=False)
    assert err.value.field == "model"
    assert "a checkpoint directory with a config.json" in str(err.value)
    if case not in WEIGHTS_ONLY:  # its config reads fine: only loading the weights can tell
        with pytest.raises(InvalidRequest, match=says):
            read_config(str(source))


@pytest.mark.parametrize("case", ["a config without model_type", "weights cut short"])
def test_a_damaged_copy_in_the_cache_is_named_with_its_folder_not_the_user_s_input(tmp_path, monkeypatch, case):
    """The demo target's converted checkpoint with its weights cut short said "cannot load a causal
    LM from demo-target: ... (pass ..., or demo-target)": the user's own input back, and no folder
    (review 23 of stop 48)."""
    import mirrorspec.models.demo_target as demo_target

    damaged, says = _not_models(tmp_path)[case]
    monkeypatch.setattr(demo_target, "ensure_demo_target", lambda: damaged)
    with pytest.raises(InvalidRequest, match=says) as err:
        load_causal_lm("demo-target", device="cpu", tokenizer=False)
    assert f"its copy built into the cache at {damaged} is damaged: delete that folder and run again" in str(err.value)
    assert "pass a checkpoint directory" not in str(err.value)


def test_weights_a_config_asks_for_and_the_checkpoint_lacks_are_refused_not_left_random(tmp_path, caplog):
    """A config.json copied over another checkpoint's loaded silently: layers missing from the
    weights were random (transformers reports them, and the CLI quiets its report), and layers the
    config has no room for were dropped (review 23 of stop 48)."""
    import json
    import logging
    import shutil

    small = support.save_tiny_llama(tmp_path / "small", seed=0, layers=1)
    big = support.save_tiny_llama(tmp_path / "big", seed=0, layers=2)
    mixed = tmp_path / "mixed"
    shutil.copytree(small, mixed)
    (mixed / "config.json").write_text((big / "config.json").read_text())  # 2 layers asked, 1 there
    with pytest.raises(InvalidRequest, match=r"weights lack \d+ tensors its config.json asks for \(e.g. "
                                             r"model.layers.1.*they would be random") as err:
        load_causal_lm(str(mixed), device="cpu", tokenizer=False)
    assert err.value.field == "model"
    shutil.copytree(big, tmp_path / "extra")
    (tmp_path / "extra" / "config.json").write_text(json.dumps(
        {**json.loads((big / "config.json").read_text()), "num_hidden_layers": 1}))
    with caplog.at_level(logging.WARNING, logger="mirrorspec.models.loading"):
        load_causal_lm(str(tmp_path / "extra"), device="cpu", tokenizer=False)  # loads, and says so
    assert "tensors its config.json does not use (e.g. model.layers.1" in caplog.text


@pytest.mark.parametrize("ids, needle", [
    ([1, 3, 20], "holds 20, outside the draft's 8-token vocabulary"),  # IndexError in a forward before
    ([-1, 2, 3], "holds -1, outside"),  # proposed id -1: an embedding IndexError
    ([], "is empty"),  # a oneDNN primitive descriptor error
    ("abc", "is a str, not a list"),
    ([1.5, 2], "holds 1.5, not a token id"),  # silently truncated to [1, 2]
    ([True, 2], "holds True, not a token id"),
    ([3, 3, 5], "lists 3 twice"),
])
def test_a_malformed_sub_vocabulary_is_refused_where_the_config_is_read(tmp_path, ids, needle):
    """A draft's hand-edited ``mirrorspec_draft_vocab`` crashed inside its first forward, and served,
    every session's open failed as INTERNAL while requests quietly ran target-only (review 27 of
    stop 49). It is refused when its config is read: by ``check_models`` before a launcher starts
    anything (naming --draft), and by every load."""
    import json

    from mirrorspec.models.loading import DRAFT_VOCAB_KEY, check_models

    target = support.save_tiny_llama(tmp_path / "target", seed=0)
    draft = support.save_tiny_llama(tmp_path / "draft", seed=1)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, DRAFT_VOCAB_KEY: ids}))
    with pytest.raises(InvalidRequest, match=f"{draft}'s config.json has a {DRAFT_VOCAB_KEY} that "
                                             f"{needle}.*each in \\[0, 8\\)") as err:
        check_models(str(target), str(draft))
    assert err.value.field == "draft"
    with pytest.raises(InvalidRequest, match=needle.replace("(", r"\(")) as err:
        load_causal_lm(str(draft), device="cpu", tokenizer=False)
    assert err.value.field == "model"
    (draft / "config.json").write_text(json.dumps({**config, DRAFT_VOCAB_KEY: [1, 3, 7]}))
    check_models(str(target), str(draft))  # a well-formed one loads
    assert load_causal_lm(str(draft), device="cpu", tokenizer=False).model.config.mirrorspec_draft_vocab == [1, 3, 7]


def test_a_model_without_a_tokenizer_is_named_when_one_is_asked_for(tmp_path):
    tiny = support.save_tiny_llama(tmp_path / "tiny", seed=0)
    assert load_causal_lm(str(tiny), device="cpu", tokenizer=False).tokenizer is None
    with pytest.raises(InvalidRequest, match="cannot load a tokenizer from .*pass a model directory with its "
                                             "tokenizer files") as err:
        load_causal_lm(str(tiny), device="cpu", tokenizer=True)
    assert err.value.field == "model"


@pytest.mark.parametrize("kind", ["gpt2", "gemma2"])
def test_a_model_without_a_tokenizer_is_named_where_transformers_builds_an_empty_one(tmp_path, kind):
    """For a Llama folder with no tokenizer files transformers raises; for GPT-2 and Gemma it builds
    a tokenizer of special tokens alone, and the CLI said "input_ids is empty" of a prompt, or ran
    on "hello world" as one unknown token and printed "" (a review's find)."""
    from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config

    from mirrorspec.models.loading import try_load_tokenizer

    config = (GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2) if kind == "gpt2" else
              Gemma2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / kind)
    with pytest.raises(InvalidRequest, match="cannot load a tokenizer from .*found no tokenizer files: transformers "
                                             "built a .*Tokenizer that holds its \\d+ special tokens alone .*pass a "
                                             "model directory with its tokenizer files") as err:
        load_causal_lm(str(tmp_path / kind), device="cpu")
    assert err.value.field == "model"
    assert try_load_tokenizer(str(tmp_path / kind)) is None  # as for a folder transformers refuses


@pytest.fixture(scope="module")
def demo_tokenizer():
    from mirrorspec.models.loading import try_load_tokenizer

    return try_load_tokenizer("demo-target")


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "usr", "content": "hi"}], "chat message 0 has role 'usr'; use one of system, user, assistant, tool"),
    ([{"role": "user", "content": "hi"}, {"role": "", "content": "x"}], "chat message 1 has role ''"),
])
def test_a_chat_role_the_model_never_saw_is_refused_before_the_template_prints_it(demo_tokenizer, messages, needle):
    from mirrorspec.models.loading import encode_chat

    with pytest.raises(InvalidRequest, match=needle) as err:
        encode_chat(demo_tokenizer, messages)
    assert err.value.field == "chat"


def test_a_chat_the_template_refuses_or_cannot_render_is_an_invalid_request(demo_tokenizer):
    import copy

    from mirrorspec.models.loading import encode_chat

    chat = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    assert encode_chat(demo_tokenizer, chat)[-3:] == demo_tokenizer("<|im_start|>assistant\n")["input_ids"][-3:]
    strict = copy.deepcopy(demo_tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
                            "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(InvalidRequest, match="chat template refuses these messages: roles must alternate"):
        encode_chat(strict, chat)
    strict.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template; send the prompt as raw_text or token_ids"):
        encode_chat(strict, chat)


def test_a_checkpoints_config_file_is_refused_naming_its_directory(tmp_path):
    """Its config read fine (so `serve` started), then transformers ran torch.load on the JSON and
    each server failed with an UnpicklingError advising weights_only=False."""
    config = support.save_tiny_llama(tmp_path / "tiny", seed=0) / "config.json"
    for call in (read_config, lambda source: load_causal_lm(source, device="cpu", tokenizer=False)):
        with pytest.raises(InvalidRequest, match="is a file; pass the checkpoint directory") as err:
            call(str(config))
        assert err.value.field == "model"


def test_processes_that_load_no_model_never_import_transformers_modeling_code():
    """transformers' modeling code takes seconds to import (3.3 s on the CI VM): imported where a
    model loads, not by every process that imports the package (the CLI's client commands, the
    front door, the controller)."""
    probe = ("import sys, mirrorspec.cli, mirrorspec.client, orchestrator.servicer, cluster.controller; "
             "print(sorted(m for m in sys.modules if m in ('transformers.modeling_utils', 'transformers.masking_utils')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
