"""The composite kinds: ListState (mlx-lm's CacheList) and ModelState (a whole model).

Every generic function maps over `.parts` (see `kinds.Composite`); only the classes live here.
"""

from __future__ import annotations

from typing import Any

from ._errors import PlacementError
from ._placement import Placement
from .kinds import (
    Capabilities,
    Composite,
    config_of,
    construction_problems,
    problems,
    state_class,
    static_field,
)


@state_class(Capabilities())
class ListState(Composite):
    """mlx-lm's CacheList: one layer whose cache is several caches (`states`, its parts)."""

    states: tuple[Any, ...] = ()


@state_class(Capabilities())
class ModelState(Composite):
    """A whole model: one state per layer (`layers`, its parts), in `model.layers` order.

    `placement`: "" for a single process; for one rank of a model split with mx.distributed,
    which part of the model this state holds ("tensor rank 0 of 2", "pipeline rank 1 of 2,
    layers 0:2 of 4"; see `kvstate.distributed.Placement`).
    """

    layers: tuple[Any, ...] = ()
    placement: str = static_field(default="")

    @staticmethod
    def __kvstate_upgrade__(statics: dict[str, Any], children: dict[str, Any]) -> Any:
        """A file written before states recorded their placement: a single process's."""
        if statics or set(children) != {"layers"}:
            return None
        return {"placement": ""}, children


@config_of.register
def _(state: ModelState) -> dict[str, Any]:
    # States of different ranks or shardings must never be batched together.
    parts = tuple(config_of(p) for p in state.parts)
    return {"kind": "ModelState", "placement": state.placement, "parts": parts}


@problems.register
def _(state: ModelState, values: bool) -> list[str]:
    found: list[str] = problems.dispatch(Composite)(state, values)
    return found + _placement_problems(state)


@construction_problems.register
def _(state: ModelState) -> list[str]:
    found: list[str] = construction_problems.dispatch(Composite)(state)
    return found + _placement_problems(state)


def _placement_problems(state: ModelState) -> list[str]:
    """The placement is one `Placement.parse` reads, and holds as many layers as the state."""
    if not isinstance(state.placement, str):
        return [f"placement: must be a str; got a {type(state.placement).__name__}"]
    found: list[str] = []
    if not state.placement:  # a single process's (every decode step builds one)
        return found
    try:
        placed = Placement.parse(state.placement)
    except PlacementError as e:
        return [f"placement: {e}"]
    if placed is not None and placed.layers is not None and isinstance(state.layers, tuple):
        start, stop = placed.layers
        if stop - start != len(state.layers):
            found.append(
                f"placement: {state.placement!r} holds {stop - start} layers, the state has "
                f"{len(state.layers)}"
            )
    return found
