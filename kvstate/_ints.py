"""Integers given to kvstate: Python and NumPy integers and 0-d integer arrays, never bools."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ._errors import StateError


def is_int(x: Any) -> bool:
    """A Python or NumPy integer, or a 0-d integer mx.array / ndarray; never a bool."""
    if isinstance(x, (mx.array, np.ndarray)):
        return x.ndim == 0 and _integer_dtype(x.dtype)
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _integer_dtype(dtype: Any) -> bool:
    if isinstance(dtype, mx.Dtype):
        return mx.issubdtype(dtype, mx.integer)
    return np.issubdtype(dtype, np.integer)


def as_int(x: Any, what: str, error: type[StateError]) -> int:
    """`x` as a Python int, or `error` naming `what`."""
    if not is_int(x):
        raise error(f"{what} must be an integer; got {x!r} ({type(x).__name__})")
    return int(x.item() if isinstance(x, (mx.array, np.ndarray)) else x)  # type: ignore[arg-type]


def as_ints(x: Any, what: str, error: type[StateError]) -> tuple[list[int], bool]:
    """An integer or a sequence / 1-d array of them as a list, and whether it was a scalar."""
    if type(x) is int:  # the common case (commit_prefix's accepted) without the checks
        return [x], True
    if is_int(x):
        return [as_int(x, what, error)], True
    if isinstance(x, (mx.array, np.ndarray)):
        if x.ndim != 1 or not _integer_dtype(x.dtype):
            raise error(
                f"{what} must be an int or a 1-d integer array; got an array of shape "
                f"{tuple(x.shape)} and dtype {x.dtype}"
            )
        return [int(v) for v in x.tolist()], False  # type: ignore[arg-type, union-attr]
    if not isinstance(x, (list, tuple)):
        raise error(f"{what} must be an int or a list of ints; got {x!r:.100}")
    bad = [v for v in x if not is_int(v)]
    if bad:
        raise error(f"{what} must hold only ints; got {bad[:5]!r} in {list(x)!r:.100}")
    return [as_int(v, what, error) for v in x], False
