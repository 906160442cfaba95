"""mlx-vlm's TurboQuant caches (`mlx_vlm.turboquant`) <-> TurboQuantKV, O(1) like the others.

    TurboQuantKVCache, BatchTurboQuantKVCache, HybridQuantKVCache -> TurboQuantKV

Both hold per side a `TurboQuantMSEState(norms (B, H, T), indices (B, H, T, W))` (integer
bits) or a `TurboQuantSplitState(low, high)` of two of them (fractional bits, mlx-vlm's
`_SplitCodec`) in a capacity buffer; the state keeps the arrays (norms with a trailing axis
of 1), the codec statics and a split side's high channels, and the caches made back get
codecs rebuilt from them as mlx-vlm builds them (keys `seed`, values `seed + 1`, a split
side's high codec its seed + 97). Codec objects of any other class (Prod / Polar, which
mlx-vlm's caches never build) are refused with a NotSupportedError naming the class. Part of
`caches.vlm` (imported only with mlx_vlm).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_vlm import turboquant as tq

from kvstate import NotSupportedError, TurboQuantKV
from kvstate.kinds import replace
from kvstate.turboquant import is_split, low_channels, scheme_of

from ..registry import fresh, register_from
from ..routes import ROUTED_FOR_GOOD, ROUTES

_SIDES = ("key", "value")


def _bits(value: float) -> float:
    """mlx-vlm's float bits as kvstate's static: an int when whole (4.0 -> 4), else x.5."""
    return int(value) if float(value) == int(value) else float(value)


def _side_codec(cache: Any, side: str, codec: Any) -> tuple[int, mx.array | None]:
    """(dim, high channels or None) of one side's codec; refuses any codec but MSE / Split
    over MSE with mlx-vlm's channel order."""
    where = f"from_mlx_vlm: {type(cache).__name__}'s {side} codec"
    if type(codec) is tq._TurboQuantMSECodec:
        return int(codec.dim), None
    if type(codec) is not tq._SplitCodec:
        raise NotSupportedError(
            f"{where} is a {type(codec).__name__} ({side}_bits={codec_bits(cache, side)}); "
            "kvstate's TurboQuantKV holds _TurboQuantMSECodec (integer bits) and _SplitCodec "
            "over it (x.5 bits), the codecs mlx-vlm's caches build"
        )
    if codec.mode != "mse" or type(codec.low_codec) is not tq._TurboQuantMSECodec:
        raise NotSupportedError(
            f"{where} is a _SplitCodec of mode {codec.mode!r}; TurboQuantKV holds mode 'mse'"
        )
    dim = int(codec.dim)
    high = np.array(codec.high_idx).tolist()
    if np.array(codec.low_idx).tolist() != low_channels(dim, high) or high != sorted(set(high)):
        raise NotSupportedError(
            f"{where} is a _SplitCodec whose channels are not mlx-vlm's order (sorted high "
            "channels, the rest low in order); TurboQuantKV cannot rebuild it"
        )
    return dim, mx.array(high, mx.int32)


def codec_bits(cache: Any, side: str) -> Any:
    """A cache's bits for one side (HybridQuantKVCache keeps them in its policy)."""
    if isinstance(cache, tq.HybridQuantKVCache):
        return getattr(cache.policy, side).bits
    return getattr(cache, f"{side}_bits")


def _spec(cache: Any) -> TurboQuantKV:
    spec = TurboQuantKV(
        key_bits=_bits(cache.key_bits), value_bits=_bits(cache.value_bits), seed=int(cache.seed)
    )
    if cache.keys is None:
        return spec
    (key_dim, key_high), (value_dim, value_high) = (
        _side_codec(cache, "key", cache.key_codec),
        _side_codec(cache, "value", cache.value_codec),
    )
    return replace(
        spec,
        key_dim=key_dim,
        value_dim=value_dim,
        key_high_channels=key_high,
        value_high_channels=value_high,
    )


def _mse_arrays(mse: Any) -> list[mx.array]:
    if type(mse) is not tq.TurboQuantMSEState:
        raise NotSupportedError(
            f"from_mlx_vlm: a TurboQuant cache holding a {type(mse).__name__}; kvstate's "
            "TurboQuantKV holds TurboQuantMSEState and TurboQuantSplitState of them"
        )
    return [mx.expand_dims(mse.norms, -1), fresh(mse.indices)]


