"""Aggregate per-generation records into one summary row per (dataset, mode, temperature, K).

Everything is a ratio of *sums* over prompts (total tokens / total time, total accepted / total
drafted), not a mean of per-prompt ratios, so long and short prompts weigh by their work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from benchmarks.harness import TARGET_ONLY, RunRecord


def expected_tokens_per_window(alpha: float, k: int) -> float:
    """E[tokens committed per target pass] with K drafts, each accepted with i.i.d. probability
    alpha, counting the bonus/recovered token: (1 - alpha^(K+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup_bound(alpha: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al. (2023), Theorem 3.8: expected walltime improvement
    (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)), c = one draft step / one target pass.

    It assumes K drafts in every window, i.i.d. acceptance, and a target pass over K+1 tokens
    that costs no more than a one-token step. Windows that draft fewer than K (n-gram and
    lookup, which propose nothing where no match is found, a draft model that stops where it is
    unsure, adaptive K) break the first, and on CPU a (K+1)-token pass costs well over one step
    (see ``Summary.pass_cost``): for those it is a guide, not a bound, and measured speedups can
    pass it.
    """
    return expected_tokens_per_window(alpha, k) / (k * cost_ratio + 1.0)


@dataclass
class Summary:
    dataset: str
    mode: str
    temperature: float
    k: int
    prompts: int
    new_tokens: int
    wall_time_s: float
    tokens_per_s: float
    speedup: float | None = None  # tokens/s over target-only's, same dataset and temperature
    # the lowest and highest of the same ratio prompt by prompt: how far one run's noise moves it
    speedup_range: list[float] | None = None
    acceptance_rate: float | None = None  # accepted / drafted
    token_acceptance: float | None = None  # Leviathan's alpha: accepted / tests run
    mean_accepted_length: float | None = None  # tokens per target pass, bonus included
    cost_ratio: float | None = None  # draft time per drafted token / verify time per window
    speedup_bound: float | None = None
    verify_s_per_window: float | None = None
    pass_cost: float | None = None  # verify time per window / target-only's time per target step
    per_position_acceptance: list[float] | None = None
    branch_hit_rate: float | None = None  # mirror modes: windows whose draft was ready at the verdict
    runner_up_hit_rate: float | None = None  # runner-up modes: windows whose first slot went to the runner-up
    identical: bool | None = None  # greedy only: all prompts token-identical to target-only
    # sampled modes with a twin (served, -on-sdpa): prompts whose tokens equal the twin's, "n/m"
    same_as_in_process: str | None = None


def _verify_per_window(stats: list[dict]) -> float | None:
    """A window's verify time, the first window of each request left out where it is known: in
    process, that verify prefills the prompt too (several one-token steps), and a mode with fewer
    windows would carry more of it per window than target-only does."""
    if stats and all(s.get("first_verify_time_s") is not None for s in stats):
        # per request: a one-window request adds nothing to either sum (it used to send its whole
        # group back to counting every first window, prefill and all, beside target-only's row)
        later = sum(s["windows"] - 1 for s in stats)
        return sum(s["verify_time_s"] - s["first_verify_time_s"] for s in stats) / later if later else None
    windows = sum(s["windows"] for s in stats)
    return sum(s["verify_time_s"] for s in stats) / windows if windows else None


def _draft_per_token(stats: list[dict]) -> float | None:
    """A drafted token's drafting time, each request's first window left out where it is known:
    a draft model's first window prefills it with the prompt too, which the verify side leaves out
    of its own (``_verify_per_window``) and this did not (a benchmark review: `cost c` 0.123 for
    0.077 on 16 tokens). A draft model that first runs in a later window (lookup in front of it)
    still carries its prefill there."""
    if stats and all(s.get("first_draft_time_s") is not None for s in stats):
        drafted = sum(s["drafted"] - s["first_drafted"] for s in stats)
        return sum(s["draft_time_s"] - s["first_draft_time_s"] for s in stats) / drafted if drafted else None
    drafted = sum(s["drafted"] for s in stats)
    return sum(s["draft_time_s"] for s in stats) / drafted if drafted else None


RUNNER_UP_MODE_MARK = "runner-up"  # in the names of the modes whose windows offer the draft's runner-up


def _spec_fields(stats: list[dict], k: int, runner_up: bool = False) -> dict:
    """Acceptance, accepted length, cost ratio and bound from summed speculation statistics.
    ``runner_up``: the mode offers runner-ups, so a run none of whose runner-ups won shows a rate
    of 0.0, not the null of modes that offer none (a benchmark review)."""
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    windows = sum(s["windows"] for s in stats)
    mirror_windows = sum(s.get("mirror_windows", 0) for s in stats)
    runner_up_hits = sum(s.get("runner_up_hits", 0) for s in stats)  # tokens kept beside the chain's drafts
    # committed tokens (a stop token cuts its window; records written before served rows counted them carry none)
    committed = sum(s.get("committed", s["accepted"] + s.get("runner_up_hits", 0) + s["windows"]) for s in stats)
    out: dict = {"mean_accepted_length": committed / windows if windows else None,
                 "verify_s_per_window": _verify_per_window(stats),
                 "branch_hit_rate": (sum(s.get("branch_hits", 0) for s in stats) / mirror_windows
                                     if mirror_windows else None)}
    if windows and (runner_up_hits or runner_up):
        out["runner_up_hit_rate"] = runner_up_hits / windows
    if k == 0 or drafted == 0:
        return out
    tests = accepted + sum(s.get("rejected", 0) for s in stats)
    alpha = accepted / tests if tests else 0.0  # per-token, what the Leviathan bound is stated in
    per_window, per_token = out["verify_s_per_window"], _draft_per_token(stats)
    cost = per_token / per_window if per_window and per_token is not None else None
    out.update(acceptance_rate=accepted / drafted, token_acceptance=alpha, cost_ratio=cost,
               speedup_bound=speedup_bound(alpha, k, cost) if cost is not None else None,
               per_position_acceptance=_per_position(stats))
    return out


def _per_position(stats: list[dict]) -> list[float]:
    width = max(len(s["drafted_per_position"]) for s in stats)
    drafted, accepted = [0] * width, [0] * width
    for s in stats:
        for i, (d, a) in enumerate(zip(s["drafted_per_position"], s["accepted_per_position"])):
            drafted[i] += d
            accepted[i] += a
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def _identity(group: list[RunRecord]) -> bool | None:
    flags = [r.identical_to_target_only for r in group]
    return None if any(f is None for f in flags) else all(flags)


def _same_as_in_process(group: list[RunRecord]) -> str | None:
    """A count rather than yes/no: both paths are exact whatever they draw, and a mismatch says
    where they drafted or verified differently. (A last-bit difference between groupings of
    passes, as a served target's own prefill makes, no longer moves a draw: ``sample_categorical``.)"""
    flags = [r.identical_to_in_process for r in group]
    return None if any(f is None for f in flags) else f"{sum(flags)}/{len(flags)}"


def summarize(records: Iterable[RunRecord]) -> list[Summary]:
    """One row per (dataset, mode, temperature, K), in first-seen order, speedups filled in."""
    groups: dict[tuple, list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.dataset, r.mode, r.temperature, r.k), []).append(r)
    rows = [_summarize_group(key, group) for key, group in groups.items()]
    baseline = {(s.dataset, s.temperature): s for s in rows if s.mode == TARGET_ONLY}
    for key, s in zip(groups, rows):
        base = baseline.get((s.dataset, s.temperature))
        if base is None:
            continue
        s.speedup = s.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None
        if s.mode != TARGET_ONLY:
            s.speedup_range = _paired_range(groups[key], groups[(base.dataset, TARGET_ONLY, base.temperature, base.k)])
        if s.k and s.verify_s_per_window and base.verify_s_per_window:
            s.pass_cost = s.verify_s_per_window / base.verify_s_per_window
    return rows


def _paired_range(group: list[RunRecord], baseline: list[RunRecord]) -> list[float] | None:
    """The lowest and highest per-prompt speedup (tok/s over target-only's on the same prompt).
    Each mode runs each prompt once, so one noisy run moves a row's ratio with nothing to show it
    (a benchmark review: a row printed 1.59x on 1.08 tokens per pass, its baseline slowed): a wide
    range says the row's ratio is not to be read to two decimals."""
    base = {r.prompt_id: r.new_tokens / r.wall_time_s for r in baseline if r.wall_time_s and r.new_tokens}
    ratios = [(r.new_tokens / r.wall_time_s) / base[r.prompt_id] for r in group
              if r.wall_time_s and r.prompt_id in base]
    return [min(ratios), max(ratios)] if len(ratios) > 1 else None


def _summarize_group(key: tuple, group: list[RunRecord]) -> Summary:
    dataset, mode, temperature, k = key
    tokens = sum(r.new_tokens for r in group)
    wall = sum(r.wall_time_s for r in group)
    stats = [r.stats for r in group if r.stats is not None]
    fields = _spec_fields(stats, k, runner_up=RUNNER_UP_MODE_MARK in mode) if stats else {}
    return Summary(dataset=dataset, mode=mode, temperature=temperature, k=k, prompts=len(group),
                   new_tokens=tokens, wall_time_s=wall, tokens_per_s=tokens / wall if wall else 0.0,
                   identical=_identity(group), same_as_in_process=_same_as_in_process(group), **fields)
