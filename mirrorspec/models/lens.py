"""A tuned lens for early-exit hints: one affine map, fitted to the target itself, from layer L's
hidden state to what the final norm hands the LM head.

The plain early exit applies the final norm and head to layer L's hidden state as it is (a "logit
lens"). The layers after L keep changing the residual stream, so on the demo target it names the
target's own next token under half the time at layer 27 of 30. A least-squares affine map from
layer L to the final normed state (Belrose et al. 2023, "Eliciting latent predictions from
transformers with the tuned lens"), fitted on the target's own hidden states over text the target
wrote, names it two to four times out of five there, and holds it in its top 4 nine times out of
ten (see ``fit_tuned_lens``). The fit is closed-form ridge regression: one pass over a few hundred
sequences, no gradient steps; it is cached per target and layer.

Hints only steer which mirror branches get drafted, so a better lens buys branch hits; it can
never change an output token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from mirrorspec.config import InvalidRequest
from mirrorspec.models.demo_target import cache_root, save_tensors_atomically
from mirrorspec.models.loading import LoadedModel, encode_prompt

RMS_EPS = 1e-6


@dataclass(frozen=True)
class LensRecipe:
    """Everything that shapes a fitted lens (and its cache key)."""

    layer: int
    num_prompts: int = 64  # training prompts the target answers (never benchmark prompts): ~8k positions
    max_prompt_tokens: int = 256
    max_new_tokens: int = 64
    ridge: float = 1.0
    seed: int = 1  # which training prompts, in mirrorspec.distill.prompts' seeded order
    batch_size: int = 32


class TunedLens:
    """``weight`` # [hidden + 1, hidden]: the map from layer L's RMS-normalised hidden state (and a
    bias column) to the final normed state; the LM head is applied after it."""

    def __init__(self, layer: int, weight: torch.Tensor):
        self.layer = layer
        self.weight = weight

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """# [n, hidden] -> [n, hidden], in ``hidden``'s dtype and device"""
        weight = self.weight.to(device=hidden.device, dtype=hidden.dtype)
        return _features(hidden) @ weight[:-1] + weight[-1]

    def save(self, path: Path, recipe: LensRecipe, source: str) -> None:
        meta = {"recipe": json.dumps(asdict(recipe)), "source": source}
        save_tensors_atomically(path, {"weight": self.weight.float().contiguous()}, meta)

    @staticmethod
    def load(path: Path, layer: int) -> TunedLens:
        from safetensors.torch import load_file

        return TunedLens(layer, load_file(str(path))["weight"])


def _features(hidden: torch.Tensor) -> torch.Tensor:
    """RMS-normalised, without a learnt scale: the lens learns its own."""
    return hidden * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + RMS_EPS).to(hidden.dtype)


def _cached_lens(path: Path, layer: int, hidden: int, log: Callable[[str], None]) -> TunedLens | None:
    """The lens cached at ``path``, or None where it is damaged (cut short, overwritten) or of
    another shape, and must be fitted again: it failed every request with a safetensors traceback,
    or a shape mismatch deep inside the first hint (review 23 of stop 48)."""
    try:
        lens = TunedLens.load(path, layer)
    except (OSError, SafetensorError, KeyError) as err:
        log(f"the cached lens at {path} does not load ({err}); fitting it again")
        return None
    if tuple(lens.weight.shape) != (hidden + 1, hidden):
        log(f"the cached lens at {path} is {list(lens.weight.shape)}, not [{hidden + 1}, {hidden}]; fitting it again")
        return None
    return lens


