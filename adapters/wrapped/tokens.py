"""Token ids a wrapped model takes, checked: integer (B, K) ids of the state's batch, inside
the vocabulary.

Ids from lists or NumPy are checked on the host. Ids in an mx.array are not read back (that
would stall the device pipeline): `guarded` replaces an id outside the vocabulary by 0 and
keeps where it was, and `poisoned` gives NaN logits there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvstate import ModelState, ShapeError, StateError, TokenError, tree_flatten
from kvstate.kinds import batch_size_of

# The integer dtypes taken as token ids without conversion.
ID_DTYPES = frozenset({mx.int32, mx.int64, mx.uint32, mx.int16, mx.uint16, mx.int8, mx.uint8})


@mx.compile
def guarded(ids: mx.array, vocab: int) -> tuple[mx.array, mx.array]:
    """Ids outside 0..vocab-1 replaced by 0 (neither MLX's CPU nor its CUDA gather checks
    bounds), and where they were. Compiled (`vocab` a constant of it, one per model): one
    fused kernel instead of four ops on every step."""
    wide = ids.astype(mx.int64)  # an int8 / uint8 / int16 id cannot hold the vocab size
    bad = (wide < 0) | (wide >= vocab)
    return mx.where(bad, 0, ids), bad


@mx.compile
def nan_where(bad: mx.array, logits: mx.array) -> mx.array:
    """`logits` (B, K, V) with NaN at the positions `bad` (B, K) marks."""
    return mx.where(bad[..., None], mx.array(float("nan"), logits.dtype), logits)


def poisoned(logits: mx.array, bad: mx.array | None) -> mx.array:
    """`logits` with NaN where an id was outside the vocabulary (`bad`; None: none was)."""
    return logits if bad is None else nan_where(bad, logits)


def checked_ids(
    tokens: Any, state: ModelState, vocab: Callable[[], int]
) -> tuple[mx.array, mx.array | None]:
    """`tokens` as a checked (B, K) integer array, and for mx.array ids the mask of ids
    outside the vocabulary (None when the ids were checked on the host). `vocab()` gives the
    vocabulary size (asked only once the ids are otherwise fine)."""
    if not isinstance(tokens, mx.array):
        return host_ids(tokens, state, vocab), None
    ids = tokens
    if not mx.issubdtype(ids.dtype, mx.integer):
        raise TokenError(f"token ids must be integers; got dtype {ids.dtype}")
    if ids.ndim == 1:
        ids = ids[None]
    check_shape(ids.shape)
    check_batch(ids.shape[0], state)
    return guarded(ids, vocab())


def host_ids(tokens: Any, state: ModelState, vocab: Callable[[], int]) -> mx.array:
    """Ids from lists or NumPy (a verify's drafts), checked on the host: one int32 array
    made once they passed (no cast in the graph)."""
    host = _as_numpy(tokens)
    if host.dtype.kind not in "iu":
        raise TokenError(f"token ids must be integers; got dtype {host.dtype}")
    if host.ndim == 1:
        host = host[None]
    check_shape(host.shape)
    check_batch(host.shape[0], state)
    size = vocab()
    flat = host.ravel().tolist()  # Python ints: faster to compare than NumPy's
    if min(flat) < 0 or max(flat) >= size:
        outside = sorted({i for i in flat if not 0 <= i < size})
        raise TokenError(f"token ids {outside[:8]} are outside the vocabulary (0..{size - 1})")
    return mx.array(host, mx.int32)


def _as_numpy(tokens: Any) -> np.ndarray:
    try:
        host = np.asarray(tokens)
    except ValueError:  # ragged nested lists
        raise TokenError(
            "tokens must be a rectangular (batch, K) array of ids; rows of different lengths "
            "need right padding and lengths= (see WrappedModel.__call__)"
        ) from None
    if host.dtype == object:
        raise TokenError(f"token ids must be integers; got {tokens!r:.80}")
    return host


def check_shape(shape: tuple[int, ...]) -> None:
    """Refuse a shape that is not a non-empty (batch, K)."""
    if len(shape) != 2 or shape[0] == 0 or shape[1] == 0:
        raise TokenError(
            f"tokens must be a non-empty (batch, K) array of ids; got shape {tuple(shape)}"
        )


def check_batch(rows: int, state: ModelState) -> None:
    """Refuse `rows` rows of tokens for a state of another batch (a state holding no arrays
    yet takes its batch from the first forward)."""
    batch = batch_size_of(state.layers[0]) if state.layers else 1
    if rows == batch:
        return
    if batch == 1 and not any(_holds_arrays(layer) for layer in state.layers):
        return
    raise TokenError(
        f"tokens have {rows} rows but the state has {batch}; give one row of tokens per row "
        "of the state (tile / row_select / merge the state to change its rows)"
    )


def _holds_arrays(layer: Any) -> bool:
    return bool(tree_flatten(layer)[0])


def check_lengths(lengths: Sequence[int], shape: tuple[int, ...], capture: bool) -> None:
    """Refuse `lengths` (each row's real length in a right-padded prompt batch of `shape`)
    that are not one int in 1..K per row, or that come with capture=True."""
    batch, width = shape
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise ShapeError(
            f"lengths must be a list with one int in 1..{width} (the padded width) per row of "
            f"the {batch}-row batch; got {lengths!r:.60}"
            + (f": pass [{lengths}]" if isinstance(lengths, int) and batch == 1 else "")
        )
    if capture:
        raise StateError(
            "capture=True with lengths=: a right-padded prompt batch is not a verify forward; "
            "prefill with lengths= first, then verify with capture=True"
        )
    bad = [n for n in lengths if not isinstance(n, int) or not 1 <= n <= width]
    if len(lengths) != batch or bad:
        raise ShapeError(
            f"lengths must give one int in 1..{width} (the padded width) per row of the "
            f"{batch}-row batch; got {list(lengths)}"
        )
