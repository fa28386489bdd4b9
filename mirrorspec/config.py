"""Typed configuration: one place for every knob and its default.

Validation lives here, in ``__post_init__``, so that every entry point (Python API, CLI, gRPC
servers) rejects the same bad values with the same message, naming the field and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import operator
import os
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


class InvalidRequest(ValueError):
    """A request parameter is out of range or malformed; the message says which and how to fix it.

    Servers map it to INVALID_ARGUMENT (or OUT_OF_RANGE via ``OutOfRange``); the CLI prints it.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


def refuse_setting(parser: argparse.ArgumentParser, err: InvalidRequest, flags: dict[str, str] | None = None):
    """For a command line: a refused setting named by its flag (``--max-sessions`` for a
    ``max_sessions`` field, unless ``flags`` names another), exiting 2 like any bad flag."""
    flag = (flags or {}).get(err.field) or (f"--{err.field.replace('_', '-')}" if err.field else None)
    parser.error(f"{flag}: {err}" if flag else str(err))


@contextmanager
def field_named(field: str, instead_of: str = "model"):
    """A callee that cannot know its role (a loader) says ``model``; a caller that does renames
    it (``draft``), so the error names the flag or request field the user actually set."""
    try:
        yield
    except InvalidRequest as err:
        if err.field == instead_of:
            err.field = field
        raise


class OutOfRange(InvalidRequest):
    """A value is well-formed but exceeds a configured limit (context window, K bound, ...)."""


# vLLM's greedy epsilon: far above where logits / T overflow float32 (~1e-37 for logits of ~30), and
# colder than anyone samples on purpose. Below it a request is refused rather than bent to greedy.
MIN_TEMPERATURE = 1e-5


