"""The in-process engine: greedy identity, stop/length handling, seeding, statistics, bad input."""

import dataclasses
import json
import random
import re

import numpy as np
import pytest
import torch

# what generate() takes and raises imports from the package, as a user writes it
from mirrorspec import (InvalidRequest, MirrorConfig, NonFiniteLogits, OutOfRange, SamplingParams, SpeculationConfig,
                        generate)
from mirrorspec.models.lens import TunedLens
from mirrorspec.drafting import DraftModelDrafter, NgramDrafter
from mirrorspec.models import encode_prompt
from support import load, save_tiny_llama


def hf_greedy(model, prompt, n, eos):
    """HF's own greedy decoding, stopping at ``eos`` like ours does."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=eos)
    return out[0, len(prompt):].tolist()


def random_prompts(count, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(count)]


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_is_token_identical_to_target_only_and_to_hf(tiny_target, tiny_draft, k):
    for prompt in random_prompts(8, vocab=8, seed=k):
        params = SamplingParams(max_new_tokens=20, stop_token_ids=(7,))  # an EOS, for HF and us alike
        baseline = generate(tiny_target, None, prompt, params).token_ids
        assert baseline == hf_greedy(tiny_target, prompt, 20, eos=7)
        for draft in (tiny_draft, "ngram", DraftModelDrafter(tiny_draft, proposal_top_k=2)):
            assert generate(tiny_target, draft, prompt, params, num_speculative_tokens=k).token_ids == baseline


def test_a_vanishing_top_p_decodes_the_greedy_chain(tiny_target, tiny_draft):
    """top_p=1e-300 keeps only each step's top token, on the target and the draft alike (it gave
    token 0 every step before: the float32 comparison dropped every token)."""
    prompt, greedy = [1, 2, 3], SamplingParams(max_new_tokens=12)
    vanishing = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1e-300)
    baseline = generate(tiny_target, None, prompt, greedy).token_ids
    assert generate(tiny_target, None, prompt, vanishing, seed=1).token_ids == baseline
    assert generate(tiny_target, tiny_draft, prompt, vanishing, num_speculative_tokens=3, seed=1).token_ids == baseline


@pytest.mark.parametrize("runner_up", [False, True])
def test_a_draft_whose_logits_overflow_leaves_sampled_output_the_target_s(tiny_target, tmp_path, runner_up):
    """A float16 draft whose head overflows has a NaN q: every draft is rejected and each token
    is drawn from p, as target-only draws it, seed for seed (it was token 0 every time)."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "overflowing", seed=1, logit_scale=1e6)
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    for seed in range(12):
        alone = generate(tiny_target, None, [1, 2, 3], params, seed=seed).token_ids
        assert generate(tiny_target, draft, [1, 2, 3], params, num_speculative_tokens=3, seed=seed,
                        runner_up=runner_up).token_ids == alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_target_whose_logits_hold_nan_is_a_clear_error(tiny_dir, temperature):
    """Sampling drew column 0 from an all-NaN p every step, and greedy took the NaN's index."""
    from mirrorspec.sampling import NonFiniteLogits

    target = load(tiny_dir["target"])
    with torch.no_grad():
        target.lm_head.weight[2, 0] = float("nan")
    with pytest.raises(NonFiniteLogits, match="the target model's logits hold NaN"):
        generate(target, None, [1, 2, 3], SamplingParams(temperature=temperature, max_new_tokens=4), seed=0)


