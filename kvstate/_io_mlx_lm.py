"""Read mlx-lm `save_prompt_cache` files without importing mlx_lm.

mlx-lm's format (mlx_lm/models/cache.py): the tensors are `tree_flatten([c.state for c in
cache])` ("3.0" = layer 3's keys); Python scalars, strings and None in a state are stored as
small arrays and listed in the metadata. The metadata is `tree_flatten([user, classes, scalars])`:
  "0.<key>"  the caller's metadata
  "1.<i>"    layer i's cache class name
  "2.0" = "" then "2.<j>.0" a tensor name and "2.<j>.1" its kind: scalar | string | none.
Each class name maps to the state `kvstate.adapters.from_mlx_lm` builds for that class.
Nothing here is trusted: paths are bounded in depth and index (a renamed tensor must not make
a billion-entry list), and `load` checks every state it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from ._chunked import ChunkedKV
from ._composite import ListState, ModelState
from ._dense import DenseKV
from ._errors import FileFormatError
from ._quantized import QuantizedKV
from ._recurrent import RecurrentState
from ._rotating import RotatingKV
from ._tree import trusted

Tree = Any  # nested lists of mx.array, int, float, bool, str, None
_MAX_DEPTH = 8  # mlx-lm's deepest path: layer . CacheList part . (state, class) . entry . array


def is_mlx_lm_file(meta: dict[str, str]) -> bool:
    """mlx-lm always writes the "2.0" = "" sentinel, and only keys under 0., 1. and 2."""
    return meta.get("2.0") == "" and all(k.split(".", 1)[0] in ("0", "1", "2") for k in meta)


def load_mlx_lm(
    path: str, meta: dict[str, str], arrays: dict[str, mx.array]
) -> tuple[ModelState, dict[str, str]]:
    """The `ModelState` and the caller's metadata of an mlx-lm prompt-cache file."""
    user, classes, scalars = _split_metadata(path, meta)
    values: dict[str, Any] = dict(arrays)
    for name, kind in scalars.items():
        values[name] = _scalar(path, name, kind, arrays.get(name))
    tree = _unflatten(path, values, len(classes))
    if not isinstance(tree, list) or len(tree) > len(classes):
        raise FileFormatError(
            f"{path!r}: the tensors describe {len(tree) if isinstance(tree, list) else '?'} "
            f"layers but the metadata names {len(classes)} cache classes; the file is corrupt"
        )
    tree += [[] for _ in range(len(classes) - len(tree))]  # a layer with no tensors
    layers = tuple(
        _layer(path, c, s, f"layer {i}") for i, (c, s) in enumerate(zip(classes, tree, strict=True))
    )
    mx.eval(list(arrays.values()))  # detach from the file now, not at first use
    return trusted(ModelState)(layers), user


def _split_metadata(
    path: str, meta: dict[str, str]
) -> tuple[dict[str, str], list[str], dict[str, str]]:
    user: dict[str, str] = {}
    classes: dict[int, str] = {}
    parts: dict[str, dict[str, str]] = {}
    for key, value in meta.items():
        head, _, rest = key.partition(".")
        if head == "0":
            user[rest] = value
        elif head == "1" and rest.isascii() and rest.isdigit() and len(rest) < 10:
            classes[int(rest)] = value
        elif head == "2" and rest != "0":
            j, _, part = rest.partition(".")
            parts.setdefault(j, {})[part] = value
        elif key != "2.0":
            raise FileFormatError(f"{path!r}: unexpected mlx-lm metadata key {key!r}")
    if sorted(classes) != list(range(len(classes))):
        raise FileFormatError(
            f"{path!r}: mlx-lm cache class entries {sorted(classes)} are not numbered 0..n-1"
        )
    scalars = {}
    for j, p in parts.items():
        if set(p) != {"0", "1"}:
            raise FileFormatError(f"{path!r}: malformed mlx-lm scalar entry 2.{j}: {p}")
        scalars[p["0"]] = p["1"]
    return user, [classes[i] for i in range(len(classes))], scalars


