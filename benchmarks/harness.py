"""Run every decoding mode side by side, in one process, on the same prompts.

Speedups on a shared CPU are only meaningful relative to a baseline measured under the same
conditions, so all modes run in a single process, against the same loaded target, with the
same torch thread count, and *interleaved per prompt* (prompt 1 in every mode, then prompt 2,
...): a slow stretch caused by another process then slows every mode alike instead of
penalising whichever mode happened to run during it.

Adding a mode is a few lines: write a function with the ``ModeFn`` signature and decorate it
with ``@register_mode``; the CLI, the table, the JSON and the plot pick it up by name.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tqdm import tqdm

from mirrorspec import GenerationStats, SamplingParams, generate
from mirrorspec.config import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_PROMPT_LOOKUP, DEFAULT_PROPOSAL_TOP_K
from mirrorspec.drafting import NgramDrafter
from mirrorspec.models.attention import IMPLEMENTATION as ATTENTION
from mirrorspec.models.loading import LoadedModel, encode_prompt

from benchmarks.prompts import Prompt
from benchmarks.served import ServedStacks

TARGET_ONLY = "target-only"
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Drafts:
    """Draft-side objects shared by all modes.

    ``model`` is a plain HF causal LM that shares the target's tokenizer (what HF assisted
    generation needs), or ``None`` when no draft model was given; modes that need one are then
    skipped. Prompt-lookup drafting needs nothing here: it is stateless and built per call.
    """

    model: torch.nn.Module | None = None
    name: str = "none"
    services: ServedStacks = field(default_factory=ServedStacks)  # started lazily by the served modes
    server_source: str | None = None  # what a drafter server process loads for ``model`` (None: it cannot)
    others: dict[str, torch.nn.Module] = field(default_factory=dict)  # the same draft loaded with other quantizations

    def as_quantized(self, quantize: str) -> Drafts:
        """These drafts with the model loaded as ``quantize`` (for in-process modes: the served
        stacks keep the main draft)."""
        return replace(self, model=self.others[quantize], others={})


@dataclass
class RunOutput:
    """What a mode returns for one prompt. ``stats`` is ``None`` where the mode has no
    speculation statistics (target-only decoding, HF's own generate)."""

    token_ids: list[int]
    wall_time_s: float
    finish_reason: str
    stats: GenerationStats | None = None


ModeFn = Callable[[LoadedModel, Drafts, list[int], SamplingParams, int, int], RunOutput]


@dataclass(frozen=True)
class Mode:
    """A named way of decoding. ``uses_k`` modes are run once per K; the others once."""

    name: str
    run: ModeFn
    uses_k: bool
    needs_draft_model: bool = False
    description: str = ""
    in_process: bool = True  # False: the draft runs in a server process, loaded there
    needs_equal_vocab: bool = False  # the draft's vocabulary table must be as wide as the target's
    # a mode whose sampled tokens must equal another's, seed for seed: a served mode's in-process
    # twin, or the same mode on another attention implementation
    twin: str | None = None
    # mirrorspec's promise: greedy tokens equal target-only's. HF's own loops are compared, not held to it
    exact: bool = True

    def with_draft_quantized(self, quantize: str) -> Mode:
        """This mode on the draft loaded as ``quantize``, named ``MODE@quantize``: side-by-side
        figures for the same draft's weights in another form."""
        def run(target, drafts, ids, params, k, seed):
            return self.run(target, drafts.as_quantized(quantize), ids, params, k, seed)
        return replace(self, name=f"{self.name}@{quantize}", run=run,
                       twin=f"{self.twin}@{quantize}" if self.twin else None)


MODES: dict[str, Mode] = {}


def register_mode(name: str, *, uses_k: bool, needs_draft_model: bool = False,
                  description: str = "", in_process: bool = True,
                  twin: str | None = None, needs_equal_vocab: bool = False,
                  exact: bool = True) -> Callable[[ModeFn], ModeFn]:
    """Decorator: make ``fn(target, drafts, prompt_ids, params, k, seed) -> RunOutput`` a mode."""
    def wrap(fn: ModeFn) -> ModeFn:
        MODES[name] = Mode(name, fn, uses_k, needs_draft_model, description or (fn.__doc__ or "").strip(),
                           in_process=in_process, twin=twin, needs_equal_vocab=needs_equal_vocab, exact=exact)
        return fn
    return wrap


# --------------------------------------------------------------------------------------- modes

def _mirrorspec(target: LoadedModel, draft: Any, ids: list[int], params: SamplingParams,
                k: int, seed: int, adaptive: bool = False, mirror: bool = False, prompt_lookup: int = 0,
                draft_confidence: float = 0.0, runner_up: bool = False) -> RunOutput:
    """A draft model proposes from the sparse q a drafter server sends (``DEFAULT_PROPOSAL_TOP_K``),
    so a sampled served mode draws the very tokens of its in-process twin (``mark_identity``)."""
    started = time.perf_counter()
    result = generate(target.model, draft, ids, params, num_speculative_tokens=k, seed=seed, adaptive=adaptive,
                      mirror=mirror, prompt_lookup=prompt_lookup, draft_confidence=draft_confidence,
                      runner_up=runner_up, proposal_top_k=DEFAULT_PROPOSAL_TOP_K)
    return RunOutput(result.token_ids, time.perf_counter() - started, result.finish_reason, result.stats)


@register_mode(TARGET_ONLY, uses_k=False)
def target_only(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                k: int, seed: int) -> RunOutput:
    """mirrorspec with no drafter: the baseline every ratio is taken against."""
    return _mirrorspec(target, None, ids, params, 0, seed)


@register_mode("mirrorspec-ngram", uses_k=True)
def mirrorspec_ngram(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                     k: int, seed: int) -> RunOutput:
    """mirrorspec with prompt-lookup (n-gram) drafting."""
    return _mirrorspec(target, NgramDrafter(), ids, params, k, seed)


@register_mode("mirrorspec-ngram-full-weak-windows", uses_k=True)
def mirrorspec_ngram_full_weak_windows(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                                       k: int, seed: int) -> RunOutput:
    """mirrorspec-ngram drafting all K after one-token matches too (before weak_match_tokens)."""
    return _mirrorspec(target, NgramDrafter(weak_match_tokens=max(k, 1)), ids, params, k, seed)


@register_mode("mirrorspec-draft", uses_k=True, needs_draft_model=True)
def mirrorspec_draft(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                     k: int, seed: int) -> RunOutput:
    """mirrorspec with the draft model.

    The bare model is passed (not a ``DraftModelDrafter``) so that ``generate`` builds the
    drafter itself and releases its KV cache at the end of the request.
    """
    return _mirrorspec(target, drafts.model, ids, params, k, seed)


@register_mode("mirrorspec-hybrid", uses_k=True, needs_draft_model=True)
def mirrorspec_hybrid(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                      k: int, seed: int) -> RunOutput:
    """mirrorspec with prompt lookup first (where the context repeats itself), the draft model elsewhere.

    What the serving entry points run with a draft model (``--prompt-lookup``, default 2).
    """
    return _mirrorspec(target, drafts.model, ids, params, k, seed, prompt_lookup=DEFAULT_PROMPT_LOOKUP)


@register_mode("mirrorspec-draft-confident", uses_k=True, needs_draft_model=True)
def mirrorspec_draft_confident(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                               k: int, seed: int) -> RunOutput:
    """mirrorspec with the draft model, each window ending after the draft's first unsure token
    (``--draft-confidence``, default 0.3)."""
    return _mirrorspec(target, drafts.model, ids, params, k, seed, draft_confidence=DEFAULT_DRAFT_CONFIDENCE)


@register_mode("mirrorspec-hybrid-confident", uses_k=True, needs_draft_model=True)
def mirrorspec_hybrid_confident(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                                k: int, seed: int) -> RunOutput:
    """mirrorspec-hybrid with the draft model's windows ending after its first unsure token."""
    return _mirrorspec(target, drafts.model, ids, params, k, seed, prompt_lookup=DEFAULT_PROMPT_LOOKUP,
                       draft_confidence=DEFAULT_DRAFT_CONFIDENCE)


@register_mode("mirrorspec-hybrid-confident-runner-up", uses_k=True, needs_draft_model=True)
def mirrorspec_hybrid_confident_runner_up(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                                          k: int, seed: int) -> RunOutput:
    """mirrorspec-hybrid-confident whose windows also offer the draft's runner-up for their
    first draft, in the same target pass (``generate(runner_up=True)``)."""
    return _mirrorspec(target, drafts.model, ids, params, k, seed, prompt_lookup=DEFAULT_PROMPT_LOOKUP,
                       draft_confidence=DEFAULT_DRAFT_CONFIDENCE, runner_up=True)


@contextmanager
def transformers_sdpa(*models: torch.nn.Module | None) -> Iterator[None]:
    """The models on transformers' own ``sdpa`` attention for a while, where they run
    ``mirrorspec_sdpa`` (``mirrorspec.models.attention``: bit-identical logits, cheaper verify
    passes on CPU): what a mode cost before it, measured side by side with what it costs now."""
    switched = [m for m in models if m is not None and m.config._attn_implementation == ATTENTION]
    for model in switched:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for model in switched:
            model.set_attn_implementation(ATTENTION)


@register_mode("mirrorspec-ngram-on-sdpa", uses_k=True, twin="mirrorspec-ngram")
def mirrorspec_ngram_on_sdpa(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                             k: int, seed: int) -> RunOutput:
    """mirrorspec-ngram with the target on transformers' own sdpa attention."""
    with transformers_sdpa(target.model):
        return mirrorspec_ngram(target, drafts, ids, params, k, seed)


@register_mode("mirrorspec-hybrid-confident-runner-up-on-sdpa", uses_k=True, needs_draft_model=True,
               twin="mirrorspec-hybrid-confident-runner-up")
def mirrorspec_hybrid_confident_runner_up_on_sdpa(target: LoadedModel, drafts: Drafts, ids: list[int],
                                                  params: SamplingParams, k: int, seed: int) -> RunOutput:
    """mirrorspec-hybrid-confident-runner-up with the target and the draft on transformers' own
    sdpa attention."""
    with transformers_sdpa(target.model, drafts.model):
        return mirrorspec_hybrid_confident_runner_up(target, drafts, ids, params, k, seed)


@register_mode("mirrorspec-hybrid-adaptive", uses_k=True, needs_draft_model=True)
def mirrorspec_hybrid_adaptive(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                               k: int, seed: int) -> RunOutput:
    """mirrorspec with prompt lookup in front of the draft model and adaptive K in [0, K]."""
    return _mirrorspec(target, drafts.model, ids, params, k, seed, adaptive=True, prompt_lookup=DEFAULT_PROMPT_LOOKUP)


@register_mode("mirrorspec-hybrid-adaptive-confident", uses_k=True, needs_draft_model=True)
def mirrorspec_hybrid_adaptive_confident(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                                         k: int, seed: int) -> RunOutput:
    """mirrorspec-hybrid-adaptive with the draft model's windows ending after its first unsure
    token: what ``mirrorspec generate --local --adaptive --no-runner-up`` runs."""
    return _mirrorspec(target, drafts.model, ids, params, k, seed, adaptive=True, prompt_lookup=DEFAULT_PROMPT_LOOKUP,
                       draft_confidence=DEFAULT_DRAFT_CONFIDENCE)


@register_mode("mirrorspec-ngram-adaptive", uses_k=True)
def mirrorspec_ngram_adaptive(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                              k: int, seed: int) -> RunOutput:
    """mirrorspec n-gram drafting with adaptive K in [0, K] (switches itself off where it loses)."""
    return _mirrorspec(target, NgramDrafter(), ids, params, k, seed, adaptive=True)


@register_mode("mirrorspec-draft-adaptive", uses_k=True, needs_draft_model=True)
def mirrorspec_draft_adaptive(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                              k: int, seed: int) -> RunOutput:
    """mirrorspec with the draft model and adaptive K in [0, K]."""
    return _mirrorspec(target, drafts.model, ids, params, k, seed, adaptive=True)


@register_mode("mirrorspec-draft-mirror", uses_k=True, needs_draft_model=True)
def mirrorspec_draft_mirror(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                            k: int, seed: int) -> RunOutput:
    """mirrorspec with the draft model, mirror-style: branches drafted while the target verifies.

    Drafter and target then run at once in two threads of this process, each with the torch
    thread count of the run: compare it with mirrorspec-draft at --threads 1 (one core each).
    """
    return _mirrorspec(target, drafts.model, ids, params, k, seed, mirror=True)


@register_mode("mirrorspec-ngram-mirror", uses_k=True)
def mirrorspec_ngram_mirror(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                            k: int, seed: int) -> RunOutput:
    """mirrorspec n-gram drafting, mirror-style."""
    return _mirrorspec(target, NgramDrafter(), ids, params, k, seed, mirror=True)


def _served(client, ids: list[int], params: SamplingParams, k: int, seed: int) -> RunOutput:
    started = time.perf_counter()
    done = client.generate(ids, max_tokens=params.max_new_tokens, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, seed=seed, k=k,
                           stop_token_ids=list(params.stop_token_ids))
    wall = time.perf_counter() - started
    s = done.stats
    # committed: what the windows gave the output, as in process (the table's tokens per pass)
    stats = GenerationStats(windows=s.windows, drafted=s.drafted, accepted=s.accepted, rejected=s.rejected,
                            draft_time_s=s.draft_time_s, verify_time_s=s.verify_time_s,
                            runner_up_hits=s.runner_up_hits, committed=len(done.token_ids),
                            windows_on_target=s.windows_on_target, first_verify_time_s=s.first_verify_time_s,
                            first_draft_time_s=None)  # not sent: the front door drafts it while the target prefills
    return RunOutput(list(done.token_ids), wall, done.finish_reason, stats)


@register_mode("served-ngram", uses_k=True, in_process=False,
               twin="mirrorspec-ngram")
def served_ngram(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                 k: int, seed: int) -> RunOutput:
    """mirrorspec over gRPC on loopback (orchestrator, target, n-gram drafter servers)."""
    return _served(drafts.services.client(target, None), ids, params, k, seed)


@register_mode("served-draft", uses_k=True, needs_draft_model=True, in_process=False,
               twin="mirrorspec-draft")
def served_draft(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                 k: int, seed: int) -> RunOutput:
    """mirrorspec over gRPC on loopback with the draft model in its own drafter server."""
    return _served(drafts.services.client(target, drafts.model, drafts.server_source), ids, params, k, seed)


@register_mode("served-hybrid", uses_k=True, needs_draft_model=True, in_process=False,
               twin="mirrorspec-hybrid")
def served_hybrid(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                  k: int, seed: int) -> RunOutput:
    """mirrorspec over gRPC on loopback, prompt lookup before the draft model: the front door
    looks up on its token log and calls the drafter server only where lookup fails."""
    return _served(drafts.services.client(target, drafts.model, drafts.server_source, DEFAULT_PROMPT_LOOKUP),
                   ids, params, k, seed)


@register_mode("served-hybrid-confident", uses_k=True, needs_draft_model=True, in_process=False,
               twin="mirrorspec-hybrid-confident")
def served_hybrid_confident(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                            k: int, seed: int) -> RunOutput:
    """served-hybrid with the drafter's windows ending after its first unsure token: what
    ``mirrorspec serve --no-runner-up`` runs."""
    return _served(drafts.services.client(target, drafts.model, drafts.server_source, DEFAULT_PROMPT_LOOKUP,
                                          draft_confidence=DEFAULT_DRAFT_CONFIDENCE), ids, params, k, seed)


@register_mode("served-hybrid-confident-runner-up", uses_k=True, needs_draft_model=True, in_process=False,
               twin="mirrorspec-hybrid-confident-runner-up")
def served_hybrid_confident_runner_up(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                                      k: int, seed: int) -> RunOutput:
    """served-hybrid-confident with windows offering the draft's runner-up too
    (what ``mirrorspec serve`` does by default; ``--no-runner-up`` turns it off)."""
    return _served(drafts.services.client(target, drafts.model, drafts.server_source, DEFAULT_PROMPT_LOOKUP,
                                          draft_confidence=DEFAULT_DRAFT_CONFIDENCE, runner_up=True),
                   ids, params, k, seed)


@register_mode("served-hybrid-confident-runner-up-on-target", uses_k=True, needs_draft_model=True, in_process=False,
               twin="mirrorspec-hybrid-confident-runner-up")
def served_hybrid_confident_runner_up_on_target(target: LoadedModel, drafts: Drafts, ids: list[int],
                                                params: SamplingParams, k: int, seed: int) -> RunOutput:
    """served-hybrid-confident-runner-up with the windows run on the target, which calls the
    drafter itself (``serve --windows-on-target``): one round trip per window; the lookup runs
    in the drafter server."""
    return _served(drafts.services.client(target, drafts.model, drafts.server_source, DEFAULT_PROMPT_LOOKUP,
                                          draft_confidence=DEFAULT_DRAFT_CONFIDENCE, runner_up=True,
                                          windows_on_target=True), ids, params, k, seed)


@register_mode("served-hybrid-adaptive-confident", uses_k=True, needs_draft_model=True, in_process=False,
               twin="mirrorspec-hybrid-adaptive-confident")
def served_hybrid_adaptive_confident(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                                     k: int, seed: int) -> RunOutput:
    """served-hybrid-confident with the front door choosing K per window in [0, K] (``mirrorspec
    serve --adaptive --no-runner-up``), pricing draft steps as the drafter server reports them."""
    return _served(drafts.services.client(target, drafts.model, drafts.server_source, DEFAULT_PROMPT_LOOKUP,
                                          draft_confidence=DEFAULT_DRAFT_CONFIDENCE, adaptive=True),
                   ids, params, k, seed)


@register_mode("served-hybrid-adaptive-confident-on-target", uses_k=True, needs_draft_model=True, in_process=False,
               twin="mirrorspec-hybrid-adaptive-confident")
def served_hybrid_adaptive_confident_on_target(target: LoadedModel, drafts: Drafts, ids: list[int],
                                               params: SamplingParams, k: int, seed: int) -> RunOutput:
    """served-hybrid-adaptive-confident with the windows run on the target (``serve --adaptive
    --windows-on-target``): the target chooses each window's K, as the front door would."""
    return _served(drafts.services.client(target, drafts.model, drafts.server_source, DEFAULT_PROMPT_LOOKUP,
                                          draft_confidence=DEFAULT_DRAFT_CONFIDENCE, adaptive=True,
                                          windows_on_target=True), ids, params, k, seed)


@register_mode("served-hybrid-drafter-lookup", uses_k=True, needs_draft_model=True, in_process=False,
               twin="mirrorspec-hybrid")
def served_hybrid_drafter_lookup(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                                 k: int, seed: int) -> RunOutput:
    """served-hybrid with the lookup left to the drafter server (front_door_lookup=False): a
    drafter call every window, looked up or not."""
    return _served(drafts.services.client(target, drafts.model, drafts.server_source, DEFAULT_PROMPT_LOOKUP,
                                          front_door_lookup=False), ids, params, k, seed)


def _hf_generate(target: LoadedModel, ids: list[int], params: SamplingParams, seed: int,
                 **extra: Any) -> RunOutput:
    """HF ``generate`` with the same stop ids, length and sampling filters as mirrorspec.

    HF's global default top_k is 50, so top_k/top_p are always passed explicitly (0 / 1 = off)
    to sample from the same distribution as mirrorspec does.
    """
    input_ids = torch.tensor([ids], dtype=torch.long, device=target.model.device)
    stop = list(params.stop_token_ids)
    sampling = {} if params.greedy else {"temperature": params.temperature, "top_k": params.top_k,
                                        "top_p": params.top_p}
    torch.manual_seed(seed)
    started = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    do_sample=not params.greedy, max_new_tokens=params.max_new_tokens,
                                    eos_token_id=stop or None, pad_token_id=stop[0] if stop else None,
                                    **sampling, **extra)
    wall = time.perf_counter() - started
    tokens = out[0, len(ids):].tolist()
    finish = "stop" if tokens and tokens[-1] in stop else "length"
    return RunOutput(tokens, wall, finish)


