"""QuantizedStateCache: kvstate's own cache object for a QuantizedKV that mlx-lm's
QuantizedKVCache cannot hold (keys and values at different bits or group sizes, a rotation,
pad channels or left padding), read by kvstate's `quantized_attention` (a wrapped model's
attention modules are routed to it: `instruments.routing`). Its cache -> state converter is
registered here, next to the class. A state with an exact tail (`exact_latest` R > 0) keeps
its latest keys and values unquantized here too: each update appends the new ones to the
last R held, so a forward of L tokens reads R + L of them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, dynamic_roll

from kvstate import NotSupportedError, QuantizedKV, StateError, quantized_attention
from kvstate.kinds import host_ints, replace
from kvstate.quantization import key_codec, latest, value_codec, with_pads

from .compat import refuse_mid_prompt
from .registry import Quantized, fresh, register_from, triple


class QuantizedStateCache(_BaseCache):
    """The cache object of a QuantizedKV that mlx-lm's QuantizedKVCache cannot hold (keys and
    values at different bits or group sizes, a rotation, pad channels or left padding).

    Like BatchKVCache with left padding: `offset` is each row's next position ((B,) array)
    and `make_mask` masks the padding. A model reads it through its attention, routed to
    `attend` (kvstate's `quantized_attention`); it has no `bits`, so an attention that was
    not routed fails with a message instead of reading the buffers with the wrong bits.
    """

    step = 256

    def __init__(self, state: QuantizedKV) -> None:
        self.spec = replace(
            state,
            keys=None,
            values=None,
            left_padding=None,
            tail_keys=None,
            tail_values=None,
            appended=0,
        )
        self.keys = triple(state.keys)
        self.values = triple(state.values)
        self.left_padding = fresh(state.left_padding)
        self.tails = (fresh(state.tail_keys), fresh(state.tail_values))
        self._idx = state.length
        self._right_padding: mx.array | None = None

    @property
    def offset(self) -> Any:
        if self.left_padding is None:
            return self._idx
        return self._idx - self.left_padding

    @property
    def bits(self) -> int:
        raise StateError(
            "this model's attention read a kvstate QuantizedStateCache as if it were mlx-lm's "
            "QuantizedKVCache (keys and values at one bits, no rotation), which it is not; run "
            "the model through kvstate.adapters.wrap(model), or route its attention first with "
            "kvstate.adapters.route_attention(model)"
        )

    def state_now(self) -> QuantizedKV:
        """The QuantizedKV this cache holds now (arrays shared, not copied)."""
        return replace(
            self.spec,
            keys=self.keys,
            values=self.values,
            left_padding=self.left_padding,
            tail_keys=self.tails[0],
            tail_values=self.tails[1],
            length=self._idx,
        )

    def read(self, appended: int = 0) -> QuantizedKV:
        """The QuantizedKV this cache holds, in fresh arrays, stamped with `appended`."""
        if self._right_padding is not None:
            refuse_mid_prompt(self, "_right_padding", self._right_padding.tolist())
        return replace(
            self.spec,
            keys=triple(self.keys),
            values=triple(self.values),
            left_padding=fresh(self.left_padding),
            tail_keys=fresh(self.tails[0]),
            tail_values=fresh(self.tails[1]),
            length=self._idx,
            appended=appended,
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        if self.keys is None:
            self.spec = with_pads(self.spec, int(keys.shape[-1]), int(values.shape[-1]))
        q_keys = key_codec(self.spec).encode(keys)
        q_values = value_codec(self.spec).encode(values)
        prev, n = self._idx, int(keys.shape[2])
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            self.keys = _grown(self.keys, q_keys, prev, n, self.step)
            self.values = _grown(self.values, q_values, prev, n, self.step)
        keys_buf, values_buf = list(self.keys), list(self.values)
        for buf, new in ((keys_buf, q_keys), (values_buf, q_values)):
            for i in range(3):
                buf[i][..., prev : prev + n, :] = new[i]
        self.keys = (keys_buf[0], keys_buf[1], keys_buf[2])
        self.values = (values_buf[0], values_buf[1], values_buf[2])
        self._idx = prev + n
        if self.spec.exact_latest:
            self.tails = (self._appended_tail(0, keys), self._appended_tail(1, values))
        return self.keys_and_values()

    def _appended_tail(self, side: int, new: mx.array) -> mx.array:
        """Tail `side` (0 keys, 1 values): its last exact_latest positions, then `new`."""
        held = self.tails[side]
        if held is None:
            return new
        return mx.concatenate([latest(held, self.spec.exact_latest), new], axis=2)

    def keys_and_values(self) -> tuple[Quantized, Quantized]:
        assert self.keys is not None and self.values is not None
        n = self._idx

        def cut(q: Quantized) -> Quantized:
            return (
                q if q[0].shape[2] == n else (q[0][..., :n, :], q[1][..., :n, :], q[2][..., :n, :])
            )

        return cut(self.keys), cut(self.values)

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """kvstate's quantized attention of `queries` over what this cache holds."""
        return quantized_attention(queries, self.state_now(), scale=scale, mask=mask)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> Any:
        if self.left_padding is None and window_size is None and not return_array:
            return None if N == 1 else "causal"
        return create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, window_size=window_size
        )

    # right-padded prompt batches (wrap(model)(tokens, state, lengths=...)), as BatchKVCache
    def prepare(
        self,
        *,
        left_padding: Any = None,
        lengths: Any = None,
        right_padding: Any = None,
    ) -> None:
        if left_padding is not None:
            raise NotSupportedError(
                "QuantizedStateCache.prepare: left padding comes from the state"
            )
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        padding = self._right_padding
        if padding is None or self.keys is None or self.values is None:
            return
        roll = padding[:, None]
        self.keys = tree_map(lambda a: dynamic_roll(a, roll, axis=2), self.keys)
        self.values = tree_map(lambda a: dynamic_roll(a, roll, axis=2), self.values)
        lp = self.left_padding
        self.left_padding = padding if lp is None else lp + padding
        self._right_padding = None
        if self.tails[0] is not None:
            # Slots rolled round from a tail's end land under the row's new padding when the
            # tail holds the whole length; otherwise they are cut.
            cut = 0 if self.tails[0].shape[2] == self._idx else max(host_ints(padding))
            self.tails = tuple(dynamic_roll(t, roll, axis=2)[..., cut:, :] for t in self.tails)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        if self.tails[0] is not None:  # positions trimmed past the tail are read quantized
            self.tails = tuple(t[..., : max(0, t.shape[2] - n), :] for t in self.tails)
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        held = [*(self.keys or ()), *(self.values or ()), *(t for t in self.tails if t is not None)]
        return sum(a.nbytes for a in held)


def _grown(current: Quantized | None, new: Quantized, prev: int, n: int, step: int) -> Quantized:
    """Buffers (of `new`'s widths and dtypes) with room for n more positions after the first
    `prev`, grown like mlx-lm's: by whole steps of 256 positions, the used part kept."""
    steps = (step + n - 1) // step * step

    def grow(i: int) -> mx.array:
        extra = mx.zeros((*new[i].shape[:2], steps, new[i].shape[3]), new[i].dtype)
        if current is None:
            return extra
        return mx.concatenate([current[i][..., :prev, :], extra], axis=2)

    return (grow(0), grow(1), grow(2))


@register_from(QuantizedStateCache)
def _(cache: QuantizedStateCache, appended: int = 0) -> QuantizedKV:
    return cache.read(appended)
