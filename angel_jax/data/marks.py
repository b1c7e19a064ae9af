"""Token ids with two marks carried in-band, in the int32 token arrays every engine already passes on.

A batch is int32 [B, T+1]: a row's inputs are row[:-1], its targets row[1:]. Instruction data (`data.format:
instruction`, angel_jax/data/instructions.py) marks two things of a token without a second array:

    not scored   the token is no target of the loss (a prompt's token, padding): stored as its bitwise complement,
                 ~v, which is negative; `t < 0` tells it and `t ^ (t >> 31)` undoes it
    doc start    the token begins a document packed into the row (bit 30, DOC_START): attention and positions
                 restart there (models/documents.py)

Text data carries neither: its ids are themselves (non-negative, below 2**30), and every function here is the
identity on them. Why in-band: one int32 array goes from the data pipeline through every engine (in-memory,
sharded, paged; split into micro-batches and over ranks) to the embedding and the loss; a mask or segment ids
beside it would be new plumbing through each of them and through the data iterator's checkpointed state.

The functions take numpy and jax arrays alike (operators only). Ids must stay below DOC_START: 2**30 ids, far
past any vocabulary.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DOC_START = 1 << 30
"""The bit of a token that begins a document packed into its row."""
MAX_ID = DOC_START - 1
"""The largest id a marked token can carry (and the mask of an id's bits)."""

Array = Any  # a numpy or jax integer array


def _unflipped(t: Array) -> Array:
    # t >> 31 is -1 for a negative int32 and 0 otherwise: XOR with it undoes the complement of an unscored token.
    return t ^ (t >> 31)


def token_ids(t: Array) -> Array:
    """The ids of marked tokens (the identity on plain ids)."""
    return _unflipped(t) & MAX_ID


def scored(t: Array) -> Array:
    """Whether each token, as a target, counts in the loss."""
    return t >= 0


def doc_starts(t: Array) -> Array:
    """Whether each token begins a document packed into its row."""
    return (_unflipped(t) & DOC_START) != 0


def mark(ids: np.ndarray, scored: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """int32 tokens carrying `ids` (each below DOC_START) with their marks: `scored` (as targets), `starts` (of a
    document)."""
    ids = np.asarray(ids, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_ID):
        raise ValueError(f"token ids must be in [0, {MAX_ID}] to carry marks, got [{ids.min()}, {ids.max()}]")
    v = (ids | np.where(starts, DOC_START, 0)).astype(np.int32)
    return np.where(scored, v, ~v).astype(np.int32)
