"""`save` / `load`: a state as one safetensors file. `load` also reads mlx-lm's
`save_prompt_cache` files (see `_io_mlx_lm.py`).

A kvstate file (format "kvstate", version 1) holds:
- one tensor per array of the state, named by its path in the tree ("layers.3.keys.0");
- safetensors metadata (str -> str):
    "kvstate.format"  "kvstate"
    "kvstate.version" "1"
    "kvstate.body"    JSON {"tree": node, "arrays": {name: {"dtype", "shape", "sha256"}},
                            "metadata": {str: str}}   (the caller's metadata)
    "kvstate.sha256"  sha256 of the body text
    "kvstate.placement" (a ModelState of one rank of a distributed model only) its placement,
                      e.g. "tensor rank 0 of 2": the same text as the state's `placement`
                      static inside the body, here for tools that read only the header
  where node is null | {"array": name} | {"tuple": [node, ...]} | {"list": [node, ...]} |
  {"class": name, "statics": {field: value}, "children": {field: node}}.

Class names resolve through the registry of kinds (`kvstate.kinds.kinds()`): nothing is
imported by name and nothing is unpickled. The checksums catch truncation, bit rot and
hand edits; they are not a signature (whoever rewrites a file can recompute them). Every
loaded state then passes `kvstate.check` (mlx-lm files carry no checksums: the check catches
what structure can tell, such as a length past its buffer, never a flipped value).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import uuid
from collections.abc import Mapping
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from ._errors import FileFormatError, NotSupportedError, ShapeError, StateError
from ._io_mlx_lm import is_mlx_lm_file, load_mlx_lm
from ._placement import check_rank, checked_group
from ._tree import is_state, rebuild
from ._validation import check
from .kinds import kind_named, kinds

FORMAT = "kvstate"
VERSION = 1
_FORMAT_KEY, _VERSION_KEY = "kvstate.format", "kvstate.version"
_BODY_KEY, _SHA_KEY = "kvstate.body", "kvstate.sha256"
_PLACEMENT_KEY = "kvstate.placement"

_MAX_DEPTH = 64  # nesting of a state description; real states nest a few levels
# fmt: off
_SAVABLE = (
    mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32, mx.int64,
    mx.float16, mx.bfloat16, mx.float32, mx.float64, mx.complex64,
)
# fmt: on
_DTYPE_NAMES = {dtype: str(dtype).rsplit(".", 1)[-1] for dtype in _SAVABLE}  # "bfloat16"
_UINTS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
_STATIC_TYPES = (bool, int, float, str, type(None))
_MAX_HEADER = 100_000_000  # the safetensors limit on the JSON header


# A path `save` cannot write to is bad input (a StateError) and the OS error it would be
# (callers may catch either), as `io.UnsupportedOperation` is both an OSError and a ValueError.
class _MissingDirectory(StateError, FileNotFoundError):
    """save: the file's directory does not exist."""


class _IsADirectory(StateError, IsADirectoryError):
    """save: the path is a directory."""


# ---------------------------------------------------------------------------- public API


def save(
    path: str | os.PathLike[str], state: Any, metadata: Mapping[str, str] | None = None
) -> None:
    """Write `state` (a ModelState, a layer state, or a tuple/list of them) to `path` as one
    safetensors file, with `metadata` (str -> str) stored alongside.

    Every array is saved whole (capacity included), bit for bit; every static, None child
    and tuple is recorded, so `load(path)` rebuilds an identical state. Before anything is
    written, the description and arrays go through the checks `load` runs (`kvstate.check`
    with values, the statics' types): a state `load` would refuse raises here
    (`ShapeError` naming the field) and no file is written. The file appears atomically: a
    crash mid-write never leaves a truncated file at `path`.
    """
    path = _checked_path(path, "save")
    user = _check_user_metadata(metadata)
    if not (is_state(state) or isinstance(state, (tuple, list))):
        raise StateError(
            f"save: expected a kvstate state (ModelState, DenseKV, ...) or a tuple/list of them; "
            f"got a {type(state).__name__}. Convert mlx-lm caches first: "
            "kvstate.adapters.from_mlx_lm(caches)"
        )
    arrays: dict[str, mx.array] = {}
    tree = _encode(state, (), arrays)
    mx.eval(list(arrays.values()))
    _check_readable(path, tree, arrays)
    specs = {
        name: {"dtype": _dtype_name(a, name), "shape": list(a.shape), "sha256": _digest(a)}
        for name, a in arrays.items()
    }
    body = json.dumps({"tree": tree, "arrays": specs, "metadata": user}, sort_keys=True)
    header = {
        _FORMAT_KEY: FORMAT,
        _VERSION_KEY: str(VERSION),
        _BODY_KEY: body,
        _SHA_KEY: _sha256(body.encode()),
    }
    if getattr(state, "placement", ""):
        header[_PLACEMENT_KEY] = state.placement
    _write_atomically(os.fspath(path), arrays, header)


