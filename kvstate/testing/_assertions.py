"""Assertions on states for tests: structure, statics and arrays compared field by field, every
mismatch reported by its path at once (as chex's and xarray's assertions do)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from .._tree import State, eval, tree_map

Compare = Callable[[mx.array, mx.array], str | None]


def assert_states_equal(actual: Any, expected: Any, *, what: str = "") -> None:
    """`actual` and `expected` are the same kind and structure, with equal statics and
    bit-for-bit equal arrays (capacity past a length included; NaNs equal when their bits
    are). Raises AssertionError listing every mismatch by path (`layers[2].keys: ...`),
    prefixed with `what`. Works on states, arrays and tuples / lists of them."""
    _assert(actual, expected, _bitwise, what)


def assert_states_allclose(
    actual: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-5, what: str = ""
) -> None:
    """As `assert_states_equal`, with arrays compared by `|a - e| <= atol + rtol * |e|`."""
    _assert(actual, expected, lambda a, e: _close(a, e, rtol, atol), what)


def frozen_copy(state: Any) -> Any:
    """An evaluated copy of `state` in new buffers: compare with it later to prove that
    nothing changed `state` in place (`assert_states_equal(state, copy)`)."""
    return eval(tree_map(lambda a: mx.array(a), eval(state)))


def _assert(actual: Any, expected: Any, compare: Compare, what: str) -> None:
    found = _differences(eval(actual), eval(expected), "", compare)
    if found:
        shown = "\n  ".join(found[:30])
        more = f"\n  ... and {len(found) - 30} more" if len(found) > 30 else ""
        prefix = f"{what}: " if what else ""
        raise AssertionError(f"{prefix}states differ in {len(found)} place(s):\n  {shown}{more}")


def _differences(a: Any, e: Any, path: str, compare: Compare) -> list[str]:
    where = path or "state"
    if isinstance(a, mx.array) or isinstance(e, mx.array):
        if not (isinstance(a, mx.array) and isinstance(e, mx.array)):
            return [f"{where}: {_what(a)} != {_what(e)}"]
        if a.shape != e.shape or a.dtype != e.dtype:
            return [f"{where}: {_what(a)} != {_what(e)}"]
        problem = compare(a, e)
        return [] if problem is None else [f"{where}: {problem}"]
    if a is None or e is None:
        return [] if a is e else [f"{where}: {_what(a)} != {_what(e)}"]
    if isinstance(a, (tuple, list)) and isinstance(e, (tuple, list)):
        if len(a) != len(e):
            return [f"{where}: {len(a)} entries != {len(e)}"]
        pairs = enumerate(zip(a, e, strict=True))
        return [m for i, (x, y) in pairs for m in _differences(x, y, f"{path}[{i}]", compare)]
    if isinstance(a, State) and isinstance(e, State):
        if type(a) is not type(e):
            return [f"{where}: {type(a).__name__} != {type(e).__name__}"]
        prefix = f"{path}." if path else ""
        found = [
            f"{prefix}{n}: {getattr(a, n)!r} != {getattr(e, n)!r}"
            for n in type(a).__kvstate_statics__
            if getattr(a, n) != getattr(e, n)
        ]
        for n in type(a).__kvstate_children__:
            found += _differences(getattr(a, n), getattr(e, n), f"{prefix}{n}", compare)
        return found
    return [] if a == e else [f"{where}: {a!r} != {e!r}"]


def _what(x: Any) -> str:
    if isinstance(x, mx.array):
        return f"array {tuple(x.shape)} {str(x.dtype).rsplit('.', 1)[-1]}"
    return "None" if x is None else type(x).__name__


def _bits(a: mx.array) -> np.ndarray:
    """The array's bits as unsigned ints (NaNs compare by bits). NumPy reads the buffer
    directly; only bfloat16, which NumPy lacks, takes an MLX view first."""
    if a.dtype == mx.bfloat16:
        return np.asarray(a.view(mx.uint16))
    host = np.asarray(a)
    return host.view(f"u{host.dtype.itemsize}") if host.dtype != np.bool_ else host


def _bitwise(a: mx.array, e: mx.array) -> str | None:
    x, y = _bits(a), _bits(e)
    differ = x != y
    if not differ.any():
        return None
    first = tuple(int(i) for i in np.argwhere(differ)[0])
    return f"{int(differ.sum())} of {differ.size} elements differ (first at {first})"


def _close(a: mx.array, e: mx.array, rtol: float, atol: float) -> str | None:
    if not mx.issubdtype(a.dtype, mx.inexact):
        return _bitwise(a, e)
    x, y = np.array(a.astype(mx.float32)), np.array(e.astype(mx.float32))
    ok = np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    if ok.all():
        return None
    worst = float(np.nanmax(np.abs(x - y)[~ok])) if (~ok).any() else float("nan")
    return (
        f"{int((~ok).sum())} of {ok.size} elements not close (rtol={rtol}, atol={atol}; "
        f"max |actual - expected| {worst:.3g})"
    )
