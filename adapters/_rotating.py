"""RotatingKVCache / BatchRotatingKVCache <-> RotatingKV.

The unpadded form (`left_padding is None`) is mlx-lm's RotatingKVCache; the batched form
carries `left_padding` and per-row `offsets` and maps `offset`, `index`, `rotated` to
BatchRotatingKVCache's `_offset`, `_idx`, `rotated`. O(1) both ways: arrays are `fresh`.

Batched states go to the model with one mask of mlx-lm 0.32's BatchRotatingKVCache corrected
(`fixed_make_mask`); everything else is mlx-lm's.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from kvstate import RotatingKV, StateError

from ._convert import fresh, register_from, to_cache


def fixed_make_mask(
    self: BatchRotatingKVCache, N: int, window_size: int | None = None, return_array: bool = False
) -> Any:
    """BatchRotatingKVCache.make_mask, right for a multi-token forward on a wrapped ring.

    mlx-lm 0.32 sizes that mask's window trim from the ring's write index `_idx`, but
    `_update_concat` first unrolls a rotated ring (`_idx` becomes its length) and then trims
    one entry more, lowering `left_padding` by one. Rows that still have padding in the window
    then lose their oldest valid entry from the mask, and a verify forward on them gives
    wrong logits (tests/test_rotating.py checks the bug is still there upstream).
    """
    make_mask = type(self).make_mask  # mlx-lm's, or mlx-vlm's copy of it
    if N > 1 and self.rotated and self.keys is not None:
        idx = self._idx
        self._idx = self.keys.shape[2]  # what _update_concat will see after unrolling
        try:
            return make_mask(self, N, window_size=window_size, return_array=return_array)
        finally:
            self._idx = idx
    return make_mask(self, N, window_size=window_size, return_array=return_array)


@register_from(RotatingKVCache)
def _(cache: RotatingKVCache, appended: int = 0) -> RotatingKV:
    return RotatingKV(
        fresh(cache.keys),
        fresh(cache.values),
        max_size=cache.max_size,
        keep=cache.keep,
        offset=cache.offset,
        index=cache._idx,
        appended=appended,
    )


@register_from(BatchRotatingKVCache)
def _(cache: BatchRotatingKVCache, appended: int = 0) -> RotatingKV:
    lengths = getattr(cache, "_lengths", None)  # from_state() skips __init__, which sets it
    if lengths is not None:
        # `_lengths` only lives between prepare() and finalize() of a right-padded prompt.
        raise StateError(
            "converting a cache: this BatchRotatingKVCache is between prepare() and finalize() "
            f"(_lengths = {lengths.tolist()}); call cache.finalize() after the padded "
            "prompt forward, then convert"
        )
    return RotatingKV(
        fresh(cache.keys),
        fresh(cache.values),
        fresh(cache.left_padding),
        fresh(cache.offset),
        max_size=cache.max_size,
        offset=cache._offset,
        index=cache._idx,
        rotated=cache.rotated,
        appended=appended,
    )


@to_cache.register
def _(state: RotatingKV) -> RotatingKVCache | BatchRotatingKVCache:
    if state.left_padding is None:
        cache = RotatingKVCache(state.max_size, keep=state.keep)
        cache.keys, cache.values = fresh(state.keys), fresh(state.values)
        cache.offset, cache._idx = state.offset, state.index
        return cache
    if state.keep != 0:
        raise StateError(
            f"to_mlx_lm: a batched RotatingKV with keep={state.keep} has no mlx-lm cache: "
            "BatchRotatingKVCache has no keep prefix; batch windows made with keep=0"
        )
    if state.offsets is None:
        raise StateError(
            "to_mlx_lm: a batched RotatingKV (left_padding set) needs per-row `offsets`; "
            "build batched states with kvstate.merge or kvstate.adapters.from_mlx_lm"
        )
    batch = BatchRotatingKVCache.__new__(BatchRotatingKVCache)
    batch.keys, batch.values = fresh(state.keys), fresh(state.values)
    batch.left_padding, batch.offset = fresh(state.left_padding), fresh(state.offsets)
    batch.max_size = state.max_size
    batch._offset, batch._idx, batch.rotated = state.offset, state.index, state.rotated
    batch._lengths = None
    # An instance attribute, not a subclass: mlx-lm's save_prompt_cache records the class name.
    batch.make_mask = MethodType(fixed_make_mask, batch)  # type: ignore[method-assign]
    return batch
