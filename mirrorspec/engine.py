"""The speculative window loop, written once.

``decode_windows`` is the whole algorithm: ask a drafter for up to K tokens, ask a verifier for a
verdict, commit the accepted prefix plus one token, repeat. It talks to a ``Drafter`` and a
``Verifier`` only, so the in-process engine below and the gRPC orchestrator (remote drafter and
target behind the same two interfaces) run the very same loop.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from mirrorspec.adaptive import AdaptiveK, posterior_alpha
from mirrorspec.mirror import MirrorPipeline
from mirrorspec.config import (
    AdaptiveKConfig,
    InvalidRequest,
    MirrorConfig,
    OutOfRange,
    SamplingParams,
    SpeculationConfig,
    as_scalar,
    check_seed,
    check_shared_vocabulary,
    is_integer,
)
from mirrorspec.drafting import DraftModelDrafter, Drafter, HybridDrafter, NgramDrafter, Proposal
from mirrorspec.models.early_exit import EarlyExitHint, EarlyExitProbe
from mirrorspec.models.lens import TunedLens
from mirrorspec.models.loading import LoadedModel, same_tokenizer_at
from mirrorspec.models.session import KVSession, LogitSession, scores_runner_up
from mirrorspec.sampling import (
    NonFiniteLogits,
    Stream,
    TokenKind,
    WindowVerdict,
    finite_logits,
    fresh_seed,
    greedy_verify,
    next_kind,
    rejection_sample,
    runner_up_sample,
    sample_categorical,
    target_probs,
    uniforms,
)


class Verifier(Protocol):
    """Decides one window: how many drafts the target keeps and which token follows them.

    One that ``gives_hints`` calls ``on_hint`` with an ``EarlyExitHint`` part-way through the
    verify, before the verdict (mirror mode steers its branches with it)."""

    vocab_size: int
    gives_hints: bool

    def verify(self, context: Sequence[int], proposal: Proposal, params: SamplingParams, seed: int,
               on_hint: Callable[[EarlyExitHint], None] | None = None) -> WindowVerdict: ...

    def offered_runner_up(self, proposal: Proposal) -> int | None:
        """The runner-up ``verify`` scores beside ``proposal``'s first draft (None: a chain only)."""


