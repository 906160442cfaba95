"""The composite kinds: ListState (mlx-lm's CacheList) and ModelState (a whole model).

Every generic function maps over `.parts` (see `kinds.Composite`); only the classes live here.
"""

from __future__ import annotations

from typing import Any

from .kinds import Capabilities, Composite, state_class


@state_class(Capabilities())
class ListState(Composite):
    """mlx-lm's CacheList: one layer whose cache is several caches (`states`, its parts)."""

    states: tuple[Any, ...] = ()


@state_class(Capabilities())
class ModelState(Composite):
    """A whole model: one state per layer (`layers`, its parts), in `model.layers` order."""

    layers: tuple[Any, ...] = ()