def is_integer(value) -> bool:
    """An int, numpy or 0-d integer torch value; not a bool (True passed for 1) nor a float."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def as_scalar(value):
    """A 0-d torch tensor or numpy value as the Python scalar it holds; anything else as it is."""
    return value.item() if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)) else value


def is_real(value) -> bool:
    """A real number (ints, floats, numpy's, a 0-d torch tensor or numpy array), not a bool nor a
    string: what a caller computed a temperature with is taken as it comes."""
    value = as_scalar(value)
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_field_types(config, field: str, *, reals: Sequence[str] = (), integers: Sequence[str] = (),
                      flags: Sequence[str] = ()) -> None:
    """A config's fields of the wrong type (a str decay, a float count) were met later, deep in the
    decoding loop, by a bare TypeError. None passes where a field's default is None."""
    kinds = ((reals, is_real, "a number"), (integers, is_integer, "an int"),
             (flags, lambda v: isinstance(v, bool), "True or False"))
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for names, test, what in kinds:
        for name in names:
            value = getattr(config, name)
            if not test(value) and not (value is None and defaults.get(name) is None):
                raise InvalidRequest(f"{type(config).__name__}.{name} must be {what}, got {value!r}", field=field)


def _token_ids(ids, field: str) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InvalidRequest(f"{field} must be a sequence of token ids, got {ids!r}", field=field)
    ids = tuple(ids)
    if not all(is_integer(t) for t in ids):
        raise InvalidRequest(f"{field} must hold integer token ids, got {ids!r}", field=field)
    return tuple(operator.index(t) for t in ids)


@dataclass(frozen=True)
class SamplingParams:
    """How the *target* distribution p is formed, and when generation stops.

    temperature == 0 means greedy decoding. top_k == 0 and top_p == 1 switch those filters off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids"))
        for name in ("temperature", "top_p"):
            if not is_real(getattr(self, name)):
                raise InvalidRequest(f"{name} must be a number, got {getattr(self, name)!r}", field=name)
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("top_k", "max_new_tokens"):
            if is_integer(getattr(self, name)):
                object.__setattr__(self, name, operator.index(getattr(self, name)))
        if math.isnan(self.temperature):
            raise InvalidRequest("temperature is NaN; use 0 for greedy or a positive value such as 0.7",
                                 field="temperature")
        if self.temperature < 0 or math.isinf(self.temperature):
            raise InvalidRequest(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}",
                                 field="temperature")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequest(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where logits / "
                                 f"temperature overflow float32 and p becomes NaN; use 0 for greedy",
                                 field="temperature")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}", field="top_k")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1] (1 = off), got {self.top_p}", field="top_p")
        if not is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}",
                                 field="max_new_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# One drafted token of a small draft model over one target step, where nothing better is known
# (the demo draft measured 0.10 on this CPU): ``Drafter.step_cost`` and adaptive K's default.
DRAFT_MODEL_STEP_COST = 0.1
# The same with int8 draft steps (``models.quantize``): the demo draft measured 0.04-0.06 (bench cost c).
INT8_DRAFT_MODEL_STEP_COST = 0.05

# Target pass over K = 1, 2, ... drafts, in one-token steps: the demo target, float32, 2 CPU threads,
# linears prepacked for oneDNN as load_causal_lm serves them (measured by benchmarks/pass_cost.py;
# plain nn.Linear measured 1.66, 2.02, 1.61, 1.59, 1.67, 1.90, 1.69, 1.86 in the same run).
DEMO_CPU_PASS_COSTS = (1.17, 1.07, 1.09, 1.06, 1.08, 1.21, 1.22, 1.21)


@dataclass(frozen=True)
class AdaptiveKConfig:
    """How adaptive K weighs speculation against plain decoding (see ``mirrorspec.adaptive``).

    ``pass_costs[K - 1]`` is the cost of a target pass over K drafts (K + 1 tokens) in one-token
    steps; past the table, each extra token adds ``pass_cost_per_token``. The default table was
    measured for the demo target on a 2-core CPU (float32, 2 threads, prepacked linears), where a
    pass over 2-9 tokens costs 1.06-1.22 steps, not in order of length (the kernels change with
    the shape). On a GPU a pass over a few tokens costs about one step: pass_costs=() and
    pass_cost_per_token ~0.
    """

    draft_cost: float | None = None  # None: the drafter's own step_cost (0.1 for a draft model, 0 for n-gram)
    pass_costs: tuple[float, ...] = DEMO_CPU_PASS_COSTS
    pass_cost_per_token: float = 0.05
    prior_accepted: float = 2.0  # Beta prior on alpha: start optimistic enough to try drafting
    prior_rejected: float = 1.0
    decay: float = 0.9  # per window: the last ~10 windows dominate the estimate
    probe_every: int = 8  # windows spent target-only before drafting again to re-measure
    probe_k: int | None = None  # None: the K whose window is cheapest (on the CPU table, K = 1-2)

    def __post_init__(self) -> None:
        check_field_types(self, "adaptive", reals=("draft_cost", "pass_cost_per_token", "prior_accepted",
                                                   "prior_rejected", "decay"), integers=("probe_every", "probe_k"))
        if isinstance(self.pass_costs, (str, bytes)) or not isinstance(self.pass_costs, Sequence) \
                or not all(is_real(c) for c in self.pass_costs):
            raise InvalidRequest(f"AdaptiveKConfig.pass_costs must be a tuple of numbers (one-token steps), got "
                                 f"{self.pass_costs!r}", field="adaptive")
        object.__setattr__(self, "pass_costs", tuple(self.pass_costs))  # a list: still hashable, as frozen
        # written so NaN fails each check: a NaN prior or cost would turn every estimate into NaN
        if not (self.draft_cost is None or 0 <= self.draft_cost < math.inf) or not 0 <= self.pass_cost_per_token < math.inf:
            raise InvalidRequest(f"draft_cost and pass_cost_per_token must be finite and >= 0, got "
                                 f"{self.draft_cost} and {self.pass_cost_per_token}", field="adaptive")
        if any(not 1.0 <= c < math.inf for c in self.pass_costs):
            raise InvalidRequest(f"pass_costs are in one-token steps and must be finite and >= 1, got {self.pass_costs}",
                                 field="adaptive")
        if not 0 < self.decay <= 1 or not 0 < self.prior_accepted < math.inf or not 0 < self.prior_rejected < math.inf:
            raise InvalidRequest(f"decay must be in (0, 1] and the priors finite and > 0, got decay {self.decay}, "
                                 f"priors {self.prior_accepted} and {self.prior_rejected}", field="adaptive")
        if self.probe_every < 1 or (self.probe_k is not None and self.probe_k < 1):
            raise InvalidRequest("probe_every and probe_k must be >= 1", field="adaptive")


MAX_BRANCHES = 16  # mirror branches per window: what a drafter's DraftBranches call takes


@dataclass(frozen=True)
class MirrorConfig:
    """Mirror-style pipelining (see ``mirrorspec.mirror``): branches drafted during a verify.

    ``stop_at_verdict`` stops branch drafting as soon as the verdict is in (the serving
    default); ``False`` drafts every branch up to ``max_branches`` whatever the timing, which
    makes branch statistics reproducible (tests) at the price of extra drafting.
    """

    max_branches: int = 4
    alternatives: int = 7  # runner-up tokens guessed per rejection point (ranked by the drafter's probabilities)
    stop_at_verdict: bool = True
    use_hints: bool = True  # steer branches by the target's early-exit hints, where it sends them
    probe_every: int = 8  # serving: the N-th window after a change of choice tries the other one (branch or not)
    max_probe_every: int = 64  # the gap doubles while probes confirm the choice, up to this

    def __post_init__(self) -> None:
        check_field_types(self, "mirror", integers=("max_branches", "alternatives", "probe_every", "max_probe_every"),
                          flags=("stop_at_verdict", "use_hints"))
        if not 2 <= self.probe_every <= self.max_probe_every:
            raise InvalidRequest(f"mirror needs 2 <= probe_every <= max_probe_every, got {self.probe_every} "
                                 f"and {self.max_probe_every}", field="mirror")
        if not 1 <= self.max_branches <= MAX_BRANCHES or self.alternatives < 0:
            raise InvalidRequest(f"mirror needs max_branches in [1, {MAX_BRANCHES}] and alternatives >= 0, got "
                                 f"{self.max_branches} and {self.alternatives}", field="mirror")


@dataclass(frozen=True)
class SpeculationConfig:
    """How the draft side proposes.

    proposal_top_k > 0 makes the proposal distribution q sparse: the drafter samples only from the
    top ``proposal_top_k`` tokens of its own distribution, renormalised. Rejection sampling stays
    exact for any q the token was really drawn from, and a sparse q travels in a few KB.
    """

    num_speculative_tokens: int = 4
    max_speculative_tokens: int = 16
    proposal_top_k: int = 0
    # > 0: a draft model's window starts with prompt lookup where the context's last
    # ``prompt_lookup`` tokens occurred before (``HybridDrafter``); 0: the draft model alone
    prompt_lookup: int = 0
    # > 0: a draft model's window ends after the first token it gives less than this probability
    draft_confidence: float = 0.0
    # None: K is fixed; otherwise K varies per window in [0, num_speculative_tokens]
    adaptive: AdaptiveKConfig | None = None

    def __post_init__(self) -> None:
        if not is_integer(self.max_speculative_tokens) or not 1 <= self.max_speculative_tokens <= 64:
            raise InvalidRequest(f"max_speculative_tokens must be in [1, 64], got {self.max_speculative_tokens!r}",
                                 field="max_speculative_tokens")
        if not is_integer(self.num_speculative_tokens):  # "4" was OutOfRange, "got 4" (a review)
            raise InvalidRequest(f"num_speculative_tokens (K) must be an int, got {self.num_speculative_tokens!r}",
                                 field="num_speculative_tokens")
        if not 0 <= self.num_speculative_tokens <= self.max_speculative_tokens:
            raise OutOfRange(
                f"num_speculative_tokens (K) must be in [0, {self.max_speculative_tokens}], "
                f"got {self.num_speculative_tokens}; use 0 for target-only decoding",
                field="num_speculative_tokens",
            )
        check_proposal_top_k(self.proposal_top_k)
        check_prompt_lookup(self.prompt_lookup)
        check_draft_confidence(self.draft_confidence)
        if not (self.adaptive is None or isinstance(self.adaptive, AdaptiveKConfig)):  # "yes" was taken (a review)
            raise InvalidRequest(f"adaptive must be None (fixed K) or an AdaptiveKConfig(...), got {self.adaptive!r}",
                                 field="adaptive")
        for name in ("num_speculative_tokens", "max_speculative_tokens", "proposal_top_k", "prompt_lookup"):
            object.__setattr__(self, name, operator.index(getattr(self, name)))  # numpy's and torch's: plain ints
        object.__setattr__(self, "draft_confidence", float(self.draft_confidence))


MAX_PROMPT_LOOKUP = 8
# What the serving entry points use with a draft model: the best of 1-3 measured on the demo pair
# (benchmark modes mirrorspec-hybrid / -draft / -ngram, side by side)
# Sparse q width where a draft model's proposal crosses the wire (drafter replicas), and at the
# CLI's --local so that a seeded sampled request gives the same tokens there as from `serve`: the
# drafter samples from its top 32 tokens, renormalised (exact; about 2 KB per window at K=8
# instead of 1.5 MB), and acceptance is unchanged (benchmarks.acceptance, T=0.7: beta 0.351 with
# top-32 against 0.350 dense on MT-Bench, 0.472 against 0.471 on HumanEval)
DEFAULT_PROPOSAL_TOP_K = 32
HINT_LENSES = ("tuned", "logit")  # how a hint reads its layer: a lens fitted to the target, or as it is
DEFAULT_PROMPT_LOOKUP = 2


# What the serving entry points use with a draft model: measured on the demo pair (benchmark modes
# mirrorspec-hybrid-confident / mirrorspec-hybrid, side by side); transformers' default is 0.4
DEFAULT_DRAFT_CONFIDENCE = 0.3


# K at the entry points (CLI, servers) where --k is not given. A drafter whose windows end on their
# own reaches further for little where it is unsure and gains where it runs long. A draft model
# ending at its first unsure token: measured on the demo pair (benchmark mode
# mirrorspec-hybrid-confident, K 4 against 8, side by side), K=8 was 2-23% faster on code edits and
# within -7%..+6% elsewhere. Prompt lookup alone, whose windows end with the match's source and
# after 3 tokens of a one-token match: K=8 against 4 measured 1.95x against 1.68x target-only on
# code edits (20 prompts, 192 tokens), 1.42x / 1.38x on HumanEval and 1.25x / 1.24x on MT-Bench
# (10 prompts, 128 tokens), side by side, stop 52. Without the cut, a draft model's K=8 drafts long
# tails the target rejects (0.88x target-only on MT-Bench), so it keeps K=4.
DEFAULT_K = 4
DEFAULT_K_CONFIDENT = 8

# How long a drafter may take over one window before its caller (the front door, or a target
# running the windows) counts it hung: a window is a few tokens of a small model, tens of
# milliseconds when healthy. One value for both callers, which may not import each other.
DRAFT_HUNG_AFTER_S = 1.0


def default_k(draft_model: bool, draft_confidence: float) -> int:
    """The entry points' K when --k is not given: longer where the drafter ends its own windows
    (prompt lookup, or a draft model with a confidence cut)."""
    return DEFAULT_K if draft_model and draft_confidence <= 0 else DEFAULT_K_CONFIDENT


def check_draft_confidence(threshold: float) -> None:
    if not is_real(threshold) or not 0.0 <= threshold < 1.0:
        raise InvalidRequest(f"draft_confidence must be a probability in [0, 1): a draft model's window ends after "
                             f"the first token it gives less than this (0 = always draft K; "
                             f"{DEFAULT_DRAFT_CONFIDENCE} is a good default), got {threshold!r}",
                             field="draft_confidence")


def check_prompt_lookup(min_match: int) -> None:
    if not is_integer(min_match) or not 0 <= min_match <= MAX_PROMPT_LOOKUP:
        raise InvalidRequest(f"prompt_lookup must be an int in [0, {MAX_PROMPT_LOOKUP}]: the context tokens a "
                             f"lookup must match before it drafts instead of the draft model (0 = the draft model "
                             f"alone; 2 is a good default), got {min_match!r}", field="prompt_lookup")


def check_unsigned(field: str, value, bits: int, what: str = "it", hint: str = "") -> int | None:
    """``value`` as an int that fits a ``bits``-bit unsigned protobuf field (None passes): protobuf
    itself refuses one that does not with a bare "Value out of range", naming nothing."""
    if value is None:
        return None
    if not is_integer(value) or not 0 <= operator.index(value) < 1 << bits:
        raise InvalidRequest(f"{what} must be an integer in [0, 2**{bits}), got {value!r}{hint}", field=field)
    return operator.index(value)


def check_writable_folder(folder: Path, field: str) -> Path:
    """``folder``, made if it is not there, where this process can write: checked before a long
    job whose results would land there, not after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidRequest(f"cannot make the folder {str(folder)!r}: {err.strerror or err}", field=field) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidRequest(f"cannot write in the folder {str(folder)!r}; choose another", field=field)
    return folder


def check_text(text: str, field: str) -> str:
    """Text a tokenizer or a protobuf string can take: a command line decodes stray bytes (a
    Latin-1 file pasted into a UTF-8 terminal) to lone surrogates, which both refuse with a
    TypeError or UnicodeEncodeError from deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequest(f"{field} is not valid UTF-8 text (undecodable bytes at character {err.start}); "
                             f"pass it as UTF-8", field=field) from None
    return text


def check_shared_vocabulary(draft_vocab: int, target_vocab: int, field: str = "draft",
                            same_tokenizer: Callable[[], bool] = lambda: False) -> None:
    """A draft model embeds the target's tokens and proposes ids the target scores, so the two
    must share a tokenizer (the draft's own sub-vocabulary aside, which lies inside it). Tables of
    one size are taken for one tokenizer, as transformers' assisted generation takes them. A draft
    whose table is narrower is the same tokenizer padded to another size only if the tokenizers
    themselves say so (Qwen2.5: 0.5B has 151,936 rows, 7B 152,064, one tokenizer): then it
    proposes ids both tables have. ``same_tokenizer`` compares them, and runs only then, since
    loading a tokenizer costs. A wider draft could propose ids the target lacks."""
    if draft_vocab == target_vocab or (draft_vocab < target_vocab and same_tokenizer()):
        return
    why = (f"is larger than the target's ({target_vocab}): it could propose ids the target does not have"
           if draft_vocab > target_vocab else
           f"differs from the target's ({target_vocab}), and their tokenizers are not known to be one (a draft with "
           f"a narrower table needs tokenizer files beside both models that map every token to the same id, each id "
           f"inside the draft's {draft_vocab} rows)")
    raise InvalidRequest(f"the draft's vocabulary ({draft_vocab} ids) {why}; a draft model must share the target's "
                         f"tokenizer (the demo target's is demo-draft), "
                         f"or draft with prompt lookup (ngram)", field=field)


def check_address(address: str, field: str) -> str:
    """A server address as mirrorspec's servers print it, host:port. gRPC would read a bare host
    as port 443 and a URL as a host name, and report either only as nothing answering."""
    host, colon, port = address.strip().rpartition(":")
    if "://" in address or not colon or not host or not port.isdigit() or not 0 < int(port) < 1 << 16:
        raise InvalidRequest(f"expected host:port (e.g. 127.0.0.1:50051, no scheme), got {address!r}", field=field)
    return address.strip()


def check_port(port: int | None, field: str = "port") -> None:
    if port is not None and not 0 <= port < 1 << 16:
        raise InvalidRequest(f"must be a TCP port in [0, 65535] (0 = any free one), got {port}", field=field)


def check_max_sessions(max_sessions: int) -> None:
    if max_sessions < 1:
        raise InvalidRequest(f"max_sessions must be >= 1 (the sessions a replica holds at once), got {max_sessions}",
                             field="max_sessions")


def check_proposal_top_k(top_k: int) -> None:
    if not is_integer(top_k) or top_k < 0:
        raise InvalidRequest(f"proposal_top_k must be an int >= 0 (0 = dense q), got {top_k!r}", field="proposal_top_k")


def check_seed(seed) -> int | None:
    """A seed names one sampled output wherever it runs, so it is held to what a request can
    carry (a uint64), in process as over gRPC."""
    return check_unsigned("seed", seed, 64, "seed", "; leave it out for a fresh one (reported back, so the run "
                                                    "can be replayed)")


QUANTIZATIONS = ("none", "int8")
# Drafts only (``models.quantize``): int8 weights for a float32 CPU draft's linear layers, a no-op
# where that does not apply (GPU, bf16). A target is never quantized: its distribution is the product.
DEFAULT_DRAFT_QUANTIZE = "int8"


def check_quantization(name: str, field: str = "quantize") -> str:
    if name not in QUANTIZATIONS:
        raise InvalidRequest(f"{field} must be one of {', '.join(QUANTIZATIONS)} (int8: int8 weights for a CPU "
                             f"draft's linear layers, exact either way), got {name!r}", field=field)
    return name


# the --dtype flags' values and help: ``models.loading.resolve_dtype`` says why auto is what it is
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = ("auto (float32 on CPU; on CUDA a bf16/fp16 checkpoint's own dtype, else float32), "
              "float32, bfloat16, float16 (in bf16/fp16 the target rounds a pass over several positions "
              "differently from a one-token step: greedy output may leave target-only's at near-ties; float32 "
              "keeps it identical)")


@dataclass(frozen=True)
class ModelConfig:
    """Where a model comes from and where it runs.

    ``source`` is a hub id, a local directory, a path to a ``.gguf`` file, or ``demo-target``.
    dtype ``auto``: float32, or on CUDA a half-precision checkpoint's own dtype (``resolve_dtype``).
    """

    source: str
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    extra: dict = field(default_factory=dict)


DEFAULT_PREFILL_CHUNK = 512  # tokens: about 1.5 s of the demo target on one CPU core, 4.5 s for 2,048 at once
PREFILL_CHUNK_HELP = (f"prefill long prompts on the targets this many tokens per step, so other requests' windows "
                      f"run between the steps (default {DEFAULT_PREFILL_CHUNK})")


DEFAULT_MAX_CONCURRENT_REQUESTS = 64
# a request thread each at the front door: past a few thousand, threads cost more than the queue they spare
MAX_CONCURRENT_REQUESTS = 4096


def check_max_concurrent_requests(requests: int) -> int:
    if not is_integer(requests) or not 1 <= requests <= MAX_CONCURRENT_REQUESTS:
        raise InvalidRequest(f"max_concurrent_requests must be a whole number from 1 to {MAX_CONCURRENT_REQUESTS}, "
                             f"got {requests!r}", field="max_concurrent_requests")
    return operator.index(requests)


def check_prefill_chunk(tokens: int) -> int:
    if not is_integer(tokens) or tokens < 1:
        raise InvalidRequest(f"prefill_chunk_tokens must be a whole number of tokens >= 1, got {tokens!r}",
                             field="prefill_chunk_tokens")
    return operator.index(tokens)


# the longest wait a flag may ask for: threading's waits and gRPC's int64-nanosecond deadlines
# overflow a little past 9.2e9 s, as tracebacks
MAX_WAIT_S = 1e7


def check_stall_timeout(seconds: float) -> float:
    if not 0 < seconds <= MAX_WAIT_S:
        raise InvalidRequest(f"stall_timeout_s must be a positive number of seconds, at most {MAX_WAIT_S:g}, "
                             f"got {seconds}", field="stall_timeout_s")
    return seconds


@dataclass(frozen=True)
class ReplicaConfig:
    """What every model-serving replica (drafter or target) needs: a model, a place, bounds."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    # a session that gets no call this long after it opened, or after its window stream ended (a front
    # door that crashed takes its connections with it), is evicted (mirrorspec.serving.sessions);
    # well above the front door's window_timeout_s (30 s), so a slow window is not taken for a crash
    orphaned_session_ttl_s: float = 60.0
    # the server pings a caller's connection this often, and drops it unanswered this long after: a
    # dead caller host's streams end, and their sessions are orphaned (serving.server.keepalive_options)
    keepalive_s: float = 30.0
    max_speculative_tokens: int = 16
    # a compute lane busy this long with one job (a forward, a collective) is wedged: the server then
    # answers its health check NOT_SERVING, and a supervisor (the Ray controller) replaces it. Above
    # the front door's backend timeout (120 s), past which any single call has failed anyway
    stall_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        check_port(self.port)
        check_max_sessions(self.max_sessions)
        check_stall_timeout(self.stall_timeout_s)
        for name in ("orphaned_session_ttl_s", "keepalive_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise InvalidRequest(f"must be a finite number of seconds > 0, got {getattr(self, name)!r}", field=name)


@dataclass(frozen=True)
class DistillRecipe:
    """Everything that determines the demo draft: ``mirrorspec demo --rebuild`` follows it.

    The teacher (the demo target) writes answers to the first ``teacher_prompts`` training
    prompts, keeping its top-``teacher_top_k`` log-probabilities; the student (a few transformer
    layers on top of the target's own frozen embedding and tied head) is distilled from that
    cache and proposes from the ``draft_vocab_size`` tokens the target chose most often.
    """

    seed: int = 0
    prompt_set: int = 2  # which chat prompts the target answers (mirrorspec.distill.prompts.training_prompts)
    teacher_prompts: int = 20480
    teacher_batch_size: int = 128
    shard_batches: int = 4
    max_prompt_tokens: int = 512
    max_new_tokens: int = 128
    teacher_top_k: int = 32
    teacher_dtype: str = "bfloat16"
    student_layers: int = 2
    draft_vocab_size: int = 8192
    epochs: float = 3.0
    batch_sequences: int = 16
    learning_rate: float = 1e-3
    train_dtype: str = "bfloat16"  # autocast; ~2x faster than float32 on AVX-512-BF16 CPUs
