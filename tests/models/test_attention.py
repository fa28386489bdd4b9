"""``mirrorspec_sdpa`` gives transformers' ``sdpa`` logits bit for bit, on every pass the engine
makes: exactness rests on it, since greedy output must stay token-identical to target-only."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mirrorspec.models import KVSession, load_causal_lm
from mirrorspec.models.attention import IMPLEMENTATION, use_cpu_verify_attention


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """A random Llama whose 4 query heads share 2 key/value heads, as the demo target's 9 share 3
    (the tests' other tiny models have one key/value head per query head)."""
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(7)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0 / model.lm_head.weight.std())
    path = tmp_path_factory.mktemp("gqa") / "model"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gqa_model(gqa_dir):
    return load_causal_lm(str(gqa_dir), tokenizer=False, prepack=False).model


def under(model, implementation: str, run):
    """``run(model)`` with ``model`` on ``implementation``, then back on ours."""
    model.set_attn_implementation(implementation)
    try:
        return run(model)
    finally:
        model.set_attn_implementation(IMPLEMENTATION)


def both(model, run):
    """(transformers' sdpa, ours): the same calls, on the same weights."""
    return under(model, "sdpa", run), under(model, IMPLEMENTATION, run)


def assert_bitwise(stock, ours):
    for got, want in zip(ours, stock, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), f"differs by up to {(got - want).abs().max().item()}"


def test_load_causal_lm_runs_cpu_models_on_it(gqa_model):
    assert gqa_model.config._attn_implementation == IMPLEMENTATION
    assert not use_cpu_verify_attention(gqa_model)  # already switched: nothing to do


def test_a_model_on_another_implementation_is_left_alone(gqa_dir):
    eager = LlamaForCausalLM.from_pretrained(gqa_dir, attn_implementation="eager")
    assert not use_cpu_verify_attention(eager)
    assert eager.config._attn_implementation == "eager"


def test_prefill_verify_passes_and_steps_are_bit_identical(gqa_model):
    """The session's own calls, as a window loop makes them: a prefill, verify passes of 2 to 17
    tokens on a cache (the masked passes this implementation changes), one-token steps and
    roll-backs, over a context that grows past a hundred tokens."""

    def session_calls(model):
        rng = random.Random(0)
        session = KVSession(model)
        context = [rng.randrange(32) for _ in range(40)]
        out = [session.logits_for(context, 3)]
        for _ in range(25):
            k = rng.randrange(17)
            window = context + [rng.randrange(32) for _ in range(k)]
            out.append(session.logits_for(window, k + 1))
            accepted = rng.randrange(k + 1)
            context = window[:len(context) + accepted] + [rng.randrange(32)]
            session.rollback(len(context) - 1)
        return out

    assert_bitwise(*both(gqa_model, session_calls))


def test_runner_up_and_branch_passes_are_bit_identical(gqa_model):
    """The passes that bring masks of their own: the runner-up's 4D mask (a target verify) and
    forked branch rows (a drafter's batched branches)."""

    def custom_masks(model):
        context = list(range(1, 30))
        session = KVSession(model)
        session.logits_for(context, 1)
        out = [session.logits_with_runner_up(context + [4, 9, 2], 4, runner_up=11)]
        session.rollback(len(context) - 1)
        batch = session.fork(context, [3, 5, 7], fork_points=[len(context), len(context) - 2, len(context) - 5])
        for _ in range(4):
            row = batch.step()
            out.append(row)
            batch.feed(row.argmax(-1).tolist())
        return out

    assert_bitwise(*both(gqa_model, custom_masks))


def test_a_left_padded_batch_is_bit_identical_where_it_is_not_padding(gqa_model):
    """The teacher's batches (``mirrorspec.distill.teacher``): rows left-padded to one width."""
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])

    def padded(model):
        return [model(input_ids=ids, attention_mask=mask).logits * mask[..., None]]  # pad rows: 0, not NaN

    assert_bitwise(*both(gqa_model, padded))


def test_a_model_type_that_branches_on_the_implementation_name_stays_on_sdpa(tmp_path):
    """Gemma 4's KV-shared layers slice their input only where the implementation is named
    "sdpa": switched, a first window (prompt and drafts into an empty cache) came out misaligned
    and greedy speculation left target-only's output (found in review)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    from mirrorspec import SamplingParams, generate

    config = Gemma4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
                              sliding_window=16, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
                              layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                              max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path), tokenizer=False, prepack=False).model
    assert model.config._attn_implementation == "sdpa"
    prompt = [3, 5, 7, 9, 11, 13, 15, 17, 19, 21]
    params = SamplingParams(max_new_tokens=24)
    spec = generate(model, "ngram", prompt, params, num_speculative_tokens=4)
    assert spec.token_ids == generate(model, None, prompt, params).token_ids