class TargetVerifier:
    """Scores a window in one target forward pass and runs exact rejection sampling on it; with
    a ``probe``, it reads early-exit hints off that same pass.

    With ``runner_up``, a window also scores the drafter's runner-up for its first draft in the
    same pass (a two-way tree at the root, one token more). Where the target rejects the first
    draft, the runner-up gets a second chance at that slot: greedy, if it is the target's argmax;
    sampled, by a second round of rejection sampling (``runner_up_sample``). Where it wins, the
    window keeps it and the target's token after it: two tokens where a chain gives one. The
    first slot's token still follows the target exactly; the runner-up only reaches further."""

    def __init__(self, session: LogitSession, probe: EarlyExitProbe | None = None, runner_up: bool = False):
        self.session = session
        self.vocab_size = session.vocab_size
        self.probe = probe
        self.runner_up = runner_up and hasattr(session, "logits_with_runner_up")  # and per window, scores_runner_up

    @property
    def gives_hints(self) -> bool:
        return self.probe is not None

    def verify(self, context: Sequence[int], proposal: Proposal, params: SamplingParams, seed: int,
               on_hint: Callable[[EarlyExitHint], None] | None = None) -> WindowVerdict:
        k, start = len(proposal), len(context)
        runner_up = self.offered_runner_up(proposal)
        if runner_up is not None and not scores_runner_up(self.session, start + k):
            runner_up = None  # past a sliding window: the chain alone (the drafter offered it all the same)
        hinting = (self.probe.watching(k + 1, on_hint, trailing=int(runner_up is not None))
                   if on_hint is not None and self.probe else nullcontext())
        window = [*context, *proposal.tokens]
        with hinting:
            if runner_up is None:
                logits, runner_up_logits = self.session.logits_for(window, k + 1), None  # [k + 1, vocab]
            else:
                logits, runner_up_logits = self.session.logits_with_runner_up(window, k + 1, runner_up).split(k + 1)
        num_accepted, next_token, runner_up_won = self._decide(logits, proposal, runner_up, params, seed, start)
        if runner_up_won:
            self.session.rollback(start)  # the runner-up's cache entry sits past the drafts: re-fed next window
            after = self._after_runner_up(runner_up_logits, params, seed, start)
            return WindowVerdict(num_accepted=1, next_token=after, next_kind=TokenKind.BONUS, runner_up=runner_up)
        self.session.rollback(start + num_accepted)  # drop the rejected drafts from the cache now
        return WindowVerdict(num_accepted=num_accepted, next_token=next_token, next_kind=next_kind(num_accepted, k))

    def _decide(self, logits: torch.Tensor, proposal: Proposal, runner_up: int | None, params: SamplingParams,
                seed: int, start: int) -> tuple[int, int, bool]:
        """(drafts accepted, the token after them, whether the runner-up took the first slot)."""
        try:
            logits = finite_logits(logits)
        except NonFiniteLogits:
            return self._decide_before_a_broken_row(logits, proposal, runner_up, params, seed, start)
        k = len(proposal)
        draft_ids = proposal.token_tensor(logits.device)  # [1, k]
        if params.greedy:
            num_accepted, next_token = greedy_verify(draft_ids, logits.argmax(dim=-1, keepdim=True).T)
            n, token = int(num_accepted.item()), int(next_token.item())
            return n, token, runner_up is not None and n == 0 and token == runner_up
        vocab = logits.shape[-1]
        p = target_probs(logits, params).unsqueeze(0)  # [1, k + 1, vocab]
        q = (proposal.q.dense(vocab, logits.device) if k else p.new_zeros(0, vocab)).unsqueeze(0)  # [1, k, vocab]
        u_accept = uniforms(seed, range(start, start + k), Stream.ACCEPT).unsqueeze(0)  # [1, k]
        u_next = uniforms(seed, range(start, start + k + 1), Stream.NEXT).unsqueeze(0)  # [1, k + 1]
        num_accepted, next_token = rejection_sample(draft_ids, q, p, u_accept, u_next)
        n, token = int(num_accepted.item()), int(next_token.item())
        if runner_up is None or n > 0:
            return n, token, False
        taken, recovered = runner_up_sample(p[:, 0], q[:, 0], torch.tensor([runner_up], device=logits.device),
                                            uniforms(seed, [start], Stream.RUNNER_UP), u_next[:, 0])
        return 0, int(recovered.item()), bool(taken.item())

    def _decide_before_a_broken_row(self, logits: torch.Tensor, proposal: Proposal, runner_up: int | None,
                                    params: SamplingParams, seed: int, start: int) -> tuple[int, int, bool]:
        """A row after a draft the target rejects plays no part, and target-only decoding never
        computes it: NaN there (a float16 pass that overflowed on a draft the target would not
        write) failed the whole window (a review's find). With the first broken row r, the window
        is decided on its first r drafts: where one of them is rejected, the verdict is the whole
        window's (rows past a rejection are not read, and randomness is addressed by position).
        Where all r pass, row r is the target's own next step, as target-only would compute it,
        and is refused as before.  # logits: [k + 1, vocab]"""
        broken = torch.isnan(logits).any(dim=-1) | (logits == float("-inf")).all(dim=-1)  # [k + 1]
        r = int(broken.nonzero()[0].item())
        if r == 0:
            finite_logits(logits[:1])  # raises: the first row is read by every verdict
        stand_in = logits[r - 1:r]  # in row r's place: read only where all r drafts pass, then refused
        n, token, runner_up_won = self._decide(torch.cat([logits[:r], stand_in]), proposal.first(r), runner_up,
                                               params, seed, start)
        if n == r:
            finite_logits(logits[r:r + 1])  # raises
        return n, token, runner_up_won

    @staticmethod
    def _after_runner_up(logits: torch.Tensor, params: SamplingParams, seed: int, start: int) -> int:
        """The target's token after a runner-up that took slot ``start``: its argmax, or a draw at
        slot start + 1 (a NEXT uniform no other token of this window used).  # logits: [1, vocab]"""
        logits = finite_logits(logits)
        if params.greedy:
            return int(logits[0].argmax())
        return int(sample_categorical(target_probs(logits, params), uniforms(seed, [start + 1], Stream.NEXT)).item())

    def offered_runner_up(self, proposal: Proposal) -> int | None:
        return runner_up_to_offer(self.runner_up, proposal)


