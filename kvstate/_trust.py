"""Which states a consumer (a wrapped model) has already checked, so that it need not check
them again: the states it vouched for, and the states the public transforms made from those
alone.

Every transform keeps each layer's kind and configuration (merge and extend refuse states of
different configurations), so a state made only from states that fit a model fits it too.
The record is weak: it keeps no state alive.
"""

from __future__ import annotations

import weakref
from typing import Any, TypeVar

S = TypeVar("S")

_VOUCHERS: weakref.WeakKeyDictionary[Any, frozenset[object]] = weakref.WeakKeyDictionary()


def vouch(state: S, voucher: object) -> S:
    """Record that `voucher` (any hashable token) checked `state`. Returns `state`."""
    _VOUCHERS[state] = _VOUCHERS.get(state, frozenset()) | {voucher}
    return state


def vouched(state: Any, voucher: object) -> bool:
    """Did `voucher` check `state`, or every state a transform made it from?"""
    try:
        return voucher in _VOUCHERS.get(state, ())
    except TypeError:  # not weak-referenceable: nobody vouched for it
        return False


def inherit(result: S, *sources: Any) -> S:
    """`result` was made by a transform from `sources` only: it carries the vouchers they all
    carry. Returns `result`."""
    common: frozenset[object] | None = None
    for source in sources:
        found = _VOUCHERS.get(source)
        if not found:
            return result
        common = found if common is None else common & found
    if common:
        _VOUCHERS[result] = common
    return result
