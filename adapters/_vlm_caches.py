"""mlx-vlm cache objects <-> kvstate states (`mlx_vlm.models.cache`), O(1) like mlx-lm's.

mlx-vlm keeps its own copy of every mlx-lm cache class. Where a class holds the same fields
with the same meaning, it maps to the same kind, so a state made from either library's caches
is the same state (tests/test_vlm_caches.py checks the fields, and the classes' own
update_and_fetch / trim / make_mask / filter / extend / extract against the state's):

    KVCache, BatchKVCache, ConcatenateKVCache  -> DenseKV
    SimpleKVCache                              -> DenseKV (concatenate, simple)
    RotatingKVCache, BatchRotatingKVCache      -> RotatingKV
    ArraysCache                                -> RecurrentState
    CacheList                                  -> ListState
    ChunkedKVCache                             -> ChunkedKV
    QuantizedKVCache, BatchQuantizedKVCache    -> QuantizedKV
    PoolingCache, BatchPoolingCache            -> PooledKV (_vlm_pooling)
    BufferedRotatingKVCache (keep=0)           -> BufferedWindowKV (_vlm_buffered_window)
    StaticPrefixKVCache                        -> StaticPrefixKV (_vlm_static_prefix)

mlx-vlm's ArraysCache reads `left_padding` / `lengths` through properties that subtract an
`advance` counter (its `advance()` no longer edits the arrays in place): the state takes the
effective values and the cache made back starts with a zero counter. A cache in the middle of
mlx-vlm's own speculation transaction (`start_speculation` without commit or abort) is
refused: its arrays are a tentative future that only that transaction can settle.

A BufferedRotatingKVCache with a `keep` prefix is refused with the reason (no model builds
one, and its state does not describe its ring buffer).

`to_vlm_cache` gives mlx-vlm classes back; `_convert.to_cache` keeps giving mlx-lm's.
This module imports mlx_vlm: only `kvstate.adapters.vlm` (and a lazy lookup in `_convert`
when it meets an mlx-vlm object) imports it.
"""

from __future__ import annotations

from functools import singledispatch
from types import MethodType
from typing import Any

from mlx_lm.models import cache as lm
from mlx_vlm.models import cache as vlm

from kvstate import (
    ChunkedKV,
    DenseKV,
    ListState,
    QuantizedKV,
    RecurrentState,
    RotatingKV,
    StateError,
)

from . import _capture
from ._convert import CONVERTERS, fresh, register_from, to_cache
from ._rotating import fixed_make_mask

# ---------------------------------------------------------------------------------------
# cache -> state
# ---------------------------------------------------------------------------------------


@register_from(vlm.SimpleKVCache)
def _(cache: vlm.SimpleKVCache, appended: int = 0) -> DenseKV:
    held = 0 if cache.keys is None else int(cache.keys.shape[2])
    if held != cache.cache_length:
        # `update()` replaces the arrays but adds to the count: the two no longer agree.
        raise StateError(
            f"from_mlx_vlm: this SimpleKVCache holds {held} positions but its cache_length is "
            f"{cache.cache_length}; only a cache whose arrays hold cache_length positions has a "
            "state"
        )
    return DenseKV(
        fresh(cache.keys), fresh(cache.values), None, held, appended, concatenate=True, simple=True
    )


@register_from(vlm.ArraysCache)
def _(cache: vlm.ArraysCache, appended: int = 0) -> RecurrentState:
    if cache.is_speculating:
        raise StateError(
            "from_mlx_vlm: this ArraysCache is inside an mlx-vlm speculation transaction "
            "(start_speculation() without commit_speculation() / abort_speculation()); "
            "settle it first, then convert (kvstate rolls back with commit_prefix instead)"
        )
    return RecurrentState(
        tuple(fresh(a) for a in cache.cache),
        fresh(cache.left_padding),  # the properties: stored value minus the advance counter
        fresh(cache.lengths),
        appended,
    )


# These mlx-vlm classes hold mlx-lm's fields with mlx-lm's meaning (the tests compare them
# field for field): kvstate's mlx-lm converters read them as they are.
for _name in (
    "KVCache",
    "ConcatenateKVCache",
    "BatchKVCache",
    "RotatingKVCache",
    "BatchRotatingKVCache",
    "CacheList",
    "ChunkedKVCache",
    "QuantizedKVCache",
):
    CONVERTERS[getattr(vlm, _name)] = CONVERTERS[getattr(lm, _name)]


