"""mlx-vlm's BufferedRotatingKVCache <-> BufferedWindowKV (imports mlx_vlm).

Only the keep=0 form has its own layout (a linear window); with a `keep` prefix the class
runs RotatingKVCache's ring-buffer code but reads and restores its state with its own
linear-window `state` / `meta_state`, and no mlx-vlm model builds one: refused.
"""

from __future__ import annotations

from typing import Any

from mlx_vlm.models import cache as vlm

from kvstate import BufferedWindowKV, NotSupportedError, StateError
from kvstate.kinds import trusted

from ..registry import fresh, register_from


@register_from(vlm.BufferedRotatingKVCache)
def _(cache: vlm.BufferedRotatingKVCache, appended: int = 0) -> BufferedWindowKV:
    if cache.keep:
        raise NotSupportedError(
            f"from_mlx_vlm: a BufferedRotatingKVCache with keep={cache.keep} runs "
            "RotatingKVCache's ring buffer, which its linear-window state does not describe; "
            "no kvstate kind holds it (mlx-vlm's models build them with keep=0)"
        )
    if cache._idx != cache.offset - cache.start_position:
        raise StateError(
            f"from_mlx_vlm: this BufferedRotatingKVCache holds {cache._idx} entries (_idx) "
            f"but offset - start_position is {cache.offset} - {cache.start_position}; only a "
            "cache whose entries are its positions has a state"
        )
    return trusted(BufferedWindowKV)(
        fresh(cache.keys),
        fresh(cache.values),
        max_size=int(cache.max_size),
        buffer_size=int(cache.buffer_size),
        step=int(cache.step),
        offset=int(cache.offset),
        start_position=int(cache.start_position),
        appended=appended,
    )


def to_buffered_window_cache(state: BufferedWindowKV) -> Any:
    cache = vlm.BufferedRotatingKVCache(state.max_size, keep=0, buffer_size=state.buffer_size)
    if state.step != cache.step:
        cache.step = state.step  # a class attribute mlx-vlm lets instances override
    cache.keys, cache.values = fresh(state.keys), fresh(state.values)
    cache.offset, cache.start_position = state.offset, state.start_position
    cache._idx = state.offset - state.start_position
    return cache
