"""Recording a forward's final hidden states (`hidden=True`): the input of the model's output
projection, (B, K, D), what MTP-style draft heads start from.

mlx-lm models end with `lm_head(h)` or, with tied embeddings, `embed_tokens.as_linear(h)`,
h being the last layer's output after the final norm. Rather than knowing each model's
attribute names, every candidate (a module named `lm_head`, a module with an `as_linear`
method) gets a recording subclass for the length of one forward, as `capture` does with
mixers, and gets its class back afterwards; exactly one distinct input must be recorded.
Nothing is patched when hidden states are not asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from kvstate import NotSupportedError

from .swap import subclass, swapped, with_body


class Projection(NamedTuple):
    """A candidate output projection: `module.<method>(hidden)` gives logits."""

    module: nn.Module
    method: str  # "__call__" (an lm_head) or "as_linear" (a tied embedding)


def output_projections(model: nn.Module) -> list[Projection]:
    """The modules of `model` that may compute its logits from its final hidden states."""
    found: list[Projection] = []
    for name, module in model.named_modules():
        if any(p.module is module for p in found):  # a module shared under two names
            continue
        if name.rsplit(".", 1)[-1] == "lm_head":
            found.append(Projection(module, "__call__"))
        elif callable(getattr(type(module), "as_linear", None)):
            found.append(Projection(module, "as_linear"))
    return found


_SINK: ContextVar[list[mx.array] | None] = ContextVar("kvstate_hidden_sink", default=None)


def _recording_class(cls: type, method: str) -> type:
    """A subclass of `cls` whose `method` records its first argument (made once per class)."""
    return subclass("hidden", cls, _make_recording_class, method)


def _make_recording_class(cls: type, method: str) -> type:
    original: Callable[..., Any] = getattr(cls, method)

    def recording(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        sink = _SINK.get()
        if sink is not None:
            sink.append(x)
        return original(self, x, *args, **kwargs)

    return with_body(cls, {method: recording})


@contextmanager
def recording_hidden(projections: list[Projection]) -> Iterator[list[mx.array]]:
    """Give every candidate projection its recording class for one forward; yields the list
    its inputs are appended to (read it with `hidden_states`)."""
    sink: list[mx.array] = []
    token = _SINK.set(sink)
    try:
        with swapped((p.module, _recording_class(type(p.module), p.method)) for p in projections):
            yield sink
    finally:
        _SINK.reset(token)


def hidden_states(sink: list[mx.array], logits: mx.array, model: nn.Module) -> mx.array:
    """The one hidden-state array the output projection took, checked against the logits.
    (A projection that delegates to another, as a tied head to its embedding, records the
    same array twice: that counts once.)"""
    distinct = list({id(x): x for x in sink}.values())
    name = type(model).__name__
    if not distinct:
        raise NotSupportedError(
            f"hidden=True: no output projection of this {name} ran (kvstate looks for a "
            "module named `lm_head` and for an embedding's `as_linear`); this model's hidden "
            "states cannot be returned"
        )
    if len(distinct) > 1:
        raise NotSupportedError(
            f"hidden=True: {len(distinct)} different inputs reached this {name}'s candidate "
            "output projections (`lm_head` / `as_linear`) in one forward; which one feeds the "
            "logits is ambiguous"
        )
    (hidden,) = distinct
    if hidden.ndim != logits.ndim or hidden.shape[:-1] != logits.shape[:-1]:
        raise NotSupportedError(
            f"hidden=True: the output projection of this {name} took shape "
            f"{tuple(hidden.shape)}, which does not line up with the logits' "
            f"{tuple(logits.shape)}"
        )
    return hidden