def test_stop_token_inside_a_window_truncates_there(tiny_target):
    prompt = [0, 3, 5, 2]
    full = generate(tiny_target, None, prompt, SamplingParams(max_new_tokens=30)).token_ids
    stop = full[5]
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))
    # the target itself as draft: every window is fully accepted, so the stop token lands mid-window
    result = generate(tiny_target, DraftModelDrafter(tiny_target), prompt, params, num_speculative_tokens=8)
    assert result.token_ids == full[: full.index(stop) + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_exactly_max_new_tokens_for_any_k(tiny_target, tiny_draft, max_new):
    for k in (1, 3, 6):
        result = generate(tiny_target, tiny_draft, [0, 1], SamplingParams(temperature=1.0, max_new_tokens=max_new),
                          num_speculative_tokens=k, seed=3)
        assert len(result.token_ids) == max_new and result.finish_reason == "length"


def test_seeded_runs_reproduce_and_k0_equals_target_only(tiny_target, tiny_draft):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=24)
    a = generate(tiny_target, tiny_draft, [0, 4], params, num_speculative_tokens=3, seed=42)
    b = generate(tiny_target, tiny_draft, [0, 4], params, num_speculative_tokens=3, seed=42)
    assert a.token_ids == b.token_ids and a.seed == 42
    outputs = {tuple(generate(tiny_target, tiny_draft, [0, 4], params, seed=s).token_ids) for s in range(8)}
    assert len(outputs) > 1
    # a window with no drafts is plain target sampling with the same counter-based draws
    assert (generate(tiny_target, tiny_draft, [0, 4], params, num_speculative_tokens=0, seed=7).token_ids
            == generate(tiny_target, None, [0, 4], params, seed=7).token_ids)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_a_first_window_drafted_ahead_is_taken_only_for_the_k_the_loop_asks(tiny_target, tiny_draft, adaptive):
    """The front door drafts the first window while the target prefills: the loop takes it when
    it asks for that k (then the drafter is not asked again for it), and drafts afresh otherwise;
    a seeded sample is the same either way."""
    from mirrorspec.config import AdaptiveKConfig, SpeculationConfig
    from mirrorspec.engine import GenerationStats, TargetVerifier, decode_windows, first_window_k
    from mirrorspec.models.session import KVSession

    class Counting(DraftModelDrafter):
        calls = 0

        def propose(self, context, k, params, seed):
            self.calls += 1
            return super().propose(context, k, params, seed)

    prompt, params, seed = [1, 4, 2, 6], SamplingParams(temperature=1.0, max_new_tokens=12), 5
    spec = SpeculationConfig(num_speculative_tokens=3, adaptive=AdaptiveKConfig() if adaptive else None)

    def run(drafted_ahead=None):
        drafter = Counting(tiny_draft, proposal_top_k=3)
        events = decode_windows(drafter, TargetVerifier(KVSession(tiny_target)), prompt, params, spec, seed,
                                GenerationStats(), drafted_ahead=drafted_ahead)
        return [t for e in events for t in e.tokens], drafter.calls

    fresh, calls = run()
    k = first_window_k(spec, params, Counting(tiny_draft))  # the loop's own first k, or the taking below fails
    assert k == 3 or adaptive and k >= 2
    ahead = Counting(tiny_draft, proposal_top_k=3).propose(prompt, k, params, seed)
    assert run((k, ahead)) == (fresh, calls - 1)  # taken: the same tokens, one draft fewer
    other = Counting(tiny_draft, proposal_top_k=3).propose(prompt, k - 1, params, seed)
    assert run((k - 1, other)) == (fresh, calls)  # another k: drafted afresh


def test_a_runner_up_win_counts_as_a_rejected_first_draft_and_its_token_apart(tiny_target, near_draft):
    """Acceptance statistics and adaptive K measure the chain's drafts; a runner-up win follows a
    rejected first draft. It used to count as an accepted draft (alpha read 0.92 where the first
    drafts passed 0.76 of their tests, in a review's run)."""
    result = generate(tiny_target, near_draft, [0, 2, 6], SamplingParams(temperature=1.0, max_new_tokens=120),
                      num_speculative_tokens=1, seed=3, runner_up=True)
    s = result.stats
    assert s.runner_up_hits > 0
    assert s.accepted + s.rejected == s.windows  # K = 1: each window tests one draft
    assert s.rejected >= s.runner_up_hits  # every win came after its first draft failed
    committed = s.accepted + s.runner_up_hits + s.windows  # drafts, runner-ups, recovered/bonus tokens
    assert committed == s.committed == len(result.token_ids)  # no stop token here cuts a window
    assert s.mean_accepted_length == pytest.approx(committed / s.windows)