def load(path: str | os.PathLike[str], *, return_metadata: bool = False, group: Any = None) -> Any:
    """Read a state written by `save`, or a prompt cache written by mlx-lm's
    `save_prompt_cache` (which gives a `ModelState`, built as `kvstate.adapters.from_mlx_lm` builds it).

    Returns the state, or `(state, metadata)` with `return_metadata=True`.
    Raises `FileFormatError` for a missing, truncated, tampered, newer-version or foreign
    file; no state is returned unless every check passed.
    `group` (an `mx.distributed.Group`, for one rank of a distributed model): the file must
    hold this rank's state, saved by a run of the same world size (`PlacementError` if not).
    Without `group` any rank's file loads (to gather them in one process, for instance).
    """
    path = _checked_path(path, "load")
    checked_group(group, "load")
    meta = _read_header(path)
    if _FORMAT_KEY in meta:
        state, user = _load_kvstate(path, meta)
    elif is_mlx_lm_file(meta):
        state, user = load_mlx_lm(path, meta, _load_arrays(path))
        _check_loaded(path, state)
    else:
        raise FileFormatError(
            f"{path!r} is a safetensors file but not a kvstate file: its metadata has "
            f"no {_FORMAT_KEY!r} entry and is not an mlx-lm prompt cache (metadata keys: "
            f"{sorted(meta)[:8]}). Load it with the tool that wrote it, or write it with "
            "kvstate.save"
        )
    if group is not None:
        check_rank(state, group.rank(), group.size(), repr(path))
    return (state, user) if return_metadata else state


# ---------------------------------------------------------------------------- saving


def _checked_path(path: Any, where: str) -> str:
    """A file path (str or os.PathLike) as a str."""
    if not isinstance(path, (str, os.PathLike)):
        raise StateError(
            f"{where}: path must be a str or os.PathLike file path; got {path!r:.60} "
            f"({type(path).__name__})"
        )
    text = os.fspath(path)
    if not isinstance(text, str):  # a bytes path
        raise StateError(f"{where}: path must be a str file path; got {text!r:.60}")
    return text


def _check_readable(path: str, tree: Any, arrays: dict[str, mx.array]) -> None:
    """Refuse to write what `load` would refuse: the state rebuilt from its description
    (through JSON, as `load` reads it) passes the same checks, or `ShapeError` names what
    does not (nothing is written)."""
    try:
        rebuilt = _decode(path, json.loads(json.dumps(tree)), arrays, set(), 0)
        _check_loaded(path, rebuilt)
    except FileFormatError as e:
        text = str(e).replace(f"{path!r} holds an inconsistent state: ", "")
        raise ShapeError(
            f"save: not writing {path!r}: load would refuse the file: {text}. Build the state "
            "with the transforms or from model caches (kvstate.adapters), or fix the fields named"
        ) from None


def _check_user_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise StateError(
            f"save: metadata must be a dict of str -> str; got a {type(metadata).__name__}"
        )
    bad = [(k, v) for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        shown = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in bad[:5])
        raise StateError(
            f"save: metadata must map str to str; these entries do not: {shown}. "
            "Convert the values with str() or json.dumps()"
        )
    return dict(metadata)


