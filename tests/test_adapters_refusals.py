"""The adapters' refusals: a well-formed request the library does not support raises
`NotSupportedError` (a caller can fall back on it), bad input keeps its own StateError, and
each refusal written once reads the same wherever it fires."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

import kvstate as ks
from kvstate.adapters import MTPHead, from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.tiny_models import tiny_model

PROMPT = [3, 17, 42, 99, 7]


class HomeMadeCache:
    """A cache class kvstate has no converter for."""


def prefilled(name: str, **config):
    m = wrap(tiny_model(name, **config))
    return m, m(mx.array([PROMPT]), m.init_state())[1]


def test_a_cache_class_without_a_state_is_not_supported():
    with pytest.raises(ks.NotSupportedError, match=r"no state for cache class .*HomeMadeCache"):
        from_mlx_lm([HomeMadeCache()])


def test_a_tree_forward_over_a_quantized_cache_is_not_supported_and_bad_parents_are_bad_input():
    m, state = prefilled("llama", head_dim=32)
    with pytest.raises(ks.NotSupportedError, match="tree forward: a layer has a"):
        m.tree_forward(mx.array([[1, 2]]), ks.quantize(state, bits=4, group_size=32), [-1, 0])
    with pytest.raises(ks.StateError, match="parents") as bad:
        m.tree_forward(mx.array([[1, 2]]), state, [-1, 1])
    assert not isinstance(bad.value, ks.NotSupportedError)


def test_a_batched_window_with_a_keep_prefix_has_no_mlx_lm_cache():
    cache = BatchRotatingKVCache(max_size=8, left_padding=[1, 0])
    cache.update_and_fetch(mx.zeros((2, 2, 3, 4)), mx.zeros((2, 2, 3, 4)))
    state = from_mlx_lm(cache)
    with pytest.raises(ks.NotSupportedError, match="keep=2 has no mlx-lm cache"):
        to_mlx_lm(ks.kinds.replace(state, keep=2))


def test_quantized_attention_with_sinks_is_not_supported():
    from kvstate.adapters.caches.quantized_cache import QuantizedStateCache
    from kvstate.adapters.instruments.routing import ROUTES

    route = ROUTES[QuantizedStateCache]
    with pytest.raises(ks.NotSupportedError, match="attention sinks"):
        route(None, None, None, None, 1.0, None, mx.zeros((1,)))


def test_a_model_without_mlx_lm_args_has_no_mtp_head():
    with pytest.raises(ks.NotSupportedError, match="no mlx-lm `args`"):
        MTPHead(nn.Linear(2, 2))


def test_a_cache_between_prepare_and_finalize_is_refused_in_one_wording():
    cache = BatchKVCache(left_padding=[0, 0])
    cache.update_and_fetch(mx.zeros((2, 2, 3, 4)), mx.zeros((2, 2, 3, 4)))
    cache.prepare(lengths=[3, 2], right_padding=[0, 1])
    with pytest.raises(ks.StateError) as refused:
        from_mlx_lm([cache])
    assert not isinstance(refused.value, ks.NotSupportedError)  # a forward in progress
    assert str(refused.value) == (
        "converting a cache: this BatchKVCache is between prepare() and finalize() "
        "(_right_padding = [0, 1]); call cache.finalize() after the padded prompt forward, then "
        "convert (kvstate.adapters.wrap(model)(tokens, state, lengths=...) runs that whole "
        "phase for you)"
    )