def runner_up_to_offer(enabled: bool, proposal: Proposal) -> int | None:
    """The runner-up a window offers, local or remote verifier alike. Every window of a request
    offers it, hinted or not: which windows gather hints depends on timing (mirror branches only
    while it pays), and a seeded request's tokens must not."""
    return proposal.runner_up() if enabled else None


@dataclass
class GenerationStats:
    """Per-request speculation statistics (names follow vLLM's spec-decode metrics)."""

    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # windows that ended in a rejection (the rest accepted every draft)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0  # drafting on the critical path
    verify_time_s: float = 0.0
    # mirror mode: windows verified while branches were drafted, branches drafted, branches used
    mirror_windows: int = 0
    branches_drafted: int = 0
    branch_hits: int = 0
    draft_time_off_path_s: float = 0.0  # branch drafting that overlapped a verify
    runner_up_hits: int = 0  # windows whose first slot went to the drafter's runner-up
    committed: int = 0  # tokens the windows committed (a stop token cuts the window it falls in)
    windows_on_target: int = 0  # served: windows the target ran, asking the drafter itself
    # windows adaptive K sent without drafts, speculation not paying there (probes excepted)
    adaptive_off_windows: int = 0
    # the first window's verify, which prefills the prompt too: per-window costs leave it out
    first_verify_time_s: float = 0.0
    # the first window's drafting, which prefills a draft model with the prompt too, and what it
    # drafted: per-token drafting costs leave them out
    first_draft_time_s: float = 0.0
    first_drafted: int = 0
    # (what, start, end) in perf_counter seconds, what = draft | verify | branches; None = not kept
    timeline: list[tuple[str, float, float]] | None = None

    def span(self, what: str, start: float, end: float) -> None:
        if self.timeline is not None:
            self.timeline.append((what, start, end))

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.windows += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.rejected += int(num_accepted < num_drafted)
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    def record_window(self, num_drafted: int, verdict: WindowVerdict, num_committed: int,
                      verify_time_s: float) -> None:
        self.verify_time_s += verify_time_s
        self.first_verify_time_s = self.first_verify_time_s or verify_time_s
        self.record(num_drafted, verdict.drafts_accepted)
        self.runner_up_hits += verdict.runner_up is not None
        self.committed += num_committed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def token_acceptance_rate(self) -> float:
        """Leviathan's alpha, the chance that one draft token passes its test: accepted tests over
        all tests run (a window stops testing at its first rejection). ``acceptance_rate``
        (accepted / drafted) also counts drafts after a rejection, which are never tested, so
        it understates alpha; with i.i.d. acceptance the two relate through
        mean_accepted_length = (1 - alpha^(K+1)) / (1 - alpha)."""
        tests = self.accepted + self.rejected
        return self.accepted / tests if tests else 0.0

    @property
    def branch_hit_rate(self) -> float:
        """Share of mirror windows whose next window was already drafted when the verdict came."""
        return self.branch_hits / self.mirror_windows if self.mirror_windows else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target pass, counting the recovered/bonus token and runner-up wins,
        and not the tokens after a stop token, which the output never gets."""
        return self.committed / self.windows if self.windows else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, token_acceptance_rate=self.token_acceptance_rate,
                   branch_hit_rate=self.branch_hit_rate,
                   mean_accepted_length=self.mean_accepted_length,
                   per_position_acceptance=self.per_position_acceptance)
        return out


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    seed: int
    stats: GenerationStats
    wall_time_s: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.wall_time_s if self.wall_time_s else 0.0


@dataclass(frozen=True)
class WindowEvent:
    """Tokens committed by one window, after stop/length truncation."""

    tokens: list[int]
    num_drafted: int
    num_accepted: int
    next_kind: TokenKind
    finish_reason: str | None


def decode_windows(
    drafter: Drafter | None,
    verifier: Verifier,
    prompt: Sequence[int],
    params: SamplingParams,
    spec: SpeculationConfig,
    seed: int,
    stats: GenerationStats,
    mirror: MirrorPipeline | None = None,
    drafted_ahead: tuple[int, Proposal] | None = None,
    policy: AdaptiveK | None = None,
) -> Iterator[WindowEvent]:
    """The speculative loop. ``drafter=None`` or K=0 is exactly target-only decoding.

    With ``mirror``, each verify overlaps the drafting of branches for the next window; a
    branch whose key matches the verdict replaces the fresh draft (same proposal, earlier).
    ``drafted_ahead`` = (k, the drafter's proposal after ``prompt`` for that k), drafted while the
    target prefilled: the first window takes it if it asks for that k (``first_window_k``), as
    a mirror branch is taken by its key: it is the very proposal a fresh draft would make.
    ``policy``: adaptive K's state carried in from windows run elsewhere (``orchestrator.direct``);
    else the request's own, new (``window_policy``).
    """
    context = list(prompt)
    produced = 0
    stop = set(params.stop_token_ids)
    if policy is None:
        policy = window_policy(spec, drafter)

    def capped(k: int, produced_so_far: int) -> int:
        return capped_k(k, params, produced_so_far) if drafter else 0

    def k_after(num_drafted: int) -> Callable[[int, int], int]:
        """K of the next window after a verdict of n accepted (m tokens committed)."""
        if policy:
            return lambda n, m: capped(policy.peek(num_drafted, n), produced + m)
        return lambda n, m: capped(spec.num_speculative_tokens, produced + m)

    prefetch, last = None, None  # last: the verdict before this window, which a prefetched branch is keyed by
    while True:
        k = capped(chosen_k(policy, stats) if policy else spec.num_speculative_tokens, produced)
        proposal = prefetch.take(last, k) if prefetch is not None else None
        stats.branch_hits += proposal is not None
        if prefetch is not None and prefetch.branches:
            mirror.policy.observe_hit(proposal is not None)
        if drafted_ahead is not None:  # the first window only
            proposal = drafted_ahead[1] if drafted_ahead[0] == k else None
            drafted_ahead = None
        if proposal is None:
            started = time.perf_counter()
            proposal = drafter.propose(context, k, params, seed) if k > 0 else Proposal.empty()
            ended = time.perf_counter()
            stats.draft_time_s += ended - started
            if stats.windows == 0:
                stats.first_draft_time_s, stats.first_drafted = ended - started, len(proposal)
            stats.span("draft", started, ended)
            if mirror is not None and k > 0:
                mirror.policy.observe_fresh_draft(ended - started)
        if mirror is not None and len(proposal):
            alpha = policy.alpha if policy else posterior_alpha(stats.accepted, stats.rejected, AdaptiveKConfig())
            prefetch = mirror.verify_while_drafting(verifier, drafter, context, proposal, params, seed, alpha,
                                                    k_after(len(proposal)))
            verdict = prefetch.verdict
            verify_time = prefetch.verify_time_s
            stats.draft_time_off_path_s += prefetch.draft_time_s
            stats.mirror_windows += prefetch.branched
            stats.branches_drafted += len(prefetch.branches)
            stats.span("verify", *prefetch.verify_span)
            if prefetch.branched:
                stats.span("branches", *prefetch.draft_span)
        else:
            prefetch = None
            started = time.perf_counter()
            verdict = verifier.verify(context, proposal, params, seed)
            ended = time.perf_counter()
            verify_time = ended - started
            stats.span("verify", started, ended)
        if policy:
            policy.observe(len(proposal), verdict.drafts_accepted)
        last = verdict

        tokens, finish = window_tokens(verdict, proposal, stop, produced, params.max_new_tokens)
        stats.record_window(len(proposal), verdict, len(tokens), verify_time)
        produced += len(tokens)
        context += tokens
        yield WindowEvent(tokens, len(proposal), verdict.num_accepted, verdict.next_kind, finish)
        if finish:
            return


def chosen_k(policy: AdaptiveK, stats: GenerationStats) -> int:
    """The next window's K by adaptive K, counted in ``stats`` where it switched drafting off."""
    k = policy.next_k()
    stats.adaptive_off_windows += k == 0
    return k


def window_tokens(verdict: WindowVerdict, proposal: Proposal, stop: Collection[int], produced: int,
                  max_new_tokens: int) -> tuple[list[int], str | None]:
    """The tokens a window commits (its accepted drafts, then the next token), cut after a stop
    token, and why the request finishes with them, if it does."""
    return cut_at_stop([*verdict.accepted_tokens(proposal.tokens), verdict.next_token], stop, produced,
                       max_new_tokens)


def cut_at_stop(tokens: list[int], stop: Collection[int], produced: int,
                max_new_tokens: int) -> tuple[list[int], str | None]:
    """``tokens`` committed after ``produced`` others, cut after a stop token, and why the request
    finishes with them, if it does."""
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[:i + 1], "stop"
    return tokens, "length" if produced + len(tokens) >= max_new_tokens else None


def window_policy(spec: SpeculationConfig, drafter: Drafter | None) -> AdaptiveK | None:
    """The request's adaptive-K state, or None for a fixed K (K = 0 is fixed: target-only decoding,
    which no probe window may turn back on)."""
    adaptive = spec.adaptive and drafter and spec.num_speculative_tokens > 0
    return AdaptiveK(spec.adaptive, spec.num_speculative_tokens, drafter.step_cost) if adaptive else None


def capped_k(k: int, params: SamplingParams, produced: int) -> int:
    """No drafts past the request's last token: the window's own next token is its last."""
    return min(k, params.max_new_tokens - produced - 1)


def first_window_k(spec: SpeculationConfig, params: SamplingParams, drafter: Drafter | None) -> int:
    """The K ``decode_windows`` asks of ``drafter`` for the first window, so a caller can draft it
    ahead, while the target prefills (``drafted_ahead``)."""
    policy = window_policy(spec, drafter)
    return capped_k(policy.next_k() if policy else spec.num_speculative_tokens, params, 0)


def validate_prompt(input_ids: Sequence[int], vocab_size: int, max_context: int, params: SamplingParams,
                    field: str = "input_ids") -> list[int]:
    """The prompt as ints, refused if empty, outside the vocabulary, or too long for the context
    window; ``field`` names the argument (or proto field) the ids came in, for the error."""
    try:
        if isinstance(input_ids, (str, bytes)):
            raise TypeError
        items = list(input_ids)
        if any(isinstance(t, bool) for t in items):  # not taken for ids 0 and 1
            raise TypeError
        ids = [operator.index(t) for t in items]  # ints (numpy, 0-d tensors too); never a float truncated
    except TypeError:
        raise InvalidRequest(f"{field} must be a sequence of integer token ids, got {type(input_ids).__name__} "
                             f"{str(input_ids)[:40]!r}; encode text first (mirrorspec.models.encode_prompt)",
                             field=field) from None
    if not ids:
        raise InvalidRequest(f"{field} is empty; pass at least one prompt token", field=field)
    for name, values in ((field, ids), ("stop_token_ids", params.stop_token_ids)):  # a stop id past it never stops
        bad = [t for t in values if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"{name} holds ids {bad[:5]} outside the vocabulary [0, {vocab_size})", field=name)
    if len(ids) >= max_context:  # no max_new_tokens would fit: the prompt is what must change
        raise OutOfRange(f"the prompt ({len(ids)} tokens) leaves no room in the context window of {max_context}; "
                         f"shorten it to at most {max_context - 1} tokens", field=field)
    if len(ids) + params.max_new_tokens > max_context:
        raise OutOfRange(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context window "
            f"of {max_context}; lower max_new_tokens to at most {max_context - len(ids)}",
            field="max_new_tokens",
        )
    return ids


def make_drafter(draft: torch.nn.Module | Drafter | str | None, proposal_top_k: int = 0,
                 prompt_lookup: int = 0, draft_confidence: float = 0.0) -> Drafter | None:
    """A drafter from what a user naturally has: an HF model, a strategy object, or a name.
    ``prompt_lookup`` > 0 puts prompt lookup in front of a draft model (``HybridDrafter``);
    ``draft_confidence`` > 0 ends a draft model's window after its first unsure token."""
    if draft is None or isinstance(draft, Drafter):
        return draft
    if draft == "ngram":
        return NgramDrafter()
    if isinstance(draft, torch.nn.Module):
        drafter = DraftModelDrafter(draft, proposal_top_k=proposal_top_k, confidence=draft_confidence)
        return HybridDrafter(drafter, min_match=prompt_lookup) if prompt_lookup > 0 else drafter
    raise InvalidRequest(f"draft must be an HF causal LM, a Drafter, 'ngram' or None; got {draft!r}", field="draft")


def checked_generate_arguments(target, params, adaptive, mirror, hint_layer, hint_lens, runner_up) -> tuple:
    """Arguments of the wrong kind met a bare AttributeError or TypeError deep in the decoding loop
    ("'str' object has no attribute 'vocab_size'"), naming nothing the caller wrote. Gives back
    ``adaptive``, ``mirror`` and ``runner_up`` with a numpy or 0-d tensor bool as the bool it holds
    (a flag computed with numpy was refused, and a str ``runner_up`` such as "no" switched it on)."""
    adaptive, mirror, runner_up = (as_scalar(flag) for flag in (adaptive, mirror, runner_up))
    runner_up = False if runner_up is None else runner_up  # as mirror and adaptive take None: off
    if not isinstance(target, torch.nn.Module) and not callable(getattr(target, "logits_for", None)):
        raise InvalidRequest(f"target must be a loaded model (transformers' from_pretrained, or "
                             f"mirrorspec.models.load_causal_lm('demo-target')), got {type(target).__name__} "
                             f"{str(target)[:40]!r}", field="target")
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be a mirrorspec.SamplingParams (e.g. SamplingParams(temperature=0.7)), "
                             f"got {type(params).__name__}", field="params")
    for name, value, config in (("adaptive", adaptive, AdaptiveKConfig), ("mirror", mirror, MirrorConfig)):
        if not (value is None or isinstance(value, (bool, config))):
            raise InvalidRequest(f"{name} must be True, False, None or {config.__name__}(...), got {value!r}", field=name)
    if hint_layer is not None and not is_integer(hint_layer):
        raise InvalidRequest(f"hint_layer must be an int (a 1-based decoder layer), got {hint_layer!r}",
                             field="hint_layer")
    if hint_lens is not None and not isinstance(hint_lens, TunedLens):
        raise InvalidRequest(f"hint_lens must be a TunedLens (mirrorspec.models.lens.tuned_lens), got "
                             f"{type(hint_lens).__name__}", field="hint_lens")
    if not isinstance(runner_up, bool):
        raise InvalidRequest(f"runner_up must be True, False or None, got {runner_up!r}", field="runner_up")
    return adaptive, mirror, runner_up


