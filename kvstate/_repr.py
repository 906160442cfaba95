"""Summary reprs: kind, batch, shapes, dtypes, statics and bytes; never the values (a state's
arrays can be gigabytes, and printing them would also force their evaluation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ._tree import State, nbytes

Parts = Callable[[Any], "tuple[str, tuple[Any, ...]] | None"]
"""A composite's (parts field, parts); None for a layer kind (`kinds` hands it in)."""


def summary(state: Any, batch_size: Callable[[Any], int], parts_of: Parts) -> str:
    """One line per state; a composite adds one indented line per part. `batch_size` and
    `parts_of` come from the kind contract (`kinds.batch_size_of`, the composite's parts)."""
    composite = parts_of(state)
    if composite is not None:
        field, parts = composite
        placed = getattr(state, "placement", "")
        where = f", {placed}" if placed else ""
        lines = [f"{_head(state, batch_size)}, {len(parts)} {field}{where})"]
        for i, part in enumerate(parts):
            line = summary(part, batch_size, parts_of)
            lines.append(f"  [{i}] " + line.replace("\n", "\n      "))
        return "\n".join(lines)
    shown = []
    for name in type(state).__kvstate_children__:
        value = getattr(state, name)
        if value is not None:
            shown.append(f"{name}={_child(value)}")
    shown += [f"{n}={getattr(state, n)!r}" for n in type(state).__kvstate_statics__]
    return f"{_head(state, batch_size)}, {', '.join(shown)})"


def _head(state: Any, batch_size: Callable[[Any], int]) -> str:
    try:
        batch, size = f"batch {batch_size(state)}", _bytes(nbytes(state))
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
