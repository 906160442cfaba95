"""Row keys: a batch whose rows each draw from their own key.

A generation's draws take one `mx.random.key` (uint32, (2,)) that covers the whole (B, ...)
array: each row gets its own noise, but the noise of row b depends on the batch it is in.
A serving engine's rows belong to different requests, each with its own seed, and join and
leave the batch between rounds; so a draw can also take *row keys*, (B, 2) uint32, row b's
key in row b, and then row b's noise is what a draw over that row alone with its key gives
(`mx.vmap` over the keys): a request's draws depend on its own key only. Everything here
takes either form, and a (2,) key draws exactly as before.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import StateError


def is_row_keys(key: mx.array) -> bool:
    """Whether `key` is row keys (B, 2) rather than one key (2,)."""
    return key.ndim == 2


def checked_key(key: Any, name: str, rows: int | None = None) -> mx.array:
    """An `mx.random.key(seed)` (uint32, (2,)), or row keys (uint32, (B, 2)) of `rows` rows
    (any B when None), else a StateError naming `name`."""
    if isinstance(key, mx.array) and key.dtype == mx.uint32:
        if key.shape == (2,):
            return key
        if key.ndim == 2 and key.shape[1] == 2 and rows in (None, key.shape[0]):
            return key
    shown = f"{key.dtype} {key.shape}" if isinstance(key, mx.array) else repr(key)[:60]
    wanted = "(B, 2)" if rows is None else f"({rows}, 2)"
    raise StateError(
        f"{name} must be an mx.random.key(seed) (uint32, (2,)) or row keys (uint32, "
        f"{wanted}: one key per row); got {shown}"
    )


def row_keys(keys: list[mx.array]) -> mx.array:
    """One key per row, (B, 2) uint32, from B keys of shape (2,)."""
    return mx.stack(keys)


def split_pair(key: mx.array) -> tuple[mx.array, mx.array]:
    """Two keys from `key`, each of its form: `mx.random.split(key)` for a (2,) key, each
    row's split for row keys."""
    if not is_row_keys(key):
        first, second = mx.random.split(key)
        return first, second
    split = _row_split(key)
    return split[:, 0], split[:, 1]


def uniform(shape: tuple[int, ...], key: mx.array | None) -> mx.array:
    """Uniform draws in [0, 1) of `shape` (B, ...): one key for all (None: MLX's global
    key), or row keys (row b drawn with key b)."""
    if key is None or not is_row_keys(key):
        return mx.random.uniform(shape=shape, key=key)
    rest = tuple(shape[1:])
    return mx.vmap(lambda k: mx.random.uniform(shape=rest, key=k))(key)


def categorical(logits: mx.array, key: mx.array | None) -> mx.array:
    """One draw per distribution of `logits` (B, ..., vocab) (unnormalised log-probabilities):
    one key for all (None: MLX's global key), or row keys (row b drawn with key b)."""
    if key is None or not is_row_keys(key):
        return mx.random.categorical(logits, key=key)
    return mx.vmap(lambda x, k: mx.random.categorical(x, key=k))(logits, key)


def _row_split(keys: mx.array) -> mx.array:
    """(B, 2, 2): each row key split in two."""
    return mx.vmap(lambda k: mx.random.split(k))(keys)


def split_row_keys(keys: mx.array) -> tuple[mx.array, mx.array]:
    """(the rows' next keys, this draw's keys), both (B, 2): each row's key split, as a
    generator splits its own key before each draw."""
    checked_key(keys, "split_row_keys: keys")
    if not is_row_keys(keys):
        raise StateError(
            f"split_row_keys: keys must be row keys (uint32, (B, 2)); got shape {keys.shape}"
        )
    return split_pair(keys)
