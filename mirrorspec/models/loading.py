"""Loading causal LMs and tokenizers with the normal ``from_pretrained``, offline.

One entry point for hub ids, local checkpoints, GGUF files and the ``demo-target`` alias, so
every service and the CLI resolve models the same way.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mirrorspec.config import InvalidRequest, check_quantization, check_shared_vocabulary, check_text, field_named
from mirrorspec.models.attention import use_cpu_verify_attention
from mirrorspec.models.prepack import prepack_linears
from mirrorspec.models.quantize import apply_quantization

if TYPE_CHECKING:  # transformers' modeling code takes seconds to import: processes that load no
    # model (the front door, the CLI's client commands) never do
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEMO_TARGET = "demo-target"
DEMO_DRAFT = "demo-draft"  # the draft mirrorspec distils from the demo target (mirrorspec demo)
# Key in a draft's config.json listing the vocabulary ids it proposes from (its sub-vocabulary).
DRAFT_VOCAB_KEY = "mirrorspec_draft_vocab"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    source: str

    @property
    def dtype_name(self) -> str:
        """The dtype as the --dtype flags spell it (``float32``), e.g. to start a server alike."""
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config and the tokenizer, for default stop conditions."""
        ids: set[int] = set()
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        # one past the model's vocabulary can never be sampled (and generate refuses stop ids there)
        return tuple(sorted(t for t in ids if t < self.model.config.vocab_size))


def quiet_transformers() -> None:
    """A truncated draft triggers a long 'unused weights' report, and HF's progress bars clutter
    stderr: the command line's and the benchmarks' own output is what a person reads."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` (CUDA where present), or a device this process can actually use: a typo or a GPU
    this machine lacks is a clear InvalidRequest naming ``device``, not a traceback at load."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = parse_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device {device!r} asked for, but this torch sees no CUDA GPU "
                             f"(torch {torch.__version__}); use cpu or auto", field="device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidRequest(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)",
                             field="device")
    return dev


def device_flag(text: str) -> str:
    """An argparse ``type`` for --device flags: a bad or absent device is the flag's error."""
    import argparse

    try:
        resolve_device(text)
    except InvalidRequest as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def parse_device(device: str) -> torch.device:
    """The device a name means, checked for syntax only (a Ray head may validate for GPU workers)."""
    try:
        dev = torch.device(device) if device != "auto" else torch.device("cpu")
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        # cpu:5 ran on the one CPU device torch has, as if it placed the model somewhere (a review)
        raise InvalidRequest(f"device must be auto, cpu, cuda or cuda:N, got {device!r}" +
                             ("; torch has one CPU device, cpu" if dev is not None and
                              dev.type == "cpu" else ""), field="device")
    return dev


def resolve_dtype(dtype: str, device: torch.device, stored: torch.dtype | None = None) -> torch.dtype:
    """The dtype a model computes in. ``auto`` is float32 on CPU (bf16 matmuls are slow there and
    coarse) and, on CUDA, the checkpoint's own half-precision dtype (``stored``), else float32.

    Why not bfloat16 on CUDA for every checkpoint: on an H200 the float32 demo pair ran 1.6-2x
    slower in bf16 (a small model's step is launch-bound, and bf16 adds casting kernels), and its
    greedy output stopped being token-identical to target-only on MT-Bench, in HF assisted
    generation as in mirrorspec: bf16 rounds a pass over K+1 positions differently from a
    one-token step, and near-ties flip. A bf16 checkpoint (a large model) stays bf16, for memory;
    ``float32`` restores identity wherever it fits."""
    if dtype == "auto":
        half = device.type == "cuda" and stored in (torch.bfloat16, torch.float16)
        return stored if half else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise InvalidRequest(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}", field="dtype") from None


