"""Compact tensor frames for the wire: msgpack maps of dtype, shape and raw little-endian bytes.

Protobuf carries the envelope; tensors travel as one ``bytes`` field each, so a sparse q row of 32
ids and probabilities costs ~256 bytes rather than a repeated-float field's per-element overhead.
Decoding validates everything a peer could get wrong, because a malformed q silently breaks
exactness: wrong shape, NaN, negative mass, rows not summing to 1, ids outside the vocabulary.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import torch

from mirrorspec.config import InvalidRequest
from mirrorspec.sampling import ProposalRows

_DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64}
Q_SUM_TOLERANCE = 1e-3
# float32 softmax rows sum to 1 within ~5e-6 (dense 49k rows, float64 sum): those are kept bit for
# bit, so served draws equal in-process ones; a row off by more is divided by its sum
Q_RENORMALISE_ABOVE = 1e-4


def encode_tensor(tensor: torch.Tensor) -> bytes:
    array = tensor.detach().cpu().contiguous().numpy()
    dtype = str(array.dtype)
    if dtype not in _DTYPES:
        raise TypeError(f"cannot frame dtype {dtype}; supported: {sorted(_DTYPES)}")
    return msgpack.packb({"dtype": dtype, "shape": list(array.shape), "data": array.astype(array.dtype.newbyteorder("<")).tobytes()})


def decode_tensor(frame: bytes, *, name: str = "tensor") -> torch.Tensor:
    return torch.from_numpy(decode_array(frame, name=name))


def decode_array(frame: bytes, *, name: str = "tensor") -> np.ndarray:
    """A frame as a native-order, writable numpy array: validation runs on it, and torch takes it without a copy."""
    try:
        header = msgpack.unpackb(frame)
        dtype, shape, data = header["dtype"], header["shape"], header["data"]
    except Exception as err:  # noqa: BLE001 - any garbage from the wire is the caller's error
        raise InvalidRequest(f"{name} is not a valid tensor frame ({err}); encode it with mirrorspec.codec",
                             field=name) from None
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise InvalidRequest(f"{name} has unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}", field=name)
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and isinstance(data, bytes)):
        raise InvalidRequest(f"{name} frame needs a shape of non-negative ints and its data as bytes, got shape "
                             f"{shape!r} and data of type {type(data).__name__}; encode it with mirrorspec.codec",
                             field=name)
    np_dtype = np.dtype(_DTYPES[dtype]).newbyteorder("<")
    count = math.prod(shape)  # Python ints: a huge shape cannot wrap around to match the bytes
    if count * np_dtype.itemsize != len(data):
        raise InvalidRequest(f"{name} frame says shape {shape} of {dtype} but carries {len(data)} bytes", field=name)
    return np.frombuffer(data, dtype=np_dtype).astype(_DTYPES[dtype]).reshape(shape)


def encode_proposal(rows: ProposalRows) -> tuple[bytes, bytes | None]:
    """(probs frame, ids frame or None for dense q)."""
    probs = encode_tensor(rows.probs.float())
    ids = encode_tensor(rows.ids.to(torch.int32)) if rows.ids is not None else None
    return probs, ids


def decode_proposal(probs_frame: bytes, ids_frame: bytes | None, *, num_tokens: int, vocab_size: int,
                    draft_tokens: list[int] | None = None, min_dense_width: int | None = None) -> ProposalRows:
    """A validated q: one row per draft token, a proper distribution in each row, containing the draft.
    Ids lie in the vocabulary; dense rows are as wide as the vocabulary, or from ``min_dense_width``
    (a draft's table, where it is narrower: one tokenizer padded to two sizes) up to it: a replica's
    own lookup may copy an id past its table into a window, and joined with the model's dense rows
    (``ProposalRows.stack``) the window is that much wider (review of stop 60). Ids past a row's
    width have no mass.

    The checks run in numpy: a q is a few rows, where each torch op's dispatch would cost more
    than its arithmetic, and this runs on every window's critical path, twice (front door, target)."""
    probs = decode_array(probs_frame, name="q.probs").astype(np.float32, copy=False)
    if probs.ndim != 2 or probs.shape[0] != num_tokens:
        raise InvalidRequest(f"q.probs must have shape [{num_tokens}, m] (one row per draft token), "
                             f"got {list(probs.shape)}", field="q")
    if not np.isfinite(probs).all():
        raise InvalidRequest("q.probs contains NaN or infinity", field="q")
    if (probs < 0).any():
        raise InvalidRequest("q.probs contains negative probabilities", field="q")
    sums = probs.sum(-1, dtype=np.float64)
    if (np.abs(sums - 1) > Q_SUM_TOLERANCE).any():
        raise InvalidRequest(f"each q row must sum to 1 (±{Q_SUM_TOLERANCE}); row sums are "
                             f"{[round(float(s), 6) for s in sums]}", field="q")
    # a drafter draws in proportion to its row (a race, or any sampler that normalises), so the
    # row over its sum is the q it drew from: as sent, the accept test u q < p was biased by the gap
    off = np.abs(sums - 1) > Q_RENORMALISE_ABOVE
    if off.any():
        probs = probs.copy()
        probs[off] = (probs[off] / sums[off, None]).astype(np.float32)
    ids = None
    if ids_frame:
        ids = decode_array(ids_frame, name="q.ids")
        if ids.dtype.kind != "i":  # a float id would be truncated to another token without a word
            raise InvalidRequest(f"q.ids must be int32 or int64, got {ids.dtype}", field="q")
        ids = ids.astype(np.int64, copy=False)
        if ids.shape != probs.shape:
            raise InvalidRequest(f"q.ids shape {list(ids.shape)} must equal q.probs shape {list(probs.shape)}",
                                 field="q")
        if ((ids < 0) | (ids >= vocab_size)).any():
            raise InvalidRequest(f"q.ids must lie in [0, {vocab_size})", field="q")
    elif num_tokens and not (min_dense_width or vocab_size) <= probs.shape[1] <= vocab_size:
        wanted = (f"{vocab_size} columns (the vocabulary)" if (min_dense_width or vocab_size) >= vocab_size else
                  f"{min_dense_width} (the draft table) to {vocab_size} (the vocabulary) columns")
        raise InvalidRequest(f"dense q.probs must have {wanted}, got {probs.shape[1]}", field="q")
    if draft_tokens:
        _check_drafts_have_mass(draft_tokens, probs, ids, vocab_size)
    return ProposalRows(probs=torch.from_numpy(probs), ids=None if ids is None else torch.from_numpy(ids))


def _check_drafts_have_mass(draft_tokens: list[int], probs: np.ndarray, ids: np.ndarray | None,
                            vocab_size: int) -> None:
    if not all(0 <= t < vocab_size for t in draft_tokens):
        raise InvalidRequest(f"draft token ids must lie in [0, {vocab_size})", field="draft_tokens")
    drafts = np.asarray(draft_tokens, dtype=np.int64)[:, None]  # [k, 1]
    # the mass q gives each draft, read off the sparse rows directly (no [k, vocab] array per window);
    # a draft past a narrower dense row has none
    if ids is not None:
        mass = (probs * (ids == drafts)).sum(-1)
    else:
        mass = np.where(drafts[:, 0] < probs.shape[1],
                        np.take_along_axis(probs, np.minimum(drafts, probs.shape[1] - 1), -1)[:, 0], 0.0)
    if (mass <= 0).any():
        raise InvalidRequest("a draft token has zero probability under its own q row; "
                             "q must be the distribution each draft was sampled from", field="q")
