"""The cache objects of a wrapped model's last plain forward, kept for the next forward from
the state that forward returned.

A decode loop (`logits, state = m(token, state)`) and a draft model's chain of one-token
steps always continue from the state the previous call returned. Those caches hold exactly
that state (it was read from them), so the next call can run on them instead of converting
the state into new cache objects: mlx-lm itself runs on one cache object per layer for a
whole generation. Only the identity of the returned state is trusted: a state derived from
it (commit_prefix, tile, ...) or any older state is converted as before.

The state never shares an array object with the kept caches (the read-back makes `fresh`
arrays), so the next forward's in-place writes into them cannot reach it. Nothing is kept
alive: the caches go when the state they hold goes.
"""

from __future__ import annotations

import weakref
from typing import Any


class KeptCaches:
    def __init__(self) -> None:
        self._state: weakref.ref[Any] | None = None
        self._caches: list[Any] | None = None

    def take(self, state: Any) -> list[Any] | None:
        """The caches holding `state`, if it is the state kept last; they are no longer kept
        either way (a forward that fails midway leaves them half updated)."""
        kept, caches = self._state, self._caches
        self._state = self._caches = None
        return caches if kept is not None and kept() is state else None

    def keep(self, state: Any, caches: list[Any] | None) -> None:
        """Keep `caches`, which hold exactly `state`, while `state` lives."""
        self._caches = caches
        self._state = None if caches is None else weakref.ref(state, self._forget)

    def _forget(self, gone: weakref.ref[Any]) -> None:
        if self._state is gone:
            self._state = self._caches = None