def test_tokens_per_pass_leave_out_what_a_stop_token_cuts(tiny_target):
    """A draft equal to the target accepts all K; a stop token second in the window cuts the rest,
    which used to count as produced (tokens per pass 5 for the 2 the output got)."""
    alone = generate(tiny_target, None, [0, 2, 6], SamplingParams(max_new_tokens=8)).token_ids
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(alone[1],))
    result = generate(tiny_target, tiny_target, [0, 2, 6], params, num_speculative_tokens=4)
    s = result.stats
    assert result.token_ids == alone[:2] and s.windows == 1 and s.accepted == 4
    assert s.committed == 2 and s.mean_accepted_length == 2


def test_statistics_add_up(tiny_target, tiny_draft):
    result = generate(tiny_target, tiny_draft, [0, 2, 6], SamplingParams(temperature=0.8, max_new_tokens=40),
                      num_speculative_tokens=4, seed=1)
    s = result.stats
    assert 0 <= s.accepted <= s.drafted
    assert sum(s.drafted_per_position) == s.drafted and sum(s.accepted_per_position) == s.accepted
    assert s.accepted + s.windows >= len(result.token_ids)  # truncation at the end may drop a few
    assert s.mean_accepted_length == pytest.approx((s.accepted + s.runner_up_hits + s.windows) / s.windows)
    assert s.committed == len(result.token_ids)
    assert 0 < s.first_verify_time_s <= s.verify_time_s
    assert 0 < s.first_draft_time_s <= s.draft_time_s and s.first_drafted == 4  # the first window drafts K
    assert s.per_position_acceptance == sorted(s.per_position_acceptance, reverse=True)  # prefix acceptance
    assert s.draft_time_s > 0 and s.verify_time_s > 0
    # every window either accepted all its drafts or ended at one rejection
    assert 0 < s.rejected <= s.windows
    assert s.token_acceptance_rate == pytest.approx(s.accepted / (s.accepted + s.rejected))
    assert s.token_acceptance_rate >= s.acceptance_rate  # untested drafts after a rejection count only there


def test_token_acceptance_is_leviathans_alpha():
    from mirrorspec.engine import GenerationStats

    s = GenerationStats()
    for drafted, accepted in [(4, 4), (4, 1), (4, 0), (4, 2)]:  # 7 accepted tests, 3 rejections
        s.record(drafted, accepted)
    assert s.rejected == 3
    assert s.token_acceptance_rate == pytest.approx(7 / 10)
    assert s.acceptance_rate == pytest.approx(7 / 16)


def test_n_gram_accepts_on_repetitive_text(tiny_target):
    # tiny random models loop; prompt lookup should catch the loop and get accepted
    result = generate(tiny_target, NgramDrafter(), [0, 3], SamplingParams(max_new_tokens=60), num_speculative_tokens=4)
    assert result.stats.accepted > 0


@pytest.mark.parametrize("prompt,params,k,error,field", [
    ([], SamplingParams(), 4, InvalidRequest, "input_ids"),
    ([0, 99], SamplingParams(), 4, InvalidRequest, "input_ids"),
    ([0, 1], SamplingParams(stop_token_ids=(7, 8)), 4, InvalidRequest, "stop_token_ids"),  # vocab 8: 8 never comes
    ([0, 1], SamplingParams(max_new_tokens=500), 4, OutOfRange, "max_new_tokens"),
    ([0, 1] * 64, SamplingParams(max_new_tokens=1), 4, OutOfRange, "input_ids"),  # the prompt fills the window
    ([0, 1], SamplingParams(), 99, OutOfRange, "num_speculative_tokens"),
    ([0, 1], SamplingParams(), -1, OutOfRange, "num_speculative_tokens"),
])
def test_bad_input_is_a_clear_error(tiny_target, prompt, params, k, error, field):
    with pytest.raises(error) as err:
        generate(tiny_target, "ngram", prompt, params, num_speculative_tokens=k)
    assert err.value.field == field


