"""Position keys: the noise of a sampled token depends on its row's seed and its position only.

A generator that split one key per round would draw the token at position t with noise that
depends on how many rounds came before it, so the tokens of a sampled generation would change
with the drafting decisions (how many drafts, a plain step or a verify), and a cost-aware
policy decides those from the clock. Here the token at position t of a row (t tokens emitted
before it) is drawn with that row's key of t (below), whatever round it falls in, and the acceptance
rule for point-mass drafts (n-gram, scripted, a greedy draft model) is the *coupled* one: draw
x_t from the target's distribution with that key, accept the draft iff it equals x_t, emit x_t
at the first disagreement. Each emitted token is then exactly the plain decode's draw at its
position, so a sampled generation with such drafts gives the tokens of the same generation
without a drafter, token for token, and its acceptance is the exact rule's (p(draft)).

`fold_in` is JAX's: Threefry-2x32 (20 rounds, Salmon et al. 2011) of the block (0, data)
under the key, a keyed pseudo-random function, so the derived keys of different data are
independent. A row's key is `fold_in(generation_key, row)`, a position's
`fold_in(row_key, t)`; no draw takes either raw (MLX's draws read blocks (0, c) of their key,
which are these keys' own derived keys): the token at a position draws with
`fold_in(position_key, TOKEN)`, the acceptance uniform there (the rule for drafts with
distributions) with `fold_in(position_key, UNIFORM)`, a tree round with `fold_in(first
position's key, TREE)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ._row_keys import categorical, uniform

TOKEN = 0  # fold_in(position key, TOKEN): the token drawn at that position
UNIFORM = 1  # fold_in(position key, UNIFORM): the acceptance test's uniform at that position
TREE = 2  # fold_in(position key, TREE): a tree round's key, from its first position's key

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def _rotl(x: mx.array, r: int) -> mx.array:
    return (x << r) | (x >> (32 - r))


@mx.compile
def _threefry(k0: mx.array, k1: mx.array, x0: mx.array, x1: mx.array) -> tuple[mx.array, mx.array]:
    """Threefry-2x32-20 of the blocks (x0, x1) under the keys (k0, k1), uint32, broadcast."""
    ks = (k0, k1, k0 ^ k1 ^ mx.array(_PARITY, mx.uint32))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + mx.array(i + 1, mx.uint32)
    return x0, x1


def threefry(key: mx.array, block: mx.array) -> mx.array:
    """Threefry-2x32-20: `key` (..., 2) uint32 encrypts `block` (..., 2) uint32, broadcast."""
    out = _threefry(key[..., 0], key[..., 1], block[..., 0], block[..., 1])
    return mx.stack(list(out), axis=-1)


def fold_in(key: mx.array, data: mx.array | int) -> mx.array:
    """Keys (..., 2) derived from `key` (..., 2) uint32 and `data` (...) int (broadcast):
    JAX's `fold_in`, Threefry of the block (0, data)."""
    data = mx.array(data).astype(mx.uint32)
    block = mx.stack([mx.zeros_like(data), data], axis=-1)
    return threefry(key, block)


def rows_of(key: mx.array, rows: int) -> mx.array:
    """(rows, 2): each row's key from a generation's key (2,)."""
    return fold_in(key, mx.arange(rows))


def position_keys(row_keys: mx.array, starts: Sequence[int], width: int) -> mx.array:
    """(B, width, 2): row b's keys of positions starts[b] .. starts[b] + width - 1 (a
    round's keys: `starts[b]` the tokens row b emitted so far), from row keys (B, 2)."""
    positions = mx.array(list(starts), mx.uint32)[:, None] + mx.arange(width, dtype=mx.uint32)[None]
    return fold_in(row_keys[:, None], positions)


def token_keys(keys: mx.array) -> mx.array:
    """The keys (..., 2) a position's token draws with, from its position keys (..., 2)."""
    return fold_in(keys, TOKEN)


def is_position_keys(key: mx.array) -> bool:
    """Whether `key` is position keys (B, S, 2), rather than one key or row keys."""
    return key.ndim == 3


def categorical_at(logits: mx.array, keys: mx.array) -> mx.array:
    """(B, S) draws from `logits` (B, S, vocab), the one at (b, s) the token of position key
    keys[b, s] (drawn with `token_keys`)."""
    rows, width = keys.shape[:2]
    flat = categorical(logits.reshape(rows * width, -1), token_keys(keys).reshape(rows * width, 2))
    return flat.reshape(rows, width)


def uniform_at(keys: mx.array) -> mx.array:
    """(B, S) uniform draws in [0, 1), the one at (b, s) the acceptance uniform of position
    key keys[b, s] (drawn with `fold_in(key, UNIFORM)`)."""
    rows, width = keys.shape[:2]
    flat = uniform((rows * width, 1), fold_in(keys, UNIFORM).reshape(rows * width, 2))
    return flat.reshape(rows, width)