def _encode(node: Any, path: tuple[str, ...], arrays: dict[str, mx.array]) -> Any:
    """The JSON node for `node`; its arrays go into `arrays`, named by their path."""
    if node is None:
        return None
    if isinstance(node, mx.array):
        name = ".".join(path)
        arrays[name] = node
        return {"array": name}
    if isinstance(node, (tuple, list)):
        tag = "tuple" if isinstance(node, tuple) else "list"
        return {tag: [_encode(c, (*path, str(i)), arrays) for i, c in enumerate(node)]}
    cls = type(node)
    if kind_named(cls.__name__) is not cls:
        where = ".".join(path) or "the root"
        raise StateError(
            f"save: cannot save a {cls.__module__}.{cls.__qualname__} at {where}; a file may "
            f"hold arrays, None, tuples, lists and the registered kinds {_kind_names()}"
        )
    statics = {}
    defaults = {f.name: f.default for f in attrs.fields(cls)}
    for name in cls.__kvstate_statics__:
        value = getattr(node, name)
        if not isinstance(value, _STATIC_TYPES):
            raise StateError(
                f"save: static field {cls.__name__}.{name} at {'.'.join(path) or 'the root'} "
                f"is a {type(value).__name__} ({value!r}); statics must be bool, int, float, "
                "str or None (use int(x) for numpy scalars)"
            )
        if not _fits(value, defaults[name]):  # load would refuse it
            raise ShapeError(
                f"save: static field {cls.__name__}.{name} at {'.'.join(path) or 'the root'} "
                f"is {value!r}, not a {type(defaults[name]).__name__}; give it a "
                f"{type(defaults[name]).__name__} (load refuses any other type)"
            )
        statics[name] = value
    kids = {
        name: _encode(getattr(node, name), (*path, name), arrays)
        for name in cls.__kvstate_children__
    }
    return {"class": cls.__name__, "statics": statics, "children": kids}


def _dtype_name(a: mx.array, name: str) -> str:
    if a.dtype not in _DTYPE_NAMES:
        raise NotSupportedError(
            f"save: array {name!r} has dtype {a.dtype}, which safetensors cannot hold"
        )
    return _DTYPE_NAMES[a.dtype]


def _digest(a: mx.array) -> str:
    """sha256 of the array's bytes in row-major order (a same-size uint view: numpy has no bf16)."""
    # Hashing the contiguous buffer directly avoids a tobytes() copy (slower than the hash).
    return _sha256(np.ascontiguousarray(np.asarray(a.view(_UINTS[a.dtype.size]))))


