"""Quantized KV caches while generating, as mlx-lm's `generate_step(kv_bits=...)` has them:
once the target's state holds `quantized_kv_start` positions, its dense KV layers become
quantized ones (`kvstate.quantize`), checked after every forward (each prefill chunk, the
prompt's last position, every step or round), as mlx-lm's `maybe_quantize_kv_cache` is.

Sliding windows and recurrent layers stay as they are (mlx-lm cannot quantize a window and
refuses a model that has one; here the model's dense layers are quantized and its windows
kept). The drafter's own model, if any, is not quantized.
"""

from __future__ import annotations

from typing import Any

from .. import DenseKV, quantize
from ..kinds import Composite, with_parts

QUANTIZED_KV_START = 5000  # mlx-lm's generate_step default (`quantized_kv_start`)


class KVQuantization:
    """`after(state)`: `state` with its DenseKV layers quantized to `bits` / `group_size`
    once its longest row holds `start` positions (the first DenseKV layer's `length`, a
    host int: no sync); the same state before, and once nothing dense is left (the kinds of
    a generation's state change only here: `filter` and the commits keep them)."""

    def __init__(self, bits: int, group_size: int, start: int) -> None:
        self.bits, self.group_size, self.start = bits, group_size, start
        self.done = False  # no DenseKV layer left: nothing more to look at

    def after(self, state: Any) -> Any:
        """The check after a forward of the generation's batch."""
        if self.done:
            return state
        dense = first_dense(state)
        if dense is None:
            self.done = True
            return state
        if dense.length < self.start:
            return state
        self.done = True
        return self.everywhere(state)

    def check(self, state: Any) -> Any:
        """The same check, for one of several rows prefilled apart (no flag kept)."""
        dense = first_dense(state)
        return state if dense is None or dense.length < self.start else self.everywhere(state)

    def everywhere(self, state: Any) -> Any:
        """`state` with its DenseKV layers quantized, whatever its length."""
        return quantized_layers(state, self.bits, self.group_size)


def first_dense(state: Any) -> DenseKV | None:
    """The first DenseKV part of `state` (depth first), or None."""
    if isinstance(state, DenseKV):
        return state
    if isinstance(state, Composite):
        for part in state.parts:
            found = first_dense(part)
            if found is not None:
                return found
    return None


def quantized_layers(state: Any, bits: int, group_size: int) -> Any:
    """`state` with every DenseKV part quantized (`kvstate.quantize`), every other part as
    it is (windows too, which `kvstate.quantize` of a whole state refuses)."""
    if isinstance(state, DenseKV):
        return quantize(state, bits, group_size)
    if isinstance(state, Composite):
        return with_parts(state, tuple(quantized_layers(p, bits, group_size) for p in state.parts))
    return state
