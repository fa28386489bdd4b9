"""A feature-conditioned draft head (EAGLE, Li et al. 2024), distilled from the target's features.

The plain student (``student.py``) has to rebuild, in two layers, everything the target's thirty
worked out about the context, and on chat it agrees with the target at only ~0.39 of greedy
positions. An EAGLE head does not: it reads the target's own top-layer feature at each committed
position (``models.features``: after the final norm, what the LM head reads) with the embedding
of the token that followed, runs one decoder layer over that sequence, and predicts the target's
feature at the next position. The target's frozen head, over the draft's frequent-token
sub-vocabulary, turns the prediction into a token. Only the layer, its input projection and its
norm are trained (~4M parameters; one draft step is a few percent of a target step).

Drafting K tokens: the first step starts from a true feature (the target computed it while
verifying); each later step feeds the head's own prediction back in place of the feature it has
not got. Training sees true features only, with uniform noise on them (EAGLE's augmentation), so
later steps agree less; ``draft_chain`` is what a replay or a drafter runs.

Exactness does not depend on any of this: the head only proposes, and rejection sampling against
the target's own distribution decides.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, DynamicCache, PreTrainedModel

from mirrorspec.distill.teacher import TeacherShard
from mirrorspec.distill.training import train_epochs
from mirrorspec.models.session import cache_argument


@dataclass(frozen=True)
class EagleRecipe:
    """How a head is trained. The defaults are what the demo target's head was measured with."""

    seed: int = 0
    layers: int = 1
    epochs: float = 4.0
    batch_tokens: int = 3000  # padded positions per step (prompt context included)
    learning_rate: float = 2e-3
    feature_noise: float = 0.2  # uniform noise on input features, +- this times their std
    regression_weight: float = 1.0  # smooth-L1 on the predicted feature, beside the token loss


@dataclass(frozen=True)
class FeatureExample:
    """One target-written sequence: tokens [L], answer start, the target's features [L - 1, hidden]."""

    tokens: torch.Tensor  # [L] int64
    start: int
    features: torch.Tensor  # [L - 1, hidden] float16: features[i] was computed reading tokens[i]


def load_feature_examples(shards: Sequence[Path]) -> list[FeatureExample]:
    out = []
    for path in shards:
        shard = TeacherShard.load(path)
        if shard.features is None:
            raise ValueError(f"{path} holds no features: write it with write_teacher_data(features=True)")
        out += [FeatureExample(t.long(), s, f) for t, s, f in zip(shard.tokens, shard.starts, shard.features)]
    return out