def refuse_settings_no_window_uses(draft, num_speculative_tokens, adaptive, mirror, hint_layer, hint_lens) -> None:
    """Settings that shape speculation's windows, where no window would use them: generate ran
    target-only, or serial, and said nothing (a review; the CLI refuses the same, naming flags).
    (``runner_up`` is left alone: it is on by default in the CLI, draft or not.)"""
    drafts_none = "draft=None" if draft is None else "num_speculative_tokens=0" if num_speculative_tokens == 0 else None
    uses = {"adaptive": "chooses K per window in [0, num_speculative_tokens]",
            "mirror": "drafts the next window while the target verifies this one"}
    for name, value in (("adaptive", adaptive), ("mirror", mirror)):
        if value and drafts_none:
            raise InvalidRequest(f"{name} {uses[name]}, and {drafts_none} drafts none (it decodes with the target "
                                 f"alone): pass a draft and num_speculative_tokens >= 1, or drop {name}", field=name)
    if hint_layer is not None and not mirror:
        raise InvalidRequest(f"hint_layer steers mirror's branches with the target's early-exit hints, and mirror is "
                             f"off: pass mirror=True too, or drop hint_layer={hint_layer!r}", field="hint_layer")
    if hint_lens is not None and hint_layer is None:
        raise InvalidRequest("hint_lens reads the hints of hint_layer, and hint_layer is None: name the layer too "
                             "(hint_layer=..., with mirror=True), or drop hint_lens", field="hint_lens")


