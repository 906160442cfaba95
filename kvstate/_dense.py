"""DenseKV: KVCache, BatchKVCache, ConcatenateKVCache (and mlx-vlm's SimpleKVCache) as one
state kind."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx
import numpy as np

from ._one_sync import materialise, parts, shared
from ._shared import array_kv_config, path_entries, path_in_place, shared_appended
from ._tree import State, host_ints, replace, trusted
from ._validation import (
    ints_within,
    kv_pair_problems,
    rows_problems,
    static_int,
    typed_statics,
)
from .kinds import (
    Capabilities,
    batch_size_of,
    commit_rows,
    config_of,
    extract_row,
    filter_rows,
    gather_path,
    keep_path,
    merge_states,
    problems,
    state_class,
    static_field,
    take_rows,
)


@state_class(
    Capabilities(trimmable=True, ragged_commit=True, batchable=True, joinable_forwards=True)
)
class DenseKV(State):
    """Keys and values in a capacity buffer; positions [0, length) are in use.

    keys (B, H, capacity, Dk), values (B, H, capacity, Dv), left_padding (B,) int32 or None.
    With left padding, row b holds its tokens at [left_padding[b], length) and its next
    RoPE position is `length - left_padding[b]` (mlx-lm's BatchKVCache.offset).
    `appended`: tokens the last forward added (the last `appended` positions of every row).
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    left_padding: mx.array | None = None
    length: int = static_field(default=0)
    appended: int = static_field(default=0)
    concatenate: bool = static_field(default=False)  # unpadded form: ConcatenateKVCache
    # The same unpadded form, given back as mlx-vlm's SimpleKVCache (florence2 and
    # nemotron_parse call its update / fetch / cache_length, which ConcatenateKVCache lacks).
    simple: bool = static_field(default=False)

    @staticmethod
    def __kvstate_upgrade__(statics: dict[str, Any], children: dict[str, Any]) -> Any:
        """A file written before the `simple` flag: it held no SimpleKVCache form."""
        if set(statics) != {"length", "appended", "concatenate"}:
            return None
        return {**statics, "simple": False}, children


def used(a: mx.array, length: int) -> mx.array:
    """The first `length` positions (axis 2) of a capacity buffer."""
    return a if a.shape[2] == length else a[..., :length, :]


def padding_or_zeros(left_padding: mx.array | None, batch: int) -> mx.array:
    return left_padding if left_padding is not None else mx.zeros((batch,), mx.int32)


@problems.register
def _(state: DenseKV, values: bool) -> list[str]:
    found = typed_statics(state, length=0, appended=0, bools=("concatenate", "simple"))
    found += kv_pair_problems(state.keys, state.values)
    if found:
        return found
    keys = state.keys
    capacity = 0 if keys is None else int(keys.shape[2])
    batch = int(keys.shape[0]) if keys is not None else batch_size_of(state)
    found += rows_problems("left_padding", state.left_padding, batch, "keys")
    found += static_int("length", state.length, 0, capacity)
    found += static_int("appended", state.appended, 0, state.length)
    if state.concatenate and state.left_padding is not None:
        found.append("concatenate: the ConcatenateKVCache form has no left_padding")
    if state.simple is True and state.concatenate is not True:
        found.append("simple: the SimpleKVCache form is the concatenate form (concatenate=True)")
    if values and not found:
        # Before the first forward the padding only says how much of it will be padding.
        top = state.length if keys is not None else 2**31 - 1
        found += ints_within("left_padding", state.left_padding, 0, top)
    return found


@batch_size_of.register
def _(state: DenseKV) -> int:
    if state.left_padding is not None:
        return int(state.left_padding.shape[0])
    return int(state.keys.shape[0]) if state.keys is not None else 1


@config_of.register
def _(state: DenseKV) -> dict[str, Any]:
    return array_kv_config("DenseKV", state.keys, state.values)


@commit_rows.register
def _(state: DenseKV, counts: tuple[int, ...], checkpoints: Any) -> DenseKV:
    keys, values = state.keys, state.values
    if keys is None or len(set(counts)) == 1:
        length = state.length - state.appended + counts[0]
        if state.concatenate and keys is not None and values is not None:
            keys, values = used(keys, length), used(values, length)
        # The constructor, not `replace`: this runs for every layer of every verify.
        return trusted(DenseKV)(
            keys, values, state.left_padding, length, 0, state.concatenate, state.simple
        )
    return _commit_ragged(state, counts)


def _commit_ragged(state: DenseKV, counts: tuple[int, ...]) -> DenseKV:
    assert state.keys is not None and state.values is not None
    (keys, values), left_padding, length = commit_ragged(
        [state.keys, state.values], state.left_padding, state.length, state.appended, counts
    )
    if keys.dtype == mx.bool_:
        # A bool pair is a validity mask the model reads at padding positions too (glm5_next
        # masks keys with it): the padding the commit added must read False, as merge's does.
        valid = (mx.arange(keys.shape[2])[None, :] >= left_padding[:, None])[:, None, :, None]
        keys, values = keys & valid, values & valid
    return replace(
        state, keys=keys, values=values, left_padding=left_padding, length=length, appended=0
    )


def commit_ragged(
    buffers: list[mx.array],
    left_padding: mx.array | None,
    length: int,
    appended: int,
    counts: tuple[int, ...],
) -> tuple[list[mx.array], mx.array, int]:
    """Rows keep different counts of the last `appended` positions of (B, H, T, ...) buffers
    that share rows and positions (a DenseKV's keys and values, a QuantizedKV's triples).
    Rather than shifting every row's context right (O(context)), move each row's *oldest*
    `d` tokens into the `d`-token hole its rejected tokens left, and grow its left padding
    by `d`. Keys carry their RoPE already, so attention does not depend on where in the
    buffer a key sits: the cost is O(max rejected), not O(context). (Models whose masks
    depend on buffer positions, a KVCache under `window_size`, need uniform counts.)
    Returns (buffers, left padding, length).
    """
    moves = ragged_moves(left_padding, length, appended, counts)
    moving = [mx.take_along_axis(a, moves.source, axis=2) for a in buffers]
    # The small moved blocks are evaluated before the buffers are: while a gather of the
    # buffer is still pending, MLX cannot write into it in place (it would copy the whole
    # context). Inside a model's commit, all layers' blocks in one sync (`_one_sync`).
    materialise(moving)
    end = moves.length

    def fill(a: mx.array, block: mx.array) -> mx.array:
        out = a[...]  # a fresh object: the assignment must not reach the input state
        out[..., end - block.shape[2] : end, :] = block
        return out

    filled = [fill(a, block) for a, block in zip(buffers, moving, strict=True)]
    return filled, moves.left_padding, moves.length


class RaggedMoves(NamedTuple):
    """Where a ragged commit moves each row's tokens: `source` (B, 1, width, 1), the buffer
    position each of the `width` positions before the new `length` reads; the new
    `left_padding`."""

    source: mx.array
    left_padding: mx.array
    length: int


def ragged_moves(
    left_padding: mx.array | None, length: int, appended: int, counts: tuple[int, ...]
) -> RaggedMoves:
    """`commit_ragged`'s moves, computed on the host from the rows' left padding, once per
    model commit for all the layers that share it (every DenseKV layer of a batch does:
    ~10 small device ops a layer otherwise, each a kernel to encode on a GPU)."""
    pads = padding_values(left_padding, len(counts))
    return shared(("DenseKV moves", pads, length, appended, counts),
                  lambda: _moves(pads, length, appended, counts))  # fmt: skip


def _moves(
    pads: tuple[int, ...], length: int, appended: int, counts: tuple[int, ...]
) -> RaggedMoves:
    start = length - appended
    new_length = start + max(counts)
    holes = np.array([max(counts) - c for c in counts])  # d per row
    lp = np.array(pads)
    moved = np.minimum(holes, start + np.array(counts) - lp)  # a row may hold fewer tokens
    width = int(holes.max())
    j = np.arange(width)[None, :]
    skip = width - moved[:, None]  # positions left of `skip` copy onto themselves
    dest = new_length - width + j
    src = np.where(j >= skip, lp[:, None] + (j - skip), dest)
    index = mx.array(src.astype(np.int32))[:, None, :, None]
    return RaggedMoves(index, mx.array((lp + holes).astype(np.int32)), new_length)


def padding_values(left_padding: mx.array | None, batch: int) -> tuple[int, ...]:
    """The rows' left padding on the host. Inside a model's commit, the first call reads
    every DenseKV layer's padding in one read (one host sync, not one a layer)."""
    if left_padding is None:
        return (0,) * batch
    known: dict[int, tuple[mx.array, tuple[int, ...]]] = shared("DenseKV paddings", dict)
    if id(left_padding) not in known:
        others = (p.left_padding for p in parts() if isinstance(p, DenseKV))
        unread = {id(a): a for a in (left_padding, *others)
                  if a is not None and a.shape == left_padding.shape and id(a) not in known}  # fmt: skip
        values = cast(list[list[int]], mx.stack(list(unread.values())).tolist())
        for (i, a), row in zip(unread.items(), values, strict=True):
            known[i] = (a, tuple(row))  # the array kept: its id stays its own meanwhile
    return known[id(left_padding)][1]


def commit_ragged_in_order(
    buffers: list[mx.array],
    left_padding: mx.array | None,
    length: int,
    appended: int,
    counts: tuple[int, ...],
) -> tuple[list[mx.array], mx.array, int]:
    """`commit_ragged` that keeps every row's tokens in order: each row shifts right by the
    hole its rejected tokens left (O(context), one gather per buffer). The quantized kinds
    use it: `commit_ragged`'s reordering changes the order attention sums its terms in, and
    those float differences flip quantization levels of later tokens, so a ragged batch
    drifts from each row decoded alone (a K5/V3 Hadamard batch lost a near tie at token 43).
    Returns (buffers, left padding, length).
    """
    batch = len(counts)
    new_length = length - appended + max(counts)
    holes = mx.array([max(counts) - c for c in counts], mx.int32)
    capacity = int(buffers[0].shape[2])
    slot = mx.arange(capacity, dtype=mx.int32)[None, :]
    # Slots under a row's new padding read slot 0 (masked garbage); slots past the new
    # length keep what they hold.
    src = mx.where(slot < new_length, mx.maximum(slot - holes[:, None], 0), slot)
    index = src[:, None, :, None]
    shifted = [mx.take_along_axis(a, index, axis=2) for a in buffers]
    return shifted, padding_or_zeros(left_padding, batch) + holes, new_length


@take_rows.register
def _(state: DenseKV, rows: tuple[int, ...]) -> DenseKV:
    index = mx.array(rows, mx.int32)
    batch = batch_size_of(state)
    keys = state.keys[index] if state.keys is not None else None
    values = state.values[index] if state.values is not None else None
    if state.left_padding is not None:
        left_padding: mx.array | None = state.left_padding[index]
    elif keys is None and len(rows) != batch:
        left_padding = mx.zeros((len(rows),), mx.int32)  # an empty state has no other batch axis
    else:
        left_padding = None
    return replace(state, keys=keys, values=values, left_padding=left_padding)


@filter_rows.register
def _(state: DenseKV, rows: tuple[int, ...]) -> DenseKV:
    kept = take_rows(state, rows)
    if kept.left_padding is None:
        return kept
    shared = min(host_ints(kept.left_padding)) if kept.keys is not None else 0
    if shared <= 0:
        return kept
    assert kept.keys is not None and kept.values is not None
    return replace(
        kept,
        keys=kept.keys[..., shared:, :],
        values=kept.values[..., shared:, :],
        left_padding=kept.left_padding - shared,
        length=kept.length - shared,
        appended=_pending_within(kept.appended, kept.length - shared),
    )


@merge_states.register
def _(first: DenseKV, rest: Sequence[DenseKV]) -> DenseKV:
    states = [first, *rest]
    length = max(s.length for s in states)
    batches = [batch_size_of(s) for s in states]
    if all(s.left_padding is None for s in states):  # single sequences: padding known on host
        pads = [length - s.length for s, b in zip(states, batches, strict=True) for _ in range(b)]
        left_padding = mx.array(pads, mx.int32)
    else:
        left_padding = mx.concatenate(
            [
                padding_or_zeros(s.left_padding, b) + (length - s.length)
                for s, b in zip(states, batches, strict=True)
            ]
        )
    appended = shared_appended(states)
    filled = [s for s in states if s.keys is not None and s.values is not None]
    if not filled:
        return trusted(DenseKV)(left_padding=left_padding, appended=appended)

    def aligned(arrays: list[mx.array | None]) -> mx.array:
        # One new buffer, each state's used positions written right-aligned into its rows
        # (as mlx-lm's merge does): every byte is copied once.
        like = next(a for a in arrays if a is not None)
        out = mx.zeros((sum(batches), like.shape[1], length, like.shape[3]), like.dtype)
        row = 0
        for s, a, b in zip(states, arrays, batches, strict=True):
            if a is not None:
                out[row : row + b, :, length - s.length :, :] = used(a, s.length)
            row += b
        return out

    keys = aligned([s.keys for s in states])
    values = aligned([s.values for s in states])
    return trusted(DenseKV)(keys, values, left_padding, length=length, appended=appended)


def _pending_within(appended: int, held: int) -> int:
    """The pending forward of rows that now hold `held` positions: it stays if they hold all
    it appended. Otherwise it was a right-padded prompt (some of its positions were padding,
    now dropped), of which only accepting everything was defined: it is settled."""
    return appended if appended <= held else 0


@extract_row.register
def _(state: DenseKV, row: int) -> DenseKV:
    if state.keys is None or state.values is None:
        return trusted(DenseKV)(concatenate=state.concatenate, simple=state.simple)
    start = host_ints(state.left_padding)[row] if state.left_padding is not None else 0
    keys = mx.contiguous(state.keys[row : row + 1, :, start : state.length])
    values = mx.contiguous(state.values[row : row + 1, :, start : state.length])
    length = state.length - start
    return trusted(DenseKV)(
        keys,
        values,
        length=length,
        appended=_pending_within(state.appended, length),
        concatenate=state.concatenate,
        simple=state.simple,
    )


@gather_path.register
def _(state: DenseKV, positions: tuple[int, ...]) -> tuple[mx.array, mx.array] | None:
    return path_entries(state.keys, state.values, state.length - state.appended, positions)


@keep_path.register
def _(state: DenseKV, positions: tuple[int, ...], checkpoints: Any, gathered: Any) -> DenseKV:
    moved = path_in_place(state.keys, state.values, state.length - state.appended, gathered)
    if moved is not None:
        state = replace(state, keys=moved[0], values=moved[1])
    return commit_rows(state, (len(positions),) * batch_size_of(state), None)