def hinted_decoder(model: torch.nn.Module, layer: int) -> tuple[Sequence[torch.nn.Module], torch.nn.Module]:
    """The decoder layers and final norm a hint at ``layer`` (1-based) reads, or a clear error:
    the layer must leave at least one after it, or the hint would come with the verdict."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    if layers is None or norm is None:
        raise InvalidRequest(f"early-exit hints need a decoder with .layers and .norm; "
                             f"{type(model).__name__} has none", field="hint_layer")
    if len(layers) < 2:  # "must be in [1, 0]" named a range with nothing in it
        raise InvalidRequest(f"this {len(layers)}-layer target has no layer before its last to read early-exit hints "
                             f"from; leave hint_layer out", field="hint_layer")
    if not 1 <= layer < len(layers):
        raise InvalidRequest(f"hint_layer must be in [1, {len(layers) - 1}] for this {len(layers)}-layer "
                             f"target, got {layer}", field="hint_layer")
    return layers, norm


@contextmanager
def _recording(model: torch.nn.Module, layer: int) -> Iterator[dict[str, torch.Tensor]]:
    """While inside, each forward leaves layer ``layer``'s output and the final norm's output."""
    layers, norm = hinted_decoder(model, layer)
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable:
        def hook(module, args, output):
            seen[name] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    handles = [layers[layer - 1].register_forward_hook(keep("layer")), norm.register_forward_hook(keep("final"))]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def fit_tuned_lens(model: torch.nn.Module, layer: int, sequences: Sequence[Sequence[int]],
                   ridge: float = 1.0) -> TunedLens:
    """Ridge regression from layer ``layer`` to the final normed state over every position of
    ``sequences``, accumulated in float64 (two small matrices, whatever the number of positions).
    Measured on the demo target, fitted on 10k positions of training prompts and their greedy
    answers, scored on every position of the first 20 HumanEval / MT-Bench prompts with their greedy
    answers: at layer 27 of 30, the head's top token is the target's own 0.44 / 0.44 of the time
    with the plain early exit and 0.81 / 0.67 through the lens (in its top 4: 0.62 / 0.59 against
    0.96 / 0.88); at layer 24, 0.28 / 0.31 against 0.67 / 0.55, better than the plain exit at 27."""
    device = next(model.parameters()).device
    hidden_size = int(model.config.hidden_size)
    xtx = torch.zeros(hidden_size + 1, hidden_size + 1, dtype=torch.float64)
    xty = torch.zeros(hidden_size + 1, hidden_size, dtype=torch.float64)
    with _recording(model, layer) as seen:
        for ids in sequences:
            model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
            x = _features(seen["layer"][0].double()).cpu()  # [n, hidden]
            x = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1)  # [n, hidden + 1]
            xtx += x.T @ x
            xty += x.T @ seen["final"][0].double().cpu()
    regulariser = ridge * torch.eye(hidden_size + 1, dtype=torch.float64)
    regulariser[-1, -1] = 0.0  # the bias is not shrunk
    return TunedLens(layer, torch.linalg.solve(xtx + regulariser, xty).float())


def lens_sequences(loaded: LoadedModel, recipe: LensRecipe) -> list[list[int]]:
    """Text the target wrote: its greedy answers to training prompts (a model without a tokenizer
    answers seeded random token prompts instead). Never benchmark prompts."""
    from mirrorspec.distill.prompts import training_prompts
    from mirrorspec.distill.teacher import generate_batch

    if loaded.tokenizer is not None:
        prompts = [encode_prompt(loaded.tokenizer, p.text)[-recipe.max_prompt_tokens:]
                   for p in training_prompts(recipe.seed, prompt_set=2)[:recipe.num_prompts]]
    else:
        generator = torch.Generator().manual_seed(recipe.seed)
        vocab = int(loaded.model.config.vocab_size)
        prompts = [torch.randint(vocab, (8,), generator=generator).tolist() for _ in range(recipe.num_prompts)]
    sequences: list[list[int]] = []
    for start in range(0, len(prompts), recipe.batch_size):
        batch = generate_batch(loaded.model, prompts[start:start + recipe.batch_size],
                               max_new_tokens=recipe.max_new_tokens, stop_ids=loaded.stop_token_ids(),
                               temperature=0.0, top_k=1, generator=torch.Generator().manual_seed(recipe.seed))
        sequences += [t.tolist() for t in batch.tokens]
    return sequences


def lens_path(loaded: LoadedModel, recipe: LensRecipe) -> Path:
    """Keyed by the target's source and shape and by every recipe field."""
    config = loaded.model.config
    key = json.dumps({"source": loaded.source, "recipe": asdict(recipe), "vocab": int(config.vocab_size),
                      "hidden": int(config.hidden_size), "layers": int(config.num_hidden_layers)}, sort_keys=True)
    return cache_root() / "lens" / f"lens-{hashlib.sha256(key.encode()).hexdigest()[:12]}.safetensors"


def tuned_lens(loaded: LoadedModel, recipe: LensRecipe, log: Callable[[str], None] = print) -> TunedLens:
    """The target's lens for ``recipe.layer``: from the cache, or fitted now and cached (about a
    minute for the demo target on 2 CPU cores; once per target and layer)."""
    hinted_decoder(loaded.model, recipe.layer)  # a bad layer fails now, not after generating the text
    path = lens_path(loaded, recipe)
    if path.exists() and (lens := _cached_lens(path, recipe.layer, loaded.model.config.hidden_size, log)):
        return lens
    log(f"fitting a tuned lens for hints at layer {recipe.layer} of {loaded.source} (once; cached at {path})")
    lens = fit_tuned_lens(loaded.model, recipe.layer, lens_sequences(loaded, recipe), recipe.ridge)
    lens.save(path, recipe, loaded.source)
    return lens