def _sha256(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomically(path: str, arrays: dict[str, mx.array], header: dict[str, str]) -> None:
    directory, base = os.path.split(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise _MissingDirectory(f"save: directory {directory!r} does not exist; create it first")
    if os.path.isdir(path):
        raise _IsADirectory(f"save: {path!r} is a directory; give the path of a file")
    # mlx appends ".safetensors" to names without it; give the temporary name that suffix.
    tmp = os.path.join(directory, f".{base}.{uuid.uuid4().hex}.tmp.safetensors")
    try:
        mx.save_safetensors(tmp, arrays, header)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------------------- loading


def _kind_names() -> list[str]:
    return sorted(k.__name__ for k in kinds())


def _read_header(path: str) -> dict[str, str]:
    """The safetensors metadata of `path`, after checking that the file is complete."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            # A named pipe or a device would block or never end: only regular files.
            raise FileFormatError(
                f"{path!r} is not a regular file (a directory, pipe or device); pass the path "
                "of a file written by kvstate.save or mlx-lm's save_prompt_cache"
            )
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little")
            raw = f.read(n) if len(prefix) == 8 and n <= _MAX_HEADER else b""
    except FileNotFoundError:
        raise FileFormatError(
            f"no file at {path!r}; check the path (kvstate.save(path, state) writes one)"
        ) from None
    except OSError as e:
        raise FileFormatError(f"cannot read {path!r}: {e}") from None
    if len(prefix) < 8:
        raise FileFormatError(
            f"{path!r} has {size} bytes, fewer than the 8-byte safetensors length prefix: "
            "the file is truncated or not a kvstate file; save the state again"
        )
    if n > _MAX_HEADER:
        raise FileFormatError(
            f"{path!r} is not a safetensors file: its length prefix announces a {n}-byte header "
            f"(at most {_MAX_HEADER}). Pass a file written by kvstate.save or save_prompt_cache"
        )
    if len(raw) < n:
        raise FileFormatError(
            f"{path!r} is truncated: its header needs {n} bytes after the prefix but the file "
            f"has only {size - 8}; save the state again"
        )
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise FileFormatError(
            f"{path!r} is not a safetensors file (its header is not JSON); pass a file written "
            "by kvstate.save or mlx-lm's save_prompt_cache"
        ) from None
    if not isinstance(header, dict):
        raise FileFormatError(f"{path!r} is not a safetensors file (its header is not a map)")
    end = 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        offsets = spec.get("data_offsets") if isinstance(spec, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and _all_ints(offsets)):
            raise FileFormatError(
                f"{path!r}: tensor {name!r} has no valid data_offsets in the safetensors header "
                f"({spec!r}); the file is corrupt, save the state again"
            )
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size != expected:
        what = "is truncated" if size < expected else "has unexpected trailing bytes"
        raise FileFormatError(
            f"{path!r} {what}: its header describes {expected} bytes but the file has {size}; "
            "save the state again"
        )
    meta = header.get("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FileFormatError(f"{path!r}: the safetensors metadata is not a map of str -> str")
    return meta


def _all_ints(values: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _load_arrays(path: str) -> dict[str, mx.array]:
    try:
        arrays = mx.load(path, format="safetensors")
    except (RuntimeError, ValueError) as e:
        raise FileFormatError(f"{path!r}: mlx cannot read the tensors: {e}") from None
    assert isinstance(arrays, dict)
    return arrays


def _load_kvstate(path: str, meta: dict[str, str]) -> tuple[Any, dict[str, str]]:
    if meta[_FORMAT_KEY] != FORMAT:
        raise FileFormatError(
            f"{path!r}: {_FORMAT_KEY} is {meta[_FORMAT_KEY]!r}, expected {FORMAT!r}; "
            "the file was not written by kvstate.save"
        )
    version = _version(path, meta.get(_VERSION_KEY))
    if version > VERSION:
        raise FileFormatError(
            f"{path!r} has kvstate format version {version}, newer than this kvstate reads "
            f"(up to {VERSION}); upgrade kvstate to load it"
        )
    body = meta.get(_BODY_KEY)
    if body is None or meta.get(_SHA_KEY) != _sha256(body.encode()):
        raise FileFormatError(
            f"{path!r}: the checksum of the state description ({_BODY_KEY}) does not match "
            f"{_SHA_KEY}: the metadata was edited or corrupted; save the state again"
        )
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        raise FileFormatError(f"{path!r}: {_BODY_KEY} is not valid JSON") from None
    specs, tree, user = _parts(path, doc)
    arrays = _load_arrays(path)
    _check_arrays(path, arrays, specs)
    used: set[str] = set()
    state = _decode(path, tree, arrays, used, 0)
    if used != set(arrays):
        raise FileFormatError(
            f"{path!r}: arrays {sorted(set(arrays) - used)} are in the file but not in the "
            "state description; the file is corrupt, save the state again"
        )
    _check_loaded(path, state)
    if meta.get(_PLACEMENT_KEY, "") != getattr(state, "placement", ""):
        raise FileFormatError(
            f"{path!r}: {_PLACEMENT_KEY} is {meta.get(_PLACEMENT_KEY)!r} but the state inside "
            f"records {getattr(state, 'placement', '')!r}: the header was edited; save the state "
            "again"
        )
    return state, user


def _check_loaded(path: str, tree: Any) -> None:
    """Every state in the loaded tree passes `kvstate.check`."""
    if isinstance(tree, (tuple, list)):
        for t in tree:
            _check_loaded(path, t)
        return
    if not is_state(tree):
        return
    try:
        check(tree)
    except ShapeError as e:
        raise FileFormatError(f"{path!r} holds an inconsistent state: {e}") from None


def _version(path: str, text: str | None) -> int:
    # ASCII digits, no leading zero: "01" or a full-width digit is not a version kvstate wrote.
    if text is None or not re.fullmatch(r"[1-9][0-9]{0,8}", text):
        raise FileFormatError(
            f"{path!r}: {_VERSION_KEY} is {text!r}, expected a positive integer; "
            "the file is corrupt or was not written by kvstate.save"
        )
    return int(text)


def _parts(path: str, doc: Any) -> tuple[dict[str, Any], Any, dict[str, str]]:
    ok = isinstance(doc, dict) and {"tree", "arrays", "metadata"} <= set(doc)
    if ok:
        specs, user = doc["arrays"], doc["metadata"]
        ok = isinstance(specs, dict) and all(
            isinstance(s, dict) and {"dtype", "shape", "sha256"} <= set(s) for s in specs.values()
        )
        ok = ok and isinstance(user, dict) and all(isinstance(v, str) for v in user.values())
    if not ok:
        raise FileFormatError(
            f"{path!r}: {_BODY_KEY} lacks the expected 'tree', 'arrays' and 'metadata' "
            "entries; the file is corrupt or from an incompatible writer"
        )
    return doc["arrays"], doc["tree"], doc["metadata"]


def _check_arrays(path: str, arrays: dict[str, mx.array], specs: dict[str, Any]) -> None:
    """Every array present, of its recorded dtype and shape, with its recorded checksum.
    Reports every mismatch at once."""
    problems = [f"missing array {name!r}" for name in specs if name not in arrays]
    problems += [f"unexpected array {name!r}" for name in arrays if name not in specs]
    for name, spec in specs.items():
        a = arrays.get(name)
        if a is None:
            continue
        dtype = _DTYPE_NAMES.get(a.dtype, str(a.dtype))
        if dtype != spec["dtype"]:
            problems.append(f"{name!r} has dtype {dtype}, recorded {spec['dtype']}")
        elif list(a.shape) != spec["shape"]:
            problems.append(f"{name!r} has shape {list(a.shape)}, recorded {spec['shape']}")
        elif _digest(a) != spec["sha256"]:
            problems.append(f"{name!r} does not match its recorded sha256 checksum")
    if problems:
        raise FileFormatError(
            f"{path!r} was corrupted or tampered with: "
            + "; ".join(problems)
            + ". Save the state again"
        )


def _decode(path: str, node: Any, arrays: dict[str, mx.array], used: set[str], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise FileFormatError(
            f"{path!r}: the state description nests deeper than {_MAX_DEPTH} levels; the file "
            "is corrupt or was not written by kvstate.save"
        )
    if node is None:
        return None
    if isinstance(node, dict) and set(node) == {"array"}:
        name = node["array"]
        if name not in arrays or name in used:
            raise FileFormatError(
                f"{path!r}: the state description names array {name!r} "
                f"{'twice' if name in used else 'which the file lacks'}; the file is corrupt"
            )
        used.add(name)
        return arrays[name]
    if isinstance(node, dict) and len(node) == 1 and isinstance(node.get("tuple"), list):
        return tuple(_decode(path, c, arrays, used, depth + 1) for c in node["tuple"])
    if isinstance(node, dict) and len(node) == 1 and isinstance(node.get("list"), list):
        return [_decode(path, c, arrays, used, depth + 1) for c in node["list"]]
    if isinstance(node, dict) and set(node) == {"class", "statics", "children"}:
        return _decode_state(path, node, arrays, used, depth)
    raise FileFormatError(f"{path!r}: unrecognised node in the state description: {node!r:.200}")


def _decode_state(
    path: str, node: dict[str, Any], arrays: dict[str, mx.array], used: set[str], depth: int
) -> Any:
    name, statics, kids = node["class"], node["statics"], node["children"]
    cls = kind_named(name) if isinstance(name, str) else None
    if cls is None:
        raise FileFormatError(
            f"{path!r} names state class {name!r}, which this kvstate does not know "
            f"(known: {_kind_names()}); it was written by a newer kvstate (upgrade to load it) or "
            "holds a kind whose module is not imported yet (import it first)"
        )
    static_names = cls.__kvstate_statics__  # type: ignore[attr-defined]
    child_names = cls.__kvstate_children__  # type: ignore[attr-defined]
    upgrade = getattr(cls, "__kvstate_upgrade__", None)  # a kind whose fields changed
    if (
        upgrade is not None
        and isinstance(statics, dict) and isinstance(kids, dict)
        and (set(statics) != set(static_names) or set(kids) != set(child_names))
    ):  # fmt: skip
        statics, kids = upgrade(statics, kids) or (statics, kids)
    if not (
        isinstance(statics, dict) and set(statics) == set(static_names)
        and isinstance(kids, dict) and set(kids) == set(child_names)
    ):  # fmt: skip
        raise FileFormatError(
            f"{path!r}: a {name} is recorded with fields "
            f"{sorted(statics) if isinstance(statics, dict) else statics!r} / "
            f"{sorted(kids) if isinstance(kids, dict) else kids!r}; this kvstate's {name} has "
            f"statics {sorted(static_names)} and children {sorted(child_names)}"
        )
    for field in attrs.fields(cls):
        if field.name in statics and not _fits(statics[field.name], field.default):
            raise FileFormatError(
                f"{path!r}: {name}.{field.name} is {statics[field.name]!r}, not a "
                f"{type(field.default).__name__}; the file is corrupt"
            )
    child_values = tuple(_decode(path, kids[n], arrays, used, depth + 1) for n in child_names)
    return rebuild(cls, child_values, tuple(statics[n] for n in static_names))


def _fits(value: Any, default: Any) -> bool:
    """A static read from JSON has the type of the field's default (bool is not int)."""
    if default is None or default is attrs.NOTHING:
        return isinstance(value, _STATIC_TYPES)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return type(value) is type(default)