def test_k_is_a_plain_int_whatever_integer_it_came_as_and_never_a_bool_or_a_fraction():

    from mirrorspec.config import SpeculationConfig

    for k in (np.int64(3), torch.tensor(3)):
        spec = SpeculationConfig(num_speculative_tokens=k, max_speculative_tokens=np.int32(8), proposal_top_k=k,
                                 prompt_lookup=k, draft_confidence=np.float32(0.25))
        assert json.dumps(dataclasses.asdict(spec))  # numpy's float32 and torch's ints did not serialise
        assert type(spec.num_speculative_tokens) is int and type(spec.max_speculative_tokens) is int
        assert type(spec.proposal_top_k) is int and type(spec.prompt_lookup) is int
        assert type(spec.draft_confidence) is float
    for bad in ({"num_speculative_tokens": True}, {"num_speculative_tokens": 2.0}, {"max_speculative_tokens": 2.5},
                {"proposal_top_k": 2.5}, {"prompt_lookup": 1.0}, {"draft_confidence": "0.5"}):
        with pytest.raises(InvalidRequest) as err:
            SpeculationConfig(**bad)
        assert err.value.field == next(iter(bad))
    # a str looked like a number in the message ("got 4"), and adaptive="yes" was taken (a review of stop 60)
    for bad, says in (({"num_speculative_tokens": "4"}, "must be an int, got '4'"),
                      ({"max_speculative_tokens": "8"}, "got '8'"), ({"adaptive": "yes"}, "got 'yes'")):
        with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
            SpeculationConfig(**bad)
        assert err.value.field == next(iter(bad))
    for bad in ({"top_k": "5"}, {"max_new_tokens": "5"}):
        with pytest.raises(InvalidRequest, match="got '5'"):
            SamplingParams(**bad)


@pytest.mark.parametrize("prompt", ["hello", [1.5, 2], [[1, 2]], None])
def test_a_prompt_that_is_not_token_ids_is_refused_naming_input_ids(tiny_target, prompt):
    # text, a float (silently truncated to 1 before), nested lists, nothing
    with pytest.raises(InvalidRequest, match="must be a sequence of integer token ids") as err:
        generate(tiny_target, None, prompt, SamplingParams(max_new_tokens=2))
    assert err.value.field == "input_ids"


def test_bools_are_not_token_ids_and_a_numpy_prompt_is_taken_as_a_tensor_is(tiny_target):
    """[True, False] ran as ids 1 and 0; a [1, n] array (``return_tensors="np"``) was told to
    encode its text first, where a [1, n] tensor passed (a user's review)."""

    params = SamplingParams(max_new_tokens=3)
    with pytest.raises(InvalidRequest, match="must be a sequence of integer token ids") as err:
        generate(tiny_target, None, [True, False], params)
    assert err.value.field == "input_ids"
    expected = generate(tiny_target, None, [1, 2, 3], params).token_ids
    for prompt in (np.array([[1, 2, 3]]), np.array([1, 2, 3], dtype=np.int32)):
        assert generate(tiny_target, None, prompt, params).token_ids == expected
    with pytest.raises(InvalidRequest, match="must be one prompt"):
        generate(tiny_target, None, np.zeros((2, 3), dtype=np.int64), params)


