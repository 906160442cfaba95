"""mlx-vlm's TurboQuant caches (`mlx_vlm.turboquant`) <-> TurboQuantKV, O(1) like the others.

    TurboQuantKVCache, BatchTurboQuantKVCache (integer key / value bits) -> TurboQuantKV

Both hold `TurboQuantMSEState(norms (B, H, T), indices (B, H, T, W))` per side in a capacity
buffer; the state keeps the arrays (norms with a trailing axis of 1) and the codec statics,
and the caches made back get codecs rebuilt from (dim, bits, seed) as mlx-vlm builds them
(keys `seed`, values `seed + 1`). Fractional bits (mlx-vlm's `_SplitCodec`, whose channel
split is chosen from the first keys it sees) and codec objects of any other class are refused
with a StateError naming the class. Imported by `_vlm_caches` (so only when mlx_vlm is).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm import turboquant as tq

from kvstate import StateError, TurboQuantKV
from kvstate.kinds import replace

from ._convert import fresh, register_from


def _codec_bits(cache: Any, side: str) -> tuple[int, int]:
    """(dim, bits) of one side's codec; refuses any codec but integer-bit MSE."""
    codec = getattr(cache, f"{side}_codec")
    if type(codec) is not tq._TurboQuantMSECodec:
        raise StateError(
            f"from_mlx_vlm: {type(cache).__name__} has a {side} codec of class "
            f"{type(codec).__name__} ({side}_bits={getattr(cache, f'{side}_bits')}); "
            "kvstate's TurboQuantKV holds only _TurboQuantMSECodec (integer bits)"
        )
    return int(codec.dim), int(codec.bits)


def _spec(cache: Any) -> TurboQuantKV:
    for side in ("key", "value"):
        bits = float(getattr(cache, f"{side}_bits"))
        if bits != int(bits):
            raise StateError(
                f"from_mlx_vlm: {type(cache).__name__} with {side}_bits={bits} uses mlx-vlm's "
                "_SplitCodec (fractional bits), which kvstate's TurboQuantKV does not hold; "
                "use integer key_bits / value_bits"
            )
    spec = TurboQuantKV(
        key_bits=int(cache.key_bits), value_bits=int(cache.value_bits), seed=int(cache.seed)
    )
    if cache.keys is None:
        return spec
    (key_dim, key_bits), (value_dim, value_bits) = (
        _codec_bits(cache, "key"),
        _codec_bits(cache, "value"),
    )
    return replace(
        spec, key_dim=key_dim, value_dim=value_dim, key_bits=key_bits, value_bits=value_bits
    )


def _side_arrays(mse: Any) -> list[mx.array]:
    if type(mse) is not tq.TurboQuantMSEState:
        raise StateError(
            f"from_mlx_vlm: a TurboQuant cache holding a {type(mse).__name__}; kvstate's "
            "TurboQuantKV holds only TurboQuantMSEState"
        )
    return [mx.expand_dims(mse.norms, -1), fresh(mse.indices)]


def _filled(spec: TurboQuantKV, cache: Any, **fields: Any) -> TurboQuantKV:
    arrays = _side_arrays(cache.keys) + _side_arrays(cache.values)
    return replace(
        spec,
        key_norms=arrays[0],
        key_indices=arrays[1],
        value_norms=arrays[2],
        value_indices=arrays[3],
        **fields,
    )


@register_from(tq.TurboQuantKVCache)
def _(cache: tq.TurboQuantKVCache, appended: int = 0) -> TurboQuantKV:
    spec = _spec(cache)
    if cache.keys is None:
        return spec
    return _filled(spec, cache, length=cache.offset, appended=appended)


@register_from(tq.BatchTurboQuantKVCache)
def _(cache: tq.BatchTurboQuantKVCache, appended: int = 0) -> TurboQuantKV:
    spec = replace(_spec(cache), left_padding=fresh(cache.left_padding))
    if cache.keys is None:
        return spec
    return _filled(spec, cache, length=cache._idx, appended=appended)


# ---------------------------------------------------------------------------------------
# state -> cache
# ---------------------------------------------------------------------------------------


def codecs(state: TurboQuantKV) -> tuple[Any, Any]:
    """mlx-vlm's (key codec, value codec) rebuilt from a filled state's statics."""
    return (
        tq._TurboQuantMSECodec(state.key_dim, state.key_bits, state.seed),
        tq._TurboQuantMSECodec(state.value_dim, state.value_bits, state.seed + 1),
    )


def _mse_states(state: TurboQuantKV) -> tuple[Any, Any]:
    kn, ki, vn, vi = state.key_norms, state.key_indices, state.value_norms, state.value_indices
    assert kn is not None and ki is not None and vn is not None and vi is not None
    return (
        tq.TurboQuantMSEState(kn[..., 0], fresh(ki)),
        tq.TurboQuantMSEState(vn[..., 0], fresh(vi)),
    )


def to_turboquant_cache(state: TurboQuantKV) -> Any:
    """A new TurboQuantKVCache (no left padding) or BatchTurboQuantKVCache holding `state`."""
    bits = {"bits": state.key_bits, "key_bits": state.key_bits, "value_bits": state.value_bits}
    if state.left_padding is None:
        cache = tq.TurboQuantKVCache(seed=state.seed, **bits)
        if state.key_norms is not None:
            cache.key_codec, cache.value_codec = codecs(state)
            cache.keys, cache.values = _mse_states(state)
            cache.offset = state.length
        return cache
    padding = fresh(state.left_padding)
    batch = tq.BatchTurboQuantKVCache([0] * int(padding.shape[0]), seed=state.seed, **bits)
    batch.left_padding = padding
    batch.offset = state.length - padding
    batch._idx = state.length
    if state.key_norms is not None:
        batch.key_codec, batch.value_codec = codecs(state)
        batch.keys, batch.values = _mse_states(state)
    batch._refresh_fused_attention_eligibility()
    return batch
