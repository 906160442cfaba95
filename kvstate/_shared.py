"""Helpers the kind modules share: merge configurations, their mismatches, pending counts,
and the KV kinds' part of keeping a tree path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._errors import CommitError, StateError, require


def kv_config(
    kind: str,
    dtype: Any = None,
    kv_heads: int | None = None,
    key_dim: int | None = None,
    value_dim: int | None = None,
    **statics: Any,
) -> dict[str, Any]:
    """The `config_of` of a KV kind."""
    return {
        "kind": kind,
        **statics,
        "dtype": dtype and str(dtype),
        "kv_heads": kv_heads,
        "key_dim": key_dim,
        "value_dim": value_dim,
    }


def array_kv_config(kind: str, keys: Any, values: Any, **statics: Any) -> dict[str, Any]:
    """`kv_config` read off (B, H, T, D) key and value buffers (None while empty)."""
    if keys is None or values is None:
        return kv_config(kind, **statics)
    return kv_config(
        kind, keys.dtype, int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3]), **statics
    )


def config_mismatches(
    a: Any, b: Any, path: str = "", labels: tuple[str, str] | None = None
) -> list[str]:
    """Every disagreement between two configs, named by its path (e.g. `parts[3].key_dim`):
    "path: x != y", or with `labels` ("model", "state") "path: model x, state y".
    None (an empty state's unknown dtype or head dims) matches anything."""
    if a is None or b is None:
        return []
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [
            m
            for k in a
            for m in config_mismatches(a[k], b[k], f"{path}.{k}" if path else k, labels)
        ]
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [m for i, (x, y) in pairs for m in config_mismatches(x, y, f"{path}[{i}]", labels)]
    if a == b:
        return []
    where = path or "config"
    if labels is None:
        return [f"{where}: {_short(a)} != {_short(b)}"]
    return [f"{where}: {labels[0]} {_short(a)}, {labels[1]} {_short(b)}"]


def _short(config: Any) -> str:
    if isinstance(config, tuple):
        return f"{len(config)} parts"
    if isinstance(config, dict) and "kind" in config:
        return str(config["kind"])
    return repr(config)


def shared_appended(states: Sequence[Any]) -> int:
    """The pending forward a merge keeps: every input's `appended` if they agree, else 0."""
    counts = {s.appended for s in states}
    return counts.pop() if len(counts) == 1 else 0


def uniform_count(state: Any, counts: tuple[int, ...]) -> int:
    """The single count of a kind with one length for all rows (no left padding)."""
    require(
        len(set(counts)) == 1,
        CommitError,
        f"{type(state).__name__} holds one length for all rows (like its mlx-lm cache, it has "
        f"no left padding), so it cannot keep ragged counts {list(counts)}; commit one count "
        f"for every row (e.g. {min(counts)}, then re-feed the rows' extra accepted tokens), "
        "or extract the rows (kvstate.extract) and commit each on its own",
    )
    return counts[0]


def path_entries(
    keys: mx.array | None, values: mx.array | None, start: int, positions: tuple[int, ...]
) -> tuple[mx.array, mx.array] | None:
    """A KV layer's `gather_path`: the keys and values (B, H, n, D) the tree forward wrote at
    input `positions`, its first token sitting at buffer position `start` (axis 2), in
    path order; None for a layer that holds nothing (`keep_path` refuses it)."""
    if keys is None or values is None:
        return None
    index = mx.array([start + q for q in positions], mx.int32)
    return mx.take(keys, index, axis=2), mx.take(values, index, axis=2)


def path_in_place(
    keys: mx.array | None, values: mx.array | None, start: int, gathered: Any
) -> tuple[mx.array, mx.array] | None:
    """A KV layer's part of `keep_path`: its keys and values with the gathered path written
    at buffer positions start .., as new arrays (the write must not reach the state they
    came from); None when nothing moves (`gathered` None: the path is already in place).
    The keys carry their RoPE at their depth in the tree, which is their final position."""
    if keys is None or values is None:
        raise StateError("tree commit: a KV layer holds nothing; run the tree forward first")
    if gathered is None:
        return None

    def fill(a: mx.array, block: mx.array) -> mx.array:
        out = a[...]  # a fresh object: the assignment must not reach the state
        out[..., start : start + block.shape[2], :] = block
        return out

    return fill(keys, gathered[0]), fill(values, gathered[1])
