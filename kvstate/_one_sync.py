"""One host sync for the small blocks that every layer of a commit must materialise, and
the work the layers of one commit share.

A ragged `DenseKV` commit gathers each row's moved tokens into a small block and writes it
back into the buffer; the block must be evaluated before the buffer is (while a gather of the
buffer is pending, MLX cannot write into it in place and copies the whole context). Done per
layer that is one host round trip per layer: 30 a speculative round on SmolLM2, tens of
microseconds each on a GPU. Inside `one_sync()` (a composite's commit opens it) the blocks
are collected and evaluated together when the outermost one closes, before anything reads
the written buffers: the writes stay in place, and the round syncs once.

The layers of one model also move the same rows by the same counts: `shared(key, make)`
computes such a value once per commit (the gather index of every layer with the same left
padding), and `parts()` names the states being committed (so a kind can read what all its
layers need from the device in one read rather than one a layer). A ragged DenseKV commit
of a whole model thus waits on the host twice: one read of every layer's left padding, one
evaluation of every layer's moved blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import mlx.core as mx

T = TypeVar("T")


class _Commit:
    """What one outermost `one_sync()` collects: blocks to evaluate, the parts, shared work."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.blocks: list[mx.array] = []
        self.parts = tuple(parts)
        self.shared: dict[Any, Any] = {}


_open: ContextVar[_Commit | None] = ContextVar("kvstate_one_sync", default=None)


@contextmanager
def one_sync(parts: Sequence[Any] = ()) -> Iterator[None]:
    """Evaluate every block `materialise` was given inside, once, at the outermost exit.
    `parts`: the states committed inside (what `parts()` returns). On an exception nothing
    is evaluated (the partial results are dropped with it)."""
    if _open.get() is not None:  # an enclosing commit evaluates them
        yield
        return
    commit = _Commit(parts)
    token = _open.set(commit)
    try:
        yield
    finally:
        _open.reset(token)
    if commit.blocks:
        mx.eval(commit.blocks)


def materialise(blocks: list[mx.array]) -> None:
    """Evaluate `blocks` now, or with the enclosing `one_sync()`'s others when one is open.
    Either way they are evaluated before the caller's results can be read by anyone."""
    commit = _open.get()
    if commit is None:
        mx.eval(blocks)
    else:
        commit.blocks.extend(blocks)


def parts() -> tuple[Any, ...]:
    """The states the open `one_sync()` commits (none outside one)."""
    commit = _open.get()
    return () if commit is None else commit.parts


def shared(key: Any, make: Callable[[], T]) -> T:
    """`make()`, once per open `one_sync()` for each `key` (every call outside one). The key
    must hold what the value depends on; an array in it must stay alive meanwhile (its id
    is what identifies it)."""
    commit = _open.get()
    if commit is None:
        return make()
    if key not in commit.shared:
        commit.shared[key] = make()
    return commit.shared[key]
