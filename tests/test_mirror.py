"""Mirror-style pipelining: same output as serial decoding, branches really used."""

import pytest

from mirrorspec import SamplingParams, generate
from mirrorspec.config import InvalidRequest, MirrorConfig
from mirrorspec.drafting import DraftModelDrafter, NgramDrafter, Proposal
from mirrorspec.mirror import Branch, Prefetch, guesses
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


def test_a_branch_is_taken_by_its_key_alone():
    branch = Proposal(tokens=(7,), q=ProposalRows.one_hot([7]))
    prefetch = Prefetch(WindowVerdict(1, 4, TokenKind.RECOVERED), 0.0, 0.0, {(1, 4): Branch(1, 4, 2, branch)})
    assert prefetch.take(1, 4, k=2) is branch
    assert prefetch.take(1, 5, k=2) is None and prefetch.take(0, 4, k=2) is None
    assert prefetch.take(1, 4, k=3) is None  # drafted for another K: redraft


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mirror_output_equals_serial_output(tiny_dir, temperature):
    import support

    target, draft = support.load(tiny_dir["target16"]), support.load(tiny_dir["draft16"])
    params = SamplingParams(temperature=temperature, max_new_tokens=30)
    hits = 0
    for seed in range(8):
        serial = generate(target, draft, [0, 3, 5, 2], params, num_speculative_tokens=3, seed=seed)
        mirror = generate(target, draft, [0, 3, 5, 2], params, num_speculative_tokens=3, seed=seed,
                          mirror=EVERY_BRANCH)
        assert mirror.token_ids == serial.token_ids
        s = mirror.stats
        assert s.mirror_windows > 0 and s.branches_drafted <= EVERY_BRANCH.max_branches * s.mirror_windows
        hits += s.branch_hits
    if temperature > 0:  # (greedy: every seed is the same run, and this random pair misses)
        assert hits > 0


def test_mirror_greedy_is_identical_to_target_only_with_adaptive_k_and_ngram(tiny_target, tiny_draft):
    params = SamplingParams(max_new_tokens=40)
    reference = generate(tiny_target, None, [0, 3], params).token_ids
    for draft in (tiny_draft, NgramDrafter()):
        result = generate(tiny_target, draft, [0, 3], params, num_speculative_tokens=4, adaptive=True,
                          mirror=EVERY_BRANCH)
        assert result.token_ids == reference


def test_branch_hits_are_counted_and_reported(tiny_target):
    # the tiny target loops, so n-gram drafts are accepted and the "all accepted" branch hits
    result = generate(tiny_target, NgramDrafter(), [0, 3], SamplingParams(max_new_tokens=60),
                      num_speculative_tokens=3, mirror=EVERY_BRANCH)
    s = result.stats
    assert s.branch_hits > 0
    assert s.branch_hit_rate == pytest.approx(s.branch_hits / s.mirror_windows)
    assert s.to_dict()["branch_hit_rate"] == s.branch_hit_rate


def test_bad_mirror_config_names_the_field():
    with pytest.raises(InvalidRequest, match="max_branches"):
        MirrorConfig(max_branches=0)


def test_drafter_alternatives_are_its_top_tokens(tiny_draft):
    proposal = DraftModelDrafter(tiny_draft).propose([0, 3, 5], 3, SamplingParams(), seed=0)
    assert len(proposal.alternatives) == 3
    for token, tops in zip(proposal.tokens, proposal.alternatives):
        assert tops[0] == token  # greedy: the draft is the drafter's own first choice
