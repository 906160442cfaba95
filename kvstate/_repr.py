"""Summary reprs: kind, batch, shapes, dtypes, statics and bytes; never the values (a state's
arrays can be gigabytes, and printing them would also force their evaluation)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ._tree import State, nbytes
from .kinds import Composite, batch_size_of


def summary(state: Any) -> str:
    """One line per state; a composite adds one indented line per part."""
    if isinstance(state, Composite):
        field = type(state)._parts_field
        placed = getattr(state, "placement", "")
        where = f", {placed}" if placed else ""
        lines = [f"{_head(state)}, {len(state.parts)} {field}{where})"]
        for i, part in enumerate(state.parts):
            lines.append(f"  [{i}] " + summary(part).replace("\n", "\n      "))
        return "\n".join(lines)
    shown = []
    for name in type(state).__kvstate_children__:
        value = getattr(state, name)
        if value is not None:
            shown.append(f"{name}={_child(value)}")
    shown += [f"{n}={getattr(state, n)!r}" for n in type(state).__kvstate_statics__]
    return f"{_head(state)}, {', '.join(shown)})"


def _head(state: Any) -> str:
    try:
        batch, size = f"batch {batch_size_of(state)}", _bytes(nbytes(state))
    except Exception:  # a repr must describe even a state that is inconsistent
        batch, size = "batch ?", "? B"
    return f"{type(state).__name__}({batch}, {size}"


def _child(value: Any) -> str:
    if isinstance(value, mx.array):
        return f"{tuple(value.shape)} {str(value.dtype).rsplit('.', 1)[-1]}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join("None" if v is None else _child(v) for v in value) + ")"
    if isinstance(value, State):
        return f"<{type(value).__name__}>"
    return type(value).__name__


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError
