import pytest
import torch

from mirrorspec import SamplingParams, generate
from mirrorspec.adaptive import AdaptiveK, best_k, expected_tokens, window_cost
from mirrorspec.config import AdaptiveKConfig, InvalidRequest
from mirrorspec.drafting import Drafter, Proposal
from mirrorspec.sampling import ProposalRows

CPU = AdaptiveKConfig()


def test_expected_tokens_matches_leviathan():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_more_acceptance_never_means_fewer_drafts():
    ks = [best_k(a / 20, 8, CPU) for a in range(20)]
    assert ks == sorted(ks)
    assert ks[0] == 0 and ks[-1] >= 4  # off when nothing is accepted, long windows near alpha = 1


def test_chosen_k_is_the_argmax_of_tokens_per_cost():
    for alpha in (0.2, 0.5, 0.75, 0.9):
        k = best_k(alpha, 6, CPU)
        rate = [expected_tokens(alpha, j) / window_cost(j, CPU) for j in range(7)]
        assert rate[k] == max(rate)


def test_free_drafting_on_a_gpu_like_cost_model_drafts_the_maximum():
    free = AdaptiveKConfig(draft_cost=0.0, pass_costs=(), pass_cost_per_token=0.0)
    assert best_k(0.3, 5, free) == 5


def test_policy_switches_off_then_probes_again():
    policy = AdaptiveK(AdaptiveKConfig(probe_every=3, probe_k=2, pass_costs=(), pass_cost_per_token=0.12), max_k=4)
    first = policy.next_k()
    assert first > 0
    for _ in range(10):
        policy.observe(first, 0)  # everything rejected
    ks = [policy.next_k() for _ in range(6)]
    assert ks == [0, 0, 2, 0, 0, 2]
    for _ in range(20):
        policy.observe(4, 4)  # everything accepted
    assert policy.next_k() == 4


def test_bad_config_is_refused_with_the_field():
    with pytest.raises(InvalidRequest, match="decay"):
        AdaptiveKConfig(decay=0.0)


class CountingDrafter(Drafter):
    """Wraps a drafter and records the K it was asked for in each window."""

    def __init__(self, inner):
        self.inner, self.ks = inner, []

    def propose(self, context, k, params, seed):
        self.ks.append(k)
        return self.inner.propose(context, k, params, seed)


class WrongDrafter(Drafter):
    """Proposes the token after the target's greedy choice: its first draft is always rejected."""

    def __init__(self, target):
        self.target = target

    def propose(self, context, k, params, seed):
        if not k:
            return Proposal.empty()
        with torch.inference_mode():
            wrong = (int(self.target(torch.tensor([context])).logits[0, -1].argmax()) + 1) % 8
        return Proposal(tokens=(wrong,) * k, q=ProposalRows.one_hot([wrong] * k))


def test_adaptive_greedy_output_is_identical_to_target_only(tiny_target, tiny_draft):
    from mirrorspec.drafting import DraftModelDrafter

    params = SamplingParams(max_new_tokens=40)
    reference = generate(tiny_target, None, [0, 3, 5], params).token_ids
    drafter = CountingDrafter(DraftModelDrafter(tiny_draft))
    linear = AdaptiveKConfig(pass_costs=(), pass_cost_per_token=0.12)  # K must vary, whatever the CPU table
    result = generate(tiny_target, drafter, [0, 3, 5], params, num_speculative_tokens=5, adaptive=linear)
    assert result.token_ids == reference
    assert len(set(drafter.ks)) > 1  # K really varied


@pytest.mark.parametrize("mirror", [False, True], ids=["serial", "mirror"])
def test_adaptive_k_with_k_zero_is_target_only_past_the_probe_gap(tiny_target, tiny_draft, mirror):
    """K = 0 asks for no drafts; adaptive K used to crash at its first probe window (``probe_k``
    over an empty range of K) once ``probe_every`` windows had passed. ``generate`` refuses the
    pair now, but a front door with adaptive K on runs a request that asks for K = 0 this way."""
    from mirrorspec.config import MirrorConfig, SpeculationConfig
    from mirrorspec.drafting import DraftModelDrafter
    from mirrorspec.engine import GenerationStats, TargetVerifier, decode_windows
    from mirrorspec.mirror import MirrorPipeline
    from mirrorspec.models import KVSession

    params = SamplingParams(max_new_tokens=AdaptiveKConfig().probe_every + 8)
    reference = generate(tiny_target, None, [0, 3, 5], params).token_ids
    drafter = CountingDrafter(DraftModelDrafter(tiny_draft))
    stats, pipeline = GenerationStats(), MirrorPipeline(MirrorConfig(stop_at_verdict=False)) if mirror else None
    try:
        windows = decode_windows(drafter, TargetVerifier(KVSession(tiny_target)), [0, 3, 5], params,
                                 SpeculationConfig(num_speculative_tokens=0, adaptive=AdaptiveKConfig()), 7, stats,
                                 pipeline)
        tokens = [t for window in windows for t in window.tokens]
    finally:
        if pipeline is not None:
            pipeline.close()
    assert tokens == reference and stats.drafted == 0 and stats.windows == len(reference)


