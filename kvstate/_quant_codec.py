"""How one side (keys or values) of a QuantizedKV turns head vectors into an `mx.quantize`
triple and back: zero channels appended up to a whole number of groups, an optional seeded
rotation (`_rotations`), then affine quantization at `bits` with `group_size`.

Stored rows are `dim + pad` wide, `pad` the zero channels that make a head dim a multiple of
the group size (mx.quantize groups whole rows: head dim 80 at group 32 is stored as 96).
Zero query channels meet them in the scores, and the output's are dropped.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from ._rotations import rotation_matrix

Quantized = tuple[mx.array, mx.array, mx.array]
"""(packed uint32 (..., D*bits//32), scales (..., D//group_size), biases (same))."""


def packed_width(dim: int, bits: int) -> int:
    """uint32 words per row of `dim` values at `bits` bits: what `mx.quantize` emits.

    (mlx-lm 0.32's QuantizedKVCache allocates `dim // (32 // bits)`, which differs for 3 bits
    at head dims 192 / 256 and for 5 / 6 bits at most head dims.)"""
    return dim * bits // 32


def channel_pad(dim: int, group_size: int) -> int:
    """Zero channels that make `dim` a whole number of groups."""
    return -dim % group_size


@attrs.frozen
class Codec:
    """One side's quantization: `bits`, `group_size`, `pad` zero channels, rotation."""

    bits: int
    group_size: int
    pad: int = 0
    rotation: str = "none"
    seed: int = 0

    def rotate(self, x: mx.array) -> mx.array:
        """(..., dim) head vectors -> (..., dim + pad): zero-padded, rotated, same dtype."""
        if self.pad:
            x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, self.pad)])
        if self.rotation == "none":
            return x
        r = rotation_matrix(self.rotation, int(x.shape[-1]), self.seed)
        return (x.astype(mx.float32) @ r.T).astype(x.dtype)

    def unrotate(self, y: mx.array) -> mx.array:
        """The inverse of `rotate`: (..., dim + pad) -> (..., dim)."""
        if self.rotation != "none":
            r = rotation_matrix(self.rotation, int(y.shape[-1]), self.seed)
            y = (y.astype(mx.float32) @ r).astype(y.dtype)
        return y[..., : y.shape[-1] - self.pad] if self.pad else y

    def encode(self, x: mx.array) -> Quantized:
        """(..., dim) -> the triple of its rotated, padded rows."""
        packed, scales, biases = mx.quantize(
            self.rotate(x), group_size=self.group_size, bits=self.bits
        )
        return (packed, scales, biases)

    def decode(self, q: Quantized) -> mx.array:
        """A triple -> (..., dim) head vectors (dequantized, rotated back, pad dropped)."""
        x = mx.dequantize(*q, group_size=self.group_size, bits=self.bits)
        return self.unrotate(x)

    def stored_dim(self, q: Quantized) -> int:
        """The stored row width (dim + pad) of a triple, read off its scales."""
        return int(q[1].shape[-1]) * self.group_size

    def dim(self, q: Quantized) -> int:
        """The head dim a triple encodes."""
        return self.stored_dim(q) - self.pad