def stored_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are in (None where it names none)."""
    named = getattr(config, "dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else None


def draft_weights(source: str) -> Path | None:
    """The demo-draft weights ``source`` names, if any: the shipped ones for ``demo-draft``, and a
    ``.safetensors`` file (what ``mirrorspec demo --rebuild --out`` writes) by its path, so a
    rebuilt draft is named wherever a draft is; both are assembled with the demo target."""
    if source == DEMO_DRAFT:
        from mirrorspec.models.demo_draft import SHIPPED_WEIGHTS

        return SHIPPED_WEIGHTS
    return Path(source).expanduser() if source.endswith(".safetensors") else None


def locate_model(source: str) -> tuple[str, dict]:
    """Where ``from_pretrained`` finds ``source`` (a hub id, a local path, a ``.gguf`` file,
    ``demo-target``, ``demo-draft`` or a demo-draft weights file), and the ``gguf_file`` argument
    it needs if any."""
    if source == DEMO_TARGET:
        from mirrorspec.models.demo_target import ensure_demo_target

        source = str(ensure_demo_target())
    elif (weights := draft_weights(source)) is not None:
        from mirrorspec.models.demo_draft import ensure_demo_draft

        source = str(ensure_demo_draft(weights))
    path = Path(source)
    if source.endswith(".gguf"):
        if not path.is_file():
            raise InvalidRequest(f"GGUF file {source} does not exist", field="model")
        return str(path.parent), {"gguf_file": path.name}
    if source.startswith((".", "/", "~")) and not path.exists():
        raise InvalidRequest(f"model directory {source} does not exist", field="model")
    if path.is_file():  # a checkpoint's config.json: its config reads, then torch.load runs on the JSON
        raise InvalidRequest(f"{source} is a file; pass the checkpoint directory that holds its config.json and "
                             f"weights, or a .gguf file", field="model")
    return source, {}


def load_causal_lm(source: str, *, dtype: str = "auto", device: str = "auto", tokenizer: bool = True,
                   prepack: bool = True, quantize: str = "none") -> LoadedModel:
    """Load a model for inference from anything ``locate_model`` finds.

    ``prepack`` packs a float32 CPU model's linear weights for oneDNN (``models.prepack``);
    pass False where the model will be trained from, edited or sharded afterwards. ``quantize``
    'int8' runs a float32 CPU model's linear layers on int8 weights (``models.quantize``: for a
    draft, whose one-token steps are memory-bound; a no-op on GPU)."""
    check_quantization(quantize)
    location, gguf = locate_model(source)
    cached = _cached_copy(source, location, gguf)
    config = _read_config(source, location, gguf)
    dev = resolve_device(device)
    stored = stored_dtype(config) if dtype == "auto" and dev.type == "cuda" else None
    # a GGUF file's config is rebuilt from its metadata while its weights load: pass only the file
    kwargs: dict = {"dtype": resolve_dtype(dtype, dev, stored), **(gguf or {"config": config})}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _not_loadable_as_invalid(source, cached=cached):
        model, info = AutoModelForCausalLM.from_pretrained(location, output_loading_info=True, **kwargs)
    check_loaded_weights(source, info)
    model = model.to(dev).eval()
    use_cpu_verify_attention(model)  # bit-identical logits, cheaper multi-token passes (models.attention)
    apply_quantization(model, quantize)  # first: packing a layer int8 then replaces is wasted work
    if prepack:
        prepack_linears(model)  # what int8 left as nn.Linear (the tied head, shapes it refused)
    tok = None
    if tokenizer:
        with _not_loadable_as_invalid(source, "a tokenizer", "a model directory with its tokenizer files",
                                      cached=cached):
            tok = check_has_tokens(AutoTokenizer.from_pretrained(location, **gguf))
    loaded_from = location if not gguf else str(Path(location) / gguf["gguf_file"])
    return LoadedModel(model=model, tokenizer=tok, source=loaded_from)


def read_config(source: str) -> PretrainedConfig:
    """The config of anything ``locate_model`` finds, without its weights: cheap, so a launcher
    checks a model before it starts processes or Ray replicas that would each fail to load it.
    Raises ``InvalidRequest`` (field ``model``) saying what is wrong and what would load."""
    location, gguf = locate_model(source)
    return _read_config(source, location, gguf)


def check_models(target: str, draft: str | None) -> None:
    """Reads the target's config and the draft model's (``draft`` None or a strategy name: none),
    and checks they share a vocabulary, before a launcher starts anything that would load them:
    a source that is not a model is named at once (field ``target`` or ``draft``), rather than by
    each server or Ray replica failing to load it in turn."""
    with field_named("target"):
        target_config = read_config(target)
    if draft is not None:
        with field_named("draft"):
            draft_vocab = read_config(draft).vocab_size
            check_shared_vocabulary(draft_vocab, target_config.vocab_size,
                                    same_tokenizer=lambda: same_tokenizer_at(draft, target, draft_vocab))


def _read_config(source: str, location: str, gguf: dict) -> PretrainedConfig:
    from transformers import AutoConfig

    with _not_loadable_as_invalid(source, cached=_cached_copy(source, location, gguf)):
        config = AutoConfig.from_pretrained(location, **gguf)
    check_sub_vocabulary(config, source)
    return config


def check_sub_vocabulary(config: PretrainedConfig, source: str | None = None) -> None:
    """A hand-edited sub-vocabulary failed deep inside a forward (an id past the head's rows, an
    empty list), went negative into Python's wrap-around, or was truncated from floats; served, each
    session's open failed as INTERNAL while requests quietly ran target-only (review 27 of stop 49).
    Checked wherever a config is read, so a launcher refuses it before anything starts."""
    ids, vocab_size = getattr(config, DRAFT_VOCAB_KEY, None), getattr(config, "vocab_size", None)
    if ids is None:
        return

    def refuse(why: str) -> InvalidRequest:
        return InvalidRequest(f"{source or config.name_or_path or 'the draft'}'s config.json has a {DRAFT_VOCAB_KEY} "
                              f"that {why}; it must list the distinct token ids the draft proposes from, each in [0, "
                              f"{vocab_size or 'vocab_size'}), or be left out (the whole vocabulary)", field="model")

    if not isinstance(ids, (list, tuple)):
        raise refuse(f"is a {type(ids).__name__}, not a list")
    if not ids:
        raise refuse("is empty")
    if not_ids := [i for i in ids if not isinstance(i, int) or isinstance(i, bool)]:
        raise refuse(f"holds {not_ids[0]!r}, not a token id")
    if outside := [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]:
        raise refuse(f"holds {outside[0]}, outside the draft's {vocab_size}-token vocabulary")
    if len(set(ids)) != len(ids):
        raise refuse(f"lists {next(i for i in ids if ids.count(i) > 1)} twice")


def check_loaded_weights(source: str, info: dict) -> None:
    """Weights the model needs that the checkpoint lacks are random: refused, where transformers
    only reports them (and the CLI quiets its report), so a config.json copied over another
    checkpoint's loaded a silently wrong model (review 23 of stop 48). Weights the model does not
    use are only logged: checkpoints carry extras (old rotary buffers, multi-token heads)."""
    if missing := sorted(info.get("missing_keys") or ()):
        raise InvalidRequest(f"{source}'s weights lack {len(missing)} tensors its config.json asks for (e.g. "
                             f"{', '.join(missing[:3])}): they would be random; is that config the checkpoint's own?",
                             field="model")
    if unexpected := sorted(info.get("unexpected_keys") or ()):
        log.warning("%s holds %d tensors its config.json does not use (e.g. %s); is that config the checkpoint's "
                    "own?", source, len(unexpected), ", ".join(unexpected[:3]))


def _cached_copy(source: str, location: str, gguf: dict) -> str | None:
    """The folder mirrorspec built ``source`` into (the demo target, a demo draft), or None: the
    source is the user's own."""
    return location if location != source and not gguf else None


