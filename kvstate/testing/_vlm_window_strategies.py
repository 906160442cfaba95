"""Hypothesis strategies of `BufferedWindowKV` and `StaticPrefixKV` (mlx-vlm's
BufferedRotatingKVCache and StaticPrefixKVCache)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from hypothesis import strategies as st

from .._buffered_window import BufferedWindowKV
from .._static_prefix import StaticPrefixKV
from .._tree import replace
from .._unpadded_kv import held
from ._strategies import _SEEDS, Knob, _knob, _kv_noise, _kv_shape, strategy_for


def buffered_update(state: BufferedWindowKV, keys: mx.array, values: mx.array) -> BufferedWindowKV:
    """mlx-vlm's BufferedRotatingKVCache.update_and_fetch (keep=0) on a state, as pure ops:
    compact only past `max_size + max(buffer_size, incoming)` entries, dropping positions
    before `offset - max_size + 1`, then append. keys (B, H, K, Dk). (The capacity is just
    what is held; tests/test_vlm_windows.py checks this against mlx-vlm's own update.)"""
    incoming, n = int(keys.shape[2]), held(state)
    start = state.start_position
    drop = 0
    if n + incoming > state.max_size + max(state.buffer_size, incoming):
        target_start = max(0, state.offset - state.max_size + 1)
        drop = min(max(0, target_start - start), n)
    if state.keys is not None and state.values is not None and n - drop > 0:
        keys = mx.concatenate([state.keys[..., drop:n, :], keys], axis=2)
        values = mx.concatenate([state.values[..., drop:n, :], values], axis=2)
    return replace(
        state,
        keys=keys,
        values=values,
        offset=state.offset + incoming,
        start_position=start + drop,
        appended=incoming,
    )


@strategy_for(BufferedWindowKV)
@st.composite
def buffered_window_kv_states(
    draw: Any,
    *,
    batch: Knob = None,
    heads: Knob = None,
    k_dim: Knob = None,
    v_dim: Knob = None,
    dtype: Knob = None,
    max_size: Knob = None,
    buffer_size: Knob = None,
    appended: Knob = None,
) -> BufferedWindowKV:
    """A `BufferedWindowKV` after 0..4 earlier forwards of 1..4 tokens and a last one of
    `appended` (0..3) tokens, each through mlx-vlm's update rule (`buffered_update`); spare
    capacity past the held entries holds garbage.

    Draws: batch in 1..3, heads in 1..2, head dims in {2, 4}, dtype in `DTYPES`, max_size in
    2..6, buffer_size in 0..3. keys (B, H, capacity, Dk). With no forward at all: empty.
    """
    batch, heads, k_dim, v_dim, dtype = _kv_shape(draw, batch, heads, k_dim, v_dim, dtype, (2, 4))
    max_size = _knob(draw, max_size, st.integers(2, 6))
    buffer_size = _knob(draw, buffer_size, st.integers(0, 3))
    appended = _knob(draw, appended, st.integers(0, 3))
    sizes = draw(st.lists(st.integers(1, 4), max_size=4))
    if batch > 1 and not sizes and not appended:
        sizes = [1]  # an empty state has no batch axis
    seed = draw(_SEEDS)
    state = BufferedWindowKV(max_size=max_size, buffer_size=buffer_size, step=4)
    for i, n in enumerate([*sizes, appended] if appended else sizes):
        state = buffered_update(
            state, *_kv_noise(seed + 2 * i, (batch, heads, n), k_dim, v_dim, dtype)
        )
    if not appended:
        state = replace(state, appended=0)
    spare = draw(st.integers(0, 2))
    if spare and state.keys is not None and state.values is not None:
        k, v = _kv_noise(seed + 90, (batch, heads, spare), k_dim, v_dim, dtype)
        state = replace(
            state,
            keys=mx.concatenate([state.keys, k], 2),
            values=mx.concatenate([state.values, v], 2),
        )
    return state


@strategy_for(StaticPrefixKV)
@st.composite
def static_prefix_kv_states(
    draw: Any,
    *,
    batch: Knob = None,
    heads: Knob = None,
    k_dim: Knob = None,
    v_dim: Knob = None,
    dtype: Knob = None,
    read_only: Knob = None,
    appended: Knob = None,
) -> StaticPrefixKV:
    """A `StaticPrefixKV`: an allocation of 1..8 positions (garbage past `offset`), offset in
    0..capacity, `appended` in 0..3 (offset at least that), `read_only` drawn when nothing is appended (a
    read-only prefix stores nothing). Empty (keys None) only at batch 1 with offset 0.

    Draws: batch in 1..3, heads in 1..2, head dims in {2, 4}, dtype in `DTYPES`; step in
    {2, 4, 256}. keys (B, H, capacity, Dk).
    """
    batch, heads, k_dim, v_dim, dtype = _kv_shape(draw, batch, heads, k_dim, v_dim, dtype, (2, 4))
    appended = _knob(draw, appended, st.integers(0, 3))
    read_only = False if appended else _knob(draw, read_only, st.booleans())
    step = draw(st.sampled_from([2, 4, 256]))
    capacity = draw(st.integers(max(1, appended), 8))
    offset = draw(st.integers(appended, capacity))
    if batch == 1 and offset == 0 and draw(st.booleans()):
        return StaticPrefixKV(max_size=capacity, step=step, read_only=read_only)
    return StaticPrefixKV(
        *_kv_noise(draw(_SEEDS), (batch, heads, capacity), k_dim, v_dim, dtype),
        max_size=capacity,
        step=step,
        offset=offset,
        read_only=read_only,
        appended=appended,
    )
