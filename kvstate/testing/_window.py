"""mlx-lm's sliding-window update, mirrored for the strategies (kvstate's core never imports
mlx-lm, so windows are built forward by forward with this copy, checked against mlx-lm's own
RotatingKVCache / BatchRotatingKVCache in the property tests)."""

from __future__ import annotations

import mlx.core as mx

from .._rotating import RotatingKV

_STEP = 256  # mlx-lm's growth step for rotating buffers


def _fresh_write(a: mx.array, at: int, x: mx.array) -> mx.array:
    out = a[...]  # a new array object: the write must not reach a state that holds `a`
    out[..., at : at + x.shape[2], :] = x
    return out


def _grow(a: mx.array | None, like: mx.array, size: int) -> mx.array:
    new = mx.zeros((*like.shape[:2], size, like.shape[3]), like.dtype)
    return new if a is None else mx.concatenate([a, new], axis=2)


def window_update(s: RotatingKV, k: mx.array, v: mx.array) -> RotatingKV:
    """One forward of k, v (B, H, S, D) into a window, exactly as mlx-lm's RotatingKVCache /
    BatchRotatingKVCache `update_and_fetch` does it (kvstate's core never imports mlx-lm,
    so the strategies carry this mirror of it). Returns the new state, `appended` unset."""
    n = k.shape[2]
    keys, values, idx, keep, top = s.keys, s.values, s.index, s.keep, s.max_size
    if s.left_padding is None:
        if n > 1:  # _update_concat
            if keys is None or values is None:
                keys, values = k, v
            else:
                if idx != keys.shape[2]:
                    if idx < s.offset:
                        keys, values = (
                            mx.concatenate(
                                [a[..., :keep, :], a[..., idx:, :], a[..., keep:idx, :]], 2
                            )
                            for a in (keys, values)
                        )
                    else:
                        keys, values = keys[..., :idx, :], values[..., :idx, :]
                trim = keys.shape[2] - top + 1
                if trim > 0:
                    keys, values = (
                        mx.concatenate([a[..., :keep, :], a[..., trim + keep :, :]], 2)
                        for a in (keys, values)
                    )
                keys, values = mx.concatenate([keys, k], 2), mx.concatenate([values, v], 2)
            return RotatingKV(
                keys, values, max_size=top, keep=keep, offset=s.offset + n, index=keys.shape[2]
            )
        prev = s.offset  # _update_in_place
        if keys is None or values is None or (prev >= keys.shape[2] and keys.shape[2] < top):
            size = min(_STEP, top - prev)
            keys, values, idx = _grow(keys, k, size), _grow(values, v, size), prev
        trim = keys.shape[2] - top
        if trim > 0:
            keys, values = (
                mx.concatenate([a[..., :keep, :], a[..., trim + keep :, :]], 2)
                for a in (keys, values)
            )
            idx = top
        if idx == top:
            idx = keep
        keys, values = _fresh_write(keys, idx, k), _fresh_write(values, idx, v)
        return RotatingKV(keys, values, max_size=top, keep=keep, offset=prev + n, index=idx + n)
    assert s.offsets is not None
    left_padding, rotated = s.left_padding, s.rotated
    if n > 1:  # BatchRotatingKVCache._update_concat (no right padding)
        if keys is None or values is None:
            keys, values = k, v
        else:
            if rotated:
                keys, values = mx.roll(keys, -idx, 2), mx.roll(values, -idx, 2)
                idx, rotated = keys.shape[2], False
            keys, values = keys[..., :idx, :], values[..., :idx, :]
            trim = idx - top + 1
            if trim > 0:
                left_padding = left_padding - trim
                keys, values = keys[..., trim:, :], values[..., trim:, :]
            keys, values = mx.concatenate([keys, k], 2), mx.concatenate([values, v], 2)
        return RotatingKV(
            keys,
            values,
            left_padding,
            s.offsets + n,
            max_size=top,
            offset=s.offset + n,
            index=keys.shape[2],
        )
    prev = s.offset  # BatchRotatingKVCache._update_in_place
    if keys is None or values is None or (prev >= keys.shape[2] and keys.shape[2] < top):
        size = min(_STEP, top - prev)
        keys, values, idx = _grow(keys, k, size), _grow(values, v, size), prev
    trim = keys.shape[2] - top
    if trim > 0:
        keys, values, idx = keys[..., trim:, :], values[..., trim:, :], top
        left_padding = left_padding - trim
    if idx == top:
        rotated, idx = True, 0
    if rotated:
        left_padding = left_padding - n
    keys, values = _fresh_write(keys, idx, k), _fresh_write(values, idx, v)
    return RotatingKV(
        keys,
        values,
        left_padding,
        s.offsets + n,
        max_size=top,
        offset=prev + n,
        index=idx + n,
        rotated=rotated,
    )