def test_a_useless_drafter_is_switched_off(tiny_target):
    reference = generate(tiny_target, None, [0, 3, 5], SamplingParams(max_new_tokens=60))
    drafter = CountingDrafter(WrongDrafter(tiny_target))
    result = generate(tiny_target, drafter, [0, 3, 5], SamplingParams(max_new_tokens=60), num_speculative_tokens=4,
                      adaptive=True)
    assert result.token_ids == reference.token_ids
    # after the first rejections, it drafts only to probe: far fewer drafts than 4 per window
    assert result.stats.accepted == 0
    assert result.stats.drafted < 0.5 * 4 * result.stats.windows
    assert len(drafter.ks) < result.stats.windows / 2  # most windows were plain target steps
    # and the stats say why: adaptive K switched drafting off in every window the drafter was not
    # asked for, but perhaps the last, whose K the token budget cut to 0
    undrafted = result.stats.windows - len(drafter.ks)
    assert undrafted - 1 <= result.stats.adaptive_off_windows <= undrafted
    fixed = generate(tiny_target, WrongDrafter(tiny_target), [0, 3, 5], SamplingParams(max_new_tokens=60),
                     num_speculative_tokens=4)
    assert fixed.stats.adaptive_off_windows == 0


def test_free_drafters_get_longer_windows_than_model_drafters():
    from mirrorspec.drafting import DraftModelDrafter, NgramDrafter

    linear = AdaptiveKConfig(pass_costs=(), pass_cost_per_token=0.12)
    assert NgramDrafter.step_cost == 0.0 < DraftModelDrafter.step_cost
    assert best_k(0.6, 8, linear, draft_cost=0.0) > best_k(0.6, 8, linear, draft_cost=0.1)
    pinned = AdaptiveKConfig(draft_cost=0.1, pass_costs=(), pass_cost_per_token=0.12)
    assert best_k(0.6, 8, pinned, draft_cost=0.0) == best_k(0.6, 8, linear, draft_cost=0.1)


def test_pass_cost_follows_the_table_then_grows_linearly():
    from mirrorspec.adaptive import pass_cost

    config = AdaptiveKConfig(pass_costs=(1.8, 1.9), pass_cost_per_token=0.1)
    assert [pass_cost(k, config) for k in range(5)] == pytest.approx([1.0, 1.8, 1.9, 2.0, 2.1])
    with pytest.raises(InvalidRequest, match="pass_costs"):
        AdaptiveKConfig(pass_costs=(0.5,))


@pytest.mark.parametrize("kwargs", [{"decay": "0.5"}, {"pass_costs": None}, {"pass_costs": "1.1"},
                                    {"probe_k": 1.5}, {"prior_accepted": True}])
def test_fields_of_the_wrong_type_are_named_not_met_by_a_bare_type_error(kwargs):
    """A str decay or a None table met "'<' not supported" or "'NoneType' is not iterable" (a user's review)."""
    name = next(iter(kwargs))
    with pytest.raises(InvalidRequest, match=f"AdaptiveKConfig.{name} must be") as err:
        AdaptiveKConfig(**kwargs)
    assert err.value.field == "adaptive"
    assert hash(AdaptiveKConfig(pass_costs=[1.1, 1.2])) == hash(AdaptiveKConfig(pass_costs=(1.1, 1.2)))


def test_on_the_measured_cpu_costs_a_weak_draft_is_switched_off():
    # a 2-9 token pass costs ~1.1-1.2 steps there: alpha ~0.35 (the demo draft on MT-Bench) pays
    # for short windows, alpha 0.15 pays for none, and n-gram copying (alpha ~0.75, free drafts)
    # takes long windows
    assert 1 <= best_k(0.35, 8, CPU, draft_cost=0.1) <= 3
    assert best_k(0.15, 8, CPU, draft_cost=0.1) == 0
    assert best_k(0.76, 8, CPU, draft_cost=0.0) >= 4


def test_probes_use_the_cheapest_window_unless_told():
    probe = AdaptiveK(CPU, max_k=8, draft_cost=0.1).probe_k()
    assert window_cost(probe, CPU, 0.1) == min(window_cost(k, CPU, 0.1) for k in range(1, 9))
    uneven = AdaptiveKConfig(pass_costs=(1.9, 1.8, 1.5, 1.2))  # a lumpy table: the 5-token pass is cheapest
    assert AdaptiveK(uneven, max_k=8, draft_cost=0.1).probe_k() == 4
    assert AdaptiveK(AdaptiveKConfig(probe_k=2), max_k=8).probe_k() == 2
    assert AdaptiveK(CPU, max_k=2, draft_cost=0.1).probe_k() in (1, 2)


@pytest.mark.parametrize("bad", [dict(prior_accepted=float("nan")), dict(prior_rejected=float("inf")),
                                 dict(draft_cost=float("nan")), dict(pass_cost_per_token=float("nan")),
                                 dict(pass_costs=(1.1, float("nan"))), dict(pass_costs=(float("inf"),)),
                                 dict(decay=float("nan")), dict(prior_accepted=0.0), dict(draft_cost=-0.1)])
def test_adaptive_settings_that_would_poison_every_estimate_are_refused(bad):
    """NaN passed the old ``x <= 0`` checks, and a NaN prior made every alpha estimate NaN."""
    (name,) = bad
    with pytest.raises(InvalidRequest, match=name.split("_")[0]) as err:
        AdaptiveKConfig(**bad)
    assert err.value.field == "adaptive"
