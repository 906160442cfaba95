"""The instruments of a token-tree forward: T tokens whose parents form a tree, over ONE copy of the prefix.

Position q of the T inputs has parent `parents[q]` < q (-1: the prefix itself, only for
q = 0). One mlx-lm forward of the T tokens computes, for every q, what a linear forward of
the root-to-q path would compute at its end:
- attention: every KV cache's mask (mlx-lm's models ask the cache: `make_mask`) is
  the causal one AND "q sees the prefix, and among the new tokens only its ancestors and
  itself"; the keys are appended in input order, so a path's keys are gathered afterwards;
- positions: RoPE at `offset + depth(q)`, not `offset + q`. The rope modules get a subclass
  for the forward that moves the token axis into the batch axis and passes one offset per
  token (mx.fast.rope takes an array offset per batch row);
- recurrent layers (kvstate's known mixers, `capture.KNOWN_MIXERS`): the convolution of
  token q reads its own window of ancestors' inputs (a gather, then mlx-lm's Conv1d over T
  windows as a batch); the recurrence (gated delta, Mamba2 SSM) starts token q from its
  parent's state. It runs in one pass with each root-to-leaf path as a batch row, through
  `gated_delta_steps` / `ssm_steps`: the same kernels a linear capture uses on GPUs (one
  launch per layer), the ops path on the CPU; a node shared by several paths is computed
  once per path. No new kernel: the parent pointers live in this module's gathers.

On CUDA, dense caches attend over a bucketed key length (`buckets`) as in any multi-token
forward; the tree mask extends that bucketed mask.

The checkpoints come back in the capture's structure (see `capture`), indexed by input
position: entry t of a recurrent array's checkpoint is its value after position t - 1 (t = 0:
before the forward), as a plain array (conv windows) or `StepStates` (recurrences).

Sliding windows (RotatingKVCache): the window is counted along each token's path, as in
mlx-lm's `create_causal_mask(window_size=...)` for a linear forward of that path.
Anything that would silently ignore the tree is refused with a NotSupportedError: batched
sliding-window, quantized or chunked caches, recurrent layers kvstate does not record, rope
modules that do not take per-row offsets, a model that builds its attention mask without
asking its cache.

These are the instruments; the forward that uses them is the wrapped model's `tree_run`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    ConcatenateKVCache,
    KVCache,
    RotatingKVCache,
)

from kvstate import NotSupportedError, RecurrentState, StateError, StepStates
from kvstate.kinds import as_int

from ..caches.registry import IN_INPUT_ORDER
from ..caches.walk import leaves
from .capture import KNOWN_MIXERS, Record
from .swap import subclass, swapped, with_body

_ATTENTION = (KVCache, BatchKVCache, ConcatenateKVCache, RotatingKVCache)
# Rope classes that pass `offset` straight to mx.fast.rope (so a per-row array works).
_ROPES: tuple[type, ...] = (
    nn.RoPE,
    rope_utils.SuScaledRoPE,
    rope_utils.Llama3RoPE,
    rope_utils.YarnRoPE,
    rope_utils.ProportionalRoPE,
)


class Tree:
    """The shape of one tree forward: parents, depths, paths, masks and window gathers."""

    def __init__(self, parents: Sequence[int]) -> None:
        self.parents = tuple(parents)
        self.size = len(self.parents)
        depth: list[int] = []
        for p in self.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        self.depths = mx.array(depth, mx.int32)
        self.is_chain = list(self.parents) == list(range(-1, self.size - 1))
        self.ropes_called = 0
        self.masks_made = 0
        self._windows: dict[int, mx.array] = {}
        self._ancestry: mx.array | None = None

    def chain(self, q: int) -> list[int]:
        """q, its parent, ..., position 0."""
        out = [q]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out

    def ancestry(self) -> mx.array:
        """(T, T) bool: [q, r] = r is q or one of q's ancestors (built once: every attention
        layer's mask takes it)."""
        if self._ancestry is None:
            rows = [[False] * self.size for _ in range(self.size)]
            for q in range(self.size):
                for r in self.chain(q):
                    rows[q][r] = True
            self._ancestry = mx.array(rows)
        return self._ancestry

    # -- attention -------------------------------------------------------------------------

    def mask(self, causal: mx.array, prefix: int) -> mx.array:
        """mlx-lm's causal mask (..., T, prefix + T [+ bucket padding, all False there])
        restricted to each token's ancestors among the T new keys."""
        self.masks_made += 1
        after = causal.shape[-1] - prefix - self.size
        parts = [mx.ones((self.size, prefix), mx.bool_), self.ancestry()]
        parts += [mx.ones((self.size, after), mx.bool_)] if after else []
        return mx.logical_and(causal, mx.concatenate(parts, 1))

    def window_mask(self, prefix: int, window: int) -> mx.array:
        """(T, prefix + T): mlx-lm's sliding-window causal mask (`create_causal_mask` with
        `window_size`) as each token's linear path sees it: token q sits at prefix + depth(q),
        so it sees the prefix keys less than `window` positions back, and its ancestors."""
        self.masks_made += 1
        depth = self.depths[:, None]
        old = mx.arange(prefix)[None] > prefix + depth - window
        near = (depth - self.depths[None]) < window
        return mx.concatenate([old, mx.logical_and(self.ancestry(), near)], 1)

    # -- recurrent layers -------------------------------------------------------------------

    def window_index(self, width: int) -> mx.array:
        """(T, width + 1) indices into a convolution's widened input (the `width` inputs
        before the forward, then the T new ones): token q's window, oldest first, is its
        ancestors' inputs, continued into the prefix when its chain is shorter."""
        if width not in self._windows:
            rows = []
            for q in range(self.size):
                chain = self.chain(q)
                back = [
                    width + chain[j] if j < len(chain) else width - 1 - (j - len(chain))
                    for j in range(width + 1)
                ]
                rows.append(back[::-1])
            self._windows[width] = mx.array(rows, mx.int32)
        return self._windows[width]

    def conv(self, call: Callable[[mx.array], mx.array], x: mx.array) -> tuple[mx.array, mx.array]:
        """A depthwise causal convolution (`call`, mlx-lm's module, over a widened input x
        (1, width + T, C)) along each token's own ancestors. Returns its output (1, T, C')
        and the convolution state after every position (1, T + 1, width, C)."""
        width = x.shape[1] - self.size
        if x.shape[0] != 1 or width < 0:
            raise NotSupportedError(
                f"tree forward: a convolution input of shape {tuple(x.shape)} does not hold "
                f"the {self.size} tree tokens of one row after its state"
            )
        windows = mx.take(x[0], self.window_index(width), axis=0)  # (T, width + 1, C)
        out = call(windows)  # (T, 1, C')
        states = mx.concatenate([x[:, None, :width], windows[None, :, 1:]], axis=1)
        return out.reshape(1, self.size, -1), states

    def recurrence(
        self,
        steps: Callable[..., tuple[mx.array, mx.array]],
        per_token: Sequence[mx.array],
        state: mx.array | None,
        mask: mx.array | None,
    ) -> tuple[mx.array, mx.array]:
        """`steps(*per_token, state, mask) -> (y, states)` (a linear recurrence over (B, T)
        inputs, such as `gated_delta_steps`) run so that token q starts from its parent's
        state. Returns y (1, T, ...) and the state after every token (1, T, ...).

        One pass with every root-to-leaf path as a batch row (shorter paths padded with
        their leaf, whose extra steps are never read): one launch per layer, as a linear
        capture, instead of one per depth level. A node on several paths is computed once
        per path, cheap next to a launch; its output and state come from the first path
        through it. Every row computes its path's recurrence exactly as a linear pass of
        that path does."""
        if self.is_chain:
            return steps(*per_token, state, mask)
        paths, slots = self._paths()
        inputs = [mx.take(a[0], paths, axis=0) for a in per_token]  # (P, D, ...)
        rows = paths.shape[0]
        start = None if state is None else mx.repeat(state, rows, axis=0)
        path_mask = None if mask is None else mx.take(mask[0], paths)
        y, states = steps(*inputs, start, path_mask)
        y = mx.take(y.reshape(-1, *y.shape[2:]), slots, axis=0)
        states = mx.take(states.reshape(-1, *states.shape[2:]), slots, axis=0)
        return y[None], states[None]

    def _paths(self) -> tuple[mx.array, mx.array]:
        """(P, D) the root-to-leaf paths' positions (padded with their leaf), and (T,) where
        each position sits in them, flattened: path * D + depth."""
        inner = set(self.parents)
        leaves = [q for q in range(self.size) if q not in inner]
        chains = [self.chain(q)[::-1] for q in leaves]
        width = max(len(c) for c in chains)
        slot = [0] * self.size
        for p in range(len(chains) - 1, -1, -1):  # the first path through a node wins
            for d, q in enumerate(chains[p]):
                slot[q] = p * width + d
        padded = [c + [c[-1]] * (width - len(c)) for c in chains]
        return mx.array(padded, mx.int32), mx.array(slot, mx.int32)


