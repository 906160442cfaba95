"""The server's interim engine (kvstate/serve/_interim_engine.py, scaffolding until the
real kvstate.engine is merged; this file goes with it): interleaved requests each get
the tokens of mlx-lm's generate_step on their prompt alone; the queue, cancel, stop ids."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kvstate import NotSupportedError, StateError, TokenError
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.serve._interim_engine import Engine, RequestParams
from tests.helpers import greedy_reference


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def run(engine: Engine) -> list:
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_interleaved_requests_each_get_their_greedy_tokens(model, drafter):
    engine = Engine(wrap(model), drafter, max_batch=2)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4, 4, 4], [200]]
    requests = [engine.submit(p, RequestParams(max_tokens=6 + i)) for i, p in enumerate(prompts)]
    assert engine.stats()["queued"] == 4
    engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["queued"] == 2  # max_batch
    run(engine)
    for r, p in zip(requests, prompts, strict=True):
        assert r.tokens == greedy_reference(model, p, len(r.tokens)) and r.finished
        assert r.finish_reason == "length" and len(r.tokens) == r.params.max_tokens
    assert engine.stats()["generated_tokens"] == sum(6 + i for i in range(4))


def test_stop_ids_logprobs_and_cancel(model):
    engine = Engine(wrap(model))
    prompt = [5, 6, 7]
    want = greedy_reference(model, prompt, 10)
    stop = engine.submit(prompt, RequestParams(max_tokens=10, stop_ids=(want[3],), logprobs=True))
    gone = engine.submit(prompt, RequestParams(max_tokens=500))
    engine.step()
    engine.cancel(gone)
    outputs = run(engine)
    assert stop.tokens == want[: want.index(want[3]) + 1] and stop.finish_reason == "stop"
    steps = list(generate_step(mx.array(prompt), model, max_tokens=len(stop.tokens)))
    np.testing.assert_allclose(
        stop.logprobs, [float(lp[t].item()) for t, lp in steps], rtol=1e-4, atol=1e-4
    )
    assert gone.finish_reason == "cancelled" and len(gone.tokens) < 5
    assert [o.finish_reason for o in outputs if o.request is gone] == ["cancelled"]
    assert not engine.has_work()


def test_refusals(model):
    target = wrap(model)
    engine = Engine(target)
    with pytest.raises(TokenError, match="256"):
        engine.submit([256])
    with pytest.raises(TokenError, match="empty"):
        engine.submit([])
    with pytest.raises(TokenError, match="at most 4096"):
        engine.submit([1] * 4097)
    with pytest.raises(StateError, match="max_tokens"):
        engine.submit([1], RequestParams(max_tokens=0))
    with pytest.raises(StateError, match="stop_ids"):
        engine.submit([1], RequestParams(stop_ids=(999,)))
    with pytest.raises(NotSupportedError):
        Engine(target, kv_bits=4)
    assert not engine.has_work()
