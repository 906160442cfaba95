"""`wrap(model)`: the wrapped model for an mlx-lm model, or for an mlx-vlm one (whose class,
and mlx_vlm with it, is imported only when such a model arrives)."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from kvstate import StateError

from ..caches.registry import is_mlx_vlm
from .model import WrappedModel


def wrap(
    model: nn.Module,
    *,
    buckets: bool | None = None,
    verify_kernel: bool | None = None,
    record_mixers: bool | None = None,
) -> WrappedModel:
    """A pure view of an mlx-lm model: `logits, state = wrap(model)(tokens, state)`.
    An mlx-vlm model gets `kvstate.adapters.vlm.VLMWrappedModel` (its caches, its language
    model). Options (None: the defaults in effect, see `kvstate.adapters.wrap_options`):
    `buckets`, `verify_kernel` (how multi-token forwards attend on CUDA), `record_mixers`
    (False: every recurrent layer's checkpoints by replay)."""
    if not isinstance(model, nn.Module):
        raise StateError(
            f"wrap: model must be an mlx-lm (or mlx-vlm) model, an mlx.nn.Module (e.g. "
            f"mlx_lm.load(path)[0]); got "
            f"{'None' if model is None else 'a ' + type(model).__name__}"
        )
    options: dict[str, Any] = {
        "buckets": buckets,
        "verify_kernel": verify_kernel,
        "record_mixers": record_mixers,
    }
    if is_mlx_vlm(model):
        from .vlm import VLMWrappedModel  # imports mlx_vlm, which this model already did

        return VLMWrappedModel(model, **options)
    return WrappedModel(model, **options)