# ---------------------------------------------------------------------------------------
# Positions and masks: rope modules with one offset per token, caches with the tree mask.
# ---------------------------------------------------------------------------------------

_TREE: ContextVar[Tree | None] = ContextVar("kvstate_tree", default=None)


def _tree_rope(cls: type, _: None) -> type:
    """A subclass of rope class `cls` that gives each token its tree position while a tree
    forward runs."""

    def __call__(self: nn.Module, x: mx.array, offset: Any = 0, *args: Any, **kw: Any) -> Any:
        tree = _TREE.get()
        if tree is None:
            return cls.__call__(self, x, offset, *args, **kw)
        if x.ndim != 4 or x.shape[0] != 1 or x.shape[2] != tree.size:
            raise NotSupportedError(
                f"tree forward: a rope input of shape {tuple(x.shape)} is not (1, heads, "
                f"{tree.size}, dims); cannot give its tokens their tree positions"
            )
        # (1, H, T, D) -> (T, H, 1, D): one batch row per token, offset + depth each.
        positions = tree.depths + offset
        tree.ropes_called += 1
        out = cls.__call__(self, x.swapaxes(0, 2), positions, *args, **kw)
        return out.swapaxes(0, 2)

    return with_body(cls, {"__call__": __call__})


def rope_modules(model: nn.Module) -> list[nn.Module]:
    """The model's rope modules; a rotary module of another class is refused. (A walk over
    every module: the wrapped model finds them once.)"""
    found: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, _ROPES):
            found.append(cast(nn.Module, module))
        elif "rope" in type(module).__name__.lower() or "rotary" in type(module).__name__.lower():
            raise NotSupportedError(
                f"tree forward: the rope module {type(module).__module__}."
                f"{type(module).__qualname__} is not one kvstate can give per-token positions "
                f"(known: {', '.join(c.__name__ for c in _ROPES)}); verify linearly instead"
            )
    return found


