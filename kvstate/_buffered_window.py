"""BufferedWindowKV: mlx-vlm's BufferedRotatingKVCache (keep=0), a linear sliding window
with rollback slack (the DFlash drafters of qwen3 and muse_glimmer build it).

Positions [start_position, offset) sit at buffer indices [0, offset - start_position). An
update appends in place; only when the buffer would pass `max_size + max(buffer_size,
incoming)` entries does it first compact, dropping the positions before `offset_before -
max_size + 1`, which no query from `offset_before` on can see. So trimming the end is an
exact rollback of any forward: the rejected tokens' queries never needed what was dropped,
and what the kept ones need is still held (mlx-vlm's `trim` does the same). Like
mlx-vlm's class it is unpadded: one length for all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._shared import array_kv_config, shared_appended
from ._tree import State, replace
from ._unpadded_kv import (
    held,
    no_batch_axis,
    register_unpadded_kv,
    require_one_span,
    window_span_problems,
)
from ._validation import kv_pair_problems, typed_statics
from .kinds import (
    Capabilities,
    config_of,
    extract_row,
    merge_states,
    problems,
    state_class,
    static_field,
)


@state_class(Capabilities(trimmable=True, ragged_commit=False, batchable=False))
class BufferedWindowKV(State):
    """mlx-vlm's BufferedRotatingKVCache with keep=0 (see the module docstring).

    keys (B, H, capacity, Dk), values (B, H, capacity, Dv): positions [start_position,
    offset) at indices [0, offset - start_position); `step`: the allocation granularity.
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    max_size: int = static_field(default=1)
    buffer_size: int = static_field(default=64)
    step: int = static_field(default=256)
    offset: int = static_field(default=0)
    start_position: int = static_field(default=0)
    appended: int = static_field(default=0)


@problems.register
def _(state: BufferedWindowKV, values: bool) -> list[str]:
    found = typed_statics(
        state, max_size=1, buffer_size=0, step=1, offset=0, start_position=0, appended=0
    )
    found += kv_pair_problems(state.keys, state.values)
    if found:
        return found
    found += window_span_problems(state)
    return found


@config_of.register
def _(state: BufferedWindowKV) -> dict[str, Any]:
    return array_kv_config(
        "BufferedWindowKV",
        state.keys,
        state.values,
        max_size=state.max_size,
        buffer_size=state.buffer_size,
        step=state.step,
    )


register_unpadded_kv(BufferedWindowKV)  # batch size, take_rows, commit by trimming


@merge_states.register
def _(first: BufferedWindowKV, rest: Sequence[BufferedWindowKV]) -> BufferedWindowKV:
    states = [first, *rest]
    require_one_span(
        states,
        "mlx-vlm's BufferedRotatingKVCache has no left padding (one offset and one mask for "
        "all rows), so every row must be at the same position",
    )
    empty = [s for s in states if s.keys is None]
    if empty:
        raise no_batch_axis(empty[0], "merge")
    n = held(first)
    keys = mx.concatenate([s.keys[..., :n, :] for s in states if s.keys is not None])
    values = mx.concatenate([s.values[..., :n, :] for s in states if s.values is not None])
    return replace(first, keys=keys, values=values, appended=shared_appended(states))


@extract_row.register
def _(state: BufferedWindowKV, row: int) -> BufferedWindowKV:
    if state.keys is None or state.values is None:
        return state
    n = held(state)
    return replace(
        state,
        keys=mx.contiguous(state.keys[row : row + 1, :, :n]),
        values=mx.contiguous(state.values[row : row + 1, :, :n]),
    )
