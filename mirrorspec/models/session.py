"""A KV-cache session over one sequence: the only way the engine touches a model.

The session is *context-addressed*: callers say which context they want logits for, and the
session works out which prefix of its cache is still valid, rolls back the rest, and feeds only
the new tokens. That single operation covers prefill, append, scoring K draft tokens in one pass
and roll-back after a rejection, and it makes "commit verified tokens, then draft" calls natural
for remote drafters: nothing but new tokens ever has to be resent.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import DynamicCache

from mirrorspec.models.prepack import PackedLinear, is_prepacked
from mirrorspec.models.quantize import int8_linear, is_quantized


class LogitSession(Protocol):
    """Anything that returns next-token logits for the last positions of a context.

    The HF-backed ``KVSession`` is the real one; the tensor-parallel target will be another.
    """

    vocab_size: int

    def logits_for(self, context: Sequence[int], num_positions: int) -> torch.Tensor: ...

    def rollback(self, length: int) -> None: ...

    def close(self) -> None: ...


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Usually one extends the other (one C-speed slice compare); a mirror branch forks a few
    tokens before the end."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def head_rows(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The output head's weights for the vocabulary ids ``rows`` alone: logits over a frequent
    sub-vocabulary then cost m/vocab of the full head's.

    # [m] -> [m, hidden]
    """
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("a sub-vocabulary head needs a bias-free output head")
    return head.weight[rows.to(head.weight.device)].detach()


HEADS_ATTRIBUTE = "_mirrorspec_sub_vocabulary_heads"


@functools.cache
def _cache_keyword(module_type: type) -> str:
    return "cache" if "cache" in inspect.signature(module_type.forward).parameters else "past_key_values"


def cache_argument(module: torch.nn.Module, cache: DynamicCache) -> dict[str, DynamicCache]:
    """``forward``'s KV-cache keyword argument. transformers 5.24 renamed ``past_key_values`` to
    ``cache``: the old name warns on every run and goes in 5.40, and the 5.x releases before the
    rename know only it."""
    return {_cache_keyword(type(module)): cache}


def sub_vocabulary_head(model: torch.nn.Module, rows: torch.Tensor) -> torch.nn.Module:
    """A linear head over ``head_rows``, packed and quantized like the model's own layers when
    they are (the head is the largest weight a small draft reads per token).

    Built once per model, sub-vocabulary and form, and shared by every session on the model: it
    holds no state, and building it (packing, int8 rounding, the kernel probe) cost 47 ms for the
    demo draft's 8k-row head, which a session per request would otherwise pay each time.

    # [..., hidden] -> [..., m]
    """
    packed, quantized = is_prepacked(model), is_quantized(model)
    key = (tuple(rows.tolist()), packed, quantized)
    heads = model.__dict__.setdefault(HEADS_ATTRIBUTE, {})
    if key not in heads:
        head = PackedLinear(head_rows(model, rows), pack=packed)
        heads[key] = int8_linear(head) if quantized else head
    return heads[key]