@register_mode("hf-target-only", uses_k=False, exact=False)
def hf_target_only(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                   k: int, seed: int) -> RunOutput:
    """Plain HF generate: a sanity baseline for mirrorspec's own target-only loop."""
    return _hf_generate(target, ids, params, seed)


# HF assisted generation takes a draft of another table width for another tokenizer: it asks for both
# and runs universal assisted decoding (another algorithm, whose sampling path crashes in
# transformers 5.x), so such a pair is skipped
@register_mode("hf-assisted", uses_k=True, needs_draft_model=True, needs_equal_vocab=True, exact=False)
def hf_assisted(target: LoadedModel, drafts: Drafts, ids: list[int], params: SamplingParams,
                k: int, seed: int) -> RunOutput:
    """HF assisted generation with the draft model, K drafts per window.

    HF reads the speculation knobs from the *assistant's* generation config. Its defaults adapt
    the window (confidence threshold 0.4, or a "heuristic" schedule), which would make K
    meaningless, so we pin a constant K and switch the threshold off (0 disables it).
    """
    config = drafts.model.generation_config
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return _hf_generate(target, ids, params, seed, assistant_model=drafts.model)


# --------------------------------------------------------------------------------------- runner

@dataclass
class RunRecord:
    """One generation: one prompt, one mode, one temperature, one K (0 for modes without K)."""

    dataset: str
    prompt_id: str
    category: str
    mode: str
    temperature: float
    k: int
    seed: int
    prompt_tokens: int
    new_tokens: int
    wall_time_s: float
    finish_reason: str
    token_ids: list[int]
    stats: dict | None = None
    identical_to_target_only: bool | None = None
    identical_to_in_process: bool | None = None  # sampled runs of a mode with a twin: tokens equal the twin's


