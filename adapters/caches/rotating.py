"""RotatingKVCache / BatchRotatingKVCache <-> RotatingKV.

The unpadded form (`left_padding is None`) is the RotatingKVCache; the batched form carries
`left_padding` and per-row `offsets` and maps `offset`, `index`, `rotated` to
BatchRotatingKVCache's `_offset`, `_idx`, `rotated`. O(1) both ways: arrays are `fresh`.

Batched states go to the model with one mask of BatchRotatingKVCache corrected
(`compat.fixed_make_mask`); everything else is the library's.
"""

from __future__ import annotations

from types import MethodType, ModuleType
from typing import Any

from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from kvstate import NotSupportedError, RotatingKV, StateError
from kvstate.kinds import trusted

from .compat import fixed_make_mask, refuse_mid_prompt
from .registry import LM, fresh, names, register_from, to_cache


@register_from(RotatingKVCache)
def _(cache: RotatingKVCache, appended: int = 0) -> RotatingKV:
    return trusted(RotatingKV)(
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
        refuse_mid_prompt(cache, "_lengths", lengths.tolist())
    return trusted(RotatingKV)(
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
def _(state: RotatingKV, lib: ModuleType = LM) -> Any:
    if state.left_padding is None:
        cache = lib.RotatingKVCache(state.max_size, keep=state.keep)
        cache.keys, cache.values = fresh(state.keys), fresh(state.values)
        cache.offset, cache._idx = state.offset, state.index
        return cache
    said = names(lib)
    if state.keep != 0:
        raise NotSupportedError(
            f"{said.to}: a batched RotatingKV with keep={state.keep} has no {said.label} cache: "
            "BatchRotatingKVCache has no keep prefix; batch windows made with keep=0"
        )
    if state.offsets is None:
        raise StateError(
            f"{said.to}: a batched RotatingKV (left_padding set) needs per-row `offsets`; "
            f"build batched states with kvstate.merge or {said.reader}"
        )
    batch = lib.BatchRotatingKVCache.__new__(lib.BatchRotatingKVCache)
    batch.keys, batch.values = fresh(state.keys), fresh(state.values)
    batch.left_padding, batch.offset = fresh(state.left_padding), fresh(state.offsets)
    batch.max_size = state.max_size
    batch._offset, batch._idx, batch.rotated = state.offset, state.index, state.rotated
    batch._lengths = None
    # An instance attribute, not a subclass: mlx-lm's save_prompt_cache records the class name.
    batch.make_mask = MethodType(fixed_make_mask, batch)
    return batch
