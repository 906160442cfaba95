"""`quantize`: DenseKV layers -> QuantizedKV, RotatingKV layers (sliding windows) ->
QuantizedRotatingKV, one codec for both (each side's bits and group size, a rotation)."""

from __future__ import annotations

from typing import Any

from ._dense import DenseKV, used
from ._errors import ConfigMismatchError, NotSupportedError, StateError, require
from ._quantized import BITS, GROUP_SIZES, QuantizedKV, key_codec, latest, value_codec, with_pads
from ._quantized_rotating import quantize_window
from ._rotating import RotatingKV
from ._rotations import ROTATIONS
from ._tree import State, replace
from ._validation import is_int
from .kinds import Composite, with_parts


def quantize(
    state: Any,
    bits: int = 8,
    group_size: int = 64,
    *,
    key_bits: int | None = None,
    value_bits: int | None = None,
    key_group_size: int | None = None,
    value_group_size: int | None = None,
    rotation: str = "none",
    seed: int = 0,
    exact_latest: int = 0,
) -> Any:
    """A DenseKV as a QuantizedKV, like mlx-lm's `KVCache.to_quantized` when keys and values
    share `bits` / `group_size` and there is no rotation (then the arrays are identical).

    `key_bits` / `value_bits` / `key_group_size` / `value_group_size` override `bits` /
    `group_size` for one side. `rotation` ("none", "so4", "hadamard") with `seed` rotates
    head vectors before quantizing (see `kvstate._rotations`). Head dims that are not a
    multiple of a side's group size are zero-padded up to one (stored 80 -> 96 at group 32).
    Only the `length` used positions are quantized; left padding and `appended` carry over.
    `exact_latest` R > 0 keeps each query's latest R tokens unquantized as well (QuantizedKV's
    exact tail; 16-32 take K4/V3's perplexity to within 1-2% of the unquantized cache on
    SmolLM2, BENCHMARKS.md): the state's last R + appended positions start it. A sliding
    window keeps its latest R in a dense ring of R slots beside the quantized one
    (`QuantizedRotatingKV.exact`); it takes one only before its first forward (an empty
    window, as the engine's `kv_bits` mapping quantizes), a filled one is refused.

    A RotatingKV (sliding window) becomes a QuantizedRotatingKV with the same codec (mlx-lm
    has no quantized window). A ModelState or ListState is mapped over: its DenseKV and
    RotatingKV layers are quantized and every other kind is left as it is, like mlx-lm's
    `maybe_quantize_kv_cache` (which refuses windows), so a Gemma-style state (sliding and
    global layers) is quantized whole.
    """
    # Each side's value and the argument it came from (named in a refusal: `bits=7` is
    # refused as bits, not as key_bits).
    given = {
        "key_bits": ("bits", bits) if key_bits is None else ("key_bits", key_bits),
        "value_bits": ("bits", bits) if value_bits is None else ("value_bits", value_bits),
        "key_group_size": ("group_size", group_size)
        if key_group_size is None
        else ("key_group_size", key_group_size),
        "value_group_size": ("group_size", group_size)
        if value_group_size is None
        else ("value_group_size", value_group_size),
    }
    for side, (name, value) in given.items():
        allowed = BITS if side.endswith("bits") else GROUP_SIZES
        require(
            is_int(value) and value in allowed,
            ConfigMismatchError,
            f"quantize: {name}={value!r} is not supported; use an int in {list(allowed)}",
        )
    spec = {side: value for side, (_, value) in given.items()}
    require(
        rotation in ROTATIONS and is_int(seed),
        ConfigMismatchError,
        f"quantize: rotation={rotation!r}, seed={seed!r}; use a rotation in {list(ROTATIONS)} "
        "and an int seed",
    )
    require(
        is_int(exact_latest) and exact_latest >= 0,
        ConfigMismatchError,
        f"quantize: exact_latest={exact_latest!r}; use an int >= 0 (0: no exact tail)",
    )
    empty = QuantizedKV(
        exact_latest=int(exact_latest),
        key_bits=int(spec["key_bits"]),
        value_bits=int(spec["value_bits"]),
        key_group_size=int(spec["key_group_size"]),
        value_group_size=int(spec["value_group_size"]),
        rotation=rotation,
        seed=int(seed),
    )
    if isinstance(state, DenseKV):
        return _quantize_dense(state, empty)
    if isinstance(state, RotatingKV):
        return _quantize_window(state, empty)
    if not isinstance(state, Composite):
        # Another kind of state is well-formed: quantize does not do it (NotSupportedError).
        raise (NotSupportedError if isinstance(state, State) else StateError)(
            f"quantize: expected a DenseKV or RotatingKV (or a ModelState / ListState holding "
            f"some); got a {type(state).__name__}"
        )
    return _quantize_layers(state, empty)


def _quantize_layers(state: Any, empty: QuantizedKV) -> Any:
    if isinstance(state, Composite):
        return with_parts(state, tuple(_quantize_layers(s, empty) for s in state.parts))
    if isinstance(state, DenseKV):
        return _quantize_dense(state, empty)
    if isinstance(state, RotatingKV):
        return _quantize_window(state, empty)
    return state


def _quantize_window(state: RotatingKV, empty: QuantizedKV) -> Any:
    return quantize_window(state, empty)


def _quantize_dense(state: DenseKV, empty: QuantizedKV) -> QuantizedKV:
    if state.keys is None or state.values is None:
        return replace(
            empty, left_padding=state.left_padding, length=state.length, appended=state.appended
        )
    # Stored widths are whole groups (multiples of 32), so every rotation applies.
    spec = with_pads(empty, int(state.keys.shape[-1]), int(state.values.shape[-1]))
    keys, values = used(state.keys, state.length), used(state.values, state.length)
    tail = spec.exact_latest + state.appended
    return replace(
        spec,
        keys=key_codec(spec).encode(keys),
        values=value_codec(spec).encode(values),
        left_padding=state.left_padding,
        tail_keys=latest(keys, tail) if spec.exact_latest else None,
        tail_values=latest(values, tail) if spec.exact_latest else None,
        length=state.length,
        appended=state.appended,
    )


__all__ = ["quantize"]