def check_parents(parents: Sequence[int], size: int) -> list[int]:
    """Parents as ints, checked: one per token, parents[0] == -1, 0 <= parents[q] < q."""
    if not isinstance(parents, Sequence):
        raise StateError(f"tree forward: parents must be a list of ints; got {parents!r:.80}")
    out = [as_int(p, "tree forward: parents", StateError) for p in parents]
    if len(out) != size:
        raise StateError(f"tree forward: {len(out)} parents for {size} tokens; give one each")
    bad = [q for q, p in enumerate(out) if (p != -1 if q == 0 else not 0 <= p < q)]
    if bad:
        raise StateError(
            f"tree forward: parents {out[:16]} are not a tree in topological order at "
            f"positions {bad[:8]}: position 0 needs parent -1 (the prefix), every other "
            "position q a parent among 0..q-1"
        )
    return out


def _tree_masked(cls: Any, _: None) -> type:
    """A subclass of attention cache class `cls` whose `make_mask` gives the tree mask while a
    tree forward runs."""

    def make_mask(
        cache: Any, n: int, *args: Any, window_size: int | None = None, **kwargs: Any
    ) -> Any:
        tree = _TREE.get()
        if tree is None:
            return cls.make_mask(cache, n, *args, window_size=window_size, **kwargs)
        if n != tree.size:
            raise NotSupportedError(
                f"tree forward: a mask for {n} tokens, the tree has {tree.size}"
            )
        if isinstance(cache, RotatingKVCache):
            # _update_concat keeps the last max_size - 1 entries before the new ones.
            prefix = min(cache.max_size - 1, cache.offset)
            return tree.window_mask(prefix, window_size or cache.max_size)
        if window_size is not None:
            if not isinstance(cache.offset, int):
                raise NotSupportedError(
                    "tree forward: a sliding-window mask over a left-padded cache is not "
                    "supported; verify linearly instead"
                )
            return tree.window_mask(cache.offset, window_size)
        kwargs.pop("return_array", None)
        causal = cls.make_mask(cache, n, return_array=True, window_size=None, **kwargs)
        # Keys before the forward: BatchKVCache's buffer index, else the offset.
        return tree.mask(causal, cache._idx if isinstance(cache, BatchKVCache) else cache.offset)

    return with_body(cls, {"make_mask": make_mask})


