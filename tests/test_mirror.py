"""Mirror-style pipelining: same output as serial decoding, branches really used."""

import copy
import random
import time
from dataclasses import replace

import pytest
import torch

from mirrorspec import SamplingParams, generate
from mirrorspec.config import InvalidRequest, MirrorConfig
from mirrorspec.drafting import DraftModelDrafter, NgramDrafter, Proposal, RankedTokens
from mirrorspec.config import SpeculationConfig
from mirrorspec.engine import GenerationStats, TargetVerifier, decode_windows
from mirrorspec.mirror import (Branch, BranchHistory, BranchPolicy, MirrorPipeline, Prefetch, guesses, hint_guesses,
                               with_runners_up)
from mirrorspec.models import KVSession
from mirrorspec.models.early_exit import EarlyExitHint
from mirrorspec.sampling import ProposalRows, TokenKind, WindowVerdict

EVERY_BRANCH = MirrorConfig(stop_at_verdict=False)  # timing-independent, so tests are deterministic


def test_guesses_rank_by_the_chance_of_each_verdict():
    proposal = Proposal(tokens=(5, 6), q=ProposalRows.one_hot([5, 6]), alternatives=((5, 1, 2), (3, 6, 4)))
    ranked = guesses(proposal, alpha=0.2, alternatives=2)
    # at alpha 0.2 a rejection at the first draft is likeliest; a rejected draft is never guessed
    assert ranked[0][1:] == (0, 1)
    assert (0, 5) not in [g[1:] for g in ranked] and (1, 6) not in [g[1:] for g in ranked]
    assert ranked == sorted(ranked, key=lambda g: -g[0])
    high = guesses(proposal, alpha=0.95, alternatives=2)
    assert high[0][1:] == (2, None)  # all accepted: the bonus guess comes first


def test_guesses_weigh_runner_ups_by_the_drafters_probabilities():
    """A likely runner-up at a later position beats an unlikely one at an earlier position, which
    ranking by order alone cannot see; a draft the drafter was sure of is guessed to pass."""
    tokens, tops = (5, 6), ((5, 1, 2), (6, 3, 4))
    probs = ((0.5, 0.45, 0.05), (0.4, 0.55, 0.05))
    by_rank = Proposal(tokens=tokens, q=ProposalRows.one_hot([5, 6]), alternatives=tops)
    weighed = replace(by_rank, alternative_probs=probs)
    assert [g[1:] for g in guesses(by_rank, alpha=0.5, alternatives=2)][:3] == [(0, 1), (2, None), (0, 2)]
    ranked = guesses(weighed, alpha=0.5, alternatives=2)
    assert [g[1:] for g in ranked][:3] == [(0, 1), (1, 3), (2, None)]  # (0, 2) at 0.05 falls behind
    # the scores estimate P(verdict = (j, c)): position 0 fails with 1 - (0.5 + 0.5) / 2 = 0.5, and
    # its rejection lands on 1 with 0.45 / (0.45 + 0.05)
    assert ranked[0][0] == pytest.approx(0.5 * 0.9)
    assert sum(g[0] for g in ranked) == pytest.approx(1.0)  # every verdict these runner-ups allow
    # a row whose probabilities do not match its ids is ranked by order, as a replica sending none is
    mismatched = replace(by_rank, alternative_probs=((0.5, 0.45), ()))
    assert guesses(mismatched, alpha=0.5, alternatives=2) == guesses(by_rank, alpha=0.5, alternatives=2)


