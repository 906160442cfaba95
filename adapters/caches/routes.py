"""The attention routes of cache classes: which function a routed model's attention calls for
a cache of each class (`instruments.routing` installs and reads them). The table lives with
the caches so that a cache module can register its own class's route without importing the
instruments above it (mlx-vlm's TurboQuant caches, in `vlm/turboquant.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (queries, keys, values, cache, scale, mask, sinks) -> output, or None for mlx-lm's function
Route = Callable[[Any, Any, Any, Any, float, Any, Any], Any]
ROUTES: dict[type, Route] = {}
# Caches whose states need their route at every step (so `wrap` routes the model for good the
# first time one runs); the other routes serve one forward (`attention_routed`).
ROUTED_FOR_GOOD: set[type] = set()