@contextmanager
def _not_loadable_as_invalid(source: str, what: str = "a causal LM",
                             would_load: str = f"a checkpoint directory with a config.json, a .gguf file, a hub id "
                                               f"already in the local cache, or {DEMO_TARGET}",
                             cached: str | None = None):
    """``from_pretrained`` says a source is not a model with OSError (no config or weights, a hub
    id neither cached nor reachable offline), ValueError (no known model_type), SafetensorError or
    UnpicklingError (a weights file cut short or not weights at all): all the caller's input, so
    they become ``InvalidRequest`` and reach users as a named flag or INVALID_ARGUMENT rather than
    a traceback. Where the source is one mirrorspec built into its cache (``cached``), that copy is
    what is damaged: the advice to pass demo-target was the user's own input back (review 23)."""
    from pickle import UnpicklingError

    from safetensors import SafetensorError

    try:
        yield
    except InvalidRequest:
        raise
    except (OSError, ValueError, SafetensorError, UnpicklingError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        fix = (f"its copy built into the cache at {cached} is damaged: delete that folder and run again to build it "
               f"afresh" if cached else f"pass {would_load}")
        raise InvalidRequest(f"cannot load {what} from {source}: {reason} ({fix})", field="model") from err


def same_tokenizer(draft: PreTrainedTokenizerBase | None, target: PreTrainedTokenizerBase | None,
                   draft_vocab: int) -> bool:
    """Whether a draft with ``draft_vocab`` rows may draft for a target of another table size:
    both tokenizers known, mapping every token to the same id, and every id inside the draft's
    table (the tables differ in padding rows alone)."""
    if draft is None or target is None:
        return False
    vocabulary = draft.get_vocab()  # {token: id}, added tokens included
    return vocabulary == target.get_vocab() and max(vocabulary.values(), default=-1) < draft_vocab


@functools.lru_cache(maxsize=16)
def same_tokenizer_at(draft: str | None, target: str | None, draft_vocab: int) -> bool:
    """``same_tokenizer`` for the models at two sources (None: unknown, not the same); remembered,
    since ``generate`` asks again for every prompt and loading a 150k-token tokenizer costs."""
    return same_tokenizer(try_load_tokenizer(draft), try_load_tokenizer(target), draft_vocab)


def try_load_tokenizer(source: str | None) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a model source, if it has one (tiny test models have none)."""
    if not source:
        return None
    from transformers import AutoTokenizer

    try:
        location, gguf = locate_model(source)
        return check_has_tokens(AutoTokenizer.from_pretrained(location, **gguf))
    except (OSError, ValueError, TypeError, InvalidRequest):
        return None


def check_has_tokens(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """From a folder with no tokenizer files, transformers 5.x raises for some model types and for
    others (GPT-2, Gemma) builds a tokenizer of its special tokens alone: text was then encoded to
    nothing ("input_ids is empty", blaming the prompt) or to one unknown token, and output decoded
    to "" (a review's find). Raised as ValueError, which loading reports as no tokenizer."""
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ValueError(f"found no tokenizer files: transformers built a {type(tokenizer).__name__} that holds its "
                         f"{len(tokenizer)} special tokens alone")
    return tokenizer


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, *, chat: bool = True,
                  system: str | None = None) -> list[int]:
    """Token ids for a user prompt; instruct models get their chat template and the assistant cue."""
    if not prompt:
        raise InvalidRequest("the prompt is empty; pass some text to continue or a question to answer",
                             field="prompt")
    check_text(prompt, "prompt")
    if system:
        check_text(system, "system")
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return encode_chat(tokenizer, messages)
    return list(tokenizer(prompt)["input_ids"])


# the roles of OpenAI-style chats; a chat template prints any string it is given as a role, so a
# typo ("usr") would reach the model as a turn header it never saw in training
CHAT_ROLES = ("system", "user", "assistant", "tool")


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Refuses what the model cannot have been trained on (an unknown role, a tokenizer without a
    chat template) and what the template itself refuses (its ``raise_exception``, e.g. roles that
    do not alternate) as ``InvalidRequest`` on ``chat``."""
    for i, message in enumerate(messages):
        if message["role"] not in CHAT_ROLES:
            raise InvalidRequest(f"chat message {i} has role {message['role']!r}; use one of "
                                 f"{', '.join(CHAT_ROLES)}", field="chat")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model's tokenizer has no chat template; send the prompt as raw_text or "
                             "token_ids instead of chat", field="chat")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as err:
        raise InvalidRequest(f"the model's chat template refuses these messages: {err}", field="chat") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