def generate(
    target: torch.nn.Module | LogitSession,
    draft: torch.nn.Module | Drafter | str | None,
    input_ids: Sequence[int] | torch.Tensor,
    params: SamplingParams | None = None,
    *,
    num_speculative_tokens: int = 4,
    seed: int | None = None,
    proposal_top_k: int = 0,
    prompt_lookup: int = 0,
    draft_confidence: float = 0.0,
    adaptive: AdaptiveKConfig | bool | None = None,
    mirror: MirrorConfig | bool | None = None,
    hint_layer: int | None = None,
    hint_lens: TunedLens | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    runner_up: bool = False,
) -> GenerationResult:
    """Generate with speculative decoding, exactly as the target alone would.

    Args:
        target: an HF causal LM, or what ``load_causal_lm`` gives (or any ``LogitSession``), whose
            distribution the output follows.
        draft: an HF causal LM (or ``load_causal_lm``'s) sharing the target's tokenizer, a
            ``Drafter``, ``"ngram"``, or ``None`` for target-only decoding (the baseline). A
            ``Drafter`` passed in belongs to the caller and keeps its state (KV cache) afterwards;
            call its ``release()``. It drafts for one call at a time: a second call while one runs
            is refused (a model passed in gets a drafter of its own per call).
        input_ids: the prompt, a list of ids or a ``[1, n]`` / ``[n]`` tensor or array.
        params: temperature / top_k / top_p / max_new_tokens / stop_token_ids. Greedy by default.
        num_speculative_tokens: K, drafts per window; 0 means target-only.
        seed: makes sampled output reproducible; a fresh one is drawn (and returned) if omitted.
        proposal_top_k: > 0 makes a draft model propose from a sparse top-k q (still exact).
        prompt_lookup: > 0 lets prompt lookup draft before a draft model wherever the context's last
            ``prompt_lookup`` tokens occurred earlier (the model drafts the rest; still exact).
        draft_confidence: > 0 ends a draft model's window after the first token it gives less than
            this probability (still exact: the window's length then depends on the context alone).
        adaptive: ``True`` (default costs) or an ``AdaptiveKConfig`` chooses K per window in
            [0, num_speculative_tokens] from the acceptance seen so far, switching speculation
            off where it does not pay; exactness is unaffected.
        mirror: ``True`` or a ``MirrorConfig`` drafts the next window's likely branches while the
            target verifies (``mirrorspec.mirror``); the output is the same as without it.
        hint_layer: with mirror and an HF target, the target sends early-exit hints read off this
            decoder layer (1-based) part-way through each verify, steering which branches get drafted;
            scored over the draft's sub-vocabulary where it declares one (a cheaper hint).
        hint_lens: read those hints through this tuned lens (``mirrorspec.models.lens.tuned_lens``)
            rather than the final norm alone: far likelier to name the target's token.
        on_tokens: called with each window's committed tokens as soon as they are known.
        runner_up: windows also offer the target the drafter's runner-up for their first draft,
            in the same pass (``TargetVerifier``); greedy output is the same, sampled output has
            the same distribution. With mirror too: a runner-up's win has branches of its own
            (``mirrorspec.mirror.runner_up_guesses``).

    Greedy output is token-identical to target-only greedy decoding; sampled output has exactly
    the target's distribution for any draft. (A target rounds a pass over several positions
    differently from a one-token step: in bf16 or fp16 enough for a near-tie to leave target-only's
    greedy output; in float32 the two differ by ~1e-5 of a logit (5e-5 at most measured on the demo
    target, CPU), so only a top-two gap that small could flip.)
    """
    # what load_causal_lm gives (the README's way to the demo models): its model, the tokenizer aside
    target, draft = (m.model if isinstance(m, LoadedModel) else m for m in (target, draft))
    adaptive, mirror, runner_up = checked_generate_arguments(target, params, adaptive, mirror, hint_layer, hint_lens,
                                                             runner_up)
    if on_tokens is not None and not callable(on_tokens):  # a bare TypeError after the first window (a review)
        raise InvalidRequest(f"on_tokens must be a callable taking each window's tokens (a list of ints), got "
                             f"{on_tokens!r}", field="on_tokens")
    params = params or SamplingParams()
    spec = SpeculationConfig(num_speculative_tokens=num_speculative_tokens, proposal_top_k=proposal_top_k,
                             prompt_lookup=prompt_lookup, draft_confidence=draft_confidence,
                             adaptive=AdaptiveKConfig() if adaptive is True else adaptive or None)
    refuse_settings_no_window_uses(draft, spec.num_speculative_tokens, adaptive, mirror, hint_layer, hint_lens)
    session = KVSession(target) if isinstance(target, torch.nn.Module) else target
    max_context = int(getattr(getattr(target, "config", None), "max_position_embeddings", 1 << 30))
    if not isinstance(input_ids, torch.Tensor) and getattr(input_ids, "ndim", 0) >= 1:  # numpy's, as a tokenizer gives
        input_ids = torch.as_tensor(input_ids)
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise InvalidRequest(f"input_ids must be one prompt, a [n] or [1, n] tensor, got shape "
                                 f"{list(input_ids.shape)}; call generate once per prompt", field="input_ids")
        input_ids = input_ids.reshape(-1).tolist()
    prompt = validate_prompt(input_ids, session.vocab_size, max_context, params)
    if isinstance(draft, torch.nn.Module):
        check_shared_vocabulary(int(draft.config.vocab_size), session.vocab_size, same_tokenizer=lambda: same_tokenizer_at(
            getattr(draft, "name_or_path", None), getattr(target, "name_or_path", None), int(draft.config.vocab_size)))
    drafter = make_drafter(draft, proposal_top_k, prompt_lookup, draft_confidence)
    seed = fresh_seed() if seed is None else check_seed(seed)
    stats = GenerationStats()
    tokens: list[int] = []
    finish = "length"
    pipeline = MirrorPipeline(MirrorConfig() if mirror is True else mirror) if mirror and drafter else None
    if hint_layer is not None and not isinstance(target, torch.nn.Module):
        raise InvalidRequest("hint_layer needs an HF model as the target (hints are read off its layers)",
                             field="hint_layer")
    probe = (EarlyExitProbe(target, hint_layer, vocab_ids=drafter.vocab_ids if drafter else None, lens=hint_lens)
             if hint_layer is not None and pipeline is not None else None)
    started = time.perf_counter()
    try:
        with drafter.serving_one_request() if drafter is not None else nullcontext():
            verifier = TargetVerifier(session, probe, runner_up=runner_up)
            for event in decode_windows(drafter, verifier, prompt, params, spec, seed, stats, pipeline):
                tokens += event.tokens
                if on_tokens is not None:
                    on_tokens(event.tokens)
                finish = event.finish_reason or finish
    finally:
        if pipeline is not None:
            pipeline.close()
        if drafter is not None and not isinstance(draft, Drafter):
            drafter.release()
    return GenerationResult(token_ids=tokens, finish_reason=finish, seed=seed, stats=stats,
                            wall_time_s=time.perf_counter() - started)