@dataclass(frozen=True)
class Slot:
    """A mode at one K: the unit that is run on every prompt."""

    mode: Mode
    k: int


@dataclass
class BenchPlan:
    """Everything ``run_benchmark`` needs, already resolved (models loaded, prompts read)."""

    target: LoadedModel
    drafts: Drafts
    prompts: dict[str, list[Prompt]]
    modes: list[Mode]
    ks: list[int]
    temperatures: list[float]
    max_new_tokens: int
    seed: int = 0
    progress: bool = True

    def slots(self) -> list[Slot]:
        return [Slot(m, k) for m in self.modes for k in (self.ks if m.uses_k else [0])]


def select_modes(names: Sequence[str], drafts: Drafts, target_vocab: int | None = None) -> tuple[list[Mode], list[str]]:
    """The runnable modes, baseline first, and a note for each skipped one; each in-process
    draft-model mode again as ``MODE@q`` for every other quantization of the draft loaded.

    target-only is always run: every ratio and the identity check are taken against it.
    """
    wanted = [TARGET_ONLY] + [n for n in names if n != TARGET_ONLY]
    modes, notes = [], []
    for name in wanted:
        mode = MODES[name]
        if mode.needs_draft_model and drafts.model is None:
            notes.append(f"skipping {name}: it needs a draft model (pass --draft PATH or --draft truncate:2)")
            continue
        draft_vocab = int(drafts.model.config.vocab_size) if drafts.model is not None else None
        if mode.needs_equal_vocab and draft_vocab is not None and target_vocab not in (None, draft_vocab):
            notes.append(f"skipping {name}: the draft's vocabulary table ({draft_vocab} rows) is narrower than the "
                         f"target's ({target_vocab}), and HF assisted generation then runs another algorithm "
                         f"(universal assisted decoding)")
            continue
        modes.append(mode)
        if mode.needs_draft_model and mode.in_process:
            modes += [mode.with_draft_quantized(q) for q in drafts.others]
    return modes, notes