def _side_fields(side: str, held: Any, split: bool) -> dict[str, mx.array]:
    if not split:
        norms, indices = _mse_arrays(held)
        return {f"{side}_norms": norms, f"{side}_indices": indices}
    if type(held) is not tq.TurboQuantSplitState:
        raise NotSupportedError(
            f"from_mlx_vlm: a split {side} codec holding a {type(held).__name__}, not a "
            "TurboQuantSplitState"
        )
    (norms, indices), (high_norms, high_indices) = _mse_arrays(held.low), _mse_arrays(held.high)
    return {
        f"{side}_norms": norms,
        f"{side}_indices": indices,
        f"{side}_high_norms": high_norms,
        f"{side}_high_indices": high_indices,
    }


def _filled(spec: TurboQuantKV, cache: Any, **fields: Any) -> TurboQuantKV:
    for side, held in zip(_SIDES, (cache.keys, cache.values), strict=True):
        split = getattr(spec, f"{side}_high_channels") is not None
        fields |= _side_fields(side, held, split)
    return replace(spec, **fields)


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


def codec_of(state: TurboQuantKV, side: str) -> Any:
    """mlx-vlm's codec of one side of a filled state, rebuilt from its statics (and a split
    side's high channels)."""
    dim, bits = getattr(state, f"{side}_dim"), getattr(state, f"{side}_bits")
    seed = state.seed + (1 if side == "value" else 0)
    if not is_split(bits):
        return tq._TurboQuantMSECodec(dim, int(bits), seed)
    high = getattr(state, f"{side}_high_channels")
    assert high is not None
    low = mx.array(low_channels(dim, np.array(high).tolist()), mx.int32)
    # from_indices seeds the high codec with seed + 97 itself (SPLIT_SEED_OFFSET).
    return tq._SplitCodec.from_indices(dim, float(bits), "mse", seed, low, fresh(high))


def codecs(state: TurboQuantKV) -> tuple[Any, Any]:
    """mlx-vlm's (key codec, value codec) rebuilt from a filled state's statics."""
    return codec_of(state, "key"), codec_of(state, "value")


def _mse(norms: mx.array, indices: mx.array) -> Any:
    return tq.TurboQuantMSEState(norms[..., 0], fresh(indices))


def side_state(state: TurboQuantKV, side: str) -> Any:
    """One side of a filled state as mlx-vlm holds it: an MSE state, or a Split state of two."""
    low = _mse(getattr(state, f"{side}_norms"), getattr(state, f"{side}_indices"))
    if getattr(state, f"{side}_high_norms") is None:
        return low
    high = _mse(getattr(state, f"{side}_high_norms"), getattr(state, f"{side}_high_indices"))
    return tq.TurboQuantSplitState(low, high)


def to_turboquant_cache(state: TurboQuantKV) -> Any:
    """A new TurboQuantKVCache (no left padding) or BatchTurboQuantKVCache holding `state`
    (a HybridQuantKVCache for `form="hybrid"`)."""
    if state.form == "hybrid":
        return to_hybrid_cache(state)
    bits = {"bits": state.key_bits, "key_bits": state.key_bits, "value_bits": state.value_bits}
    if state.left_padding is None:
        cache = tq.TurboQuantKVCache(seed=state.seed, **bits)
        if state.key_indices is not None:
            cache.key_codec, cache.value_codec = codecs(state)
            cache.keys, cache.values = side_state(state, "key"), side_state(state, "value")
            cache.offset = state.length
        return cache
    padding = fresh(state.left_padding)
    batch = tq.BatchTurboQuantKVCache([0] * int(padding.shape[0]), seed=state.seed, **bits)
    batch.left_padding = padding
    batch.offset = state.length - padding
    batch._idx = state.length
    if state.key_indices is not None:
        batch.key_codec, batch.value_codec = codecs(state)
        batch.keys, batch.values = side_state(state, "key"), side_state(state, "value")
    batch._refresh_fused_attention_eligibility()
    return batch


# ---------------------------------------------------------------------------------------
# HybridQuantKVCache: one side TurboQuant, the other mx.quantize (mlx-vlm's generate builds
# it when a KVQuantPolicy mixes schemes); held exactly `offset` long, no padding, no batch.
# ---------------------------------------------------------------------------------------