def test_a_branch_is_taken_by_its_key_alone():
    branch = Proposal(tokens=(7,), q=ProposalRows.one_hot([7]))
    prefetch = Prefetch(WindowVerdict(1, 4, TokenKind.RECOVERED), 0.0, 0.0, {(1, 4): Branch(1, 4, 2, branch)})
    verdict = WindowVerdict(1, 4, TokenKind.RECOVERED)
    assert prefetch.take(verdict, k=2) is branch
    assert prefetch.take(replace(verdict, next_token=5), k=2) is None
    assert prefetch.take(replace(verdict, num_accepted=0), k=2) is None
    assert prefetch.take(verdict, k=3) is None  # drafted for another K: redraft
    # the runner-up took the first slot, then 4: the context holds the runner-up, not the first
    # draft the chain branch was drafted after; a branch drafted after the runner-up fits it
    won = replace(verdict, next_kind=TokenKind.BONUS, runner_up=9)
    assert prefetch.take(won, k=2) is None
    after_runner_up = Proposal(tokens=(8,), q=ProposalRows.one_hot([8]))
    prefetch.branches[(1, 4, 9)] = Branch(1, 4, 2, after_runner_up, runner_up=9)
    assert prefetch.take(won, k=2) is after_runner_up and prefetch.take(verdict, k=2) is branch
    assert prefetch.take(replace(won, runner_up=3), k=2) is None


