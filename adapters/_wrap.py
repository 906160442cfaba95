"""`wrap(model)`: a pure view of an mlx-lm model, `logits, state = m(tokens, state)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import make_prompt_cache

from kvstate import ModelState, ShapeError, StateError
from kvstate._transforms import batch_size_of, record_forward

from ._capture import forward_capturing
from ._convert import from_cache, from_mlx_lm, to_cache


class WrappedModel:
    """An mlx-lm model as a pure function of (tokens, state).

    Each call builds fresh mlx-lm cache objects from the state (O(1): the arrays are new
    objects over the same buffers), runs the model, and reads the caches back into a new
    state. When the caller rebinds (`state = ...`) nothing else holds the old buffers and
    MLX updates them in place; when the caller keeps the old state, MLX copies on write.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def init_state(self, batch_size: int = 1) -> ModelState:
        """An empty state for `batch_size` rows, built by the model's own `make_cache`
        (batched through mlx-lm's own merge, exactly like its BatchGenerator)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ShapeError(f"init_state: batch_size must be an int >= 1; got {batch_size!r}")
        if batch_size == 1:
            return from_mlx_lm(make_prompt_cache(self.model))
        caches = [make_prompt_cache(self.model) for _ in range(batch_size)]
        return from_mlx_lm(_merge_caches(caches))

    def __call__(
        self,
        tokens: mx.array,
        state: ModelState,
        *,
        lengths: Sequence[int] | None = None,
        capture: bool = False,
    ) -> Any:
        """Run `tokens` (B, K) int through the model from `state`.

        `lengths`: for a right-padded batch of prompts, each row's real length; rows are
        re-aligned to left padding afterwards, as in mlx-lm's batch generation.
        `capture=True` also returns per-token checkpoints for `commit_prefix`.
        Returns `(logits (B, K, vocab), state)` or `(logits, state, checkpoints)`.
        """
        if not isinstance(state, ModelState):
            raise StateError(
                f"wrapped model: state must be a kvstate.ModelState; got {type(state).__name__} "
                "(start from m.init_state(batch) or kvstate.adapters.from_mlx_lm(caches))"
            )
        # All layers share the batch; the first says it without a walk over every layer.
        tokens = _as_batch(tokens, batch_size_of(state.layers[0]) if state.layers else 1)
        if lengths is not None:
            _check_lengths(lengths, tokens.shape, capture)
        if capture:
            return forward_capturing(self, tokens, state)
        return self.forward(tokens, state, lengths)

    def forward(
        self, tokens: mx.array, state: ModelState, lengths: Sequence[int] | None = None
    ) -> tuple[mx.array, ModelState]:
        caches = [to_cache(layer) for layer in state.layers]
        width = tokens.shape[1]
        padded = lengths is not None and any(n != width for n in lengths)
        if padded:
            assert lengths is not None
            for c in caches:
                c.prepare(lengths=list(lengths), right_padding=[width - n for n in lengths])
        logits = self.model(tokens, cache=caches)
        if padded:
            for c in caches:
                c.finalize()
        # Read back and stamp each layer in one pass (this runs every decode step).
        layers = zip(caches, state.layers, strict=True)
        return logits, ModelState(tuple(record_forward(from_cache(c), b, width) for c, b in layers))


def _as_batch(tokens: Any, batch: int) -> mx.array:
    tokens = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or (tokens.shape[0] != batch and batch != 1):
        raise ShapeError(
            f"tokens must be (batch, K) with batch = {batch} (the state's rows); "
            f"got shape {tuple(tokens.shape)}"
        )
    return tokens


def _check_lengths(lengths: Sequence[int], shape: tuple[int, ...], capture: bool) -> None:
    batch, width = shape
    if capture:
        raise StateError(
            "capture=True with lengths=: a right-padded prompt batch is not a verify forward; "
            "prefill with lengths= first, then verify with capture=True"
        )
    bad = [n for n in lengths if not isinstance(n, int) or not 1 <= n <= width]
    if len(lengths) != batch or bad:
        raise ShapeError(
            f"lengths must give one int in 1..{width} (the padded width) per row of the "
            f"{batch}-row batch; got {list(lengths)}"
        )


def wrap(model: nn.Module) -> WrappedModel:
    """A pure view of an mlx-lm model: `logits, state = wrap(model)(tokens, state)`."""
    return WrappedModel(model)
