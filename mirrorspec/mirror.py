"""Mirror-style pipelining: draft the next window while the target verifies this one.

While the target scores window t, the drafter drafts window t+1 on *branches*, each a guess
(j, c) of the verdict: j drafts accepted, then token c (recovered at a rejection, or the bonus
when all were accepted). When the verdict (n, x) arrives, the branch keyed (n, x), if drafted,
is window t+1's proposal and drafting has left the critical path; otherwise the drafter drafts
afresh (Mirror-SD, arXiv 2510.13161; PEARL's pre-verify).

Why it stays exact: a branch is picked by the verdict alone, by its key, never by its tokens.
Its context is then exactly the true context, and ``propose`` draws from the DRAFT stream at
absolute positions (counter-based randomness), so the branch is the very proposal a fresh draft
would make: same tokens, same q. Mirror mode changes *when* drafting happens, not what is drafted.

The best guesses are drafted together, wherever in the window they fork (``Drafter.propose_branches``
with fork points: one batched forward per step for a draft model, each row masked to its own
prefix; one call for a remote drafter). The verdict is spread over the window's positions, so a
batch of the best few guesses across them holds it about twice as often as the best guesses at
one point.

Guesses, best first: for each rejection point j < K, the drafter's own runner-up tokens at j
(a rejected draft is never the recovered token: the residual is 0 there; where the window was
looked up rather than drafted, the drafter ranks the looked-up tokens with its model during the
verify, ``Drafter.alternatives_for``); for "all accepted", the drafter's greedy next token after
its last draft. Ranked by their chance of being the verdict: where the rejection falls, from the
running acceptance estimate and the drafter's own probability of each draft; which token the
target says there, from the drafter's probabilities of its runner-ups (``guesses``). A verifier
that gives early-exit hints (``mirrorspec.models.early_exit``, read through a tuned lens,
``mirrorspec.models.lens``) sends the target's own leaning part-way through the verify: the
pipeline drafts its best own
guesses (half the branches at most), waits for the hint (or the verdict), then ranks the hint's
guesses with the rest.

Where the window also offers the target the drafter's runner-up b for its first draft (runner-up
windows), the target picking b there is b winning the slot, and the verdict is (b, then the
target's token after it): a context no chain branch fits, so that guess is drafted after b and
the drafter's own next token (``runner_up_guesses``), and keyed apart (``branch_key``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

from mirrorspec.config import MirrorConfig, SamplingParams
from mirrorspec.drafting import Drafter, Proposal
from mirrorspec.models.early_exit import EarlyExitHint
from mirrorspec.sampling import WindowVerdict

GREEDY = SamplingParams(max_new_tokens=1)


@dataclass(frozen=True)
class Branch:
    """A pre-drafted window t+1 for the verdict (num_accepted, next_token) of window t; with
    ``runner_up``, for the verdict "the runner-up took the first slot, then next_token"."""

    num_accepted: int
    next_token: int
    k: int  # the K it was drafted with: used only if window t+1 asks for the same K
    proposal: Proposal
    runner_up: int | None = None

    @property
    def key(self) -> tuple[int, ...]:
        return branch_key(self.num_accepted, self.next_token, self.runner_up)


def branch_key(num_accepted: int, next_token: int, runner_up: int | None) -> tuple[int, ...]:
    """(j, c) for a chain verdict, (1, c, runner-up) where the runner-up won: the two contexts differ."""
    return (num_accepted, next_token) if runner_up is None else (num_accepted, next_token, runner_up)


@dataclass
class Prefetch:
    """What one overlapped window produced: the verdict, its verify time, the branches."""

    verdict: WindowVerdict
    verify_time_s: float
    draft_time_s: float  # branch drafting, all of it off the critical path
    branches: dict[tuple[int, ...], Branch]  # by Branch.key
    verify_span: tuple[float, float] = (0.0, 0.0)  # perf_counter start and end, for timelines
    draft_span: tuple[float, float] = (0.0, 0.0)
    branched: bool = True  # False: this window skipped branching (it did not pay; see should_branch)

    def take(self, verdict: WindowVerdict, k: int) -> Proposal | None:
        """The branch matching the verdict, by key alone; None on a miss. A chain verdict (the
        window's own first j drafts, then c) and a runner-up's (the runner-up, then c) leave
        different contexts, so their keys differ (``branch_key``)."""
        branch = self.branches.get(branch_key(verdict.num_accepted, verdict.next_token, verdict.runner_up))
        return branch.proposal if branch is not None and branch.k == k else None


def guesses(proposal: Proposal, alpha: float | Sequence[float],
            alternatives: int) -> list[tuple[float, int, int | None]]:
    """(score, j, c) for every guess, the score an estimate of P(verdict = (j, c)); c None = "the
    drafter's greedy token after all K drafts". ``alpha``: the chance each draft passes, one for all
    or one per position.

    Where the drafter sent its probabilities (``Proposal.alternative_probs``), a draft passes with
    a chance halfway between alpha and the drafter's own probability of it, and a rejection there
    lands on a runner-up in proportion to the drafter's probability of it: one the drafter gives 0.3
    is a far better guess than one it gives 0.01 at another position, which rank alone cannot tell
    (``benchmarks.hints``, greedy, the demo pair, 20 prompts: the share of verdicts 4 branches hold
    went from 0.30 to 0.34 on HumanEval and 0.23 to 0.26 on MT-Bench; 8 branches: 0.38 to 0.42, 0.25
    to 0.38).
    Without them (looked-up tokens, older replicas), runner-ups score by rank: 1, 1/2, 1/3, ..."""
    rates = per_position(alpha, len(proposal))
    ranked = proposal.ranked()
    out: list[tuple[float, int, int | None]] = []
    reach = 1.0  # P(the window gets to position j)
    for j, (draft, tops) in enumerate(zip(proposal.tokens, proposal.alternatives)):
        probs = ranked.probs_at(j)
        if probs is None:  # ranked by order alone
            passes = rates[j]
            shares = [(c, 1 / (rank + 1)) for rank, c in enumerate(t for t in tops if t != draft)][:alternatives]
        else:
            passes = 0.5 * (rates[j] + dict(zip(tops, probs)).get(draft, 0.0))
            runners_up = [(c, p) for c, p in zip(tops, probs) if c != draft][:alternatives]
            mass = sum(p for _, p in runners_up) or 1.0
            shares = [(c, p / mass) for c, p in runners_up]  # where the rejection lands, given one here
        out += [(reach * (1 - passes) * share, j, c) for c, share in shares]
        reach *= passes
    out.insert(0, (reach, len(proposal), None))  # first among equals, as it always was
    return sorted(out, key=lambda g: -g[0])


def runner_up_guesses(pending: list[tuple], runner_up: int | None) -> list[tuple]:
    """``pending`` with the guess (0, b) for a runner-up b the target scores turned into
    (score, 1, None, b): where the target picks b at the first slot, b wins it and the target adds
    its token after b, guessed as the drafter's greedy one there (as for "all accepted"). Its
    chance is the same event's, so the score stands."""
    if runner_up is None:
        return pending
    return [(g[0], 1, None, runner_up) if (g[1], g[2]) == (0, runner_up) else g for g in pending]


def per_position(alpha: float | Sequence[float], k: int) -> list[float]:
    return [float(alpha)] * k if isinstance(alpha, (int, float)) else [float(a) for a in alpha]


def looked_up(proposal: Proposal) -> tuple[bool, ...]:
    """Which drafts came without runners-up: looked up, not drafted by a model. They pass far more
    often than drafted ones (prompt lookup only fires where the text repeats), so the two are
    counted apart when ranking guesses."""
    tops = proposal.alternatives
    return tuple(j >= len(tops) or all(t == draft for t in tops[j]) for j, draft in enumerate(proposal.tokens))


def with_runners_up(drafter: Drafter, context: Sequence[int], proposal: Proposal) -> Proposal:
    """``proposal`` with the drafter's own top tokens where it came without runners-up (a looked-up
    window has none), so a rejection there can be guessed too. Only guesses change: the proposal
    under verification is the one already sent."""
    if not any(looked_up(proposal)):
        return proposal
    scored = drafter.alternatives_for(context, proposal.tokens)
    if len(scored) != len(proposal):
        return proposal
    return replace(proposal, alternatives=scored.ids, alternative_probs=scored.probs)


def hint_guesses(proposal: Proposal, hint: EarlyExitHint,
                 alpha: float | Sequence[float]) -> list[tuple[float, int, int]]:
    """(score, j, c) from the target's early-exit hint: a draft passes with a chance between the
    running alpha and the hint's own probability of it (the early exit is not calibrated, so
    neither is trusted alone); where it fails, the target's token is one of the hint's others."""
    rates = per_position(alpha, len(proposal))
    out: list[tuple[float, int, int]] = []
    reach = 1.0  # P(the window gets to position j)
    for j in range(len(proposal) + 1):
        draft = proposal.tokens[j] if j < len(proposal) else None
        passes = 0.5 * (rates[j] + hint.prob(j, draft)) if draft is not None else 0.0
        out += [(reach * (1 - passes) * p, j, c) for c, p in zip(hint.top_tokens[j], hint.top_probs[j]) if c != draft]
        reach *= passes
    return sorted(out, key=lambda g: -g[0])


class AcceptanceByKind:
    """How often looked-up and drafted tokens pass, counted apart, each shrunk towards the
    request's overall alpha while its own count is small (a Beta prior of ``prior_weight``)."""

    def __init__(self, prior_weight: float = 2.0):
        self.prior_weight = prior_weight
        self.passed = {True: 0, False: 0}  # keyed by looked_up
        self.tested = {True: 0, False: 0}

    def rates(self, kinds: Sequence[bool], alpha: float) -> list[float]:
        w = self.prior_weight
        return [(self.passed[kind] + w * alpha) / (self.tested[kind] + w) for kind in kinds]

    def observe(self, kinds: Sequence[bool], num_accepted: int) -> None:
        """The drafts before ``num_accepted`` passed; the one at it (if any) failed."""
        for j, kind in enumerate(kinds[:num_accepted + 1]):
            self.tested[kind] += 1
            self.passed[kind] += j < num_accepted


class MirrorPipeline:
    """Runs the verify in a worker thread and drafts branches in the caller's meanwhile.

    Drafter and verifier must not share state (each has its own model session); torch releases
    the GIL inside kernels, so the two really run at once. Give each side its own cores: on a
    2-core machine, one torch thread each. Serving (``stop_at_verdict``), branching is also
    bounded by measured cost (``BranchPolicy``).
    """

    def __init__(self, config: MirrorConfig | None = None, history: BranchHistory | None = None):
        self.config = config or MirrorConfig()
        # earlier requests' estimates, to start from and add to (a request of its own: none)
        self.history = history if history is not None else BranchHistory()
        self.policy = self.history.policy(self.config)  # whether, and how far, to branch
        self.acceptance = AcceptanceByKind()  # ranks guesses: looked-up drafts pass far more often
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mirror-verify")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.history.keep(self.policy)

    def verify_while_drafting(self, verifier, drafter: Drafter, context: Sequence[int], proposal: Proposal,
                              params: SamplingParams, seed: int, alpha: float,
                              k_after: Callable[[int, int], int]) -> Prefetch:
        """Verify ``proposal``; meanwhile draft branches. ``k_after(n, produced_tokens)`` is the K
        window t+1 would get after verdict n (0: no next window worth drafting)."""
        kinds = looked_up(proposal)
        if not self.policy.should_branch():  # a serial window: verify right here, no thread hop
            verdict, span = _timed(verifier.verify, context, proposal, params, seed)
            self.policy.observe_verify(span[1] - span[0], branched=False)
            self.acceptance.observe(kinds, verdict.drafts_accepted)
            return Prefetch(verdict, span[1] - span[0], 0.0, {}, span, (span[0], span[0]), branched=False)
        hints: list[EarlyExitHint] = []
        heard = threading.Event()  # a hint came, or the verify is over

        def on_hint(hint: EarlyExitHint) -> None:
            hints.append(hint)
            heard.set()

        wants_hints = self.config.use_hints and getattr(verifier, "gives_hints", False)
        verify = partial(verifier.verify, on_hint=on_hint) if wants_hints else verifier.verify
        future = self._pool.submit(_timed, verify, context, proposal, params, seed)
        future.add_done_callback(lambda _: heard.set())
        branches: dict[tuple[int, ...], Branch] = {}
        started = time.perf_counter()
        rates = self.acceptance.rates(kinds, alpha)
        pending = guesses(with_runners_up(drafter, context, proposal), rates, self.config.alternatives)
        # a runner-up the target scores in this window takes the first slot itself where the
        # target picks it: the guess (0, runner-up) becomes "the runner-up won, then the drafter's
        # own next token"
        offered = verifier.offered_runner_up(proposal)
        pending = runner_up_guesses(pending, offered)
        drafting_s = 0.0  # in propose calls, not waiting for hints
        groups = 0
        while len(branches) < self.config.max_branches:
            if self.config.stop_at_verdict and future.done():
                break
            if wants_hints and (branches or not pending):  # own best guess drafted: let the target steer
                wants_hints = False
                heard.wait()
                if hints:
                    hinted = runner_up_guesses(hint_guesses(proposal, hints[0], rates), offered)
                    pending = sorted([*pending, *hinted], key=lambda g: -g[0])
                continue
            if not pending:
                break
            # the best guesses, wherever they fork, are drafted together (one batched forward per
            # step, for not much more than the price of one); a branch is only any use if drafted
            # with the K its window will ask for, so a group keeps to one K. Before a hint, the
            # drafter's own guesses take half the branches: the rest are the hint's to steer
            room = self.config.max_branches - len(branches)
            if wants_hints:
                room = -(-self.config.max_branches // 2)
            k = k_after(pending[0][1], pending[0][1] + 1)
            # a guess after the runner-up forks from a context of its own: a group alone. (Keeping it
            # a slot where it ranks among the next ``room`` measured no better: greedy, 4 branches,
            # 10 + 10 prompts, hits 0.275 -> 0.258 of windows on HumanEval, 0.186 -> 0.203 on MT-Bench)
            runner_up = pending[0][3] if len(pending[0]) > 3 else None
            group = [pending[0]] if runner_up is not None else \
                [g for g in pending if len(g) == 3 and k_after(g[1], g[1] + 1) == k][:room]
            if self.config.stop_at_verdict and not self.policy.worth_starting(sum(g[0] for g in group),
                                                                              time.perf_counter() - started):
                break  # the rest are likelier misses still
            pending = [g for g in pending if g not in group]
            if k <= 0:  # no next window after these verdicts (or not one worth drafting)
                continue
            group_started = time.perf_counter()
            window = proposal.tokens if runner_up is None else (runner_up,)  # what the group's branches follow
            same_head = {(b.num_accepted, b.next_token) for b in branches.values() if b.runner_up == runner_up}
            drafted_group = self._draft_group(drafter, context, window, [(g[1], g[2]) for g in group], k, params,
                                              seed, exclude=same_head)
            for (j, c), drafted in drafted_group:
                branch = Branch(j, c, k, drafted, runner_up)
                branches[branch.key] = branch
            drafting_s += time.perf_counter() - group_started
            groups += 1
        drafted = time.perf_counter()
        verdict, verify_span = future.result()
        self.acceptance.observe(kinds, verdict.drafts_accepted)
        self.policy.observe_verify(verify_span[1] - verify_span[0], branched=True)
        if groups:
            self.policy.observe_group(drafting_s / groups, max(drafted - verify_span[1], 0.0))
        return Prefetch(verdict, verify_span[1] - verify_span[0], drafted - started, branches, verify_span,
                        (started, drafted))

    @staticmethod
    def _draft_group(drafter: Drafter, context: Sequence[int], window: Sequence[int],
                     guessed: list[tuple[int, int | None]], k: int, params: SamplingParams, seed: int,
                     exclude: set[tuple[int, int]]) -> list[tuple[tuple[int, int], Proposal]]:
        """Branches for each guessed verdict (j, c), drafted together: after the window's first j
        drafts, then c (None: the drafter's own greedy choice there, the guess for "all accepted")."""
        keys: list[tuple[int, int]] = []
        for j, c in guessed:
            if c is None and (c := own_next_token(drafter, [*context, *window[:j]], seed)) is None:
                continue
            keys.append((j, c))
        keys = [key for key in dict.fromkeys(keys) if key not in exclude]
        if not keys:
            return []
        head = [*context, *window[:max(j for j, _ in keys)]]
        forks = [len(context) + j for j, _ in keys]
        return list(zip(keys, drafter.propose_branches(head, [c for _, c in keys], k, params, seed, forks)))


def own_next_token(drafter: Drafter, context: Sequence[int], seed: int) -> int | None:
    """The drafter's greedy next token after ``context``, the guess of the target's bonus token
    where every draft passes (None: the drafter proposes none there)."""
    guess = drafter.propose(context, 1, GREEDY, seed)
    return guess.tokens[0] if guess.tokens else None


class BranchPolicy:
    """Whether mirror branching pays, from running averages of a request's timings, started from
    the last request's (``BranchHistory``), for mirror at the front door (``MirrorPipeline``) and
    on a target (``target_service.run_windows``):
    - a branch still drafting when the verdict comes delays the next window, so a group of them
      is started only while its expected saving beats its expected delay (``worth_starting``);
    - drafting beside a verify can slow the verify (shared cores, memory bandwidth), so a window
      branches only while hits save more than that costs (``should_branch``); it falls back to
      serial drafting where mirror does not pay, and probes the other choice now and then.
    """

    def __init__(self, config: MirrorConfig | None = None):
        self.config = config or MirrorConfig()
        self.verify_s = RunningMean()  # verify time in windows that branched
        self.alone_s = RunningMean()  # verify time in windows that did not
        self.group_s = RunningMean()  # drafting time per group of branches drafted together, beside a verify
        self.fresh_s = RunningMean()  # a window drafted on the critical path, alone: what a hit saves
        self.overrun_s = RunningMean()  # branch drafting past the verdict
        self.hit_rate = RunningMean()
        self._branching: bool | None = None  # the choice the estimates make
        self._probe_gap = self.config.probe_every
        self._since_probe = 0
        self._resumed_samples = 0  # samples its means started with (``resume``): not this request's

    def _means(self) -> dict[str, RunningMean]:
        return {name: getattr(self, name) for name in _ESTIMATES}

    def samples_of_its_own(self) -> int:
        """Samples this request added to its estimates (none: it learnt nothing worth keeping)."""
        return sum(mean.count for mean in self._means().values()) - self._resumed_samples

    def state(self) -> PolicyState:
        """What this policy has learnt, for the next request to start from (``BranchHistory``)."""
        return PolicyState({name: (mean.value, mean.count) for name, mean in self._means().items()},
                           self._branching, self._probe_gap, self._since_probe)

    def resume(self, state: PolicyState) -> None:
        """Start from an earlier request's ``state``: its estimates, each weighing as much as
        ``PolicyState.resumed_samples`` samples, so this request's own first windows move them
        more than the running weight would (its pair of replicas or its K may differ); and its
        probe schedule, so requests shorter than a probe gap still probe in turn, and gaps keep
        doubling across requests. The next probe comes where that schedule puts it, or
        ``probe_every`` windows in where that is sooner: a request whose branching would pay
        finds out within that many windows, as a request starting blank did. (Capping the gap
        itself, with the count since the last probe kept, made most requests of a few windows
        more than the cap probe in their first window, and none back off.)"""
        for name, mean in self._means().items():
            value, count = state.estimates[name]
            mean.value, mean.count = value, min(count, state.resumed_samples)
        self._resumed_samples = sum(mean.count for mean in self._means().values())
        self._branching, self._probe_gap = state.branching, state.probe_gap
        self._since_probe = max(state.since_probe, state.probe_gap - self.config.probe_every)

    def observe_verify(self, seconds: float, branched: bool) -> None:
        """A window's verify, with branches drafted beside it or not."""
        (self.verify_s if branched else self.alone_s).add(seconds)

    def observe_group(self, seconds: float, overrun_s: float) -> None:
        """A group of branches drafted beside a verify, and how long it ran past the verdict."""
        self.group_s.add(seconds)
        self.overrun_s.add(overrun_s)

    def observe_hit(self, hit: bool) -> None:
        """Whether the last window's branches held the verdict (the engine knows, at ``take``)."""
        self.hit_rate.add(float(hit))

    def observe_fresh_draft(self, seconds: float) -> None:
        """A window drafted after the verdict, on the critical path (the engine times it)."""
        self.fresh_s.add(seconds)

    def should_branch(self) -> bool:
        """Branch in this window? Yes while hits save more drafting than branching costs: the
        verify's slowdown beside the drafter plus the drafting that runs past the verdict.
        A hit saves the window's fresh draft, timed alone on the critical path; not the branches'
        own drafting time, which beside a verify runs up to twice as slow (shared cores and memory
        bandwidth) and in batches, and so overstated the saving.
        It learns both sides first, then probes the other choice so the estimates follow the
        request: ``probe_every`` windows after the choice changes, then at doubling gaps (up to
        ``max_probe_every``) while probes leave it standing: each probe of a choice that does not
        pay costs that window's loss, which a fixed gap keeps paying for the whole request.
        Tests (``stop_at_verdict=False``) always branch."""
        if not self.config.stop_at_verdict:
            return True
        if not (self.verify_s.count and self.hit_rate.count):
            return True
        if not self.alone_s.count:
            return False
        saved_per_hit = self.fresh_s.value if self.fresh_s.count else self.group_s.value
        saving = self.hit_rate.value * saved_per_hit
        cost = max(self.verify_s.value - self.alone_s.value, 0.0) + self.overrun_s.value
        branching = saving > cost
        if branching != self._branching:  # the estimates changed the choice: look back soon
            self._branching, self._probe_gap, self._since_probe = branching, self.config.probe_every, 0
        self._since_probe += 1
        if self._since_probe < self._probe_gap:
            return branching
        self._since_probe = 0
        self._probe_gap = min(2 * self._probe_gap, self.config.max_probe_every)
        return not branching

    def worth_starting(self, p_hit: float, elapsed_s: float) -> bool:
        """Start a group of branches (those forking at one point, drafted together) that holds the
        verdict with chance ``p_hit``, at ``elapsed_s`` into the verify? A hit saves the drafting
        it did before the verdict (at most the verify time left, r); a miss delays the fresh draft
        by the part that runs past the verdict (D - r for a group of D)."""
        if not (self.verify_s.count and self.group_s.count):
            return True  # nothing measured yet: learn
        left = max(self.verify_s.value - elapsed_s, 0.0)
        cost = self.group_s.value
        p_hit = min(max(p_hit, 0.0), 1.0)
        return left >= cost or p_hit * left > (1 - p_hit) * (cost - left)


_ESTIMATES = ("verify_s", "alone_s", "group_s", "fresh_s", "overrun_s", "hit_rate")  # BranchPolicy's means


@dataclass(frozen=True)
class PolicyState:
    """A ``BranchPolicy``'s running means (value, samples) and probe schedule."""

    estimates: dict[str, tuple[float, int]]
    branching: bool | None
    probe_gap: int
    since_probe: int
    resumed_samples: int = 2  # a resumed mean weighs this many samples at most: the next weighs 1/3


class BranchHistory:
    """The branch policy's state across requests, for each mirror configuration: each request's
    policy starts where the last finished one left off, and learns on from its own windows.

    A policy that starts blank spends its first windows learning whether branching pays (the
    first branches, the second does not, whatever they cost), and then probes on a schedule of
    its own. A request of 48 tokens on an H200 had about 20 windows, so learning took a tenth of
    them, and requests shorter than a probe gap never looked again. Requests through one front
    door (or one target) share the pools whose timings the policy weighs, so they can share what
    it learnt. Thread-safe: concurrent requests each start from the last state kept, and the last
    to finish is kept (their samples are not merged)."""

    max_configs = 16  # configurations remembered at once (the oldest kept goes first): a bound on what clients make

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[MirrorConfig, PolicyState] = {}

    def policy(self, config: MirrorConfig) -> BranchPolicy:
        policy = BranchPolicy(config)
        with self._lock:
            state = self._states.get(config)
        if state is not None:
            policy.resume(state)
        return policy

    def keep(self, policy: BranchPolicy) -> None:
        """``policy``'s state, for the next request of its configuration, if it learnt anything of
        its own: a request that ended before its first window (or whose windows the target ran)
        would put back the state it started from over what others learnt meanwhile."""
        if policy.samples_of_its_own():
            state = policy.state()
            with self._lock:
                self._states.pop(policy.config, None)
                self._states[policy.config] = state
                while len(self._states) > self.max_configs:
                    del self._states[next(iter(self._states))]


class RunningMean:
    """An exponential running mean that starts as the plain mean of its first samples."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.count = 0
        self.value = 0.0

    def add(self, sample: float) -> None:
        self.count += 1
        self.value += (sample - self.value) * max(self.weight, 1 / self.count)


def _timed(fn, *args):
    started = time.perf_counter()
    out = fn(*args)
    return out, (started, time.perf_counter())