@pytest.mark.parametrize("runner_up", [False, True], ids=["chain", "runner-up"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mirror_output_equals_serial_output(tiny_dir, near_draft16, temperature, runner_up):
    """With a draft that agrees with the target now and then: against the random draft16, which
    the target almost always rejects at the first draft, the output is the residual's draw whatever
    was drafted, and branches drafted with the wrong seed passed."""
    import support

    target, draft = support.load(tiny_dir["target16"]), near_draft16
    params = SamplingParams(temperature=temperature, max_new_tokens=30)
    hits = runner_up_hits = 0
    for seed in range(8):
        serial = generate(target, draft, [0, 3, 5, 2], params, num_speculative_tokens=3, seed=seed,
                          runner_up=runner_up)
        mirror = generate(target, draft, [0, 3, 5, 2], params, num_speculative_tokens=3, seed=seed,
                          mirror=EVERY_BRANCH, runner_up=runner_up)
        assert mirror.token_ids == serial.token_ids
        s = mirror.stats
        assert s.mirror_windows > 0 and s.branches_drafted <= EVERY_BRANCH.max_branches * s.mirror_windows
        assert s.runner_up_hits == serial.stats.runner_up_hits
        hits += s.branch_hits
        runner_up_hits += s.runner_up_hits
    if temperature > 0:  # (greedy: every seed is the same run)
        assert hits > 0
        assert runner_up_hits > 0 if runner_up else runner_up_hits == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_windows_after_a_runner_up_win_are_fed_by_branches_drafted_after_it(tiny_target, near_draft, temperature,
                                                                            monkeypatch):
    """A draft that agrees with the target now and then (the tiny random pair above almost never
    does), so the guess of the target's token after a winning runner-up comes true: the next
    window is then a branch, and the output is still serial's."""
    params = SamplingParams(temperature=temperature, max_new_tokens=30)
    fed = []  # verdicts the runner-up won whose next window a branch fed
    take = Prefetch.take

    def counting_take(self, verdict, k):
        proposal = take(self, verdict, k)
        if verdict.runner_up is not None and proposal is not None:
            fed.append(verdict)
        return proposal

    monkeypatch.setattr(Prefetch, "take", counting_take)
    for seed in range(8):
        prompt = [0, 3, 5, 2, seed % 8]
        serial = generate(tiny_target, near_draft, prompt, params, num_speculative_tokens=3, seed=seed, runner_up=True)
        mirror = generate(tiny_target, near_draft, prompt, params, num_speculative_tokens=3, seed=seed,
                          runner_up=True, mirror=EVERY_BRANCH)
        assert mirror.token_ids == serial.token_ids
    assert fed


def test_a_runner_up_the_target_scores_is_guessed_to_win_its_slot(tiny_dir):
    """Where the window offers its runner-up b, the target's choice of b at the first slot is the
    runner-up winning, which no chain branch fits: the chain guess (0, b) becomes a branch after b
    and the drafter's own next token c, keyed (1, c, b), the very proposal a fresh draft of that
    context makes."""
    import support

    target, draft = support.load(tiny_dir["target16"]), support.load(tiny_dir["draft16"])
    context, params = [0, 3, 5, 2], SamplingParams(max_new_tokens=16)
    proposal = Proposal(tokens=(5, 6), q=ProposalRows.one_hot([5, 6]), alternatives=((5, 1, 2), (6, 3, 4)))
    keys = {}
    for runner_up in (False, True):
        pipeline = MirrorPipeline(MirrorConfig(max_branches=8, alternatives=2, stop_at_verdict=False))
        try:
            verifier = TargetVerifier(KVSession(target), runner_up=runner_up)
            prefetch = pipeline.verify_while_drafting(verifier, DraftModelDrafter(draft), context, proposal,
                                                      params, 0, 0.5, lambda n, m: 2)
        finally:
            pipeline.close()
        keys[runner_up] = set(prefetch.branches)
    [after_runner_up] = keys[True] - keys[False]
    assert (0, 1) in keys[False] and keys[True] - {after_runner_up} == keys[False] - {(0, 1)}
    greedy_next = DraftModelDrafter(draft).propose([*context, 1], 1, SamplingParams(max_new_tokens=1), 0).tokens[0]
    assert after_runner_up == (1, greedy_next, 1)
    fresh = DraftModelDrafter(draft).propose([*context, 1, greedy_next], 2, params, 0)
    assert prefetch.branches[after_runner_up].proposal.tokens == fresh.tokens


def test_mirror_greedy_is_identical_to_target_only_with_adaptive_k_and_ngram(tiny_target, tiny_draft):
    params = SamplingParams(max_new_tokens=40)
    reference = generate(tiny_target, None, [0, 3], params).token_ids
    for draft in (tiny_draft, NgramDrafter()):
        result = generate(tiny_target, draft, [0, 3], params, num_speculative_tokens=4, adaptive=True,
                          mirror=EVERY_BRANCH)
        assert result.token_ids == reference


def test_seeded_output_under_the_serving_policy_is_serials_whatever_the_timing(tiny_target, near_draft, monkeypatch):
    """The serving default (``stop_at_verdict``) drafts branches while the verdict is out and as far
    as they pay, so which windows branch, how many branches each gets, and which are hit all
    depend on timing. The tests above branch every window (``EVERY_BRANCH``), for statistics that
    do not; this one delays each verify by a random 0, 2 or 20 ms so that windows variously branch,
    stop branching at the verdict, skip a branch not worth its delay, or go serial, and the
    seeded output must still be serial's, token for token: greedy and sampled, with adaptive K
    and with the runner-up."""
    jitter = random.Random(0)
    verify = TargetVerifier.verify
    monkeypatch.setattr(TargetVerifier, "verify", lambda self, *args, **kwargs: (
        time.sleep(jitter.choice((0.0, 0.002, 0.02))), verify(self, *args, **kwargs))[1])
    branched = spy_on(monkeypatch, BranchPolicy, "should_branch")
    hits = 0
    for temperature, adaptive, runner_up in ((0.0, False, False), (1.0, False, True), (1.0, True, False)):
        params = SamplingParams(temperature=temperature, max_new_tokens=40)
        for seed in range(4):
            prompt = [0, 3, 5, 2, seed]
            options = dict(num_speculative_tokens=3, seed=seed, adaptive=adaptive, runner_up=runner_up)
            serial = generate(tiny_target, near_draft, prompt, params, **options)
            served = generate(tiny_target, near_draft, prompt, params, mirror=MirrorConfig(), **options)
            assert served.token_ids == serial.token_ids, (temperature, adaptive, runner_up, seed)
            hits += served.stats.branch_hits
    # windows went both ways (branching, serial), and branches really fed windows. (Groups not worth
    # their delay were skipped in 2-6 of ~60 asks in three runs: too few to promise here)
    assert set(branched) == {True, False} and hits > 0


def spy_on(monkeypatch, owner, name: str) -> list:
    """The values ``owner.name`` returns from now on, in a list that fills as it is called."""
    returned, method = [], getattr(owner, name)

    def spied(*args, **kwargs):
        returned.append(method(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(owner, name, spied)
    return returned


def test_branch_hits_are_counted_and_reported(tiny_target):
    # the tiny target loops, so n-gram drafts are accepted and the "all accepted" branch hits
    result = generate(tiny_target, NgramDrafter(), [0, 3], SamplingParams(max_new_tokens=60),
                      num_speculative_tokens=3, mirror=EVERY_BRANCH)
    s = result.stats
    assert s.branch_hits > 0
    assert s.branch_hit_rate == pytest.approx(s.branch_hits / s.mirror_windows)
    assert s.to_dict()["branch_hit_rate"] == s.branch_hit_rate


def test_hint_guesses_follow_where_the_target_leans():
    proposal = Proposal(tokens=(5, 6), q=ProposalRows.one_hot([5, 6]))
    hint = EarlyExitHint(1, ((5, 2), (4, 6), (9,)), ((0.9, 0.1), (0.8, 0.2), (1.0,)))
    ranked = hint_guesses(proposal, hint, alpha=0.5)
    # draft 5 likely passes (0.9), draft 6 likely fails (0.2) where the target leans to 4
    assert [g[1:] for g in ranked] == [(1, 4), (2, 9), (0, 2)]
    assert ranked[0][0] == pytest.approx(0.7 * 0.65 * 0.8)


class RecordingDrafter(DraftModelDrafter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[list[int]] = []  # the fork points of each propose_branches call

    def propose_branches(self, head, next_tokens, k, params, seed, fork_points=None):
        self.batches.append(list(fork_points))
        return super().propose_branches(head, next_tokens, k, params, seed, fork_points)


def test_the_best_guesses_are_drafted_in_one_batch_wherever_they_fork(tiny_dir):
    """The verdict is spread over the window's positions, so the first batch takes the best guesses
    across them, not only those at the likeliest one; each branch is a fresh draft of its key's
    context."""
    import support

    target, draft = support.load(tiny_dir["target16"]), support.load(tiny_dir["draft16"])
    context, params = [0, 3, 5, 2], SamplingParams(max_new_tokens=16)
    proposal = Proposal(tokens=(5, 6, 7), q=ProposalRows.one_hot([5, 6, 7]), alternatives=((5, 1, 2), (3, 6, 4), (7, 8, 9)))
    drafter = RecordingDrafter(draft)
    pipeline = MirrorPipeline(MirrorConfig(max_branches=4, alternatives=2, stop_at_verdict=False))
    try:
        prefetch = pipeline.verify_while_drafting(TargetVerifier(KVSession(target)), drafter, context, proposal,
                                                  params, 0, 0.5, lambda n, m: 3)
    finally:
        pipeline.close()
    # at alpha 0.5: two guesses at the first draft, one at the second, then "all accepted"
    assert drafter.batches == [[4, 4, 5, 7]]
    assert [key for key in prefetch.branches][:3] == [(0, 1), (0, 2), (1, 3)]
    for (j, c), branch in prefetch.branches.items():
        alone = DraftModelDrafter(draft).propose([*context, *proposal.tokens[:j], c], 3, params, 0)
        assert branch.proposal.tokens == alone.tokens and branch.k == 3


class OracleHints:
    """A verifier whose "early-exit hint" is its verdict (sent before it returns): the pipeline,
    once its own best guess is drafted, must draft the branch the hint points at."""

    gives_hints = True

    def __init__(self, model):
        self.inner = TargetVerifier(KVSession(model))
        self.vocab_size = self.inner.vocab_size
        self.offered_runner_up = self.inner.offered_runner_up

    def verify(self, context, proposal, params, seed, on_hint=None):
        verdict = self.inner.verify(context, proposal, params, seed)
        rows = [(t,) for t in proposal.tokens[:verdict.num_accepted]] + [(verdict.next_token,)]
        rows += [(0,)] * (len(proposal) + 1 - len(rows))
        if on_hint is not None:
            on_hint(EarlyExitHint(1, tuple(rows), tuple((1.0,) for _ in rows)))
        return verdict


def decode_with(verifier, draft, params, mirror):
    stats, pipeline = GenerationStats(), MirrorPipeline(mirror)
    try:
        windows = decode_windows(DraftModelDrafter(draft), verifier, [0, 3, 5, 2], params,
                                 SpeculationConfig(num_speculative_tokens=3), 4, stats, pipeline)
        return [t for window in windows for t in window.tokens], stats
    finally:
        pipeline.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hints_steer_branches_to_the_verdict_and_never_change_the_output(tiny_dir, temperature):
    import support

    target, draft = support.load(tiny_dir["target16"]), support.load(tiny_dir["draft16"])
    params = SamplingParams(temperature=temperature, max_new_tokens=30)
    serial = generate(target, draft, [0, 3, 5, 2], params, num_speculative_tokens=3, seed=4).token_ids
    two_branches = MirrorConfig(max_branches=2, alternatives=0, stop_at_verdict=False)
    steered, with_hints = decode_with(OracleHints(target), draft, params, two_branches)
    unsteered, without = decode_with(OracleHints(target), draft, params, replace(two_branches, use_hints=False))
    assert steered == serial == unsteered
    # every window's verdict was drafted before it came (the last window has no next one)
    assert with_hints.branch_hits == with_hints.mirror_windows - 1 > without.branch_hits


def test_real_early_exit_hints_keep_mirror_output_identical(tiny_dir):
    import support

    target, draft = support.load(tiny_dir["target16"]), support.load(tiny_dir["draft16"])
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=30)
        serial = generate(target, draft, [0, 3, 5, 2], params, num_speculative_tokens=3, seed=1)
        hinted = generate(target, draft, [0, 3, 5, 2], params, num_speculative_tokens=3, seed=1,
                          mirror=EVERY_BRANCH, hint_layer=1)
        assert hinted.token_ids == serial.token_ids and hinted.stats.mirror_windows > 0


def test_hinted_windows_offer_the_runner_up_so_seeded_output_does_not_depend_on_which_windows_branch(
        tiny_dir, near_draft16):
    """Only branched windows gather hints, and whether a window branches depends on timing. Hinted
    windows used to offer no runner-up, so a seeded sampled request with hints gave other tokens
    than without mirror (15 of 20 seeds in a review's run)."""
    import support

    target = support.load(tiny_dir["target16"])
    params = SamplingParams(temperature=1.0, max_new_tokens=30)
    runner_up_hits = 0
    for seed in range(6):
        prompt = [0, 3, 5, 2, seed]
        serial = generate(target, near_draft16, prompt, params, num_speculative_tokens=2, seed=seed,
                          runner_up=True)
        hinted = generate(target, near_draft16, prompt, params, num_speculative_tokens=2, seed=seed,
                          runner_up=True, mirror=EVERY_BRANCH, hint_layer=1)
        assert hinted.token_ids == serial.token_ids and hinted.stats.mirror_windows > 0
        assert hinted.stats.runner_up_hits == serial.stats.runner_up_hits
        runner_up_hits += serial.stats.runner_up_hits
    assert runner_up_hits > 0


def test_a_branch_is_started_only_while_it_is_worth_its_delay():
    policy = BranchPolicy()
    assert policy.worth_starting(0.01, elapsed_s=5.0)  # nothing measured yet
    policy.observe_verify(0.100, branched=True)
    policy.observe_group(0.040, 0.0)
    assert policy.worth_starting(0.01, elapsed_s=0.050)  # it ends before the verdict: free
    # 20 ms left, 20 ms past the verdict: worth it only if a hit is likelier than a miss
    assert policy.worth_starting(0.6, elapsed_s=0.080)
    assert not policy.worth_starting(0.4, elapsed_s=0.080)
    assert not policy.worth_starting(0.9, elapsed_s=0.150)  # the verdict is due: nothing to save


def test_mirror_falls_back_to_serial_where_branching_does_not_pay_and_probes_back():
    policy = BranchPolicy(MirrorConfig(probe_every=4))
    assert policy.should_branch()  # learn what branching gives first
    policy.observe_verify(0.110, branched=True)
    policy.observe_group(0.040, 0.0)
    policy.observe_hit(True)
    assert not policy.should_branch()  # then what a verify costs without a drafter beside it
    policy.observe_verify(0.100, branched=False)
    # hits save 0.5 * 40 ms = 20 ms a window; branching costs 10 ms of verify slowdown: branch,
    # probing serial 4 windows on, then 8 more on: the gap doubles while the choice stands
    policy.observe_hit(False)
    assert [policy.should_branch() for _ in range(12)] == [True] * 3 + [False] + [True] * 7 + [False]
    for _ in range(30):
        policy.observe_hit(False)  # hits dry up: 0 ms saved against 10 ms: go serial
    # the choice changed, so the next probe comes 4 windows on again
    assert [policy.should_branch() for _ in range(8)] == [False, False, False, True] + [False] * 4
    assert BranchPolicy(EVERY_BRANCH).should_branch()  # tests: always branch, whatever the timings


def test_a_hit_is_worth_the_fresh_draft_it_saves_not_the_branch_drafting():
    """Branches drafted beside a verify run slower than a window drafted alone (shared cores and
    memory): 40 ms a group here against 15 ms for the fresh draft a hit saves. Half the windows hit,
    so a hit saves 7.5 ms a window, less than the 10 ms the verify loses: serial, where the
    branches' own time (20 ms a window) would have said branch."""
    policy = BranchPolicy(MirrorConfig(probe_every=64, max_probe_every=64))
    policy.observe_verify(0.110, branched=True)
    policy.observe_verify(0.100, branched=False)
    policy.observe_group(0.040, 0.0)
    policy.observe_hit(True)
    policy.observe_hit(False)
    assert policy.should_branch()  # no fresh draft timed yet: the branches' time stands in
    policy.observe_fresh_draft(0.015)
    assert not any(policy.should_branch() for _ in range(8))
    policy.observe_fresh_draft(0.045)  # drafting alone got dear: (15 + 45) / 2 = 30 ms, 15 ms a window
    assert all(policy.should_branch() for _ in range(8))


def _taught(policy: BranchPolicy, pays: bool) -> BranchPolicy:
    """30 windows of each kind, then its choice. Where branching pays it costs the verify nothing
    and always hits; where it does not it slows the verify by 100 ms and never hits."""
    for _ in range(30):
        policy.observe_verify(0.100 if pays else 0.200, branched=True)
        policy.observe_verify(0.100, branched=False)
        policy.observe_group(0.040, 0.0)
        policy.observe_hit(pays)
    assert policy.should_branch() == pays
    return policy


def test_a_request_starts_from_where_the_last_left_off_and_learns_on_from_its_own_windows():
    """A blank policy branches its first window to learn (a loss where branching does not pay) and
    probes on its own schedule, which a request shorter than the gap never reaches. From the
    history, the next request's first window is already serial, its probes come where the last
    request's schedule put them, and its own samples move the estimates at the running weight."""
    config = MirrorConfig(probe_every=4, max_probe_every=16)
    history = BranchHistory()
    first = _taught(history.policy(config), pays=False)
    assert BranchPolicy(config).should_branch()  # blank: learn first
    history.keep(first)
    second = history.policy(config)
    continued = copy.deepcopy(first)
    expected = [continued.should_branch() for _ in range(12)]
    assert [second.should_branch() for _ in range(12)] == expected and not expected[0] and any(expected)
    assert second.verify_s.count == 2 and second.verify_s.value == pytest.approx(0.200)
    second.observe_verify(0.300, branched=True)
    # a third of the way: a resumed mean weighs two samples (30 would make it the running weight, 1/5)
    assert second.verify_s.value == pytest.approx(0.200 + 0.100 / 3)
    assert history.policy(replace(config, max_branches=2)).should_branch()  # another configuration: blank


def test_a_resumed_request_probes_within_probe_every_windows_whatever_gap_the_last_one_reached():
    """Requests differ (K, greedy or sampled, replicas): one whose branching would pay finds out
    within ``probe_every`` windows, as a blank one did, not after the last request's doubled gap."""
    config = MirrorConfig(probe_every=2, max_probe_every=8)
    history = BranchHistory()
    first = _taught(history.policy(config), pays=False)
    probes = [first.should_branch() for _ in range(13)]
    assert [i for i, probe in enumerate(probes) if probe] == [0, 4, 12]  # gaps 2, 4, 8: a probe just now
    history.keep(first)
    second = history.policy(config)
    assert [second.should_branch() for _ in range(2)] == [False, True]  # a probe 2 windows on, not 8


def test_a_resumed_request_probes_where_the_shared_schedule_says_not_at_once():
    """The last request probed 3 windows before it ended, and its next gap is 8: the next request
    probes 4 windows in (``probe_every``), not in its first window, which made nearly every
    request of 10 windows pay a probe first and never let the gaps grow (review of stop 57)."""
    config = MirrorConfig(probe_every=4, max_probe_every=16)
    history = BranchHistory()
    first = _taught(history.policy(config), pays=False)
    assert [first.should_branch() for _ in range(6)] == [False, False, True, False, False, False]
    history.keep(first)
    second = history.policy(config)
    # and its gaps go on doubling: 16 windows to the next probe
    assert [second.should_branch() for _ in range(20)] == [False] * 3 + [True] + [False] * 15 + [True]


@pytest.mark.parametrize("kwargs, says", [({"alternatives": 2.5}, "alternatives must be an int"),
                                          ({"max_branches": "4"}, "max_branches must be an int"),
                                          ({"use_hints": 1}, "use_hints must be True or False")])
def test_mirror_fields_of_the_wrong_type_are_named(kwargs, says):
    """alternatives=2.5 was taken, then met "slice indices must be integers" mid-request (a user's review)."""
    with pytest.raises(InvalidRequest, match=f"MirrorConfig.{says}") as err:
        MirrorConfig(**kwargs)
    assert err.value.field == "mirror"


def test_a_history_keeps_what_was_learnt_only_and_a_bounded_number_of_configurations():
    """A request that ended before its first window, or whose windows the target ran, learnt
    nothing: it must not put back the state it started from over what another request learnt."""
    history = BranchHistory()
    history.keep(_taught(history.policy(MirrorConfig()), pays=False))
    idle, busy = history.policy(MirrorConfig()), history.policy(MirrorConfig())
    history.keep(_taught(busy, pays=True))
    history.keep(idle)
    history.keep(BranchPolicy(MirrorConfig()))
    assert history.policy(MirrorConfig()).should_branch()  # the busy request's state stands
    others = [MirrorConfig(max_branches=2, alternatives=a) for a in range(BranchHistory.max_configs)]
    for config in others:
        history.keep(_taught(history.policy(config), pays=False))
    assert history.policy(MirrorConfig()).should_branch()  # the oldest configuration went: blank again
    assert not any(history.policy(config).should_branch() for config in others)


def test_a_pipeline_hands_its_policy_to_the_history_when_it_closes():
    history = BranchHistory()
    pipeline = MirrorPipeline(MirrorConfig(), history)
    _taught(pipeline.policy, pays=False)
    pipeline.close()
    assert not MirrorPipeline(MirrorConfig(), history).policy.should_branch()


def test_probe_gaps_double_up_to_the_configured_bound():
    policy = BranchPolicy(MirrorConfig(probe_every=2, max_probe_every=8))
    policy.observe_verify(0.200, branched=True)  # branching slows the verify by 100 ms and never hits
    policy.observe_verify(0.100, branched=False)
    policy.observe_group(0.040, 0.0)
    policy.observe_hit(False)
    decisions = [policy.should_branch() for _ in range(2 + 4 + 8 + 8)]
    assert [i + 1 for i, d in enumerate(decisions) if d] == [2, 6, 14, 22]  # gaps 2, 4, 8, 8
    with pytest.raises(InvalidRequest, match="max_probe_every"):
        MirrorConfig(probe_every=16, max_probe_every=8)


def test_running_mean_starts_plain_then_weights_recent_samples():
    from mirrorspec.mirror import RunningMean

    mean = RunningMean(weight=0.5)
    for sample in (1.0, 3.0):
        mean.add(sample)
    assert mean.value == pytest.approx(2.0) and mean.count == 2
    mean.add(6.0)
    assert mean.value == pytest.approx(4.0)


@pytest.mark.parametrize("max_branches", [0, 17])
def test_bad_mirror_config_names_the_field(max_branches):
    """17: a drafter's DraftBranches takes 16 at most; windows on the target failed the request
    (OUT_OF_RANGE), at the front door every branch call failed (review 4 of stop 43)."""
    with pytest.raises(InvalidRequest, match="max_branches"):
        MirrorConfig(max_branches=max_branches)


def test_drafter_alternatives_are_its_top_tokens(tiny_draft):
    drafter = DraftModelDrafter(tiny_draft, num_alternatives=3, confidence=0.01)
    proposal = drafter.propose([0, 3, 5], 3, SamplingParams(), seed=0)
    assert len(proposal.alternatives) == len(proposal.alternative_probs) == 3
    context = [0, 3, 5]
    for token, tops, probs in zip(proposal.tokens, proposal.alternatives, proposal.alternative_probs):
        assert tops[0] == token  # greedy: the draft is the drafter's own first choice
        # its own probabilities at temperature 1, best first: the softmax of its logits
        logits = tiny_draft(torch.tensor([context])).logits[0, -1].float()
        expected = logits.softmax(-1).topk(3)
        assert list(tops) == expected.indices.tolist()
        assert probs == pytest.approx(expected.values.tolist(), abs=1e-5)
        context.append(token)


class ScoringDrafter(NgramDrafter):
    """Looks up like the n-gram drafter; ranks tokens 7, 8, 9 at every position when asked."""

    def alternatives_for(self, context, tokens):
        return RankedTokens(tuple((7, 8, 9) for _ in tokens))


def test_a_window_without_runners_up_takes_the_drafters_alternatives_for_its_guesses():
    looked_up = Proposal(tokens=(7, 5), q=ProposalRows.one_hot([7, 5]), alternatives=((7,), (5,)))
    filled = with_runners_up(ScoringDrafter(), [0, 1], looked_up)
    assert filled.tokens == looked_up.tokens and filled.q is looked_up.q  # the proposal itself is unchanged
    rejection_guesses = {g[1:] for g in guesses(filled, alpha=0.5, alternatives=2) if g[1] < 2}
    assert rejection_guesses == {(0, 8), (0, 9), (1, 7), (1, 8)}  # a rejected draft is never its own guess
    assert with_runners_up(NgramDrafter(), [0, 1], looked_up) is looked_up  # no opinion: as it was
    drafted = Proposal(tokens=(7,), q=ProposalRows.one_hot([7]), alternatives=((7, 2, 3),))
    assert with_runners_up(ScoringDrafter(), [0, 1], drafted) is drafted  # has its own: not asked