def _params(plan: BenchPlan, temperature: float, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                          stop_token_ids=plan.target.stop_token_ids())


def warm_up(plan: BenchPlan, ids: list[int]) -> None:
    """One short untimed generation per slot: first calls pay for lazy init, allocator growth
    and (for HF) generation-config setup, which would otherwise be charged to whichever mode
    runs first."""
    params = _params(plan, 0.0, min(WARMUP_TOKENS, plan.max_new_tokens))
    for slot in plan.slots():
        slot.mode.run(plan.target, plan.drafts, ids, params, slot.k, plan.seed)


def run_benchmark(plan: BenchPlan) -> list[RunRecord]:
    """Every slot on every prompt at every temperature; returns one record per generation."""
    encoded = {name: [encode_prompt(plan.target.tokenizer, p.text) for p in prompts]
               for name, prompts in plan.prompts.items()}
    first = next(ids for ids_list in encoded.values() for ids in ids_list)
    warm_up(plan, first)
    slots = plan.slots()
    total = len(plan.temperatures) * sum(len(v) for v in encoded.values()) * len(slots)
    records: list[RunRecord] = []
    with tqdm(total=total, file=sys.stderr, disable=not plan.progress, unit="gen", dynamic_ncols=True) as bar:
        for temperature in plan.temperatures:
            params = _params(plan, temperature, plan.max_new_tokens)
            for dataset, prompts in plan.prompts.items():
                for index, (prompt, ids) in enumerate(zip(prompts, encoded[dataset])):
                    seed = plan.seed + index  # same seed for every mode on this prompt
                    for slot in slots:  # interleaved: see the module docstring
                        bar.set_postfix_str(f"{dataset} T={temperature:g} {slot.mode.name} K={slot.k}")
                        out = slot.mode.run(plan.target, plan.drafts, ids, params, slot.k, seed)
                        records.append(_record(prompt, slot, temperature, seed, ids, out))
                        bar.update()
    mark_identity(records, {s.mode.name: s.mode.twin for s in slots if s.mode.twin})
    return records


