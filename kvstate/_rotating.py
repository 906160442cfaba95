"""RotatingKV: RotatingKVCache and BatchRotatingKVCache (sliding windows) as one state kind.

Two layouts, exactly mlx-lm's:
- unpadded (`left_padding is None`, RotatingKVCache): `offset` counts every token seen,
  `index` is the ring's write index, the first `keep` entries never rotate out;
- batched (BatchRotatingKVCache, keep = 0): `left_padding` (B,) counts the padding entries at
  the window's temporal front (negative once rotated past them), `offsets` (B,) are the rows'
  RoPE positions, `offset` is mlx-lm's `_offset` (steps, padding included), `rotated` says the
  ring wrapped.

merge / filter / extend / extract follow mlx-lm's BatchRotatingKVCache methods array for array,
without touching their inputs. `commit_prefix` rebuilds the window from the state before the
verify forward (`previous`) in O(window) and returns a canonical, unrotated state: entries in
temporal order, `index` = their count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx

from ._errors import CommitError, ConfigMismatchError, NotSupportedError
from ._shared import array_kv_config, path_entries, path_in_place, shared_appended
from ._tree import State, host_ints, replace, trusted
from ._validation import (
    kv_pair_problems,
    previous_rows_problems,
    rows_problems,
    static_int,
    typed_statics,
)
from .kinds import (
    Capabilities,
    batch_size_of,
    capabilities_of,
    commit_rows,
    config_of,
    extend_states,
    extract_row,
    gather_path,
    keep_path,
    merge_states,
    problems,
    record_forward,
    state_class,
    static_field,
    take_rows,
)


@state_class(Capabilities(trimmable=True, ragged_commit=True, batchable=True))
class RotatingKV(State):
    """A sliding window: a ring buffer of at most `max_size` entries (more right after a
    multi-token forward, exactly like mlx-lm), the first `keep` of which never rotate out.

    keys/values (B, H, L, D). `offset` counts every token seen (the batched form's `_offset`),
    `index` is the ring's write index, `rotated` (batched form) says the ring has wrapped.
    The batched form also carries per-row `offsets` (B,) (RoPE positions). `previous` is the
    window before the last multi-token forward, which may have pushed entries out: an exact
    rollback needs them back.
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    left_padding: mx.array | None = None
    offsets: mx.array | None = None
    previous: RotatingKV | None = None
    max_size: int = static_field(default=0)
    keep: int = static_field(default=0)
    offset: int = static_field(default=0)
    index: int = static_field(default=0)
    rotated: bool = static_field(default=False)
    appended: int = static_field(default=0)


KV = tuple[mx.array, mx.array]


def _batched(state: RotatingKV) -> bool:
    return state.left_padding is not None


def _cat(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def temporal(state: RotatingKV) -> KV | None:
    """The window's entries oldest first, (B, H, P, D) each; None for an empty window.

    mlx-lm's `_temporal_order` of either class (the batched one drops the unused tail too).
    """
    k, v = state.keys, state.values
    if k is None or v is None:
        return None
    length, idx = k.shape[2], state.index
    if _batched(state):
        if state.rotated:
            return mx.roll(k, -idx, 2), mx.roll(v, -idx, 2)
        return (k, v) if idx == length else (k[..., :idx, :], v[..., :idx, :])
    if idx == length:
        return k, v
    if idx < state.offset:  # wrapped: [keep | oldest .. | newest ..]
        keep = state.keep

        def order(a: mx.array) -> mx.array:
            return mx.concatenate([a[..., :keep, :], a[..., idx:, :], a[..., keep:idx, :]], 2)

        return order(k), order(v)
    return k[..., :idx, :], v[..., :idx, :]


@problems.register
def _(state: RotatingKV, values: bool) -> list[str]:
    found = typed_statics(
        state, max_size=1, keep=0, offset=0, index=0, appended=0, bools=("rotated",)
    )
    found += kv_pair_problems(state.keys, state.values)
    if found:
        return found
    found += static_int("keep", state.keep, 0, state.max_size)
    found += static_int("appended", state.appended, 0, state.offset)
    capacity = 0 if state.keys is None else int(state.keys.shape[2])
    found += static_int("index", state.index, 0, capacity)
    if _batched(state):
        found += rows_problems("left_padding", state.left_padding, batch_size_of(state))
        batch = batch_size_of(state)
        if state.keys is not None and state.keys.shape[0] != batch:
            found.append(f"keys: batch {state.keys.shape[0]}, but left_padding has {batch} rows")
        found += rows_problems("offsets", state.offsets, batch, "left_padding")
        if state.offsets is None:
            found.append("offsets: the batched form (left_padding set) needs per-row offsets")
        if state.keep:
            found.append(f"keep: {state.keep}, but the batched form has no keep prefix")
    elif state.offsets is not None or state.rotated:
        found.append("offsets / rotated: only the batched form (left_padding set) has them")
    if state.previous is not None:
        found += _previous_problems(state, state.previous, values)
    return found


def _previous_problems(state: RotatingKV, prev: Any, values: bool) -> list[str]:
    if not isinstance(prev, RotatingKV):
        return [f"previous: must be a RotatingKV or None; got a {type(prev).__name__}"]
    found = [f"previous.{m}" for m in problems(prev, values)]
    if (prev.max_size, prev.keep) != (state.max_size, state.keep):
        found.append("previous: max_size and keep must be the state's own")
    if prev.previous is not None or prev.appended:
        found.append("previous: holds one window, with no record or pending forward of its own")
    return found + previous_rows_problems(state, prev)


@capabilities_of.register
def _(state: RotatingKV) -> Capabilities:
    # A batched window has no keep prefix, so one with keep takes neither ragged counts nor
    # a batch; a one-token forward that overwrote a slot cannot be undone.
    return Capabilities(
        trimmable=True,
        ragged_commit=not state.keep,
        batchable=not state.keep,
        can_roll_back=_can_roll_back(state),
    )


def _can_roll_back(state: RotatingKV) -> bool:
    """False after a one-token forward that wrote over an entry the window still needed."""
    return state.appended != 1 or state.previous is not None or _slot_was_free(state)


def _slot_was_free(state: RotatingKV) -> bool:
    """After a one-token forward: the write went to an unused slot (all the window is there)."""
    overwrote = state.rotated if _batched(state) else state.offset > state.max_size
    return not overwrote and state.index >= 1 and (_batched(state) or state.index == state.offset)


@batch_size_of.register
def _(state: RotatingKV) -> int:
    if state.left_padding is not None:
        return int(state.left_padding.shape[0])
    return int(state.keys.shape[0]) if state.keys is not None else 1


@config_of.register
def _(state: RotatingKV) -> dict[str, Any]:
    return array_kv_config(
        "RotatingKV", state.keys, state.values, max_size=state.max_size, keep=state.keep
    )


@record_forward.register
def _(state: RotatingKV, before: RotatingKV, n: int) -> RotatingKV:
    # A multi-token forward (mlx-lm's _update_concat) trims the window, so an exact rollback
    # needs the state before it. A 1-token forward writes one ring slot in place: holding
    # `before` there would stop MLX from donating the buffer on every decode step.
    previous = replace(before, previous=None, appended=0) if n > 1 else None
    return replace(state, previous=previous, appended=n)


# ---------------------------------------------------------------------------------------
# commit_prefix
# ---------------------------------------------------------------------------------------


@attrs.frozen
class _History:
    """What a rebuild needs: the window before the forward, in temporal order, and the
    forward's new entries. keys (B, H, P, Dk) or None; new_keys (B, H, n, Dk)."""

    keys: mx.array | None
    values: mx.array | None
    new_keys: mx.array
    new_values: mx.array
    left_padding: mx.array | None  # before the forward (batched form)
    offsets: mx.array | None
    offset: int


@commit_rows.register
def _(state: RotatingKV, counts: tuple[int, ...], checkpoints: Any) -> RotatingKV:
    n = state.appended
    if all(c == n for c in counts):
        return replace(state, previous=None, appended=0)
    if state.previous is not None and not any(counts):
        return replace(state.previous, previous=None, appended=0)  # exactly the state before
    history = _history(state, counts)
    if len(set(counts)) == 1:
        return _commit_uniform(state, history, counts[0])
    return _commit_ragged(state, history, counts)


def _history(state: RotatingKV, counts: tuple[int, ...]) -> _History:
    n = state.appended
    k, v = state.keys, state.values
    assert k is not None and v is not None
    prev = state.previous
    if prev is not None:
        # _update_concat leaves the window in temporal order with the n new entries last.
        if state.offsets is not None and prev.offsets is not None:
            # A right-padded prompt forward (wrap(..., lengths=)) rolls rows: no prefix exists.
            steps = state.offsets - prev.offsets
            if not bool(mx.all(steps == n).item()):
                raise CommitError(
                    f"commit_prefix: the last forward of {n} tokens was a right-padded prompt "
                    f"(rows advanced by {steps.tolist()} tokens, not {n}); only accepting all "
                    "of it is defined: pass accepted = appended, or run the prompt unpadded"
                )
        pk, pv = temporal(prev) or (None, None)
        length = k.shape[2]
        return _History(
            pk,
            pv,
            k[..., length - n :, :],
            v[..., length - n :, :],
            prev.left_padding,
            prev.offsets,
            prev.offset,
        )
    if n == 1 and _slot_was_free(state):
        # The 1-token write went to an unused slot: the window before it is still all there.
        i = state.index
        return _History(
            k[..., : i - 1, :],
            v[..., : i - 1, :],
            k[..., i - 1 : i, :],
            v[..., i - 1 : i, :],
            state.left_padding,
            state.offsets - 1 if state.offsets is not None else None,
            state.offset - 1,
        )
    if n == 1:
        raise CommitError(
            f"commit_prefix(state, {list(counts)}) after a 1-token forward that overwrote a "
            f"window slot (offset {state.offset}, max_size {state.max_size}): the overwritten "
            "entry is gone. Keep the state you passed to that forward and use it instead: "
            "states are immutable, so that state IS the rollback"
        )
    raise CommitError(
        f"commit_prefix: this RotatingKV says its last forward appended {n} tokens but holds "
        "no record of the window before it (`previous` is None); commit states that "
        "kvstate.adapters.wrap returned, or build them with kvstate.kinds.record_forward"
    )


def _commit_uniform(state: RotatingKV, h: _History, accepted: int) -> RotatingKV:
    """Every row keeps `accepted`: the pre-forward window, then the accepted entries, then
    mlx-lm's own trim (the `keep` prefix and the newest max_size - keep)."""
    parts_k = [a for a in (h.keys,) if a is not None and a.shape[2] > 0]
    parts_v = [a for a in (h.values,) if a is not None and a.shape[2] > 0]
    if accepted:
        parts_k.append(h.new_keys[..., :accepted, :])
        parts_v.append(h.new_values[..., :accepted, :])
    total = (h.keys.shape[2] if h.keys is not None else 0) + accepted
    max_size, keep = state.max_size, state.keep
    cut = max(0, total - max_size)
    keys: mx.array | None = None
    values: mx.array | None = None
    if parts_k:
        keys, values = _cat(parts_k), _cat(parts_v)
        if cut:
            keys = mx.concatenate([keys[..., :keep, :], keys[..., keep + cut :, :]], axis=2)
            values = mx.concatenate([values[..., :keep, :], values[..., keep + cut :, :]], 2)
    length = total - cut
    if not _batched(state):
        return trusted(RotatingKV)(
            keys, values, max_size=max_size, keep=keep, offset=h.offset + accepted, index=length
        )
    assert h.left_padding is not None and h.offsets is not None
    return trusted(RotatingKV)(
        keys,
        values,
        h.left_padding - cut,
        h.offsets + accepted,
        max_size=max_size,
        offset=max(length, h.offset + accepted),
        index=length,
    )


def _commit_ragged(state: RotatingKV, h: _History, counts: tuple[int, ...]) -> RotatingKV:
    """Row b keeps counts[b]: one gather right-aligns every row's newest entries (at most
    max_size) and grows its left padding; O(window) whatever the context."""
    if state.keep:
        raise CommitError(
            f"commit_prefix: ragged counts {list(counts)} on a window with keep={state.keep}: "
            "the batched (left-padded) form has no keep prefix; commit one count for all rows"
        )
    batch, most = len(counts), max(counts)
    before = h.keys.shape[2] if h.keys is not None else 0
    new_k, new_v = h.new_keys[..., :most, :], h.new_values[..., :most, :]
    src_k = new_k if h.keys is None else mx.concatenate([h.keys, new_k], axis=2)
    src_v = new_v if h.values is None else mx.concatenate([h.values, new_v], axis=2)
    length = min(before + most, state.max_size)
    accepted = mx.array(counts, mx.int32)
    pad0 = h.left_padding if h.left_padding is not None else mx.zeros((batch,), mx.int32)
    offsets0 = h.offsets if h.offsets is not None else mx.full((batch,), h.offset, mx.int32)
    ends = before + accepted  # one past each row's newest kept entry in src
    kept = mx.clip(ends - mx.maximum(pad0, 0), 0, state.max_size)
    index = mx.maximum(ends[:, None] - length + mx.arange(length, dtype=mx.int32)[None], 0)
    index = index[:, None, :, None]
    return trusted(RotatingKV)(
        mx.take_along_axis(src_k, index, axis=2),
        mx.take_along_axis(src_v, index, axis=2),
        (length - kept).astype(mx.int32),
        offsets0 + accepted,
        max_size=state.max_size,
        offset=max(length, h.offset + most),
        index=length,
    )


# ---------------------------------------------------------------------------------------
# Rows: take, merge, extend, extract (mlx-lm's BatchRotatingKVCache semantics, pure)
# ---------------------------------------------------------------------------------------


@take_rows.register
def _(state: RotatingKV, rows: tuple[int, ...]) -> RotatingKV:
    if state.keys is None and not _batched(state):
        # An empty unpadded window fits any batch; a batch of them needs the batched form.
        if len(rows) == 1:
            return state
        _require_no_keep(state, "tile/row_select of an empty window")
        zeros = mx.zeros((len(rows),), mx.int32)
        return trusted(RotatingKV)(left_padding=zeros, offsets=zeros, max_size=state.max_size)
    index = mx.array(rows, mx.int32)

    def take(a: mx.array | None) -> mx.array | None:
        return a[index] if a is not None else None

    previous = state.previous
    if previous is not None and (previous.keys is not None or _batched(previous)):
        previous = take_rows(previous, rows)
    return replace(
        state,
        keys=take(state.keys),
        values=take(state.values),
        left_padding=take(state.left_padding),
        offsets=take(state.offsets),
        previous=previous,
    )


def _require_no_keep(state: RotatingKV, what: str) -> None:
    if state.keep:
        raise ConfigMismatchError(
            f"{what}: a window with keep={state.keep} cannot take the batched form: mlx-lm's "
            "BatchRotatingKVCache has no keep prefix and would silently drop it; use windows "
            "made with keep=0 (model.make_cache's default) or decode these sequences apart"
        )


@merge_states.register
def _(first: RotatingKV, rest: Sequence[RotatingKV]) -> RotatingKV:
    _require_no_keep(first, "merge")
    return _keeping_pending([first, *rest], _merge_windows)


@extend_states.register
def _(a: RotatingKV, b: RotatingKV) -> RotatingKV:
    _require_no_keep(a, "extend")
    return _keeping_pending([a, b], _merge_windows)


def _merge_windows(states: Sequence[RotatingKV]) -> RotatingKV:
    if not any(_batched(s) for s in states):
        return _merge_unpadded(states)
    batched = [s if _batched(s) else _merge_unpadded([s]) for s in states]
    return functools.reduce(_extend_batched, batched)


def _keeping_pending(
    states: Sequence[RotatingKV], combine: Callable[[Sequence[RotatingKV]], RotatingKV]
) -> RotatingKV:
    """`combine(states)` with their shared pending forward, if it survives the combination.

    Every combined layout keeps each row's newest entries last, so the forward's n entries
    stay the last n; the windows before it are combined the same way. A one-token forward
    needs no record if its slot was free; one that overwrote a slot cannot stay pending (the
    combined, unrolled window would no longer show that it did), and a forward longer than
    the window would lose its own entries to the combination's trim.
    """
    out = combine(states)
    n = shared_appended(states)
    if not n or n > states[0].max_size or not all(_can_roll_back(s) for s in states):
        return out
    if n == 1:
        return replace(out, appended=1)
    previous = [s.previous for s in states]
    if any(p is None for p in previous):
        return out
    return replace(out, previous=combine(previous), appended=n)  # type: ignore[arg-type]


def _merge_unpadded(states: Sequence[RotatingKV]) -> RotatingKV:
    """BatchRotatingKVCache.merge: each window's newest min(offset, max_size) entries,
    right-aligned over zeros; `_idx` = `_offset` = the longest."""
    max_size = states[0].max_size
    sizes = [min(s.offset, max_size) if s.keys is not None else 0 for s in states]
    rows = [batch_size_of(s) for s in states]
    longest = max(sizes)
    padding = [longest - n for n, r in zip(sizes, rows, strict=True) for _ in range(r)]
    offsets = [s.offset for s, r in zip(states, rows, strict=True) for _ in range(r)]
    if longest == 0:
        zeros = mx.zeros((sum(rows),), mx.int32)
        return trusted(RotatingKV)(left_padding=zeros, offsets=zeros, max_size=max_size)
    filled = next(s for s in states if s.keys is not None)
    assert filled.keys is not None and filled.values is not None
    k0, v0 = filled.keys, filled.values

    def rows_of(s: RotatingKV, size: int, r: int) -> KV:
        t = temporal(s)
        if t is None or size == 0:
            return (
                mx.zeros((r, k0.shape[1], longest, k0.shape[3]), k0.dtype),
                mx.zeros((r, v0.shape[1], longest, v0.shape[3]), v0.dtype),
            )
        return _left_pad(t[0][..., -size:, :], longest - size), _left_pad(
            t[1][..., -size:, :], longest - size
        )

    parts = [rows_of(s, n, r) for s, n, r in zip(states, sizes, rows, strict=True)]
    return trusted(RotatingKV)(
        mx.concatenate([p[0] for p in parts]),
        mx.concatenate([p[1] for p in parts]),
        mx.array(padding, mx.int32),
        mx.array(offsets, mx.int32),
        max_size=max_size,
        offset=longest,
        index=longest,
    )


def _left_pad(a: mx.array, n: int) -> mx.array:
    return a if n == 0 else mx.pad(a, [(0, 0), (0, 0), (n, 0), (0, 0)])


def _unrotated(s: RotatingKV) -> tuple[mx.array | None, mx.array | None, int]:
    """BatchRotatingKVCache._temporal_order: (keys, values, index) with the ring unrolled."""
    if s.rotated and s.keys is not None and s.values is not None:
        k, v = mx.roll(s.keys, -s.index, 2), mx.roll(s.values, -s.index, 2)
        return k, v, k.shape[2]
    return s.keys, s.values, s.index


def _extend_batched(a: RotatingKV, b: RotatingKV) -> RotatingKV:
    """BatchRotatingKVCache.extend: rows of `a` then rows of `b`, write indices aligned."""
    assert a.left_padding is not None and b.left_padding is not None
    assert a.offsets is not None and b.offsets is not None
    if a.keys is None and b.keys is None:
        return replace(
            a,
            left_padding=mx.concatenate([a.left_padding, b.left_padding]),
            offsets=mx.concatenate([a.offsets, b.offsets]),
            previous=None,
            appended=0,
        )
    rotated = a.rotated
    parts = [(a.keys, a.values, a.index), (b.keys, b.values, b.index)]
    if a.rotated != b.rotated or a.index != b.index:
        parts, rotated = [_unrotated(a), _unrotated(b)], False
    at = max(p[2] for p in parts)
    like_k = next(p[0] for p in parts if p[0] is not None)
    like_v = next(p[1] for p in parts if p[1] is not None)
    assert like_k is not None and like_v is not None
    width = max(p[0].shape[2] if p[0] is not None else 0 for p in parts)

    def pad(s: RotatingKV, k: mx.array | None, v: mx.array | None, idx: int) -> tuple[Any, ...]:
        assert s.left_padding is not None
        left = at - idx
        if k is None or v is None:
            rows = batch_size_of(s)
            k = mx.zeros((rows, like_k.shape[1], 0, like_k.shape[3]), like_k.dtype)
            v = mx.zeros((rows, like_k.shape[1], 0, like_v.shape[3]), like_k.dtype)
        right = width - k.shape[2] - left
        if right < 0:
            k, v, right = k[..., :right, :], v[..., :right, :], 0
        if left or right:
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            k, v = mx.pad(k, widths), mx.pad(v, widths)
        return k, v, s.left_padding + left

    (ka, va, pa), (kb, vb, pb) = (pad(s, *p) for s, p in zip((a, b), parts, strict=True))
    return trusted(RotatingKV)(
        mx.concatenate([ka, kb]),
        mx.concatenate([va, vb]),
        mx.concatenate([pa, pb]),
        mx.concatenate([a.offsets, b.offsets]),
        max_size=a.max_size,
        offset=max(a.offset, b.offset),
        index=at,
        rotated=rotated,
    )


@extract_row.register
def _(state: RotatingKV, row: int) -> RotatingKV:
    # The row's window, unrolled, still shows whether a one-token forward overwrote an entry
    # (its offset passes max_size only then), so the pending forward can stay.
    out = _extract_window(state, row)
    n = state.appended
    if not n or out.index < n:
        return out
    if state.previous is None:
        return replace(out, appended=n)
    prev = state.previous
    # A right-padded prompt forward advanced its rows by less than n: no prefix exists.
    batched = state.offsets is not None and prev.offsets is not None
    if batched and host_ints(state.offsets)[row] - host_ints(prev.offsets)[row] != n:  # type: ignore[arg-type]
        return out
    return replace(out, previous=_extract_window(prev, row), appended=n)


def _extract_window(state: RotatingKV, row: int) -> RotatingKV:
    if state.keys is None or state.values is None:
        return trusted(RotatingKV)(max_size=state.max_size, keep=state.keep)
    if not _batched(state):
        return replace(
            state,
            keys=mx.contiguous(state.keys[row : row + 1]),
            values=mx.contiguous(state.values[row : row + 1]),
            previous=None,
            appended=0,
        )
    assert state.left_padding is not None and state.offsets is not None
    # BatchRotatingKVCache.extract: unroll the ring, drop the row's padding.
    padding = max(0, host_ints(state.left_padding)[row])
    offset = host_ints(state.offsets)[row]
    if offset <= 0:  # the row holds no entries yet (only padding): an empty window
        return trusted(RotatingKV)(max_size=state.max_size, keep=state.keep)
    k, v = state.keys[row : row + 1], state.values[row : row + 1]
    end = state.index
    if state.rotated:
        k, v, end = (
            mx.roll(k, -state.index, 2),
            mx.roll(v, -state.index, 2),
            state.max_size,
        )
    k, v = mx.contiguous(k[:, :, padding:end]), mx.contiguous(v[:, :, padding:end])
    return trusted(RotatingKV)(k, v, max_size=state.max_size, offset=offset, index=k.shape[2])


def _path_start(state: RotatingKV) -> int:
    """Where a tree forward's first token sits: a multi-token forward leaves the window in
    temporal order, its tokens last."""
    return (0 if state.keys is None else int(state.keys.shape[2])) - state.appended


@gather_path.register
def _(state: RotatingKV, positions: tuple[int, ...]) -> tuple[mx.array, mx.array] | None:
    if state.left_padding is not None:
        return None  # keep_path refuses it
    return path_entries(state.keys, state.values, _path_start(state), positions)


@keep_path.register
def _(state: RotatingKV, positions: tuple[int, ...], checkpoints: Any, gathered: Any) -> RotatingKV:
    if state.keys is not None and state.values is not None and state.left_padding is not None:
        raise NotSupportedError("tree commit: a batched sliding window cannot keep a tree path")
    moved = path_in_place(state.keys, state.values, _path_start(state), gathered)
    if moved is not None:
        state = replace(state, keys=moved[0], values=moved[1])
    return commit_rows(state, (len(positions),) * batch_size_of(state), None)
