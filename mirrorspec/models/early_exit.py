"""Early-exit hints: the target's guess at the verdict, read off an intermediate layer.

Mirror-SD (arXiv 2510.13161) lets the target tell the drafter, part-way through a verify, which
tokens it is leaning towards at each window position: the final norm and LM head applied to
layer L's hidden state. The verify pass computes that hidden state anyway, so a forward hook
reads it as it goes by; the hint leaves before the remaining layers run, and the drafter spends
that time drafting the branches the hint points at.

Hints only steer *which* branches get drafted. Acceptance always uses the target's final
distribution, so a wrong hint costs a branch miss, never exactness.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mirrorspec.config import InvalidRequest
from mirrorspec.models.lens import TunedLens, hinted_decoder
from mirrorspec.models.session import sub_vocabulary_head


@dataclass(frozen=True)
class EarlyExitHint:
    """Top-κ tokens (best first) and their early-exit probabilities at each window position:
    row j predicts the token after the first j drafts (row K: after all of them)."""

    layer: int
    top_tokens: tuple[tuple[int, ...], ...]
    top_probs: tuple[tuple[float, ...], ...]

    def prob(self, position: int, token: int) -> float:
        """The hint's probability of ``token`` at ``position``; 0 outside its top-κ."""
        for t, p in zip(self.top_tokens[position], self.top_probs[position]):
            if t == token:
                return p
        return 0.0


class EarlyExitProbe:
    """Reads layer ``layer``'s top-``top_k`` guesses during a target forward pass.

    ``layer`` counts decoder layers from 1 and must leave at least one layer after it (the hint
    is worth something only if it arrives before the verdict). Decoder-only HF models with
    ``get_decoder().layers`` and ``get_decoder().norm`` (Llama, Mistral, Qwen, SmolLM ...).

    ``vocab_ids`` scores the hint over those ids alone (a draft's frequent-token sub-vocabulary):
    the full head is a fifth of a small target's verify, and the hint runs on the verify's own
    thread, so a full-vocabulary hint slows every verdict it precedes. Its probabilities are then
    renormalised over the sub-vocabulary; they only rank guesses, so that is harmless.
    """

    def __init__(self, model: torch.nn.Module, layer: int, top_k: int = 4, vocab_ids: torch.Tensor | None = None,
                 lens: TunedLens | None = None):
        layers, norm = hinted_decoder(model, layer)
        if top_k < 1:
            raise InvalidRequest(f"hint_top_k must be >= 1, got {top_k}", field="hint_top_k")
        self.layer = layer
        self.top_k = top_k
        self._block = layers[layer - 1]
        full_head = model.get_output_embeddings()
        self._vocab_ids = None if vocab_ids is None else vocab_ids.to(full_head.weight.device)  # [m]
        self._head = full_head if vocab_ids is None else sub_vocabulary_head(model, vocab_ids)
        if lens is not None and lens.layer != layer:
            raise InvalidRequest(f"a tuned lens fitted for layer {lens.layer} cannot read layer {layer}",
                                 field="hint_layer")
        # layer -> what the head takes: a tuned lens fitted to this target, or the final norm as is
        self._to_head = lens if lens is not None else norm

    @contextmanager
    def watching(self, num_positions: int, on_hint: Callable[[EarlyExitHint], None],
                 trailing: int = 0) -> Iterator[None]:
        """While inside, each forward through the model on this thread sends one hint for its last
        ``num_positions`` positions before ``trailing`` more (a runner-up's row, fed after the
        window's) to ``on_hint`` (called on the forward's thread). Forwards from
        other threads pass unheard: a draft that is the target model itself drafts branches through
        the same block meanwhile, and its one-row forwards are no hint about this window."""
        watcher = threading.get_ident()

        def hook(module, args, output):
            if threading.get_ident() != watcher:
                return
            hidden = output[0] if isinstance(output, tuple) else output  # [1, n, hidden]
            end = hidden.shape[1] - trailing
            normed = self._to_head(hidden[0, end - num_positions:end])  # [num_positions, hidden]
            logits = self._head(normed).float()  # [num_positions, vocab or m]
            top = logits.softmax(dim=-1).topk(min(self.top_k, logits.shape[-1]), dim=-1)  # [num_positions, κ]
            ids = top.indices if self._vocab_ids is None else self._vocab_ids[top.indices]
            on_hint(EarlyExitHint(self.layer, tuple(map(tuple, ids.tolist())), tuple(map(tuple, top.values.tolist()))))

        handle = self._block.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()
