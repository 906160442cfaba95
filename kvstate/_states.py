"""The state classes: one per kind of cache. Batch is the leading axis of every array.

Conventions shared by every class:
- `appended` is how many tokens the last forward added, so `commit_prefix` needs no K.
- A batched form carries `left_padding` (B,) int32; `None` means the unpadded
  single-sequence form (mlx-lm's KVCache, RotatingKVCache...).
- `previous` (window kinds only) is the state before the last multi-token forward: such a
  forward may push entries out of the window, and an exact rollback needs them back.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ._tree import state_class, static_field

Quantized = tuple[mx.array, mx.array, mx.array]
"""(packed uint32 (B, H, T, D*bits//32), scales (B, H, T, D//group), biases (same))."""


@state_class
class DenseKV:
    """Keys and values in a capacity buffer; positions [0, length) are in use.

    keys (B, H, capacity, Dk), values (B, H, capacity, Dv), left_padding (B,) int32 or None.
    With left padding, row b holds its tokens at [left_padding[b], length) and its next
    RoPE position is `length - left_padding[b]` (mlx-lm's BatchKVCache.offset).
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    left_padding: mx.array | None = None
    length: int = static_field(default=0)
    appended: int = static_field(default=0)
    concatenate: bool = static_field(default=False)  # unpadded form: ConcatenateKVCache


@state_class
class QuantizedKV:
    """Quantized keys and values (`mx.quantize` triples) in a capacity buffer."""

    keys: Quantized | None = None
    values: Quantized | None = None
    length: int = static_field(default=0)
    group_size: int = static_field(default=64)
    bits: int = static_field(default=8)
    appended: int = static_field(default=0)


@state_class
class RotatingKV:
    """A sliding window: a ring buffer of at most `max_size` entries (more right after a
    multi-token forward, exactly like mlx-lm), the first `keep` of which never rotate out.

    keys/values (B, H, L, D). `offset` counts every token seen (the batched form's `_offset`),
    `index` is the ring's write index, `rotated` (batched form) says the ring has wrapped.
    The batched form also carries per-row `offsets` (B,) (RoPE positions).
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


@state_class
class ChunkedKV:
    """mlx-lm's ChunkedKVCache: a dense buffer whose front is dropped past `chunk_size`.

    Positions [start_position, offset) are held at buffer indices [0, offset - start_position).
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    previous: ChunkedKV | None = None
    chunk_size: int = static_field(default=0)
    offset: int = static_field(default=0)
    start_position: int = static_field(default=0)
    appended: int = static_field(default=0)


@state_class
class RecurrentState:
    """Fixed-size recurrent arrays (conv window, SSM / linear-attention state), each (B, ...).

    Not trimmable: `commit_prefix` needs the checkpoints a capturing forward returns.
    `left_padding` / `lengths` (B,) mirror mlx-lm's ArraysCache batch bookkeeping.
    """

    arrays: tuple[mx.array | None, ...] = ()
    left_padding: mx.array | None = None
    lengths: mx.array | None = None
    appended: int = static_field(default=0)


@state_class
class ListState:
    """mlx-lm's CacheList: one layer whose cache is several caches."""

    states: tuple[Any, ...] = ()


@state_class
class ModelState:
    """A whole model: one state per layer, in `model.layers` order."""

    layers: tuple[Any, ...] = ()


LayerState = DenseKV | QuantizedKV | RotatingKV | ChunkedKV | RecurrentState | ListState
State = LayerState | ModelState
