"""Cache objects <-> kvstate states, O(1): no data is copied (the face of `caches`).

`from_mlx_lm` / `to_mlx_lm` convert a model's list of caches or one cache. mlx-vlm's caches
convert here too: the first mlx-vlm cache to arrive loads its converters (`caches.vlm`,
which imports mlx_vlm; nothing else here does).
"""

from __future__ import annotations

from typing import Any

from kvstate import ModelState, check
from kvstate.kinds import trusted

from .registry import add_loader, from_cache, is_mlx_vlm, to_cache


def _load_vlm(cache: Any) -> bool:
    """Register mlx-vlm's converters when the first of its caches arrives."""
    if not is_mlx_vlm(cache):
        return False
    from . import vlm  # noqa: F401  (registers on import)

    return True


add_loader(_load_vlm)


def from_mlx_lm(caches: Any) -> Any:
    """mlx-lm caches -> a state. A list (a model's prompt cache) gives a `ModelState`;
    a single cache object gives that layer's state.

    The state is checked (`kvstate.check`: shapes, counts, and the per-row padding, which
    reads those small arrays back from the device) before it is returned.
    """
    if isinstance(caches, (list, tuple)):
        return check(trusted(ModelState)(tuple(from_cache(c) for c in caches)))
    return check(from_cache(caches))


def to_mlx_lm(state: Any) -> Any:
    """A state -> new mlx-lm cache objects: a list for a `ModelState`, else one cache."""
    if isinstance(state, ModelState):
        return [to_cache(s) for s in state.layers]
    return to_cache(state)
