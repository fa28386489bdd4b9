"""The demo draft: a 2-layer student distilled from the demo target, shipped as a few MB.

Only the trained layers, the final norm and the sub-vocabulary are committed
(``demo_draft/draft.safetensors``, with its recipe and measured provenance in ``draft.json``);
the embedding and tied head are the target's own. On first use the plain checkpoint is
assembled from the two and cached, keyed by the weights' hash, so it then loads with the normal
``from_pretrained`` like any other draft (and HF assisted generation can use it too).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from mirrorspec.config import InvalidRequest
from mirrorspec.models.demo_target import build_once, cache_root, ensure_demo_target, write_atomically

SHIPPED_WEIGHTS = Path(__file__).parent / "demo_draft" / "draft.safetensors"
VOCAB_TENSOR = "draft_vocab"  # the sub-vocabulary's ids, stored beside the trained weights
# what `save_pretrained` writes for the demo target's tokenizer (a fast one, and its chat template)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def weights_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_vocabulary(weights: Path = SHIPPED_WEIGHTS) -> torch.Tensor:
    """The draft's sub-vocabulary, read off the weights file alone: no checkpoint is assembled
    (which would load the target), so a head node can learn it cheaply."""
    from safetensors import safe_open

    _check_draft_weights(weights)
    with safe_open(str(weights), "pt") as f:
        return f.get_tensor(VOCAB_TENSOR).long()  # [m]


def ensure_demo_draft(weights: Path = SHIPPED_WEIGHTS) -> Path:
    """Path of the assembled draft checkpoint for ``weights``, assembling it the first time."""
    _check_draft_weights(weights)
    digest = weights_digest(weights)

    def assemble(tmp: Path) -> None:
        from mirrorspec.distill.student import assemble_draft
        from mirrorspec.models.loading import load_causal_lm

        target = load_causal_lm("demo-target", dtype="float32", device="cpu", tokenizer=False,
                                prepack=False)
        assemble_draft(target.model, weights, tmp)
        (tmp / "ASSEMBLED_OK").write_text(f"weights={weights}\nsha256={digest}\n")

    out = build_once(cache_root() / f"demo-draft-{digest[:12]}", "ASSEMBLED_OK", assemble,
                     "assembling the demo draft from the target and its shipped weights", field="draft")
    share_tokenizer(ensure_demo_target(), out)
    return out


def share_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """Copy the target's tokenizer files beside the draft, which shares its tokenizer, so the
    draft loads like any checkpoint (``load_causal_lm("demo-draft")`` with its tokenizer). Run on
    every use, since drafts assembled before this have none; each file lands whole (a concurrent
    reader never sees half of one)."""
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file() and not (draft_dir / name).is_file():
            write_atomically(draft_dir / name, lambda tmp, source=target_dir / name: shutil.copyfile(source, tmp))


def _check_draft_weights(weights: Path) -> None:
    from safetensors import SafetensorError, safe_open

    if not weights.is_file():
        raise InvalidRequest(f"demo draft weights {weights} are missing; run `mirrorspec demo --rebuild` "
                             "or pass another --draft", field="draft")
    try:
        with safe_open(str(weights), "pt") as f:
            names = set(f.keys())
    except (SafetensorError, OSError) as err:
        raise InvalidRequest(f"{weights} is not a readable safetensors file ({err})", field="draft") from None
    if VOCAB_TENSOR not in names:
        raise InvalidRequest(f"{weights} holds no {VOCAB_TENSOR!r} tensor, so it is not demo-draft weights (what "
                             "`mirrorspec demo --rebuild --out` writes); name a model directory instead",
                             field="draft")
