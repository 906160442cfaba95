"""Row transforms shared by the unpadded KV kinds: keys / values (B, H, capacity, D) and one
length (`offset`) for all rows, as mlx-lm's ChunkedKVCache and mlx-vlm's
BufferedRotatingKVCache and StaticPrefixKVCache hold them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._errors import ConfigMismatchError, NotSupportedError, require
from ._shared import uniform_count
from ._tree import replace
from ._validation import static_int
from .kinds import batch_size_of, commit_rows, take_rows


def held(state: Any) -> int:
    """Buffer entries in use by a window kind holding positions [start_position, offset) at
    indices [0, offset - start_position) (mlx-vlm's `_idx`)."""
    return int(state.offset - state.start_position)


def window_span_problems(state: Any) -> list[str]:
    """A window kind's positions against its buffer: start_position <= offset, the held
    span fits the capacity, and the pending forward fits the held span."""
    capacity = 0 if state.keys is None else int(state.keys.shape[2])
    found = static_int("start_position", state.start_position, 0, state.offset)
    if not found:
        found += static_int("offset - start_position", held(state), 0, capacity)
        found += static_int("appended", state.appended, 0, held(state))
    return found


def require_one_span(states: Sequence[Any], why: str) -> None:
    """A merge of a window kind batches rows at one (start_position, offset) only: else a
    ConfigMismatchError naming the kind, the spans and `why`."""
    spans = [(s.start_position, s.offset) for s in states]
    require(
        len(set(spans)) == 1,
        ConfigMismatchError,
        f"merge: {type(states[0]).__name__} states with (start_position, offset) {spans} "
        f"cannot be batched: {why}",
    )


def kv_batch_size(state: Any) -> int:
    """The batch axis of `state.keys`; an empty state (no arrays) counts as one row."""
    return int(state.keys.shape[0]) if state.keys is not None else 1


def no_batch_axis(state: Any, what: str) -> NotSupportedError:
    """The refusal of `what` ("merge", or a row transform) on an empty `state` of a kind
    without left padding, whose rows exist only once a forward gave it arrays."""
    verb = "merge" if what == "merge" else "gather rows"
    return NotSupportedError(
        f"{what}: an empty {type(state).__name__} has no arrays, so no batch axis to {verb} "
        "along; run the first forward (prefill) first (an empty state takes the batch size "
        "of its first forward)"
    )


def take_kv_rows(state: Any, rows: tuple[int, ...]) -> Any:
    """`rows` of keys and values. An empty state is its own row (0,) and has no others
    (`no_batch_axis`)."""
    if state.keys is None or state.values is None:
        if rows == (0,):
            return state
        raise no_batch_axis(state, "row_select / tile")
    index = mx.array(rows, mx.int32)
    return replace(state, keys=state.keys[index], values=state.values[index])


def trimmed(state: Any, accepted: int, **fields: Any) -> Any:
    """`state` with the last forward's rejected tokens trimmed off the end (the next update
    overwrites them), nothing pending, and `fields` replaced."""
    rejected = state.appended - accepted
    return replace(state, offset=state.offset - rejected, appended=0, **fields)


def commit_by_trim(state: Any, counts: tuple[int, ...], checkpoints: Any) -> Any:
    """`commit_rows` of a kind whose rollback is trimming the end: one count for all rows."""
    return trimmed(state, uniform_count(state, counts))


def register_unpadded_kv(cls: type) -> None:
    """Register `kv_batch_size`, `take_kv_rows` and `commit_by_trim` for the kind `cls`."""
    batch_size_of.register(cls, kv_batch_size)
    take_rows.register(cls, take_kv_rows)
    commit_rows.register(cls, commit_by_trim)