def _scalar(path: str, name: str, kind: str, a: mx.array | None) -> Any:
    """The Python value mlx-lm stored as a small array (as its load_prompt_cache decodes it)."""
    if a is None:
        raise FileFormatError(f"{path!r}: the metadata lists scalar {name!r}, which has no tensor")
    if kind == "scalar" and a.size == 1:
        return a.item()
    if kind == "string" and a.ndim == 1:
        return "".join(chr(i) for i in cast(list[int], a.tolist()))
    if kind == "none":
        return None
    raise FileFormatError(
        f"{path!r}: scalar {name!r} has kind {kind!r} and shape {tuple(a.shape)}; mlx-lm writes "
        "kinds scalar (one element), string (1-D) and none"
    )


def _unflatten(path: str, values: dict[str, Any], layers: int) -> Tree:
    """Dotted integer paths -> nested lists; gaps become empty lists (mlx-lm's empty states).

    A layer index is below `layers`; an index inside a layer is below the number of entries
    in the file (a list that long needs at least that many), so no path makes a huge list.
    """
    root: dict[int, Any] = {}
    limit = len(values) + layers
    for name, value in values.items():
        keys = name.split(".")
        if not all(k.isascii() and k.isdigit() for k in keys) or len(keys) > _MAX_DEPTH:
            raise FileFormatError(
                f"{path!r}: tensor name {name!r:.80} is not an mlx-lm prompt-cache path (at "
                f"most {_MAX_DEPTH} dotted integers); the file was not written by "
                "save_prompt_cache"
            )
        indices = [int(k) for k in keys]
        if indices[0] >= layers or max(indices) >= limit:
            raise FileFormatError(
                f"{path!r}: tensor name {name!r:.80} points past the file's {layers} layers "
                f"or {len(values)} entries; the file is corrupt"
            )
        node = root
        for k in indices[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise FileFormatError(f"{path!r}: tensor {name!r} sits inside another tensor")
        if indices[-1] in node:
            raise FileFormatError(f"{path!r}: tensor {name!r} clashes with another path")
        node[indices[-1]] = value
    return _as_lists(root)


def _as_lists(node: Any) -> Tree:
    if not isinstance(node, dict):
        return node
    n = max(node) + 1 if node else 0
    return [_as_lists(node[i]) if i in node else [] for i in range(n)]


# ---------------------------------------------------------------------------- per class


def _layer(path: str, name: str, s: Tree, where: str) -> Any:
    entry = _CLASSES.get(name)
    if entry is None:
        raise FileFormatError(
            f"{path!r}: {where} has mlx-lm cache class {name!r}, which kvstate cannot read "
            f"(known: {sorted(_CLASSES)})"
        )
    arity, build = entry
    if not isinstance(s, list) or (arity is not None and len(s) != arity):
        raise FileFormatError(
            f"{path!r}: {where} ({name}) has a state of {len(s) if isinstance(s, list) else s!r} "
            f"entries; mlx-lm's {name}.state has {arity}"
        )
    return build(_Reader(path, f"{where} ({name})"), s)


class _Reader:
    """Typed access to one layer's state entries, with errors that name the file and layer."""

    def __init__(self, path: str, where: str) -> None:
        self.path, self.where = path, where

    def fail(self, what: str, value: Any) -> FileFormatError:
        shown = f"an array {tuple(value.shape)}" if isinstance(value, mx.array) else repr(value)
        return FileFormatError(
            f"{self.path!r}: {self.where}: expected {what}, found {shown:.100}; the file is corrupt"
        )

    def array(self, x: Any) -> mx.array:
        if not isinstance(x, mx.array):
            raise self.fail("an array", x)
        return x

    def optional(self, x: Any) -> mx.array | None:
        return None if x is None else self.array(x)

    def int(self, x: Any) -> int:
        if not isinstance(x, int) or isinstance(x, bool):
            raise self.fail("an integer", x)
        return x

    def bool(self, x: Any) -> bool:
        if not isinstance(x, bool):
            raise self.fail("a bool", x)
        return x

    def triple(self, x: Any) -> tuple[mx.array, mx.array, mx.array] | None:
        if x is None:
            return None
        if not (isinstance(x, list) and len(x) == 3):
            raise self.fail("a quantized triple (packed, scales, biases) or None", x)
        return (self.array(x[0]), self.array(x[1]), self.array(x[2]))


def _kv(r: _Reader, s: Tree) -> DenseKV:
    keys, values, offset = s
    return trusted(DenseKV)(r.optional(keys), r.optional(values), length=r.int(offset))


def _concat(r: _Reader, s: Tree) -> DenseKV:
    keys, values = r.optional(s[0]), r.optional(s[1])
    # ConcatenateKVCache.from_state derives offset from the keys' length.
    return trusted(DenseKV)(
        keys, values, length=0 if keys is None else keys.shape[-2], concatenate=True
    )


def _batch_kv(r: _Reader, s: Tree) -> DenseKV:
    keys, values, offset, left_padding, idx = s
    r.array(offset)  # derived: offset == _idx - left_padding
    return trusted(DenseKV)(
        r.optional(keys), r.optional(values), r.array(left_padding), length=r.int(idx)
    )


def _rotating(r: _Reader, s: Tree) -> RotatingKV:
    keys, values, offset, keep, max_size, idx = s
    return trusted(RotatingKV)(
        r.optional(keys),
        r.optional(values),
        max_size=r.int(max_size),
        keep=r.int(keep),
        offset=r.int(offset),
        index=r.int(idx),
    )


def _batch_rotating(r: _Reader, s: Tree) -> RotatingKV:
    keys, values, offsets, left_padding, max_size, offset, idx, rotated = s
    return trusted(RotatingKV)(
        r.optional(keys),
        r.optional(values),
        r.array(left_padding),
        r.array(offsets),
        max_size=r.int(max_size),
        offset=r.int(offset),
        index=r.int(idx),
        rotated=r.bool(rotated),
    )


def _quantized(r: _Reader, s: Tree) -> QuantizedKV:
    keys, values, offset, group_size, bits = s
    return trusted(QuantizedKV)(
        r.triple(keys),
        r.triple(values),
        length=r.int(offset),
        key_bits=r.int(bits),
        value_bits=r.int(bits),
        key_group_size=r.int(group_size),
        value_group_size=r.int(group_size),
    )


def _chunked(r: _Reader, s: Tree) -> ChunkedKV:
    keys, values, offset, chunk_size, start = s
    return trusted(ChunkedKV)(
        r.optional(keys),
        r.optional(values),
        chunk_size=r.int(chunk_size),
        offset=r.int(offset),
        start_position=r.int(start),
    )


def _arrays(r: _Reader, s: Tree) -> RecurrentState:
    cache, left_padding, lengths = s
    if not isinstance(cache, list):
        raise r.fail("a list of arrays", cache)
    return trusted(RecurrentState)(
        tuple(r.optional(a) for a in cache), r.optional(left_padding), r.optional(lengths)
    )


def _cache_list(r: _Reader, s: Tree) -> ListState:
    children = []
    for i, pair in enumerate(s):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], str)):
            raise r.fail("(state, class name) pairs", pair)
        children.append(_layer(r.path, pair[1], pair[0], f"{r.where} cache {i}"))
    return trusted(ListState)(tuple(children))


_CLASSES: dict[str, tuple[int | None, Callable[[_Reader, Tree], Any]]] = {
    "KVCache": (3, _kv),
    "ConcatenateKVCache": (2, _concat),
    "BatchKVCache": (5, _batch_kv),
    "RotatingKVCache": (6, _rotating),
    "BatchRotatingKVCache": (8, _batch_rotating),
    "QuantizedKVCache": (5, _quantized),
    # Written by kvstate 0.1's adapters (a subclass name mlx-lm cannot load); still read.
    "PackedQuantizedKVCache": (5, _quantized),
    "ChunkedKVCache": (5, _chunked),
    "ArraysCache": (3, _arrays),
    "CacheList": (None, _cache_list),
}
