"""mlx-vlm's copies of mlx-lm's cache classes -> states.

Most hold mlx-lm's fields with mlx-lm's meaning (the tests compare them field for field):
kvstate's mlx-lm converters read them as they are. mlx-vlm's own differences:
- ArraysCache reads `left_padding` / `lengths` through properties that subtract an `advance`
  counter (its `advance()` no longer edits the arrays in place): the state takes the
  effective values, and the cache made back starts with a zero counter. A cache inside
  mlx-vlm's own speculation transaction is refused (`compat.check_settled`);
- SimpleKVCache is a concatenating cache whose count is `cache_length`;
- BatchQuantizedKVCache is mlx-vlm's BatchKVCache with quantized triples.
The walk over a model's caches (`walk`) learns mlx-vlm's CacheList and ArraysCache here.
"""

from __future__ import annotations

from mlx_lm.models import cache as lm
from mlx_vlm.models import cache as vlm

from kvstate import DenseKV, QuantizedKV, RecurrentState, StateError
from kvstate.kinds import trusted

from .. import walk
from ..compat import check_settled, refuse_mid_prompt
from ..registry import CONVERTERS, fresh, register_from, triple

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
    register_from(getattr(vlm, _name))(CONVERTERS[getattr(lm, _name)])

walk.register_list(vlm.CacheList)
walk.register_recurrent(vlm.ArraysCache)


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
    return trusted(DenseKV)(
        fresh(cache.keys), fresh(cache.values), None, held, appended, concatenate=True, simple=True
    )


@register_from(vlm.ArraysCache)
def _(cache: vlm.ArraysCache, appended: int = 0) -> RecurrentState:
    check_settled(cache)
    return trusted(RecurrentState)(
        tuple(fresh(a) for a in cache.cache),
        fresh(cache.left_padding),  # the properties: stored value minus the advance counter
        fresh(cache.lengths),
        appended,
    )


@register_from(vlm.BatchQuantizedKVCache)
def _(cache: vlm.BatchQuantizedKVCache, appended: int = 0) -> QuantizedKV:
    # mlx-vlm's BatchKVCache with quantized triples: left padding, offset == _idx - padding.
    right_padding = getattr(cache, "_right_padding", None)
    if right_padding is not None:
        refuse_mid_prompt(cache, "_right_padding", right_padding.tolist())
    return trusted(QuantizedKV)(
        triple(cache.keys),
        triple(cache.values),
        fresh(cache.left_padding),
        length=cache._idx,
        appended=appended,
        key_bits=cache.bits,
        value_bits=cache.bits,
        key_group_size=cache.group_size,
        value_group_size=cache.group_size,
    )
