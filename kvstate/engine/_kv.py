"""The empty state every request's prefill starts from: the target's own (`init_state`), or
with quantized attention layers (`kv_bits`): `kvstate.quantize`'s uniform codec, or
TurboQuant (`kv_scheme="turboquant"`). Every row then prefills, verifies and commits on
those layers from its first token, as `generate` does on such a target."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx

from .. import (
    ConfigMismatchError,
    DenseKV,
    ModelState,
    NotSupportedError,
    StateError,
    TurboQuantKV,
    quantize,
)
from ..kinds import Composite, with_parts
from ..speculative import Target

SCHEMES = ("uniform", "turboquant")


def empty_state(
    target: Target, kv_bits: Any, kv_group_size: int, kv_scheme: str
) -> Callable[[], Any]:
    """A function giving a batch-1 empty state for the target.

    `kv_bits`: None (the target's own state), an int (`kvstate.quantize(state, bits,
    group_size=kv_group_size)`; TurboQuant: its bits, x.5 allowed), or a mapping of
    `kvstate.quantize`'s keywords (uniform only: key_bits, value_bits, rotation, ...)."""
    if kv_scheme not in SCHEMES:
        raise StateError(f"Engine: kv_scheme must be one of {SCHEMES}; got {kv_scheme!r}")
    if kv_bits is None:
        return lambda: target.init_state(1)
    if kv_scheme == "turboquant":
        if not isinstance(kv_bits, (int, float)) or isinstance(kv_bits, bool):
            raise StateError(
                f"Engine: kv_bits with kv_scheme='turboquant' must be a number of bits; got "
                f"{kv_bits!r}"
            )
        bits = float(kv_bits)
        if not bits.is_integer():
            raise NotSupportedError(
                f"Engine: kv_bits={kv_bits} with kv_scheme='turboquant' is the Split layout "
                "(x.5 bits), whose high channels are chosen from each prompt's data: rows of "
                "different prompts cannot be batched together; use integer bits"
            )
        made = _turboquant(target.init_state(1), bits)
        _probe(target, made, kv_scheme, {"bits": bits})
        return lambda: _turboquant(target.init_state(1), bits)
    if isinstance(kv_bits, Mapping):
        options = dict(kv_bits)
    elif isinstance(kv_bits, int) and not isinstance(kv_bits, bool):
        options = {"bits": kv_bits, "group_size": kv_group_size}
    else:
        raise StateError(
            f"Engine: kv_bits must be None, an int or a mapping of kvstate.quantize's keywords; "
            f"got {kv_bits!r}"
        )
    try:
        made = quantize(target.init_state(1), **options)
    except TypeError as e:
        raise StateError(f"Engine: kv_bits {options}: {e}") from None
    except ConfigMismatchError as e:
        raise ConfigMismatchError(f"Engine: kv_bits {options}: {e}") from None
    _probe(target, made, kv_scheme, options)
    return lambda: quantize(target.init_state(1), **options)


def _turboquant(state: Any, bits: float) -> Any:
    """`state` with each dense KV layer an empty TurboQuantKV of `bits`."""
    if isinstance(state, DenseKV):
        return TurboQuantKV(key_bits=bits, value_bits=bits)
    if isinstance(state, Composite):
        return with_parts(state, tuple(_turboquant(p, bits) for p in state.parts))
    return state


def _probe(target: Target, state: ModelState, scheme: str, options: dict[str, Any]) -> None:
    """One forward of one token on `state`: refuses a model whose attention cannot run on
    it (mlx-lm's quantized attention wants head dims a multiple of the group size;
    TurboQuant states need mlx-vlm)."""
    try:
        logits, _ = target(mx.array([[0]], mx.int32), state)
        mx.eval(logits)
    except StateError:
        raise
    except Exception as e:  # the model's own attention code, not kvstate's
        hint = (
            "TurboQuant states are mlx-vlm's caches: install mlx-vlm (the vlm extra)"
            if scheme == "turboquant"
            else "choose a group size that divides the model's head dims"
        )
        raise NotSupportedError(
            f"Engine: kv_scheme={scheme!r}, kv_bits {options}: this model's attention cannot "
            f"run on such states ({type(e).__name__}: {str(e)[:200]}); {hint}"
        ) from None
