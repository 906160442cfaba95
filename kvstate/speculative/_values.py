"""Checks of single values the speculative package takes (counts, seeds, keys, token ids),
and the marks its device-side checks leave for a round's one host read.

Host values (Python ints, lists, NumPy arrays) are checked on the host, before anything
runs. Ids and distributions that are still on the device (a draft model's unevaluated drafts
and probabilities) are not read back for a check, which would stall the pipeline: a round
computes a few bits per row next to its verdict (`DRAFT_ID`, ...), reads them with the
verdict it reads anyway, and raises after that read if any is set (`raise_marked`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np

from .. import StateError, TokenError

# Bits of the per-row marks a round computes on the device and reads with its verdict.
DRAFT_ID = 1  # a counted draft id outside the vocabulary its distribution covers
DRAFT_PROBS = 2  # a counted draft's probs are not a distribution (NaN, negative, sum != 1)
DRAFT_UNLIKELY = 4  # a counted draft has probability 0 under the probs it was drawn from
TARGET_NAN = 8  # the target's distribution the next token is drawn from holds NaN

INT32_LIMIT = 2**31  # ids are int32 on the device: none at or past this is a token
SEED_LIMIT = 2**64  # mx.random.key takes a uint64
SUM_TOLERANCE = 1e-2  # |sum(q) - 1| of a float32 / bfloat16 distribution over ~150k ids


class Made(list[int]):
    """Ids or counts the generator made itself and has checked (a round's next tokens, its
    kept counts), as it hands them to a drafter's `propose` / `accept`: a drafter skips
    re-checking their types and counts (it still checks what its own model cannot take).
    Anything else a drafter is given (a plain list, an array) is checked in full."""

    __slots__ = ()


class DrafterError(StateError):
    """A drafter's output the generator cannot verify: not a `Proposal` / `DraftTree`, rows
    or counts that do not match the round, probabilities of the wrong shape or that are not
    a distribution. Draft ids outside the vocabulary raise `TokenError` instead."""


def is_integer(x: Any) -> bool:
    """A Python or NumPy integer (never a bool)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def integer(x: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    """`x` as an int in low..high (None: unbounded), else a StateError naming `name`."""
    if not is_integer(x):
        raise StateError(f"{name} must be an int; got {x!r} ({type(x).__name__}){_hint(x)}")
    value = int(x)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise StateError(f"{name} must be an int {span}; got {value}")
    return value


def _hint(x: Any) -> str:
    if isinstance(x, float) and math.isfinite(x) and x == int(x):
        return f": pass {int(x)}"
    if isinstance(x, str) and x.strip().lstrip("-").isdigit():
        return f": pass {int(x)}, not a string"
    return ""


def real(x: Any, name: str) -> float:
    """`x` as a finite float (an int or float, never a bool or a string)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise StateError(f"{name} must be a number; got {x!r} ({type(x).__name__})")
    if not math.isfinite(float(x)):
        raise StateError(f"{name} must be finite; got {x!r}")
    return float(x)


def flag(x: Any, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise StateError(f"{name} must be True or False; got {x!r} ({type(x).__name__})")
    return bool(x)


def seed(x: Any, name: str) -> int:
    """A PRNG seed: an int in 0 .. 2**64 - 1 (what `mx.random.key` takes)."""
    return integer(x, name, 0, SEED_LIMIT - 1)


def prng_key(key: Any, name: str) -> mx.array:
    """An `mx.random.key(seed)`: uint32 of shape (2,)."""
    if not (isinstance(key, mx.array) and key.shape == (2,) and key.dtype == mx.uint32):
        shown = f"{key.dtype} {key.shape}" if isinstance(key, mx.array) else repr(key)[:60]
        raise StateError(f"{name} must be an mx.random.key(seed) (uint32, (2,)); got {shown}")
    return key


def ids(x: Any, name: str, vocab: int | None) -> list[int]:
    """A sequence or 1-d array of token ids as Python ints, each in 0..vocab-1 (None: in
    int32), else a TokenError naming `name` and the ids."""
    if isinstance(x, mx.array):
        if x.ndim != 1 or not mx.issubdtype(x.dtype, mx.integer):
            raise TokenError(
                f"{name} must be a 1-d array of integer ids; got an mx.array of shape "
                f"{tuple(x.shape)} and dtype {x.dtype}"
            )
        values = [int(v) for v in cast(list[int], x.tolist())]
    elif isinstance(x, np.ndarray):
        if x.ndim != 1 or x.dtype.kind not in "iu":
            raise TokenError(
                f"{name} must be a 1-d array of integer ids; got a NumPy array of shape "
                f"{x.shape} and dtype {x.dtype}"
            )
        values = [int(v) for v in x.tolist()]
    elif isinstance(x, (list, tuple, range)):
        values = list(x)
        if not all(type(v) is int for v in values):  # the common case in one pass
            bad = [v for v in values if not is_integer(v)]
            if bad:
                raise TokenError(
                    f"{name} must hold integer token ids; got {bad[:4]!r} "
                    f"({type(bad[0]).__name__}) in {_short(values)}"
                )
            values = [int(v) for v in values]
    else:
        raise TokenError(
            f"{name} must be a list or 1-d array of token ids; got {_short(x)} ({type(x).__name__})"
        )
    top = INT32_LIMIT if vocab is None else vocab
    if values and (min(values) < 0 or max(values) >= top):
        outside = sorted({v for v in values if not 0 <= v < top})
        raise TokenError(f"{name} holds ids {outside[:8]} outside {_range(vocab)}")
    return values


def _range(vocab: int | None) -> str:
    if vocab is None:
        return f"0..{INT32_LIMIT - 1} (int32 ids)"
    return f"the target's vocabulary (0..{vocab - 1})"


def _short(x: Any) -> str:
    return f"{x!r:.80}"


def counts_of(x: Any, name: str, rows: int, most: int) -> list[int]:
    """One int in 0..most per row (a list, tuple or 1-d integer array)."""
    if isinstance(x, (mx.array, np.ndarray)) and x.ndim == 1:
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        raise DrafterError(f"{name} must be a list of ints, one per row; got {_short(x)}")
    values = list(x)
    if not all(type(v) is int for v in values):
        bad = [v for v in values if not is_integer(v)]
        if bad:
            raise DrafterError(f"{name} must hold ints; got {bad[:4]!r} in {_short(values)}")
        values = [int(v) for v in values]
    if len(values) != rows:
        raise DrafterError(f"{name} has {len(values)} counts for {rows} rows; give one per row")
    if values and (min(values) < 0 or max(values) > most):
        raise DrafterError(f"{name} must each be in 0..{most}; got {values[:16]}")
    return values


def raise_marked(marks: Sequence[int], messages: dict[int, tuple[type[StateError], Any]]) -> None:
    """Raise for the first bit (in `messages`' order) set in some row's `marks`: the error
    class and a function of the rows marked that writes the message (read on the error path
    only)."""
    for bit, (error, message) in messages.items():
        rows = [b for b, m in enumerate(marks) if m & bit]
        if rows:
            raise error(message(rows))