@pytest.mark.parametrize("kwargs, field, says", [
    ({"target": "demo-target"}, "target", "target must be a loaded model"),
    ({"target": None}, "target", "got NoneType"),
    ({"params": {"temperature": 0.7}}, "params", "params must be a mirrorspec.SamplingParams"),
    ({"params": SpeculationConfig()}, "params", "got SpeculationConfig"),
    ({"adaptive": "yes"}, "adaptive", "adaptive must be True, False, None or AdaptiveKConfig(...)"),
    ({"mirror": 1}, "mirror", "mirror must be True, False, None or MirrorConfig(...), got 1"),
    ({"mirror": torch.tensor(1)}, "mirror", "MirrorConfig(...), got 1"),
    ({"runner_up": "no"}, "runner_up", "runner_up must be True, False or None, got 'no'"),
    ({"mirror": True, "hint_layer": "1"}, "hint_layer", "hint_layer must be an int"),
    ({"mirror": True, "hint_layer": 1, "hint_lens": "tuned"}, "hint_lens", "hint_lens must be a TunedLens"),
    ({"on_tokens": 5}, "on_tokens", "on_tokens must be a callable"),  # a bare TypeError after the first window
    # settings no window would use: it ran target-only, or serial, and said nothing (a review of stop 60)
    ({"draft": None, "mirror": True}, "mirror", "and draft=None drafts none"),
    ({"num_speculative_tokens": 0, "mirror": MirrorConfig()}, "mirror", "and num_speculative_tokens=0 drafts none"),
    ({"draft": None, "adaptive": True}, "adaptive", "chooses K per window in [0, num_speculative_tokens], and "
                                                    "draft=None drafts none"),
    ({"num_speculative_tokens": 0, "adaptive": True}, "adaptive", "num_speculative_tokens=0 drafts none"),
    ({"hint_layer": 1}, "hint_layer", "and mirror is off: pass mirror=True too, or drop hint_layer=1"),
    ({"mirror": True, "hint_lens": TunedLens(1, torch.zeros(3, 2))}, "hint_lens", "and hint_layer is None"),
])
def test_arguments_of_the_wrong_kind_are_named_before_decoding(tiny_target, tiny_draft, kwargs, field, says):
    """Each met a bare AttributeError or TypeError deep inside ("'str' object has no attribute
    'vocab_size'", "'dict' object has no attribute 'stop_token_ids'"; a user's review)."""
    call = {"target": tiny_target, "draft": tiny_draft, "input_ids": [1, 2], "params": SamplingParams(), **kwargs}
    with pytest.raises(InvalidRequest, match=re.escape(says)) as err:
        generate(**call)
    assert err.value.field == field


class PoisonedTarget:
    """The tiny target, but its logits after ``poison`` are NaN (a float16 pass that overflowed)."""

    def __init__(self, model, poison: int):
        from support import MemoSession

        self.memo, self.poison, self.vocab_size = MemoSession(model), poison, int(model.config.vocab_size)

    def next_logits(self, context):
        row = self.memo.next_logits(context)
        return torch.full_like(row, float("nan")) if context[-1] == self.poison else row

    def logits_for(self, context, num_positions):
        n = len(context)
        return torch.stack([self.next_logits(context[: n - num_positions + i + 1]) for i in range(num_positions)])

    def rollback(self, length):
        pass

    def close(self):
        pass


class WrongThenPoison(DraftModelDrafter):
    """Drafts a token the target does not take, then ``poison``: the row after it is never read."""

    def __init__(self, target: PoisonedTarget, poison: int):
        self.target, self.poison = target, poison

    def propose(self, context, k, params, seed):
        from mirrorspec.drafting import Proposal
        from mirrorspec.sampling import ProposalRows

        wrong = next(t for t in range(self.target.vocab_size)
                     if t not in (int(self.target.next_logits(list(context)).argmax()), self.poison))
        tokens = [wrong, self.poison, wrong][:k]  # at K=3 the window is decided on its first 2 drafts
        return Proposal(tuple(tokens), ProposalRows.one_hot(tokens))

    def release(self):
        pass