def _record(prompt: Prompt, slot: Slot, temperature: float, seed: int, ids: list[int],
            out: RunOutput) -> RunRecord:
    return RunRecord(dataset=prompt.dataset, prompt_id=prompt.prompt_id, category=prompt.category,
                     mode=slot.mode.name, temperature=temperature, k=slot.k, seed=seed,
                     prompt_tokens=len(ids), new_tokens=len(out.token_ids), wall_time_s=out.wall_time_s,
                     finish_reason=out.finish_reason, token_ids=out.token_ids,
                     stats=out.stats.to_dict() if out.stats is not None else None)


def identity_failures(records: Sequence[RunRecord]) -> list[str]:
    """One line per run whose tokens should have equalled another's and did not: a greedy run of
    a mirrorspec mode and target-only's, a sampled served run and its in-process twin's. Each is a
    broken promise of exactness, not a figure to read beside its speed. HF's modes are not held to
    it (their loops are compared, not promised)."""
    baseline = {(r.dataset, r.prompt_id): r.token_ids
                for r in records if r.mode == TARGET_ONLY and r.temperature == 0.0}
    lines = []
    for r in records:
        mode = MODES.get(r.mode.split("@")[0])
        if mode is not None and not mode.exact:
            continue
        against = ("target-only" if r.identical_to_target_only is False
                   else "its in-process twin" if r.identical_to_in_process is False else None)
        if against is None:
            continue
        where = ""
        if r.identical_to_target_only is False:
            expected = baseline[(r.dataset, r.prompt_id)]
            first = next((i for i, (a, b) in enumerate(zip(r.token_ids, expected)) if a != b),
                         min(len(r.token_ids), len(expected)))
            where = f", first at output token {first}"
        lines.append(f"{r.mode} (K={r.k}, T={r.temperature:g}) on {r.dataset} prompt {r.prompt_id}: its tokens differ "
                     f"from {against}'s{where}")
    return lines


