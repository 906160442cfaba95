"""Does a state fit a model? Its layers against the model's own caches, config by config."""

from __future__ import annotations

from typing import Any

from kvstate import ModelState
from kvstate.kinds import config_mismatches, fit_config_of


def layer_mismatches(expected: tuple[dict[str, Any], ...], state: ModelState) -> list[str]:
    """Every way `state`'s layers differ from `expected` (the model's `fit_config_of` per
    layer), as "layers[i].field: model's != state's"; empty when the state fits."""
    layers = state.layers
    if len(layers) != len(expected):
        return [f"the state has {len(layers)} layers, the model has {len(expected)}"]
    found = []
    for i, (want, layer) in enumerate(zip(expected, layers, strict=True)):
        got = fit_config_of(layer)
        if got != want:
            found += config_mismatches(want, got, f"layers[{i}]", ("model", "state"))
    return found
