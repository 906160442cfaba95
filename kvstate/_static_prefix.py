"""StaticPrefixKV: mlx-vlm's StaticPrefixKVCache (llada2_moe, diffusion_gemma).

A fixed allocation of `max_size` positions (grown in `step`s past it) holding positions
[0, offset). Decoders read the whole allocation (`decoder_state`) with a mask that hides
what lies past `offset`, so the state keeps the allocation whole, stale entries included. A
`read_only` cache is a frozen prefix: a forward attends to it and its own tokens but stores
nothing, so its state appends nothing (`record_forward` keeps `appended=0`). Rolling back a
writable one trims `offset`, as mlx-vlm's `trim` does (the next update overwrites the
entries past it). Unpadded: one length for all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._errors import ConfigMismatchError, require
from ._shared import array_kv_config, shared_appended
from ._tree import State, replace
from ._unpadded_kv import no_batch_axis, register_unpadded_kv
from ._validation import kv_pair_problems, static_int, typed_statics
from .kinds import (
    Capabilities,
    config_of,
    extract_row,
    merge_states,
    problems,
    record_forward,
    state_class,
    static_field,
)


@state_class(Capabilities(trimmable=True, ragged_commit=False, batchable=False))
class StaticPrefixKV(State):
    """mlx-vlm's StaticPrefixKVCache (see the module docstring).

    keys (B, H, capacity, Dk), values (B, H, capacity, Dv): the whole allocation; positions
    [0, offset) are valid.
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    max_size: int = static_field(default=0)
    step: int = static_field(default=256)
    offset: int = static_field(default=0)
    read_only: bool = static_field(default=False)
    appended: int = static_field(default=0)


@problems.register
def _(state: StaticPrefixKV, values: bool) -> list[str]:
    found = typed_statics(state, max_size=0, step=1, offset=0, appended=0, bools=("read_only",))
    found += kv_pair_problems(state.keys, state.values)
    if found:
        return found
    capacity = 0 if state.keys is None else int(state.keys.shape[2])
    found += static_int("offset", state.offset, 0, capacity)
    found += static_int("appended", state.appended, 0, 0 if state.read_only else state.offset)
    return found


@config_of.register
def _(state: StaticPrefixKV) -> dict[str, Any]:
    return array_kv_config(
        "StaticPrefixKV", state.keys, state.values, step=state.step, read_only=state.read_only
    )


@record_forward.register
def _(state: StaticPrefixKV, before: StaticPrefixKV, n: int) -> StaticPrefixKV:
    appended = 0 if state.read_only else n  # a read-only prefix stores nothing
    return state if state.appended == appended else replace(state, appended=appended)


register_unpadded_kv(StaticPrefixKV)  # batch size, take_rows, commit by trimming


def _grown(a: mx.array, capacity: int) -> mx.array:
    if a.shape[2] == capacity:
        return a
    pad = mx.zeros((*a.shape[:2], capacity - a.shape[2], a.shape[3]), a.dtype)
    return mx.concatenate([a, pad], axis=2)


@merge_states.register
def _(first: StaticPrefixKV, rest: Sequence[StaticPrefixKV]) -> StaticPrefixKV:
    states = [first, *rest]
    offsets = [s.offset for s in states]
    require(
        len(set(offsets)) == 1,
        ConfigMismatchError,
        f"merge: StaticPrefixKV states with offsets {offsets} cannot be batched: mlx-vlm's "
        "StaticPrefixKVCache has no left padding (one offset for all rows), so every row "
        "must be at the same position",
    )
    empty = [s for s in states if s.keys is None]
    if empty:
        raise no_batch_axis(empty[0], "merge")
    # Rows keep their whole allocation (decoders read it); a smaller one is grown with zeros.
    capacity = max(int(s.keys.shape[2]) for s in states if s.keys is not None)
    keys = mx.concatenate([_grown(s.keys, capacity) for s in states if s.keys is not None])
    values = mx.concatenate([_grown(s.values, capacity) for s in states if s.values is not None])
    max_size = max(s.max_size for s in states)
    return replace(
        first, keys=keys, values=values, max_size=max_size, appended=shared_appended(states)
    )


@extract_row.register
def _(state: StaticPrefixKV, row: int) -> StaticPrefixKV:
    if state.keys is None or state.values is None:
        return state
    return replace(
        state,
        keys=mx.contiguous(state.keys[row : row + 1]),
        values=mx.contiguous(state.values[row : row + 1]),
    )
