"""Seeded orthogonal rotations of head vectors, applied before quantizing keys and values.

A rotation spreads an outlier channel's energy over many channels, so one group's scale no
longer has to span it. Queries get the key rotation too (scores are unchanged:
(R q) . (R k) = q . k); the attention output is rotated back with the value rotation's
transpose. A rotation is never stored: `rotation_matrix(kind, dim, seed)` rebuilds it from
those statics (NumPy, float64, cached), so a saved state reloads with the same one.

Kinds:
- "none": the identity (nothing is applied).
- "so4": block-diagonal SO(4), the IsoQuant construction: each 4-channel block v is read as
  a quaternion and mapped to q_L v conj(q_R), with seeded unit quaternions q_L, q_R per
  block (normalized Gaussians: uniform on SO(4)'s double cover). `dim` must be a multiple of 4.
- "hadamard": full-width Hadamard with seeded random signs,
  R = (H_p / sqrt(p)  kron  C_m) . diag(s), where dim = p * m, p the largest power of two
  dividing dim, m odd, H_p the Sylvester Hadamard matrix, C_m the orthonormal DCT-II matrix
  of size m (C_1 = [1]) and s seeded random signs. A Kronecker product of orthogonal matrices
  is orthogonal, and every output channel mixes channels of every 1/m-th of the vector; for
  a power-of-two dim (64, 128, 256) this is the plain randomized Hadamard transform. dim 80 =
  16 * 5, 96 = 32 * 3, 192 = 64 * 3.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

ROTATIONS = ("none", "so4", "hadamard")


def rotation_problems(kind: object, dim: int) -> list[str]:
    """Why (kind, dim) names no rotation (empty when it does)."""
    if kind not in ROTATIONS:
        return [f"rotation: {kind!r} is not one of {list(ROTATIONS)}"]
    if kind == "so4" and dim % 4:
        return [f"rotation: 'so4' rotates 4-channel blocks; head dim {dim} is not a multiple of 4"]
    return []


@lru_cache(maxsize=64)
def rotation_numpy(kind: str, dim: int, seed: int) -> np.ndarray:
    """The (dim, dim) float64 orthogonal matrix R of (kind, dim, seed): x -> R x."""
    found = rotation_problems(kind, dim)
    if found:
        raise ValueError(found[0])
    if kind == "none":
        return np.eye(dim)
    rng = np.random.default_rng(seed)
    if kind == "so4":
        return _so4(rng, dim)
    return _hadamard(rng, dim)


@lru_cache(maxsize=64)
def rotation_matrix(kind: str, dim: int, seed: int) -> mx.array:
    """R as a float32 mx.array. Rotate rows with `x @ R.T`, rotate back with `y @ R`."""
    return mx.array(rotation_numpy(kind, dim, seed).astype(np.float32))


def _left(q: np.ndarray) -> np.ndarray:
    """The matrix of v -> q v (Hamilton product, (w, x, y, z) order)."""
    w, x, y, z = q
    return np.array([[w, -x, -y, -z], [x, w, -z, y], [y, z, w, -x], [z, -y, x, w]])


def _right(q: np.ndarray) -> np.ndarray:
    """The matrix of v -> v q."""
    w, x, y, z = q
    return np.array([[w, -x, -y, -z], [x, w, z, -y], [y, -z, w, x], [z, y, -x, w]])


def _so4(rng: np.random.Generator, dim: int) -> np.ndarray:
    blocks = dim // 4
    quats = rng.standard_normal((2, blocks, 4))
    quats /= np.linalg.norm(quats, axis=-1, keepdims=True)
    out = np.zeros((dim, dim))
    conj = np.array([1.0, -1.0, -1.0, -1.0])
    for b in range(blocks):
        q_left, q_right = quats[0, b], quats[1, b]
        out[4 * b : 4 * b + 4, 4 * b : 4 * b + 4] = _left(q_left) @ _right(q_right * conj)
    return out


def _hadamard(rng: np.random.Generator, dim: int) -> np.ndarray:
    p = dim & -dim  # the largest power of two dividing dim
    m = dim // p
    h = np.ones((1, 1))
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    mixed = np.kron(h / np.sqrt(p), _dct(m))
    signs = rng.choice([-1.0, 1.0], size=dim)
    return mixed * signs[None, :]


def _dct(m: int) -> np.ndarray:
    """The orthonormal DCT-II matrix of size m."""
    k, n = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    c = np.cos(np.pi * (2 * n + 1) * k / (2 * m)) * np.sqrt(2.0 / m)
    c[0] /= np.sqrt(2.0)
    return c