def attention_reach(config) -> int | None:
    """How many positions back the narrowest layer of a model attends (None: every layer sees the
    whole context). A 4D mask handed to the model is used as it is, in sliding-window layers too,
    so the runner-up's whole-context mask is right only while the sequence fits this reach
    (Mistral's ``sliding_window``, Gemma 2 and 3's sliding layers, Llama 4's attention chunks)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    if types is not None and all(kind == "full_attention" for kind in types):
        return None
    reaches = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size")]
    reaches = [int(r) for r in reaches if isinstance(r, int) and not isinstance(r, bool) and r > 0]
    return min(reaches, default=None)


def runner_up_reach(model: torch.nn.Module) -> int | None:
    """The longest sequence a runner-up can be scored in (None: any; 0: none). Scoring one hands
    the model a 4D mask and the runner-up's ``position_ids``, which models with ALiBi biases
    (Bloom, MPT, Falcon with ``alibi``) cannot take: they build the bias from a 2D mask, and take
    no positions. Bloom raised a bare ValueError deep in transformers (a review's find); their
    windows verify the chain alone, as windows past a sliding window do."""
    if getattr(model.config, "alibi", False) or "position_ids" not in inspect.signature(model.forward).parameters:
        return 0
    return attention_reach(model.config)


def runner_up_mask(cached: int, queries: int, first: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive attention mask for ``queries`` new tokens after ``cached`` ones: causal for all
    but the last, which sees keys before ``first`` and itself only.

    # -> [1, 1, queries, cached + queries]
    """
    keys = torch.arange(cached + queries, device=device)
    visible = keys[None, :] <= torch.arange(cached, cached + queries, device=device)[:, None]  # [queries, keys]
    visible[-1] = keys < first
    visible[-1, -1] = True
    blocked = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    return blocked.masked_fill(visible, 0.0)[None, None]


def scores_runner_up(session, length: int) -> bool:
    """Whether ``session`` can score a runner-up within a ``length``-token sequence."""
    reach = getattr(session, "reach", None)
    return hasattr(session, "logits_with_runner_up") and (reach is None or length <= reach)


class KVSession:
    """Holds one DynamicCache and the token ids it covers.

    ``output_rows`` restricts the logits to those vocabulary ids (a draft's frequent-token
    sub-vocabulary): the head then costs m rows instead of the whole vocabulary, which for a
    2-layer draft over a 49k vocabulary is most of its work. Column j of the logits is token
    ``output_rows[j]``.
    """

    def __init__(self, model: torch.nn.Module, output_rows: torch.Tensor | None = None):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.device = next(model.parameters()).device
        self.embeddable = int(model.get_input_embeddings().num_embeddings)
        self.tokens: list[int] = []
        self._cache = DynamicCache()
        self._head = None
        self.reach = runner_up_reach(model)  # longest sequence a runner-up can be scored in (None: any; 0: none)
        if output_rows is not None:
            self._head = sub_vocabulary_head(model, output_rows)  # [..., hidden] -> [..., m]

    def __len__(self) -> int:
        return len(self.tokens)

    @torch.inference_mode()
    def logits_for(self, context: Sequence[int], num_positions: int) -> torch.Tensor:
        """Next-token logits after each of the last ``num_positions`` tokens of ``context``.

        # -> [num_positions, vocab] float32, row i predicts context[len - num_positions + i + 1]
        """
        if not 1 <= num_positions <= len(context):
            raise ValueError(f"num_positions must be in [1, {len(context)}], got {num_positions}")
        return self._extend(context, num_positions)[0]

    @torch.inference_mode()
    def logits_with_runner_up(self, context: Sequence[int], num_positions: int, runner_up: int) -> torch.Tensor:
        """``logits_for(context, num_positions)`` plus one more row from the same forward pass: the
        next-token logits after ``runner_up`` put in place of the first of the last
        ``num_positions - 1`` tokens (a second candidate for a window's first draft: a two-way
        tree at the root).

        The runner-up goes in last, at its rival's position index, under a 4D mask that shows it
        the context before that position and itself only, so its row is what a forward over
        ``context[:first] + [runner_up]`` would give. Its cache entry is left at the end: the
        caller rolls back to at most ``len(context)`` (a verifier always does).

        # -> [num_positions + 1, vocab] float32; the last row follows the runner-up
        """
        if not 2 <= num_positions <= len(context):
            raise ValueError(f"num_positions must be in [2, {len(context)}], got {num_positions}")
        if self.reach == 0:
            raise ValueError(f"this model ({type(self.model).__name__}) cannot score a runner-up: it takes no 4D "
                             f"attention mask with position ids (ALiBi); verify the chain alone")
        if not scores_runner_up(self, len(context)):
            raise ValueError(f"a runner-up in a {len(context)}-token sequence is past this model's attention reach "
                             f"({self.reach}): its mask would see too far back")
        return self._extend(context, num_positions, runner_up)[0]

    def _extend(self, context: Sequence[int], num_positions: int, runner_up: int | None = None) -> torch.Tensor:
        """Make the cache cover ``context``, recomputing at least its last ``num_positions``
        (and, with ``runner_up``, score it as ``logits_with_runner_up`` says).

        # -> [1, num_positions (+ 1 with a runner-up), vocab or m]
        """
        keep = min(common_prefix_length(self.tokens, context), len(context) - num_positions)
        self.rollback(keep)
        fed, masking = list(context[keep:]), {}
        if runner_up is not None:
            first = len(context) - num_positions + 1  # where the runner-up competes with context[first]
            fed.append(runner_up)
            masking = {"attention_mask": runner_up_mask(keep, len(fed), first, next(self.model.parameters()).dtype,
                                                        self.device),
                       "position_ids": torch.tensor([[*range(keep, len(context)), first]], device=self.device)}
        new = self.input_ids([fed])  # [1, n]
        try:
            logits = self.forward(new, self._cache, num_positions + (runner_up is not None), **masking)
        except BaseException:  # a forward that failed part-way leaves layers of unknown length: start over
            self._cache, self.tokens = DynamicCache(), []
            raise
        # with a runner-up, as long as the cache but not a sequence: the caller rolls back before reuse
        self.tokens = [*context[:keep], *fed]
        return logits

    def input_ids(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Token rows as the model's input. A draft whose table is narrower than its target's (the
        same tokenizer, padded to another size: Qwen2.5 0.5B has 151,936 rows, 7B 152,064) cannot
        embed the target's extra ids, which only its padding rows hold and which it all but never
        emits; such an id is fed as id 0. What a draft is fed only steers its guesses: the target
        verifies them against its own distribution, so exactness does not depend on it.

        # -> [len(rows), n] int64
        """
        ids = [[t if t < self.embeddable else 0 for t in row] for row in rows]
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def forward(self, input_ids: torch.Tensor, cache: DynamicCache, num_positions: int,
                **masking: torch.Tensor) -> torch.Tensor:
        """Feed ``input_ids`` through ``cache``; logits of the last positions, over the head's rows.
        ``masking``: ``attention_mask`` and ``position_ids`` where rows skip cached positions.

        # [batch, n] -> [batch, num_positions, vocab or m] float32
        """
        if self._head is not None:
            decoder = self.model.get_decoder()
            hidden = decoder(input_ids=input_ids, use_cache=True, **cache_argument(decoder, cache), **masking)
            return self._head(hidden.last_hidden_state[:, -num_positions:]).float()
        # logits_to_keep: a 49k-vocabulary head over every prompt position costs more than the prefill
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=num_positions,
                         **cache_argument(self.model, cache), **masking)
        return out.logits[:, -num_positions:].float()

    @torch.inference_mode()
    def fork(self, prefix: Sequence[int], next_tokens: Sequence[int],
             fork_points: Sequence[int] | None = None) -> BranchBatch:
        """Continuations of ``prefix``, one per next token, decoded side by side (mirror branches).
        Row b continues ``prefix[:fork_points[b]]`` (default: all of ``prefix``), so branches that
        fork at different points of one window share one batch. This session keeps ``prefix``
        cached and is not changed."""
        if common_prefix_length(self.tokens, prefix) < len(prefix):  # cache the rest; its logits are unused
            self._extend(prefix, 1)
        else:
            self.rollback(len(prefix))
        return BranchBatch(self, next_tokens, fork_points)

    def rollback(self, length: int) -> None:
        """Forget every cached position from ``length`` on."""
        drop = len(self.tokens) - length
        if drop <= 0:
            return
        if length == 0:
            self._cache = DynamicCache()
        else:
            self._cache.crop(-drop)
        del self.tokens[length:]

    def reset(self) -> None:
        self.rollback(0)

    def close(self) -> None:
        """Free the cache (a closed session's memory goes back at once, not at garbage collection)."""
        self.reset()


class BranchBatch:
    """B sequences sharing a session's cached prefix, one batched forward per step: the prefix's
    KV cache is copied B times once, and every row advances one token per ``step``.

    A row that forks before the end of the prefix keeps the whole cache but is masked off the
    positions past its fork point, and its new tokens take the positions right after that point:
    it attends to exactly what a single sequence ``prefix[:fork] + its tokens`` would (masked
    keys get zero weight), so one batch serves guesses at every rejection point of a window.
    """

    def __init__(self, session: KVSession, next_tokens: Sequence[int], fork_points: Sequence[int] | None = None):
        self.session = session
        self._cache = copy.deepcopy(session._cache)
        self._cache.batch_repeat_interleave(len(next_tokens))
        self._next = self._column(next_tokens)
        self._steps = 0
        cached = len(session.tokens)
        forks = [cached] * len(next_tokens) if fork_points is None else [int(f) for f in fork_points]
        if len(forks) != len(next_tokens) or not all(0 < f <= cached for f in forks):
            raise ValueError(f"fork points must be one per next token, each in [1, {cached}]; got {forks}")
        self._forks = torch.tensor(forks, dtype=torch.long, device=session.device)  # [B]
        self._prefix_mask = None  # [B, cached], 0 past each row's fork; None where every row forks at the end
        if min(forks) < cached:
            self._prefix_mask = (torch.arange(cached, device=session.device) < self._forks[:, None]).long()

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """Feed each row's pending token. # -> [B, vocab or m] float32"""
        masking = {}
        if self._prefix_mask is not None:
            rows = len(self._forks)
            fed = torch.ones(rows, self._steps + 1, dtype=torch.long, device=self.session.device)  # [B, steps + 1]
            masking = {"attention_mask": torch.cat([self._prefix_mask, fed], dim=1),  # [B, cached + steps + 1]
                       "position_ids": (self._forks + self._steps)[:, None]}  # [B, 1]
        self._steps += 1
        return self.session.forward(self._next, self._cache, 1, **masking)[:, 0]

    def feed(self, tokens: Sequence[int]) -> None:
        self._next = self._column(tokens)

    def _column(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.session.input_ids([[int(t)] for t in tokens])  # [B, 1]
