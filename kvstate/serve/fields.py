"""Checks of one JSON field each: the value, or a BadRequest naming the field.

JSON's numbers arrive as int or float and its booleans as bool (a subclass of int in
Python): every check below tells them apart, so `"max_tokens": true` is refused, not read
as 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import BadRequest


def integer(value: Any, field: str, low: int | None = None, high: int | None = None) -> int:
    """An int (not a bool; a float only when it is whole, as JSON writers emit 16.0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{field} must be an integer; got {_shown(value)}", field)
    if low is not None and value < low:
        raise BadRequest(f"{field} must be >= {low}; got {value}", field)
    if high is not None and value > high:
        raise BadRequest(f"{field} must be <= {high}; got {value}", field)
    return value


def number(value: Any, field: str, low: float | None = None, high: float | None = None) -> float:
    """A finite int or float (not a bool) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{field} must be a finite number; got {_shown(value)}", field)
    if low is not None and value < low:
        raise BadRequest(f"{field} must be >= {low}; got {value}", field)
    if high is not None and value > high:
        raise BadRequest(f"{field} must be <= {high}; got {value}", field)
    return float(value)


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{field} must be true or false; got {_shown(value)}", field)
    return value


def string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{field} must be a string; got {_shown(value)}", field)
    return value


def obj(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{field} must be an object; got {_shown(value)}", field)
    return value


def array(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"{field} must be an array; got {_shown(value)}", field)
    return value


def token_ids(value: Any, field: str, vocab_size: int) -> tuple[int, ...]:
    """A non-empty array of ids in [0, vocab_size)."""
    ids = array(value, field)
    if not ids:
        raise BadRequest(f"{field} is empty; give at least one token", field)
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(
                f"{field}[{i}] must be a token id (an integer); got {_shown(t)}", field
            )
        if not 0 <= t < vocab_size:
            raise BadRequest(
                f"{field}[{i}] = {t} is not a token id of this model (0 .. {vocab_size - 1})",
                field,
            )
        out.append(t)
    return tuple(out)


def stop_strings(value: Any, field: str) -> tuple[str, ...]:
    """`stop`: a string or an array of strings, none of them empty."""
    stops = [value] if isinstance(value, str) else array(value, field)
    for i, s in enumerate(stops):
        where = field if isinstance(value, str) else f"{field}[{i}]"
        if not isinstance(s, str) or not s:
            raise BadRequest(f"{where} must be a non-empty string; got {_shown(s)}", field)
    return tuple(stops)


def neutral(value: Any, field: str, allowed: tuple[Any, ...], what: str) -> None:
    """A field the server understands but does not implement: accepted only at its value
    that changes nothing (`allowed`); any other is refused, never silently ignored."""
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise BadRequest(
            f"{field} {what} is not supported by this server; got {_shown(value)}", field
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