def _triple(q: Any) -> Any:
    if q is None:
        return None
    packed, scales, biases = q
    return (fresh(packed), fresh(scales), fresh(biases))


@register_from(vlm.BatchQuantizedKVCache)
def _(cache: vlm.BatchQuantizedKVCache, appended: int = 0) -> QuantizedKV:
    # mlx-vlm's BatchKVCache with quantized triples: left padding, offset == _idx - padding.
    right_padding = getattr(cache, "_right_padding", None)
    if right_padding is not None:
        raise StateError(
            "from_mlx_vlm: this BatchQuantizedKVCache is between prepare() and finalize() "
            f"(_right_padding = {right_padding.tolist()}); call cache.finalize() after the "
            "padded prompt forward, then convert"
        )
    return QuantizedKV(
        _triple(cache.keys),
        _triple(cache.values),
        fresh(cache.left_padding),
        length=cache._idx,
        appended=appended,
        key_bits=cache.bits,
        value_bits=cache.bits,
        key_group_size=cache.group_size,
        value_group_size=cache.group_size,
    )


# ---------------------------------------------------------------------------------------
# state -> cache
# ---------------------------------------------------------------------------------------


@singledispatch
def to_vlm_cache(state: Any) -> Any:
    """One layer state -> a new mlx-vlm cache object holding fresh arrays."""
    raise StateError(
        f"to_mlx_vlm: cannot convert a {type(state).__name__}; expected a kvstate layer state "
        "of a kind mlx-vlm has a cache for (DenseKV, RotatingKV, RecurrentState, ListState, "
        "ChunkedKV, QuantizedKV)"
    )


@to_vlm_cache.register
def _(state: DenseKV) -> Any:
    if state.left_padding is not None:
        batch = vlm.BatchKVCache.__new__(vlm.BatchKVCache)
        batch.keys, batch.values = fresh(state.keys), fresh(state.values)
        batch.left_padding = fresh(state.left_padding)
        batch.offset = state.length - state.left_padding
        batch._idx = state.length
        batch._right_padding = None
        return batch
    if state.simple:
        simple = vlm.SimpleKVCache()
        # No tokens is `keys is None` there: florence2's cross-attention reads a cache whose
        # keys are not None as filled, so a state committed back to 0 gives a fresh cache.
        if state.keys is not None and state.values is not None and state.length > 0:
            simple.keys = state.keys[..., : state.length, :]
            simple.values = state.values[..., : state.length, :]
        simple.cache_length = state.length
        return simple
    if state.concatenate:
        concat = vlm.ConcatenateKVCache()
        if state.keys is not None and state.values is not None:
            concat.keys = state.keys[..., : state.length, :]
            concat.values = state.values[..., : state.length, :]
        concat.offset = state.length
        return concat
    cache = vlm.KVCache()
    cache.keys, cache.values, cache.offset = fresh(state.keys), fresh(state.values), state.length
    return cache


@to_vlm_cache.register
def _(state: RotatingKV) -> Any:
    if state.left_padding is None:
        cache = vlm.RotatingKVCache(state.max_size, keep=state.keep)
        cache.keys, cache.values = fresh(state.keys), fresh(state.values)
        cache.offset, cache._idx = state.offset, state.index
        return cache
    if state.keep != 0:
        raise StateError(
            f"to_mlx_vlm: a batched RotatingKV with keep={state.keep} has no mlx-vlm cache: "
            "BatchRotatingKVCache has no keep prefix; batch windows made with keep=0"
        )
    if state.offsets is None:
        raise StateError(
            "to_mlx_vlm: a batched RotatingKV (left_padding set) needs per-row `offsets`; "
            "build batched states with kvstate.merge or from_mlx_vlm"
        )
    batch = vlm.BatchRotatingKVCache.__new__(vlm.BatchRotatingKVCache)
    batch.keys, batch.values = fresh(state.keys), fresh(state.values)
    batch.left_padding, batch.offset = fresh(state.left_padding), fresh(state.offsets)
    batch.max_size = state.max_size
    batch._offset, batch._idx, batch.rotated = state.offset, state.index, state.rotated
    batch._lengths = None
    # mlx-vlm 0.7.10 copied mlx-lm's multi-token mask trim on a rotated padded ring
    # (tests/test_vlm_caches.py checks the bug is still there upstream).
    batch.make_mask = MethodType(fixed_make_mask, batch)  # type: ignore[method-assign]
    return batch


