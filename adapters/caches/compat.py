"""Upstream quirks, corrected in one place, and the refusals of a cache caught in the middle
of something only its library can finish.

- `fixed_make_mask`: BatchRotatingKVCache's multi-token mask on a wrapped ring (mlx-lm 0.32,
  and mlx-vlm 0.7.10's copy of it), set on the caches made from states;
- `packed_update_and_fetch` / `packed_quantized_cache`: mlx-lm 0.32's QuantizedKVCache
  allocates `dim // (32 // bits)` uint32 words per row, but `mx.quantize` emits
  `dim * bits // 32`; they differ for 3 bits at head dims 192 / 256 and for 5 / 6 bits at most
  head dims, where mlx-lm's slice write fails;
- `refuse_mid_prompt` (a cache between prepare() and finalize() of a right-padded prompt
  forward) and `check_settled` (an mlx-vlm cache inside its own speculation transaction):
  both describe a forward in progress, not a state.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, NoReturn

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchRotatingKVCache, QuantizedKVCache

from kvstate import StateError, packed_width


def fixed_make_mask(
    self: BatchRotatingKVCache, N: int, window_size: int | None = None, return_array: bool = False
) -> Any:
    """BatchRotatingKVCache.make_mask, right for a multi-token forward on a wrapped ring.

    mlx-lm 0.32 sizes that mask's window trim from the ring's write index `_idx`, but
    `_update_concat` first unrolls a rotated ring (`_idx` becomes its length) and then trims
    one entry more, lowering `left_padding` by one. Rows that still have padding in the window
    then lose their oldest valid entry from the mask, and a verify forward on them gives
    wrong logits (tests/test_rotating.py checks the bug is still there upstream).
    """
    make_mask = type(self).make_mask  # mlx-lm's, or mlx-vlm's copy of it
    if N > 1 and self.rotated and self.keys is not None:
        idx = self._idx
        self._idx = self.keys.shape[2]  # what _update_concat will see after unrolling
        try:
            return make_mask(self, N, window_size=window_size, return_array=return_array)
        finally:
            self._idx = idx
    return make_mask(self, N, window_size=window_size, return_array=return_array)


def packed_update_and_fetch(self: Any, keys: mx.array, values: mx.array) -> Any:
    """mlx-lm's QuantizedKVCache.update_and_fetch with only `init_quant`'s width changed."""
    B, n_kv_heads, num_steps, k_head_dim = keys.shape
    v_head_dim = values.shape[-1]
    prev = self.offset

    if self.keys is None or (prev + num_steps) > self.keys[0].shape[-2]:
        new_steps = (self.step + num_steps - 1) // self.step * self.step
        shape = (B, n_kv_heads, new_steps)

        def init_quant(dim: int) -> tuple[mx.array, mx.array, mx.array]:
            return (
                mx.zeros((*shape, packed_width(dim, self.bits)), dtype=mx.uint32),
                mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
            )

        def expand_quant(x: mx.array) -> mx.array:
            new_x = mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)
            return mx.concatenate([x, new_x], axis=-2)

        if self.keys is not None:
            if prev % self.step != 0:
                self.keys, self.values = tree_map(
                    lambda x: x[..., :prev, :], (self.keys, self.values)
                )
            self.keys, self.values = tree_map(expand_quant, (self.keys, self.values))
        else:
            self.keys, self.values = init_quant(k_head_dim), init_quant(v_head_dim)

    self.offset += num_steps

    q_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
    q_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
    for i in range(len(self.keys)):
        self.keys[i][..., prev : self.offset, :] = q_keys[i]
        self.values[i][..., prev : self.offset, :] = q_values[i]

    return self.keys_and_values()


def packed_quantized_cache(group_size: int, bits: int) -> QuantizedKVCache:
    """An mlx-lm QuantizedKVCache whose buffers hold `dim * bits // 32` words per row.

    `update_and_fetch` is `packed_update_and_fetch`, set as an instance attribute (not a
    subclass) so that mlx-lm's `save_prompt_cache` records the class `QuantizedKVCache`."""
    cache = QuantizedKVCache(group_size=group_size, bits=bits)
    cache.update_and_fetch = MethodType(packed_update_and_fetch, cache)  # type: ignore[method-assign]
    return cache


def refuse_mid_prompt(cache: Any, marker: str, value: Any) -> NoReturn:
    """Refuse to convert `cache`: it is between prepare() and finalize() of a right-padded
    prompt forward (its `marker` attribute, set only then, holds `value`)."""
    raise StateError(
        f"converting a cache: this {type(cache).__name__} is between prepare() and finalize() "
        f"({marker} = {value}); call cache.finalize() after the padded prompt forward, then "
        "convert (kvstate.adapters.wrap(model)(tokens, state, lengths=...) runs that whole "
        "phase for you)"
    )


def check_settled(cache: Any) -> None:
    """Refuse to convert an mlx-vlm cache inside its own speculation transaction: its arrays
    are a tentative future that only that transaction can settle."""
    if cache.is_speculating:
        raise StateError(
            f"from_mlx_vlm: this {type(cache).__name__} is inside an mlx-vlm speculation "
            "transaction (start_speculation() without commit_speculation() / "
            "abort_speculation()); settle it first, then convert (kvstate rolls back with "
            "commit_prefix instead)"
        )