def test_a_broken_row_past_a_rejected_draft_fails_nothing_and_one_the_target_reads_is_refused(tiny_target):
    """Target-only decoding never computes the row after a draft the target rejects; NaN there (a
    float16 overflow on a draft the target would not write) failed the whole window (a review's
    find). Greedy, the output is target-only's, and sampled windows decide on (the statistical tests
    hold the distribution); a NaN row the target itself reaches is refused as before."""
    prompt, params = [1, 2], SamplingParams(max_new_tokens=12)
    plain = generate(tiny_target, None, prompt, params).token_ids
    poison = next(t for t in range(tiny_target.config.vocab_size) if t not in plain)
    target = PoisonedTarget(tiny_target, poison)
    for k in (2, 3):
        drafter = WrongThenPoison(target, poison)
        assert generate(target, drafter, prompt, params, num_speculative_tokens=k).token_ids == plain
    sampled, finished = SamplingParams(max_new_tokens=12, temperature=1.0), 0
    for seed in range(8):
        try:  # a sampled window may pass the poison (the target writes it too): its next row is read, refused
            finished += len(generate(target, WrongThenPoison(target, poison), prompt, sampled, seed=seed,
                                     num_speculative_tokens=3).token_ids) == 12
        except NonFiniteLogits:
            pass
    assert finished > 0  # every window drafts the poison: before, every request failed at its first
    with pytest.raises(NonFiniteLogits, match="logits hold NaN"):
        generate(PoisonedTarget(tiny_target, plain[3]), None, prompt, params)


def test_flags_computed_with_numpy_or_torch_are_taken_as_the_bools_they_hold(tiny_target, tiny_draft):
    """``mirror=np.bool_(True)`` was refused as not a bool, and a str ``runner_up`` ("no") switched
    the runner-up on, as any non-empty value did."""
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    plain = generate(tiny_target, tiny_draft, [1, 2], params, seed=3, mirror=True, adaptive=True, runner_up=True)
    computed = generate(tiny_target, tiny_draft, [1, 2], params, seed=3, mirror=np.bool_(True),
                        adaptive=torch.tensor(True), runner_up=np.array(True))
    def windows(result):
        return [getattr(result.stats, name) for name in ("windows", "drafted", "accepted")]

    assert computed.token_ids == plain.token_ids and windows(computed) == windows(plain)
    assert plain.stats.mirror_windows > 0
    # how many windows branched depends on timing (the default policy stops at the verdict: 2 and 1
    # under load in one run), so that the computed flags are the bools they hold is asked directly
    from mirrorspec.engine import checked_generate_arguments

    taken = checked_generate_arguments(tiny_target, params, torch.tensor(True), np.bool_(True), None, None,
                                       np.array(True))
    assert taken == (True, True, True) and all(type(flag) is bool for flag in taken)
    off = generate(tiny_target, tiny_draft, [1, 2], params, seed=3, mirror=np.bool_(False), runner_up=np.False_)
    assert off.stats.mirror_windows == 0
    assert generate(tiny_target, tiny_draft, [1, 2], params, seed=3, runner_up=None).token_ids == generate(
        tiny_target, tiny_draft, [1, 2], params, seed=3).token_ids  # passed through as None: off, as mirror's


def test_a_drafter_drafting_for_one_call_refuses_a_second_at_once_and_serves_it_after(tiny_target, tiny_draft):
    """One Drafter shared by threads: three of four calls failed inside torch, and the fourth
    drafted other tokens than alone (a user's review). A call made while another drafts with it
    (here from the first's own callback, deterministically) is refused naming the draft."""
    drafter = DraftModelDrafter(tiny_draft)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    refused = []

    def second_call(tokens):
        if not refused:
            with pytest.raises(InvalidRequest, match="is drafting for another request right now") as err:
                generate(tiny_target, drafter, [3, 1], params, seed=5)
            refused.append(err.value.field)

    first = generate(tiny_target, drafter, [1, 2], params, seed=4, on_tokens=second_call)
    assert refused == ["draft"]
    alone = generate(tiny_target, DraftModelDrafter(tiny_draft), [1, 2], params, seed=4)
    assert first.token_ids == alone.token_ids
    again = generate(tiny_target, drafter, [3, 1], params, seed=5)  # free again
    assert again.token_ids == generate(tiny_target, DraftModelDrafter(tiny_draft), [3, 1], params, seed=5).token_ids


