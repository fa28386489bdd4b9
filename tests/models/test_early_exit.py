"""Early-exit hints are the target's own norm and head on an intermediate layer's output, read
during a forward pass the verify runs anyway."""

import pytest
import torch

from mirrorspec.config import InvalidRequest
from mirrorspec.models import KVSession
from mirrorspec.models.early_exit import EarlyExitHint, EarlyExitProbe
from support import load


def test_a_hint_is_the_head_on_the_layer_output_for_the_window_positions(tiny_dir):
    model = load(tiny_dir["target16"])  # 2 layers
    probe = EarlyExitProbe(model, layer=1, top_k=3)
    session, hints, ids = KVSession(model), [], [0, 3, 5, 2, 7]
    session.logits_for(ids[:2], 1)  # a cached prefix: the hinted forward sees only the new tokens
    with probe.watching(3, hints.append):
        session.logits_for(ids, 3)
    hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1]  # after layer 1
    expected = model.lm_head(model.model.norm(hidden[:, -3:]))[0].softmax(-1).topk(3)
    assert len(hints) == 1 and hints[0].layer == 1
    assert hints[0].top_tokens == tuple(map(tuple, expected.indices.tolist()))
    assert torch.allclose(torch.tensor(hints[0].top_probs), expected.values, atol=1e-5)
    session.logits_for([*ids, 1], 1)
    assert len(hints) == 1  # the hook is gone outside `watching`


def test_a_runner_up_row_after_the_window_leaves_the_hint_the_chains(tiny_dir):
    """A runner-up window feeds the runner-up after the window's tokens: the hint reads the rows
    before it, the same hint the chain's pass gives."""
    model = load(tiny_dir["target16"])
    probe, ids = EarlyExitProbe(model, layer=1, top_k=3), [0, 3, 5, 2, 7]
    chain, with_runner_up = [], []
    with probe.watching(3, chain.append):
        KVSession(model).logits_for(ids, 3)
    with probe.watching(3, with_runner_up.append, trailing=1):
        KVSession(model).logits_with_runner_up(ids, 3, runner_up=9)
    assert len(with_runner_up) == 1 and with_runner_up[0].top_tokens == chain[0].top_tokens
    assert torch.allclose(torch.tensor(with_runner_up[0].top_probs), torch.tensor(chain[0].top_probs), atol=1e-5)


def test_forwards_from_other_threads_send_no_hint(tiny_dir):
    """A draft that is the target model itself drafts through the hooked block while the verify
    runs; its forwards are no hint about the window (and one-row ones broke the hint's shape)."""
    import threading

    model = load(tiny_dir["target16"])
    probe, hints = EarlyExitProbe(model, layer=1, top_k=3), []
    with probe.watching(3, hints.append):
        other = threading.Thread(target=lambda: KVSession(model).logits_for([0, 3], 1))
        other.start()
        other.join()
        assert hints == []
        KVSession(model).logits_for([0, 3, 5, 2, 7], 3)
    assert len(hints) == 1 and len(hints[0].top_tokens) == 3


def test_mirror_with_hints_and_the_target_as_its_own_draft_is_target_only_output(tiny_dir):
    from mirrorspec import SamplingParams, generate
    from mirrorspec.config import MirrorConfig

    model = load(tiny_dir["target16"])
    params = SamplingParams(max_new_tokens=24)
    reference = generate(model, None, [0, 7, 3], params).token_ids
    result = generate(model, model, [0, 7, 3], params, num_speculative_tokens=3, hint_layer=1,
                      mirror=MirrorConfig(stop_at_verdict=False))
    assert result.token_ids == reference and result.stats.mirror_windows > 0


def test_a_sub_vocabulary_hint_ranks_only_those_ids_by_the_same_logits(tiny_dir):
    model = load(tiny_dir["target16"])
    rows = torch.tensor([1, 4, 6, 9, 11, 15])
    probe = EarlyExitProbe(model, layer=1, top_k=3, vocab_ids=rows)
    session, hints, ids = KVSession(model), [], [0, 3, 5, 2, 7]
    with probe.watching(2, hints.append):
        session.logits_for(ids, 2)
    hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1]
    logits = model.lm_head(model.model.norm(hidden[:, -2:]))[0][:, rows]  # [2, m]
    expected = logits.softmax(-1).topk(3)
    assert hints[0].top_tokens == tuple(map(tuple, rows[expected.indices].tolist()))
    assert torch.allclose(torch.tensor(hints[0].top_probs), expected.values, atol=1e-5)


def test_hint_prob_is_zero_outside_its_top_tokens():
    hint = EarlyExitHint(3, ((4, 2),), ((0.7, 0.2),))
    assert hint.prob(0, 2) == 0.2 and hint.prob(0, 9) == 0.0


@pytest.mark.parametrize("layer", [0, 2])
def test_a_layer_without_layers_after_it_is_refused_by_name(tiny_dir, layer):
    with pytest.raises(InvalidRequest, match=r"hint_layer must be in \[1, 1\]"):
        EarlyExitProbe(load(tiny_dir["target16"]), layer=layer)


def test_a_one_layer_target_is_said_to_have_no_layer_to_read_hints_from(tiny_dir):
    """It was told "hint_layer must be in [1, 0]", a range with nothing in it (a user's review)."""
    with pytest.raises(InvalidRequest, match="this 1-layer target has no layer before its last") as err:
        EarlyExitProbe(load(tiny_dir["target"]), layer=1)
    assert err.value.field == "hint_layer"
