"""What the quantized KV kinds (QuantizedKV, TurboQuantKV) share: every array holds
positions on axis 2, rows are left-padded, row b's tokens are [left_padding[b], length), and
the layer stands in for the DenseKV a model's cache factory makes. A kind describes how to
list and rebuild its arrays (`Layout`); batch size, fit, filter, merge and extract are then
written once, here. A kind may also keep tails: arrays holding only its latest positions
(the last W of [0, length), right-aligned; QuantizedKV's exact tail), which move with the
rows (merge right-aligns them too) and which the kind's `rebuild` cuts to what it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx

from ._dense import padding_or_zeros, used
from ._shared import kv_config, shared_appended
from ._tree import host_ints, replace
from .kinds import (
    batch_size_of,
    config_of,
    extract_row,
    filter_rows,
    fit_config_of,
    merge_states,
    take_rows,
)


def _no_tails(state: Any) -> list[mx.array]:
    return []


class Layout(NamedTuple):
    arrays: Callable[[Any], list[mx.array]]  # a filled state's arrays, in a fixed order
    empty: Callable[[Any], bool]  # no arrays yet (before the first forward)
    # rebuild(state, arrays + tails, **changes): the same kind
    rebuild: Callable[..., Any]
    tails: Callable[[Any], list[mx.array]] = _no_tails  # arrays of the latest positions


def register(cls: type, layout: Layout) -> None:
    """Register batch size, fit, filter, merge and extract for the kind `cls`, laid out as
    `layout` says."""
    batch_size_of.register(cls, lambda s: _batch_size(layout, s))
    fit_config_of.register(cls, _fits_as_dense)
    filter_rows.register(cls, lambda s, rows: drop_shared_padding(layout, take_rows(s, rows)))
    merge_states.register(cls, lambda first, rest: merge_padded(layout, [first, *rest]))
    extract_row.register(cls, lambda s, row: extract_padded(layout, s, row))


def _batch_size(layout: Layout, state: Any) -> int:
    if state.left_padding is not None:
        return int(state.left_padding.shape[0])
    return 1 if layout.empty(state) else int(layout.arrays(state)[0].shape[0])


def _fits_as_dense(state: Any) -> dict[str, Any]:
    # A quantized layer stands in for the dense one a model's cache factory makes.
    dense = config_of(state)
    return kv_config("DenseKV", None, dense["kv_heads"], dense["key_dim"], dense["value_dim"])


def drop_shared_padding(layout: Layout, kept: Any) -> Any:
    """`kept` (rows already taken) without the left padding all its rows share."""
    if kept.left_padding is None or layout.empty(kept):
        return kept
    shared = min(host_ints(kept.left_padding))
    if shared <= 0:
        return kept
    held = kept.length - shared
    return layout.rebuild(
        kept,
        [a[..., shared:, :] for a in layout.arrays(kept)] + layout.tails(kept),
        left_padding=kept.left_padding - shared,
        length=held,
        appended=kept.appended if kept.appended <= held else 0,
    )


def merge_padded(layout: Layout, states: Sequence[Any]) -> Any:
    """The rows of `states` (one configuration, checked by the caller), each state's used
    positions right-aligned in new buffers, shorter ones left-padded."""
    length = max(s.length for s in states)
    batches = [batch_size_of(s) for s in states]
    left_padding = mx.concatenate(
        [
            padding_or_zeros(s.left_padding, b) + (length - s.length)
            for s, b in zip(states, batches, strict=True)
        ]
    )
    appended = shared_appended(states)
    filled = [s for s in states if not layout.empty(s)]
    if not filled:
        return replace(states[0], left_padding=left_padding, length=0, appended=appended)
    like = layout.arrays(filled[0])

    def aligned(i: int) -> mx.array:
        model = like[i]
        out = mx.zeros((sum(batches), model.shape[1], length, model.shape[3]), model.dtype)
        row = 0
        for s, b in zip(states, batches, strict=True):
            if not layout.empty(s):
                out[row : row + b, :, length - s.length :, :] = used(layout.arrays(s)[i], s.length)
            row += b
        return out

    def aligned_tail(i: int) -> mx.array:
        tails = [layout.tails(s)[i] if not layout.empty(s) else None for s in states]
        model = next(t for t in tails if t is not None)
        width = max(int(t.shape[2]) for t in tails if t is not None)
        out = mx.zeros((sum(batches), model.shape[1], width, model.shape[3]), model.dtype)
        row = 0
        for t, b in zip(tails, batches, strict=True):
            if t is not None:  # zeros before a narrower tail: padding, or past exact_latest
                out[row : row + b, :, width - int(t.shape[2]) :, :] = t
            row += b
        return out

    return layout.rebuild(
        filled[0],
        [aligned(i) for i in range(len(like))]
        + [aligned_tail(i) for i in range(len(layout.tails(filled[0])))],
        left_padding=left_padding,
        length=length,
        appended=appended,
    )


def extract_padded(layout: Layout, state: Any, row: int) -> Any:
    """Row `row` alone, unpadded, in buffers of its own."""
    if layout.empty(state):
        return replace(state, left_padding=None, length=0, appended=0)
    start = host_ints(state.left_padding)[row] if state.left_padding is not None else 0
    held = state.length - start
    return layout.rebuild(
        state,
        [mx.contiguous(a[row : row + 1, :, start : state.length]) for a in layout.arrays(state)]
        + [mx.contiguous(t[row : row + 1]) for t in layout.tails(state)],
        left_padding=None,
        length=held,
        appended=state.appended if state.appended <= held else 0,
    )
