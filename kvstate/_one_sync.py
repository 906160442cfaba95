"""One host sync for the small blocks that every layer of a commit must materialise.

A ragged `DenseKV` commit gathers each row's moved tokens into a small block and writes it
back into the buffer; the block must be evaluated before the buffer is (while a gather of the
buffer is pending, MLX cannot write into it in place and copies the whole context). Done per
layer that is one host round trip per layer: 30 a speculative round on SmolLM2, tens of
microseconds each on a GPU. Inside `one_sync()` (a composite's commit opens it) the blocks
are collected and evaluated together when the outermost one closes, before anything reads
the written buffers: the writes stay in place, and the round syncs once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx

_collected: ContextVar[list[mx.array] | None] = ContextVar("kvstate_one_sync", default=None)


@contextmanager
def one_sync() -> Iterator[None]:
    """Evaluate every block `materialise` was given inside, once, at the outermost exit.
    On an exception nothing is evaluated (the partial results are dropped with it)."""
    if _collected.get() is not None:  # an enclosing commit evaluates them
        yield
        return
    token = _collected.set([])
    try:
        yield
        blocks = _collected.get()
    finally:
        _collected.reset(token)
    if blocks:
        mx.eval(blocks)


def materialise(blocks: list[mx.array]) -> None:
    """Evaluate `blocks` now, or with the enclosing `one_sync()`'s others when one is open.
    Either way they are evaluated before the caller's results can be read by anyone."""
    collected = _collected.get()
    if collected is None:
        mx.eval(blocks)
    else:
        collected.extend(blocks)