def _hybrid_side(cache: Any, side: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(statics, arrays) of one side of a HybridQuantKVCache."""
    spec, quantizer = getattr(cache.policy, side), getattr(cache, f"{side}_quantizer")
    held = getattr(cache, f"{side}s")
    statics: dict[str, Any] = {f"{side}_scheme": spec.scheme}
    if type(quantizer) is tq._UniformTensorQuantizer:
        statics |= {f"{side}_scheme": "uniform", f"{side}_bits": int(quantizer.bits)}
        if held is None:
            return statics, {}
        packed, scales, biases = held
        dim = int(packed.shape[-1]) * 32 // int(quantizer.bits)
        arrays = {f"{side}_indices": fresh(packed), f"{side}_scales": fresh(scales)}
        return statics | {f"{side}_dim": dim}, arrays | {f"{side}_biases": fresh(biases)}
    if type(quantizer) is not tq._TurboTensorQuantizer:
        raise NotSupportedError(
            f"from_mlx_vlm: HybridQuantKVCache's {side} quantizer is a "
            f"{type(quantizer).__name__}; kvstate knows _UniformTensorQuantizer and "
            "_TurboTensorQuantizer"
        )
    statics |= {f"{side}_scheme": "turboquant", f"{side}_bits": _bits(quantizer.bits)}
    if held is None:
        return statics, {}
    dim, high = _side_codec(cache, side, quantizer.codec)
    statics |= {f"{side}_dim": dim, f"{side}_high_channels": high}
    return statics, _side_fields(side, held, high is not None)


@register_from(tq.HybridQuantKVCache)
def _(cache: tq.HybridQuantKVCache, appended: int = 0) -> TurboQuantKV:
    policy = cache.policy
    if policy.key.group_size != policy.value.group_size:
        raise NotSupportedError(
            "from_mlx_vlm: HybridQuantKVCache with key group_size "
            f"{policy.key.group_size} and value group_size {policy.value.group_size}; its "
            "meta_state (and TurboQuantKV) keep one group size"
        )
    fields: dict[str, Any] = {}
    for side in _SIDES:
        statics, arrays = _hybrid_side(cache, side)
        fields |= statics | arrays
    state = TurboQuantKV(
        seed=int(cache.seed),
        form="hybrid",
        group_size=int(policy.group_size),
        policy_bits=float(policy.bits),
    )
    state = replace(state, **fields)
    if cache.keys is None:
        return state
    return replace(state, length=int(cache.offset), appended=appended)


def _uniform(state: TurboQuantKV, side: str) -> tuple[mx.array, mx.array, mx.array]:
    n = state.length
    parts = [getattr(state, f"{side}_{p}") for p in ("indices", "scales", "biases")]
    return parts[0][:, :, :n], parts[1][:, :, :n], parts[2][:, :, :n]


def _truncated(held: Any, n: int) -> Any:
    """An mlx-vlm side state cut to its first `n` positions (HybridQuantKVCache has no spare
    capacity: it concatenates)."""
    if isinstance(held, tq.TurboQuantSplitState):
        return tq.TurboQuantSplitState(_truncated(held.low, n), _truncated(held.high, n))
    return tq.TurboQuantMSEState(held.norms[:, :, :n], held.indices[:, :, :n])


def to_hybrid_cache(state: TurboQuantKV) -> Any:
    """A new HybridQuantKVCache holding a `form="hybrid"` state (rows without padding)."""
    from mlx_vlm.kv_quant import KVQuantPolicy, KVQuantSpec

    if state.left_padding is not None:
        if any(np.array(state.left_padding).tolist()):
            raise NotSupportedError(
                "to_mlx_vlm: HybridQuantKVCache holds one length for all rows (no left "
                f"padding); this state's rows are padded {np.array(state.left_padding).tolist()}"
                ": extract the rows (kvstate.extract) and give each back on its own"
            )
        state = replace(state, left_padding=None)

    def spec(side: str) -> Any:
        bits = float(getattr(state, f"{side}_bits"))
        return KVQuantSpec(scheme_of(state, side), bits, state.group_size)

    policy = KVQuantPolicy(bits=state.policy_bits, key=spec("key"), value=spec("value"))
    cache = tq.HybridQuantKVCache(policy, seed=state.seed)
    if state.key_indices is None:
        return cache
    for side in _SIDES:
        quantizer = getattr(cache, f"{side}_quantizer")
        if scheme_of(state, side) == "uniform":
            setattr(cache, f"{side}s", _uniform(state, side))
        else:
            quantizer.codec = codec_of(state, side)
            setattr(cache, f"{side}s", _truncated(side_state(state, side), state.length))
    cache.offset = state.length
    return cache


# ---------------------------------------------------------------------------- attention


def _turboquant_attention(
    queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any
) -> Any:
    """An mlx-lm model's attention over mlx-vlm's TurboQuant caches: mlx-vlm's own attention
    function (its fused kernels, or the dequantized path it falls back to). mlx-lm's function
    would take the caches for its QuantizedKVCache (they have `bits`) and fail."""
    from mlx_vlm.models.base import scaled_dot_product_attention

    return scaled_dot_product_attention(
        queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
    )


for _cls in (tq.TurboQuantKVCache, tq.BatchTurboQuantKVCache):
    ROUTES[_cls] = _turboquant_attention
    ROUTED_FOR_GOOD.add(_cls)