def mark_identity(records: list[RunRecord], twins: dict[str, str] | None = None) -> None:
    """For greedy runs, whether each record's tokens equal target-only's on the same prompt; for
    sampled runs of a mode in ``twins`` (served mode -> in-process mode), whether they equal the
    twin's on the same prompt, seed and K, where the twin ran too.

    Greedy speculative decoding must be token-identical to the target alone. Sampled runs are only
    equal to it in distribution, but randomness is addressed by (seed, position), so the served
    path must draw exactly what the in-process engine draws with the same drafter: that keeps the
    served / in-process ratio free of sampling noise, and checks the wire on every sampled run.
    """
    baseline = {(r.dataset, r.prompt_id): r.token_ids
                for r in records if r.mode == TARGET_ONLY and r.temperature == 0.0}
    sampled = {(r.dataset, r.prompt_id, r.mode, r.temperature, r.k): r.token_ids
               for r in records if r.temperature > 0.0}
    twins = twins or {}
    for r in records:
        key = (r.dataset, r.prompt_id)
        if r.temperature == 0.0 and key in baseline:
            r.identical_to_target_only = r.token_ids == baseline[key]
        twin = sampled.get((r.dataset, r.prompt_id, twins.get(r.mode), r.temperature, r.k))
        if r.temperature > 0.0 and twin is not None:
            r.identical_to_in_process = r.token_ids == twin
