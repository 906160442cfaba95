"""A soak: a few hundred random requests through one engine (random arrivals, cancellations
at every stage, prompt lengths over shared prefixes, greedy and sampled rows, a prefix cache
that evicts), then nothing is left: no row, no prefilling prompt, no state of a finished
request, the prefix cache within its bound, and MLX's active memory back to where it was
before the engine was made once the cache is cleared. Greedy requests that ran to the end
are checked against mlx-lm's `generate_step` of their prompt alone.

`KVSTATE_SOAK=1` runs 1000 requests (and checks every greedy one); the default run 200."""

from __future__ import annotations

import gc
import os

import mlx.core as mx
import numpy as np
import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.engine import Engine, RequestParams

from .engine_helpers import Oracle, expected

LONG = os.environ.get("KVSTATE_SOAK") == "1"
REQUESTS = 1000 if LONG else 200
MOST = 6
CACHE_BYTES = 600_000
SLACK = 64 * 1024  # bytes of active memory the soak may leave (allocator rounding)


def _active() -> int:
    gc.collect()
    mx.synchronize()
    return int(mx.get_active_memory())


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_a_soak_leaves_nothing_behind(kind):
    model = tiny_model(kind)
    target = wrap(model)
    oracle = Oracle(model, target, MOST)
    rng = np.random.default_rng(11)
    prefixes = [tuple(int(t) for t in rng.integers(0, VOCAB, n)) for n in (3, 9, 17)]
    requests, checked = [], 0
    start = _active()
    engine = Engine(target, "ngram", max_batch=6, prefill_chunk=12, prefill_rows=4,
                    prefix_cache_bytes=CACHE_BYTES, k=3, seed=5)  # fmt: skip
    while len(requests) < REQUESTS or engine.has_work():
        for _ in range(int(rng.poisson(0.8)) if len(requests) < REQUESTS else 0):
            head = prefixes[rng.integers(3)] if rng.random() < 0.6 else ()
            tail = tuple(int(t) for t in rng.integers(0, VOCAB, rng.integers(1, 14)))
            greedy = rng.random() < 0.6
            params = RequestParams(
                max_tokens=int(rng.integers(1, MOST + 1)),
                temperature=0.0 if greedy else float(rng.choice([0.7, 1.0])),
                top_k=int(rng.choice([0, 5])),
                seed=int(rng.integers(2**32)),
            )
            requests.append(engine.submit((*head, *tail), params))
        live = [r for r in requests if not r.finished and not r.cancel_requested]
        if live and rng.random() < 0.1:  # queued, prefilling or running: any stage
            engine.cancel(live[int(rng.integers(len(live)))])
        engine.step()
        stats = engine.stats()
        assert stats["prefix_bytes"] <= CACHE_BYTES
        assert stats["running"] + stats["prefilling"] <= 6
        assert all(not r.finished for r in engine.running)
    assert all(r.finished for r in requests)
    for r in requests:
        if r.finish_reason != "cancelled" and r.params.sampler.greedy and (LONG or checked < 40):
            assert r.tokens == expected(r, oracle(r.prompt)), r.prompt
            checked += 1
    stats = engine.stats()
    assert stats["running"] == stats["prefilling"] == stats["queued"] == 0
    assert stats["running_bytes"] == 0
    assert stats["cancelled"] > 0 and stats["prefix_hits"] > 0 and stats["prefix_evictions"] > 0
    assert stats["finished"] + stats["cancelled"] == len(requests)
    assert engine._batch.state is None and engine._group.state is None
    assert not engine._group.prompts
    cache = engine.prefix_cache
    assert cache is not None
    cache.clear()
    del requests, live
    assert _active() <= start + SLACK, (_active(), start)