@contextmanager
def following(tree: Tree, ropes: list[nn.Module], attention: list[Any]) -> Iterator[None]:
    """For the length of one forward, the rope modules give each token its tree position and
    every attention cache answers `make_mask` with the tree mask (the caches are this
    forward's own objects)."""
    token = _TREE.set(tree)
    try:
        pairs = [(r, subclass("tree.rope", type(r), _tree_rope)) for r in ropes]
        pairs += [(c, subclass("tree.mask", type(c), _tree_masked)) for c in attention]
        with swapped(pairs):
            yield
    finally:
        _TREE.reset(token)


def attention_caches(caches: list[Any]) -> list[Any]:
    """The attention caches of a tree forward's caches; every cache a tree forward cannot
    serve exactly is refused."""
    attention = []
    for c in leaves(caches):
        if type(c) in _ATTENTION:
            attention.append(c)
        elif not isinstance(c, ArraysCache) and type(c) not in IN_INPUT_ORDER:
            raise NotSupportedError(
                f"tree forward: a layer has a {type(c).__name__}; tree verification supports "
                "KVCache, BatchKVCache, RotatingKVCache (unpadded sliding windows), "
                "kvstate's known recurrent layers and caches registered in_input_order. "
                "Batched sliding-window, quantized and chunked caches: verify linearly or as "
                "a batch of paths (verify_paths) instead"
            )
    return attention


def check_followed(
    tree: Tree, attention: list[Any], ropes: list[Any], records: list[Record]
) -> None:
    """Refuse a tree forward the model did not follow: no mask asked of its caches, rope
    modules not called with the tree's tokens, recurrent layers kvstate does not record."""
    if attention and tree.masks_made == 0:
        raise NotSupportedError(
            "tree forward: the model never asked its caches for an attention mask, so the "
            "tree mask could not be applied; verify linearly instead"
        )
    if ropes and tree.ropes_called == 0:
        raise NotSupportedError(
            "tree forward: the model has rope modules but none was called with the tree's "
            "tokens, so their positions may come from elsewhere; verify linearly instead"
        )
    unknown = [r for r in records if not r.complete()]
    if unknown:
        raise NotSupportedError(
            f"tree forward: {len(unknown)} recurrent layer(s) are not ones kvstate records "
            f"(known: {', '.join(k.rsplit('.', 1)[-1] for k in KNOWN_MIXERS)}); a tree "
            "cannot follow their parent pointers. Verify linearly (capture=True) instead"
        )


def tree_checkpoints(record: Record, before: RecurrentState, after: RecurrentState) -> Any:
    """One recurrent layer's checkpoints by input position: conv windows as one array, the
    recurrence's states as StepStates (the state before, then after each position)."""
    conv, final = after.arrays[0], after.arrays[1] if len(after.arrays) > 1 else None
    assert record.conv_states is not None and record.mixer is not None and conv is not None
    entries: list[Any] = [record.conv_states.astype(conv.dtype)]
    if record.mixer.recurrence is not None:
        assert record.states is not None and final is not None
        first = before.arrays[1]
        first = mx.zeros_like(final) if first is None else first
        entries.append(StepStates(first.astype(record.states.dtype), record.states))
    entries += [None] * (len(after.arrays) - len(entries))
    return tuple(entries)
