"""Attention over a QuantizedKV without dequantizing it: `quantized_attention`.

Scores come from `mx.quantized_matmul` at the key bits, the output from another at the
value bits (mlx-lm's `quantized_scaled_dot_product_attention` does the same with one bits
for both). Queries are zero-padded and rotated like the stored keys, so the scores are those
of the unrotated vectors; the output is rotated back with the value rotation and its pad
channels dropped. Rows' left padding is masked here, whatever mask the caller passes.

A state with an exact tail (`exact_latest` R > 0) is read in two parts under one softmax: the
scores of the quantized keys, masked where the key is one of the query's latest R (held in
the tail), and those of the tail's unquantized keys, masked where it is not; the output is
the quantized values' part plus the tail values' part.

The quantized operands are always row-contiguous arrays with the queries' batch shape: MLX
CUDA's quantized_matmul (0.32) refuses a matrix whose flags say it is not contiguous (a cache
buffer cut at `length` < capacity: "No implementation for problem shape") and reads a
broadcast one as if every batch were batch 0 (wrong scores, no error). So the GQA repeats
are folded into the query rows (B, kv_heads, repeats * L, D) instead of broadcasting the
keys, and a cut buffer is copied by `mx.contiguous` (the CPU kernel copies it anyway).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ._errors import ShapeError, StateError, require
from ._quant_codec import Quantized
from ._quantized import QuantizedKV, key_codec, latest, used_q, value_codec
from ._tree import replace


def quantized_attention(
    queries: mx.array, state: QuantizedKV, *, scale: float, mask: Any = None
) -> mx.array:
    """softmax(scale * q k^T + mask) v over the state's positions [0, length).

    queries (B, n_heads, L, key_dim), n_heads a multiple of the state's kv heads (GQA);
    mask: None, "causal" (query i sees keys up to length - L + i), a bool array (True:
    attend) or an additive float array, broadcastable to (B, n_heads, L, length).
    Returns (B, n_heads, L, value_dim) in the queries' dtype.
    """
    require(
        state.keys is not None and state.values is not None,
        StateError,
        "quantized_attention: the state is empty; run a forward (update the cache) first",
    )
    assert state.keys is not None and state.values is not None
    kc, vc = key_codec(state), value_codec(state)
    keys, values = used_q(state.keys, state.length), used_q(state.values, state.length)
    B, n_heads, L, dim = queries.shape
    kv_heads = int(keys[0].shape[1])
    require(
        keys[0].shape[0] == B and dim == kc.dim(keys) and n_heads % kv_heads == 0,
        ShapeError,
        f"quantized_attention: queries {tuple(queries.shape)} do not fit keys of batch "
        f"{keys[0].shape[0]}, {kv_heads} heads x {kc.dim(keys)} dims (batch and dims equal, "
        "heads a multiple)",
    )
    repeats = n_heads // kv_heads
    masks = _masks(mask, state, L)
    if state.tail_keys is None or state.tail_values is None:
        # (B, n_heads, L, D) -> (B, kv_heads, repeats * L, D): head h = kv * repeats + r
        # reads kv head kv, as in mlx-lm's GQA.
        q = (kc.rotate(queries) * scale).reshape(B, kv_heads, repeats * L, -1)
        scores = _quantized_matmul(q, keys, transpose=True, group_size=kc.group_size, bits=kc.bits)
        scores = _masked(scores, masks, kv_heads, repeats, L)
        weights = mx.softmax(scores, axis=-1, precise=True)
        out = _quantized_matmul(
            weights, values, transpose=False, group_size=vc.group_size, bits=vc.bits
        )
        return vc.unrotate(out.reshape(B, n_heads, L, -1))
    # The exact tail: its keys' scores beside the quantized ones, one softmax over both.
    width = int(state.tail_keys.shape[2])
    raw = min(state.exact_latest, width)
    if L == 1 and mask is None and raw < state.length:
        # One query (a decode step) reads its latest `raw` keys from the tail and the rest
        # quantized: a cut of each part, no masks but the padding's (the host encodes fewer
        # kernels; a GPU decode step is bound by that).
        view = replace(state, length=state.length - raw)
        padding = _masks(None, state, 1)
        return _two_parts(
            queries,
            view,
            scale,
            _masks(None, view, 1),
            latest(state.tail_keys, raw),
            latest(state.tail_values, raw),
            [_latest_columns(m, state.length, raw) for m in padding],
        )
    exact = _read_exactly(state, L)  # (L, length): the key is read from the tail
    tail_masks = [_latest_columns(m, state.length, width) for m in masks]
    return _two_parts(
        queries,
        state,
        scale,
        [*masks, ~exact],
        state.tail_keys,
        state.tail_values,
        [*tail_masks, exact[:, -width:]],
    )


def attention_with_raw_keys(
    queries: mx.array,
    state: QuantizedKV,
    raw_keys: mx.array,
    raw_values: mx.array,
    *,
    scale: float,
    mask: Any,
    read_raw: mx.array,
    raw_mask: Any,
) -> mx.array:
    """One softmax over a QuantizedKV's keys (`mask` as for `quantized_attention`, and not
    where `read_raw`, bool, broadcastable to (B, n_heads, L, length), is True: those keys are
    read from `raw_keys`) and over unquantized `raw_keys` / `raw_values` (B, kv_heads, S, D),
    masked by `raw_mask` (None or a bool array broadcastable to (B, n_heads, L, S)): a quantized
    sliding window and the ring of its latest tokens (`QuantizedRotatingKV.exact`)."""
    require(
        state.keys is not None and state.values is not None,
        StateError,
        "attention_with_raw_keys: the state is empty; run a forward (update the cache) first",
    )
    masks = _masks(mask, state, int(queries.shape[2]))
    raw_masks = [] if raw_mask is None else [raw_mask]
    return _two_parts(queries, state, scale, [*masks, ~read_raw], raw_keys, raw_values, raw_masks)


def _two_parts(
    queries: mx.array,
    state: QuantizedKV,
    scale: float,
    masks: list[mx.array],
    raw_keys: mx.array,
    raw_values: mx.array,
    raw_masks: list[mx.array],
) -> mx.array:
    """softmax over [quantized scores under `masks`, raw scores under `raw_masks`], then the
    quantized values' part plus the raw values' part."""
    assert state.keys is not None and state.values is not None
    kc, vc = key_codec(state), value_codec(state)
    keys, values = used_q(state.keys, state.length), used_q(state.values, state.length)
    B, n_heads, L, _ = queries.shape
    kv_heads = int(keys[0].shape[1])
    repeats = n_heads // kv_heads
    q = (kc.rotate(queries) * scale).reshape(B, kv_heads, repeats * L, -1)
    scores = _quantized_matmul(q, keys, transpose=True, group_size=kc.group_size, bits=kc.bits)
    raw_q = (queries * scale).reshape(B, kv_heads, repeats * L, -1)
    raw_scores = raw_q @ raw_keys.swapaxes(-1, -2).astype(raw_q.dtype)
    scores = _masked(scores, masks, kv_heads, repeats, L)
    raw_scores = _masked(raw_scores, raw_masks, kv_heads, repeats, L)
    weights = mx.softmax(
        mx.concatenate([scores, raw_scores.astype(scores.dtype)], axis=-1),
        axis=-1,
        precise=True,
    )
    out = _quantized_matmul(
        weights[..., : state.length],
        values,
        transpose=False,
        group_size=vc.group_size,
        bits=vc.bits,
    )
    raw_out = weights[..., state.length :].astype(raw_q.dtype) @ raw_values.astype(raw_q.dtype)
    return vc.unrotate(out.reshape(B, n_heads, L, -1)) + raw_out.reshape(B, n_heads, L, -1)


def _read_exactly(state: QuantizedKV, L: int) -> mx.array:
    """(L, length) bool: query i (at position length - L + i) reads key position t from the
    tail, which it does when t is one of its latest `exact_latest` positions and the tail
    holds t."""
    length, width = state.length, int(state.tail_keys.shape[2])  # type: ignore[union-attr]
    q_pos = mx.arange(length - L, length)[:, None]
    k_pos = mx.arange(length)[None]
    return (k_pos > q_pos - state.exact_latest) & (k_pos >= length - width)


def _latest_columns(mask: mx.array, length: int, width: int) -> mx.array:
    """The columns of the last `width` key positions of a mask over `length` keys."""
    if mask.shape[-1] == 1:
        return mask
    return mask[..., length - width :]


def _masked(
    scores: mx.array, masks: list[mx.array], kv_heads: int, repeats: int, L: int
) -> mx.array:
    """(B, kv_heads, repeats * L, S) scores with `masks` (bool: True attends; float: added),
    each broadcastable to (B, n_heads, L, S), applied."""
    if not masks:
        return scores
    B, S = scores.shape[0], scores.shape[-1]
    scores = scores.reshape(B, kv_heads, repeats, L, S)
    for m in masks:
        m = _heads_form(m, kv_heads, repeats)
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + m
    return scores.reshape(B, kv_heads, repeats * L, S)


def one_group_rows_read_wrongly() -> bool:
    """Whether quantized_matmul on the default device misreads a matrix whose rows are one
    quantization group each: MLX CUDA 0.32's does (SmolLM2, head dim 64, group 64: perplexity
    ~2300 instead of 14; group 32 right; with the group halved and the scales repeated it
    raises "No implementation for problem shape"); the CPU kernel is right."""
    return mx.default_device().type == mx.DeviceType.gpu


def _quantized_matmul(
    x: mx.array, q: Quantized, *, transpose: bool, group_size: int, bits: int
) -> mx.array:
    """x @ q^T (transpose) or x @ q of the quantized matrix `q`; where the kernel misreads it
    (one group a row on a GPU), x @ its dequantized form: the same values, exact."""
    operands = (mx.contiguous(q[0]), mx.contiguous(q[1]), mx.contiguous(q[2]))
    if int(q[1].shape[-1]) == 1 and one_group_rows_read_wrongly():
        dense = mx.dequantize(*operands, group_size=group_size, bits=bits).astype(x.dtype)
        return x @ (dense.swapaxes(-1, -2) if transpose else dense)
    # Row-contiguous operands (no copy when they already are): see the module's docstring.
    return mx.quantized_matmul(x, *operands, transpose=transpose, group_size=group_size, bits=bits)


def _masks(mask: Any, state: QuantizedKV, L: int) -> list[mx.array]:
    """The caller's mask as an array, and the left padding's (each broadcastable to
    (B, n_heads, L, length))."""
    length = state.length
    found = []
    if isinstance(mask, str):
        require(
            mask == "causal",
            StateError,
            f"quantized_attention: mask {mask!r}; use 'causal', None or an array",
        )
        q_pos = mx.arange(length - L, length)[:, None]
        found.append(q_pos >= mx.arange(length)[None])
    elif mask is not None:
        found.append(mask)
    if state.left_padding is not None:
        lp = state.left_padding[:, None, None, None]
        found.append(mx.arange(length)[None, None, None] >= lp)
    return found


def _heads_form(mask: mx.array, kv_heads: int, repeats: int) -> mx.array:
    """A mask broadcastable to (B, n_heads, L, S) in the (B, kv_heads, repeats, L, S) form."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if mask.shape[1] == 1:
        return mx.expand_dims(mask, 2)
    return mask.reshape(mask.shape[0], kv_heads, repeats, *mask.shape[2:])