@pytest.mark.parametrize("shape", [(2, 3), (1, 1, 3)])
def test_a_batch_of_prompts_is_refused_rather_than_run_as_one_long_prompt(tiny_target, shape):
    with pytest.raises(InvalidRequest, match="must be one prompt") as err:
        generate(tiny_target, None, torch.zeros(shape, dtype=torch.long), SamplingParams(max_new_tokens=2))
    assert err.value.field == "input_ids"
    assert generate(tiny_target, None, torch.zeros(1, 3, dtype=torch.long), SamplingParams(max_new_tokens=2)).token_ids


def test_a_draft_model_with_another_vocabulary_is_refused_before_it_embeds_a_token_it_lacks(tiny_target, tiny_dir):
    draft16 = load(tiny_dir["draft16"])  # vocab 16 against the target's 8 (an IndexError mid-draft before)
    with pytest.raises(InvalidRequest, match=r"the draft's vocabulary \(16 ids\) is larger than the target's \(8\): "
                                             r"it could propose ids the target does not have") as err:
        generate(tiny_target, draft16, [0, 1], SamplingParams(max_new_tokens=4))
    assert err.value.field == "draft"


PADDING_PROMPT = [1, 1]  # the padded target's greedy answer holds its padding ids 14, 15, 13


@pytest.mark.parametrize("proposal_top_k", [0, 4], ids=["dense-q", "sparse-q"])
def test_a_draft_with_a_narrower_table_and_the_targets_tokenizer_drafts_token_identically(padded_pair,
                                                                                          proposal_top_k):
    """Qwen2.5's shape: one tokenizer, tables of 12 and 16 rows. The draft proposes from its 12 ids
    (dense q is widened with zeros), and is fed id 0 for the target's padding ids it cannot embed:
    refused before, and an IndexError in the draft's embedding had it not been."""
    target, draft = load(padded_pair["target"]), load(padded_pair["draft"])
    params = SamplingParams(max_new_tokens=24)
    alone = generate(target, None, PADDING_PROMPT, params).token_ids
    assert {13, 14, 15} <= set(alone)
    drafter = DraftModelDrafter(draft, proposal_top_k=proposal_top_k)
    for chosen in (draft, drafter):  # a model (its tokenizer checked), and a Drafter built from it
        result = generate(target, chosen, PADDING_PROMPT, params, num_speculative_tokens=4)
        assert result.token_ids == alone
        assert result.stats.drafted > 0 and result.stats.accepted > 0
    drafter.release()


@pytest.mark.parametrize("draft", ["stranger", None], ids=["another-tokenizer", "no-tokenizer"])
def test_a_draft_with_a_narrower_table_is_refused_unless_its_tokenizer_is_the_targets(padded_pair, tmp_path,
                                                                                       draft):
    source = padded_pair[draft] if draft else save_tiny_llama(tmp_path / "bare", seed=5, vocab=12)
    with pytest.raises(InvalidRequest, match=r"the draft's vocabulary \(12 ids\) differs from the target's \(16\), "
                                             r"and their tokenizers are not known to be one") as err:
        generate(load(padded_pair["target"]), load(source), PADDING_PROMPT, SamplingParams(max_new_tokens=4))
    assert err.value.field == "draft"


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 0.5])
def test_a_seed_a_request_could_not_carry_is_refused_in_process_too(tiny_target, seed):
    # the same seed must name the same sample in process and served, where it is a uint64
    with pytest.raises(InvalidRequest, match=r"seed must be an integer in \[0, 2\*\*64\)") as err:
        generate(tiny_target, "ngram", [0, 1], SamplingParams(temperature=1.0, max_new_tokens=8), seed=seed)
    assert err.value.field == "seed"


@pytest.fixture(scope="module")
def quick_draft(demo_target):
    """A quickly made same-tokenizer draft: the target's first 2 layers, its own norm and head.

    Only greedy identity is tested with it, where the draft's quality does not matter.
    """
    from transformers import AutoModelForCausalLM

    from mirrorspec.models.demo_target import CHECKPOINT_NAME, cache_root

    return AutoModelForCausalLM.from_pretrained(cache_root() / CHECKPOINT_NAME, num_hidden_layers=2,
                                                dtype=torch.float32).eval()


PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple.",
    "Give me three tips for writing clear emails.",
    "What is the capital of France? Answer in one sentence.",
    "def fibonacci(n):",
]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_identity_on_the_real_demo_target(demo_target, quick_draft, prompt):
    ids = encode_prompt(demo_target.tokenizer, prompt)
    params = SamplingParams(max_new_tokens=48, stop_token_ids=demo_target.stop_token_ids())
    baseline = generate(demo_target.model, None, ids, params).token_ids
    for draft, k, runner_up in ((quick_draft, 3, False), ("ngram", 4, False),
                                (DraftModelDrafter(quick_draft, proposal_top_k=8), 5, False), (quick_draft, 4, True)):
        out = generate(demo_target.model, draft, ids, params, num_speculative_tokens=k, runner_up=runner_up)
        assert out.token_ids == baseline


def test_runner_up_windows_on_a_sliding_window_target_stay_identical_to_target_only(tmp_path):
    """The runner-up's 4D mask sees the whole context, and the model used it as it was in its
    sliding layers too: past the window greedy output left target-only's (Mistral, Gemma 2 and 3;
    review 12 of stop 47). Runner-ups still win within the window."""
    from support import noisy_copy, save_tiny_llama

    path = save_tiny_llama(tmp_path / "mistral", seed=0, layers=2, sliding_window=8)
    target = load(path)
    near = noisy_copy(target)
    params, hits = SamplingParams(max_new_tokens=40), 0
    for prompt in random_prompts(6, vocab=8, seed=1):
        result = generate(target, near, prompt, params, num_speculative_tokens=3, runner_up=True)
        assert result.token_ids == generate(target, None, prompt, params).token_ids
        hits += result.stats.runner_up_hits
    assert hits > 0


def test_greedy_runner_up_windows_are_identical_to_target_only_and_take_runner_ups(tiny_target, near_draft,
                                                                                   monkeypatch):
    """The runner-up changes how far a window reaches, never what is generated; and it is used
    (a runner-up that never won would test nothing). A planted bug that takes the runner-up
    wherever the first draft is rejected, without the target choosing it, must change the output."""
    from mirrorspec.engine import TargetVerifier

    params = SamplingParams(max_new_tokens=24, stop_token_ids=(7,))
    prompts = random_prompts(12, vocab=8, seed=3)
    baselines = [generate(tiny_target, None, p, params).token_ids for p in prompts]
    hits = 0
    for prompt, baseline in zip(prompts, baselines):
        for k in (1, 3):
            result = generate(tiny_target, near_draft, prompt, params, num_speculative_tokens=k, runner_up=True)
            assert result.token_ids == baseline
            hits += result.stats.runner_up_hits
    assert hits > 0

    original = TargetVerifier.verify

    def trusting(self, context, proposal, params, seed, on_hint=None):
        verdict = original(self, context, proposal, params, seed, on_hint)
        runner_up = self.offered_runner_up(proposal)
        if verdict.num_accepted == 0 and runner_up is not None and verdict.runner_up is None:
            self.session.rollback(len(context))
            return type(verdict)(1, verdict.next_token, verdict.next_kind, runner_up)  # unchecked
        return verdict

    monkeypatch.setattr(TargetVerifier, "verify", trusting)
    planted = [generate(tiny_target, near_draft, p, params, num_speculative_tokens=3, runner_up=True).token_ids
               for p in prompts]
    assert planted != baselines


def test_what_load_causal_lm_gives_is_taken_as_target_and_draft(tiny_dir, tiny_target, tiny_draft):
    """The README's way to the demo models; passing it raised AttributeError ('vocab_size')."""
    from mirrorspec.models import load_causal_lm

    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    target, draft = (load_causal_lm(str(tiny_dir[name]), tokenizer=False) for name in ("target", "draft"))
    loaded = generate(target, draft, [1, 2, 3], params, seed=5)
    assert loaded.token_ids == generate(tiny_target, tiny_draft, [1, 2, 3], params, seed=5).token_ids