class EagleHead(nn.Module):
    """(feature at i, token i+1) -> predicted feature at i+1, for every i of a sequence at once."""

    def __init__(self, target: PreTrainedModel, vocab: Sequence[int] | torch.Tensor, layers: int = 1):
        super().__init__()
        decoder = target.get_decoder()
        if not 1 <= layers <= len(decoder.layers):
            raise ValueError(f"layers must be in [1, {len(decoder.layers)}] (the target's own, which it starts "
                             f"from), got {layers}")
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
        hidden = config.hidden_size
        self.body = AutoModel.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        for i, layer in enumerate(self.body.layers):  # from the target's top layers: they read features
            layer.load_state_dict(decoder.layers[len(decoder.layers) - layers + i].state_dict())
        self.body.norm.load_state_dict(decoder.norm.state_dict())
        self.body.embed_tokens.weight.data.copy_(decoder.embed_tokens.weight.data.float())
        self.body.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * hidden, hidden)
        with torch.no_grad():  # start from "the next token's embedding, a little of the feature"
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(0.1 * torch.eye(hidden))
            self.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            self.fc.bias.zero_()
        self._target_head = target.get_output_embeddings().weight.detach()  # [V, hidden], not a copy
        vocab = torch.as_tensor(vocab, dtype=torch.long)
        _check_vocabulary(vocab, self._target_head.shape[0])
        self.register_buffer("vocab", vocab, persistent=True)
        self.register_buffer("head_rows", self._rows(), persistent=False)  # [m, hidden]
        self.to(self._target_head.device)  # beside the target whose features it reads

    @property
    def device(self) -> torch.device:
        return self.head_rows.device

    def _rows(self) -> torch.Tensor:
        return self._target_head[self.vocab.to(self._target_head.device)].float()

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: DynamicCache | None = None) -> torch.Tensor:
        """# [b, s, hidden], [b, s] -> [b, s, hidden]: row i predicts the feature at i + 1"""
        features, next_tokens = features.to(self.device), next_tokens.to(self.device)
        x = self.fc(torch.cat([features, self.body.embed_tokens(next_tokens)], dim=-1))
        extra = {} if cache is None else {**cache_argument(self.body, cache), "use_cache": True}
        return self.body(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                         **extra).last_hidden_state

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """# [..., hidden] -> [..., m]: the target's head over the sub-vocabulary"""
        return features.to(self.head_rows.dtype) @ self.head_rows.T

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What a head ships: everything but the target's own embedding (reattached on load)."""
        return {k: v for k, v in self.state_dict().items() if k != "body.embed_tokens.weight"}

    def load_trained_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights ``trained_state`` wrote, whatever sub-vocabulary this head was built with."""
        if "vocab" not in state:
            raise ValueError("not a head's weights: no 'vocab' (the sub-vocabulary it proposes from)")
        _check_vocabulary(state["vocab"], self._target_head.shape[0])
        self.vocab = state["vocab"].to(self.device, torch.long)  # may differ in size from this head's
        missing, unexpected = self.load_state_dict({k: v for k, v in state.items() if k != "vocab"}, strict=False)
        if unexpected or set(missing) - {"body.embed_tokens.weight", "vocab"}:
            raise ValueError(f"not this head's weights: missing {missing}, unexpected {unexpected}")
        self.head_rows = self._rows()  # the loaded sub-vocabulary's rows of the target's head


def _check_vocabulary(vocab: torch.Tensor, vocab_size: int) -> None:
    if vocab.numel() == 0 or not 0 <= int(vocab.min()) <= int(vocab.max()) < vocab_size:
        raise ValueError(f"the head's sub-vocabulary must be ids of this target's {vocab_size}-token vocabulary "
                         "(weights trained for another target?)")


@torch.inference_mode()
def draft_chain(head: EagleHead, features: torch.Tensor, tokens: torch.Tensor, committed: int, k: int,
                cache: DynamicCache, fed: int) -> tuple[list[int], int]:
    """Greedy drafts for positions committed .. committed + k - 1, and how many true inputs the
    cache then holds.

    ``tokens[:committed]`` are committed and ``features[:committed - 1]`` are the target's. The
    cache holds the head's inputs 0 .. fed - 1 (input i = (features[i], tokens[i + 1])); the true
    ones still missing are fed first, then each draft's input (the head's own prediction, the
    draft) is appended, and dropped again before returning: the next call's true inputs replace them.
    """
    if committed < 2:
        raise ValueError(f"a head drafts after at least 2 committed tokens (one feature), got {committed}")
    last = committed - 2  # the last true input: (features[c - 2], tokens[c - 1])
    index = torch.arange(fed, last + 1, device=head.device)
    predicted = head(features.to(head.device)[index][None].float(), tokens.to(head.device)[index + 1][None],
                     position_ids=index[None], cache=cache)[0, -1]
    drafts = []
    for j in range(k):
        drafts.append(int(head.vocab[head.logits(predicted).argmax()]))
        if j + 1 < k:
            position = torch.tensor([[last + 1 + j]], device=head.device)
            predicted = head(predicted[None, None], torch.tensor([[drafts[-1]]]), position_ids=position,
                             cache=cache)[0, -1]
    if k > 1:
        cache.crop(-(k - 1))
    return drafts, last + 1


def feature_std(examples: Sequence[FeatureExample], sample: int = 200) -> float:
    return float(torch.cat([e.features[:200].float() for e in examples[:sample]]).std())


def _padded(batch: Sequence[FeatureExample], answers_only: bool = True) -> tuple[torch.Tensor, ...]:
    """Inputs, targets and masks of a batch, right-padded: input i = (features[i], tokens[i + 1]),
    target = features[i + 1]; the loss counts rows that predict answer tokens."""
    width = max(len(e.tokens) for e in batch) - 2
    hidden = batch[0].features.shape[-1]
    features = torch.zeros(len(batch), width, hidden)
    targets = torch.zeros(len(batch), width, hidden)
    next_tokens = torch.zeros(len(batch), width, dtype=torch.long)
    attention = torch.zeros(len(batch), width, dtype=torch.long)
    scored = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, e in enumerate(batch):
        n = len(e.tokens) - 2
        f = e.features.float()
        features[row, :n], targets[row, :n] = f[:n], f[1:n + 1]
        next_tokens[row, :n] = e.tokens[1:n + 1]
        attention[row, :n] = 1
        scored[row, max(e.start - 2, 0) if answers_only else 0:n] = True
    return features, next_tokens, targets, attention, scored


def batch_loss(head: EagleHead, batch: Sequence[FeatureExample], scale: float, noise: float = 0.0,
               regression_weight: float = 1.0) -> tuple[torch.Tensor, int, int]:
    """(loss, argmax matches, scored rows): cross-entropy against the target's distribution over
    the sub-vocabulary at the next position (its head on the true feature), plus smooth-L1 on the
    predicted feature."""
    features, next_tokens, targets, attention, scored = (t.to(head.device) for t in _padded(batch))
    if noise > 0:
        features = features + (torch.rand_like(features) - 0.5) * (2 * noise * scale)
    with torch.autocast(head.device.type, dtype=torch.bfloat16):
        predicted = head(features, next_tokens, attention_mask=attention)
    predicted, targets = predicted.float()[scored], targets[scored]  # [n, hidden]
    log_q = torch.log_softmax(head.logits(predicted), dim=-1)  # [n, m]
    with torch.no_grad():
        p = torch.softmax(head.logits(targets), dim=-1)  # [n, m]
    loss = -(p * log_q).sum(-1).mean()
    loss = loss + regression_weight * nn.functional.smooth_l1_loss(predicted / scale, targets / scale)
    matches = int((log_q.argmax(-1) == p.argmax(-1)).sum())
    return loss, matches, int(scored.sum())


def token_batches(examples: Sequence[FeatureExample], batch_tokens: int, rng: random.Random) -> list[list[FeatureExample]]:
    """Length-sorted batches of at most ``batch_tokens`` padded positions, in a shuffled order."""
    batches, current = [], []
    for e in sorted(examples, key=lambda e: len(e.tokens)):
        if current and (len(current) + 1) * len(e.tokens) > batch_tokens:
            batches.append(current)
            current = []
        current.append(e)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def train_head(head: EagleHead, train: Sequence[FeatureExample], recipe: EagleRecipe, *,
               on_step: Callable[[int, int, float, float], None] | None = None) -> None:
    """AdamW with warm-up and cosine decay over ``recipe.epochs`` passes."""
    if not train:
        raise ValueError("no training sequences: the teacher shards are missing or empty")
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    scale = feature_std(train)
    params = [p for p in head.parameters() if p.requires_grad]
    train_epochs(head, params, lambda: token_batches(train, recipe.batch_tokens, rng),
                 lambda batch: batch_loss(head, batch, scale, recipe.feature_noise, recipe.regression_weight),
                 epochs=recipe.epochs, learning_rate=recipe.learning_rate, on_step=on_step)


@torch.inference_mode()
def agreement(head: EagleHead, examples: Sequence[FeatureExample], batch_tokens: int = 3000) -> float:
    """How often the head's first draft (from true features) is the target's argmax over the
    sub-vocabulary, on answer positions."""
    scale = feature_std(examples)
    matched = total = 0
    for batch in token_batches(examples, batch_tokens, random.Random(0)):
        _, m, n = batch_loss(head, batch, scale)
        matched, total = matched + m, total + n
    return matched / max(total, 1)
