"""Quantized KV caches while generating, as mlx-lm's `generate_step(kv_bits=...)` has them:
once the target's state holds `quantized_kv_start` positions, its dense KV layers become
quantized ones (`kvstate.quantize`), checked after every forward (each prefill chunk, the
prompt's last position, every step or round), as mlx-lm's `maybe_quantize_kv_cache` is.

Sliding windows are quantized too (QuantizedRotatingKV: mlx-lm cannot quantize a window and
refuses a model that has one), so kv_bits covers every KV layer of a Gemma-style model;
recurrent layers stay as they are. The drafter's own model, if any, is not quantized.
"""

from __future__ import annotations

from typing import Any

from .. import DenseKV, RotatingKV, quantize
from ..kinds import Composite, with_parts

QUANTIZED_KV_START = 5000  # mlx-lm's generate_step default (`quantized_kv_start`)


class KVQuantization:
    """`after(state)`: `state` with its DenseKV and RotatingKV layers quantized to `bits` /
    `group_size` once its longest row holds `start` positions (the first DenseKV layer's
    `length`, or in a model of windows only the first window's `offset`: host ints, no
    sync); the same state before, and once nothing of those kinds is left (the kinds of a
    generation's state change only here: `filter` and the commits keep them)."""

    def __init__(self, bits: int, group_size: int, start: int) -> None:
        self.bits, self.group_size, self.start = bits, group_size, start
        self.done = False  # no DenseKV layer left: nothing more to look at

    def after(self, state: Any) -> Any:
        """The check after a forward of the generation's batch."""
        if self.done:
            return state
        held = positions_held(state)
        if held is None:
            self.done = True
            return state
        if held < self.start:
            return state
        self.done = True
        return self.everywhere(state)

    def check(self, state: Any) -> Any:
        """The same check, for one of several rows prefilled apart (no flag kept)."""
        held = positions_held(state)
        return state if held is None or held < self.start else self.everywhere(state)

    def everywhere(self, state: Any) -> Any:
        """`state` with its DenseKV and RotatingKV layers quantized, whatever its length."""
        return quantized_layers(state, self.bits, self.group_size)


def positions_held(state: Any) -> int | None:
    """The first DenseKV part's `length` (depth first), else the first RotatingKV part's
    `offset`; None when `state` has neither (nothing left to quantize)."""
    dense = first_of(state, DenseKV)
    if dense is not None:
        return int(dense.length)
    window = first_of(state, RotatingKV)
    return None if window is None else int(window.offset)


def first_of(state: Any, kind: type) -> Any:
    """The first part of `state` of `kind` (depth first), or None."""
    if isinstance(state, kind):
        return state
    if isinstance(state, Composite):
        for part in state.parts:
            found = first_of(part, kind)
            if found is not None:
                return found
    return None


def quantized_layers(state: Any, bits: int, group_size: int) -> Any:
    """`state` with every DenseKV and RotatingKV part quantized (`kvstate.quantize`), every
    other part as it is."""
    if isinstance(state, (DenseKV, RotatingKV)):
        return quantize(state, bits, group_size)
    if isinstance(state, Composite):
        return with_parts(state, tuple(quantized_layers(p, bits, group_size) for p in state.parts))
    return state
