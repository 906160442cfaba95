"""The engine prefills several prompts per forward (ragged: right-padded chunks, left-padded
states), exactly: every greedy request's tokens equal mlx-lm's `generate_step` of its
prompt alone, on every architecture the engine's machine covers, with a row decoding beside
them, with block-boundary snapshots for the prefix cache, and under a tight budget (many
small forwards, rows of every phase at once)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.engine import Engine, RequestParams

from .engine_helpers import Oracle, run_all

N = 6
LENGTHS = (1, 2, 5, 9, 13, 17, 23, 30)
RNG = np.random.default_rng(7)
PROMPTS = [tuple(int(t) for t in RNG.integers(0, VOCAB, n)) for n in LENGTHS]

CASES: dict[str, tuple[str, dict[str, Any], Any]] = {
    "llama": ("llama", {}, None),
    "gemma3_text window 4": ("gemma3_text", {"sliding_window": 4}, None),
    "qwen3_next": ("qwen3_next", {}, None),
    "nemotron_h": ("nemotron_h", {}, None),  # no right padding: equal chunks per forward
    "llama K4/V4": ("llama", {"head_dim": 32}, {"bits": 4, "group_size": 32}),
}
_built: dict[str, tuple[Any, Oracle]] = {}


def built(name: str) -> tuple[Any, Oracle]:
    if name not in _built:
        kind, over, kv = CASES[name]
        model = tiny_model(kind, **over)
        target = wrap(model)
        _built[name] = target, Oracle(model, target, N, kv)
    return _built[name]


@pytest.mark.parametrize("name", list(CASES))
def test_prompts_prefilled_together_give_each_prompts_tokens_alone(name):
    target, oracle = built(name)
    kv = CASES[name][2]
    engine = Engine(target, max_batch=9, prefill_chunk=256, kv_bits=kv)
    beside = engine.submit((4, 8, 15, 16), RequestParams(max_tokens=N))
    engine.step()
    before = engine.stats()["prefill_forwards"]
    requests = [engine.submit(p, RequestParams(max_tokens=N)) for p in PROMPTS]
    engine.step()  # every prompt prefilled in this step, beside `beside`'s round
    assert all(len(r.tokens) == 1 for r in requests)
    forwards = engine.stats()["prefill_forwards"] - before
    if name == "nemotron_h":
        assert forwards > 2  # one forward per distinct chunk length, then the last positions
    else:
        assert forwards == 2  # every prompt's body in one forward, their last positions in one
    run_all(engine)
    for r in [beside, *requests]:
        assert r.tokens == oracle(r.prompt), r.prompt


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "gemma3_text window 4"])
def test_a_tight_budget_and_block_snapshots_stay_exact(name):
    """A budget of 7 positions per step over 8 prompts (most forwards cut every chunk; rows
    begin, reach their last positions and join at different steps), blocks of 7 (the
    prefix cache keeps states at block boundaries of hybrids and windows): then the same
    prompts extended, served from those snapshots."""
    target, oracle = built(name)
    engine = Engine(target, max_batch=8, prefill_chunk=7, prefix_cache_bytes=10**8)
    requests = [engine.submit(p, RequestParams(max_tokens=N)) for p in PROMPTS]
    while engine.has_work():
        engine.step()
        assert engine.stats()["prefilled_tokens"] <= 7 * engine.stats()["steps"]
    again = [engine.submit((*p, 3, 1), RequestParams(max_tokens=N)) for p in PROMPTS[3:]]
    run_all(engine)
    for r in [*requests, *again]:
        assert r.tokens == oracle(r.prompt), r.prompt
    assert all(r.cached_tokens >= 7 for r in again)