@to_vlm_cache.register
def _(state: RecurrentState) -> Any:
    cache = vlm.ArraysCache.__new__(vlm.ArraysCache)  # __new__ zeroes the advance counters
    cache.cache = [fresh(a) for a in state.arrays]
    cache.left_padding = fresh(state.left_padding)
    cache.lengths = fresh(state.lengths)
    return cache


@to_vlm_cache.register
def _(state: ListState) -> Any:
    return vlm.CacheList(*(to_vlm_cache(s) for s in state.states))


@to_vlm_cache.register
def _(state: ChunkedKV) -> Any:
    cache = vlm.ChunkedKVCache(state.chunk_size)
    cache.keys, cache.values = fresh(state.keys), fresh(state.values)
    cache.offset, cache.start_position = state.offset, state.start_position
    return cache


@to_vlm_cache.register
def _(state: QuantizedKV) -> Any:
    if state.left_padding is not None:
        return _batch_quantized(state)
    made = to_cache(state)
    if type(made) is not lm.QuantizedKVCache:
        raise StateError(
            f"to_mlx_vlm: this QuantizedKV becomes an mlx-lm {type(made).__name__}, which "
            "mlx-vlm's QuantizedKVCache (one group_size and bits for keys and values) "
            "cannot hold"
        )
    # mlx-vlm allocates `dim * bits // 32` words per row: no packing fix is needed there.
    cache = vlm.QuantizedKVCache(group_size=made.group_size, bits=made.bits)
    cache.keys, cache.values, cache.offset = made.keys, made.values, made.offset
    return cache


def _batch_quantized(state: QuantizedKV) -> Any:
    # seed included: a state keeps it even without a rotation, and this class cannot hold it
    plain = (state.key_pad, state.value_pad, state.rotation, state.seed) == (0, 0, "none", 0)
    if not plain or (state.key_bits, state.key_group_size) != (
        state.value_bits,
        state.value_group_size,
    ):
        raise StateError(
            "to_mlx_vlm: mlx-vlm's BatchQuantizedKVCache has one bits and group_size for keys "
            "and values and no padded channels, rotation or seed; this QuantizedKV has "
            f"key_bits={state.key_bits}, value_bits={state.value_bits}, key_group_size="
            f"{state.key_group_size}, value_group_size={state.value_group_size}, key_pad="
            f"{state.key_pad}, value_pad={state.value_pad}, rotation={state.rotation!r}, "
            f"seed={state.seed}"
        )
    padding = fresh(state.left_padding)
    batch = vlm.BatchQuantizedKVCache.__new__(vlm.BatchQuantizedKVCache)
    batch.keys, batch.values = _triple(state.keys), _triple(state.values)
    batch.left_padding, batch.offset = padding, state.length - padding
    batch._idx = state.length
    batch.group_size, batch.bits = state.key_group_size, state.key_bits
    batch._right_padding = None
    return batch


# A capturing forward finds mlx-vlm's recurrent caches as it finds mlx-lm's.
_capture.LIST_CACHES += (vlm.CacheList,)
_capture.RECURRENT_CACHES += (vlm.ArraysCache,)

# TurboQuant (mlx_vlm.turboquant) registers its converters there; to_vlm_cache dispatches to it.
from kvstate import TurboQuantKV  # noqa: E402

from ._vlm_turboquant import to_turboquant_cache  # noqa: E402

to_vlm_cache.register(TurboQuantKV, to_turboquant_cache)

# The kinds only mlx-vlm has caches for register their converters in their own modules.
from kvstate import BufferedWindowKV, PooledKV, StaticPrefixKV  # noqa: E402

from ._vlm_buffered_window import to_buffered_window_cache  # noqa: E402
from ._vlm_pooling import to_pooling_cache  # noqa: E402
from ._vlm_static_prefix import to_static_prefix_cache  # noqa: E402

to_vlm_cache.register(PooledKV, to_pooling_cache)
to_vlm_cache.register(BufferedWindowKV, to_buffered_window_cache)
to_vlm_cache.register(StaticPrefixKV, to_static_prefix_cache)
