"""The engine, example by example: refusals naming the field, cancellation freeing rows and
bytes, the queue's order and the batch bound, the prefill stall bound, stop ids and
log-probabilities, the prefix cache (cold start vs hit, its byte bound, save / load across
a restart, refusals), drafters that cannot admit rows, quantized and TurboQuant states.
Greedy tokens are checked against mlx-lm's `generate_step` of each prompt alone."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.engine import Engine, Request, RequestParams
from kvstate.speculative import (
    CostAwarePolicy,
    FixedCost,
    ModelDrafter,
    MTPDrafter,
    NGramDrafter,
    Sampler,
)

from .engine_helpers import Oracle, OracleDrafter, expected, run_all
from .test_mtp_drafter import TargetHead

N = 8
LONG = tuple(int(t) for t in np.random.default_rng(0).integers(0, 256, 40))


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any, Oracle]:
    model = tiny_model("llama")
    target = wrap(model)
    return model, target, Oracle(model, target, N)


@pytest.fixture(scope="module")
def hybrid() -> tuple[Any, Any, Oracle]:
    model = tiny_model("qwen3_next")
    target = wrap(model)
    return model, target, Oracle(model, target, N)


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"stop_ids": "eos"}, "stop_ids"),
        ({"stop_ids": (1, -2)}, "stop_ids"),
    ],
)
def test_bad_params_are_refused_naming_the_field(params, field):
    with pytest.raises(ks.StateError, match=field) as caught:
        RequestParams(**params)
    assert caught.value.field == field  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("prompt", "params", "field", "error"),
    [
        ([], None, "prompt", ks.TokenError),
        ("hello", None, "prompt", ks.TokenError),
        ([1, 2, 256], None, "prompt", ks.TokenError),
        ([1, -1], None, "prompt", ks.TokenError),
        ([1, 2.0], None, "prompt", ks.TokenError),
        (list(range(20)), None, "prompt", ks.TokenError),  # past max_prompt_tokens
        ([1, 2], RequestParams(stop_ids=(300,)), "stop_ids", ks.TokenError),
        ([1, 2], {"max_tokens": 3}, "params", ks.StateError),
    ],
)
def test_bad_prompts_are_refused_before_queueing(llama, prompt, params, field, error):
    _, target, _ = llama
    engine = Engine(target, max_prompt_tokens=16)
    with pytest.raises(error) as caught:
        engine.submit(prompt, params)
    assert caught.value.field == field  # type: ignore[attr-defined]
    assert not engine.has_work() and engine.stats()["queued"] == 0


def test_the_prompt_limit_defaults_to_the_models_positions(llama):
    _, target, _ = llama
    assert Engine(target).max_prompt_tokens == 4096
    assert Engine(target).vocab_size == 256


@pytest.mark.parametrize(
    "options",
    [
        {"max_batch": 0},
        {"prefill_chunk": 0},
        {"k": 0},
        {"prefix_cache_bytes": -1},
        {"seed": -1},
        {"kv_scheme": "fp4"},
        {"kv_bits": "four"},
        {"kv_bits": 7},
        {"kv_bits": 4, "kv_group_size": 48},
        {"kv_bits": {"bits": 4, "shape": 2}},
    ],
)
def test_bad_engine_options_are_refused(llama, options):
    _, target, _ = llama
    with pytest.raises(ks.StateError):
        Engine(target, **options)


def test_a_drafter_that_cannot_admit_rows_is_refused(llama):
    _, target, _ = llama

    class FixedRows:
        def start(self, prompts, *, key=None): ...
        def propose(self, last, k, sampler): ...
        def accept(self, fed, kept): ...
        def keep_rows(self, rows): ...

    with pytest.raises(ks.NotSupportedError, match="add_rows"):
        Engine(target, FixedRows())
    with pytest.raises(ks.StateError, match="drafter"):
        Engine(target, "medusa")


def test_the_policy_options(llama):
    """The default with a drafter is a CostAwarePolicy (adaptive=False: fixed k, none);
    a policy that is not one, or one with adaptive=False, is refused."""
    _, target, _ = llama
    assert isinstance(Engine(target, "ngram").policy, CostAwarePolicy)
    assert Engine(target, "ngram", adaptive=False).policy is None
    assert Engine(target).policy is None
    mine = CostAwarePolicy()
    assert Engine(target, "ngram", policy=mine).policy is mine
    with pytest.raises(ks.StateError, match="policy"):
        Engine(target, "ngram", policy=object())
    with pytest.raises(ks.StateError, match="adaptive=False"):
        Engine(target, "ngram", policy=mine, adaptive=False)


@pytest.mark.parametrize("dear", [False, True])
def test_the_policy_chooses_the_drafts_the_rounds_verify(llama, dear):
    """Where a verify costs little the engine's rounds verify drafts; where it costs ten
    plain steps a draft, none but the policy's probes (2 drafts at most, rarely); the tokens
    are the oracle's either way, and the policy keeps one estimate per running row."""
    _, target, oracle = llama
    cost = FixedCost(lambda w: 1.0 + (10.0 if dear else 0.05) * w)
    engine = Engine(target, OracleDrafter(oracle, 0.9), max_batch=3, k=3,
                    policy=CostAwarePolicy(cost=cost))  # fmt: skip
    requests = [engine.submit(p, RequestParams(max_tokens=N)) for p in [LONG, (1, 2), (5,)]]
    rounds = 0
    while engine.has_work():
        engine.step()
        rounds += 1
        assert engine.policy is not None
        assert len(engine.policy.acceptance) == len(engine.running)
    for r in requests:
        assert r.tokens == expected(r, oracle(r.prompt))
    drafted = engine.stats()["drafted"]
    if dear:
        assert drafted <= 2 * 3 * (rounds // 8 + 1)  # probes only
    else:
        assert drafted > 3 * rounds // 2


def test_an_mtp_drafter_with_a_prefix_cache_is_refused(llama):
    model, target, _ = llama
    with pytest.raises(ks.NotSupportedError, match="MTP"):
        Engine(target, MTPDrafter(TargetHead(model)), prefix_cache_bytes=10**6)


# -- scheduling -----------------------------------------------------------------------------


def test_cancelling_frees_the_row_and_its_bytes_at_the_next_step(llama):
    _, target, oracle = llama
    engine = Engine(target, NGramDrafter(), max_batch=4)
    a = engine.submit([1, 2, 3], RequestParams(max_tokens=50))
    b = engine.submit([4, 5, 6, 7, 8], RequestParams(max_tokens=N))
    queued = engine.submit([9], RequestParams(max_tokens=N))
    engine.cancel(queued)  # before it ever runs
    engine.step()
    engine.step()
    assert engine.running == (a, b)
    both = engine.stats()["running_bytes"]
    engine.cancel(a)
    assert not a.finished  # freed at the next step, not inside cancel
    outputs = {o.request.id: o for o in engine.step()}
    assert a.finished and a.finish_reason == "cancelled" and outputs[a.id].finished
    assert queued.finish_reason == "cancelled" and queued.tokens == []
    assert engine.running == (b,)
    assert engine.stats()["running_bytes"] < both
    assert a.tokens == oracle((1, 2, 3))[: len(a.tokens)]
    engine.cancel(a)  # idempotent, and nothing for a finished request
    run_all(engine)
    assert b.tokens == expected(b, oracle(b.prompt))
    assert engine.stats()["running_bytes"] == 0 and engine.stats()["cancelled"] == 2


def test_requests_wait_in_order_beyond_max_batch(llama):
    _, target, oracle = llama
    engine = Engine(target, max_batch=2)
    requests = [engine.submit([i + 1, i + 2], RequestParams(max_tokens=3 + i)) for i in range(5)]
    admitted: list[int] = []
    while engine.has_work():
        engine.step()
        live = [r.id for r in (*engine.prefilling, *engine.running)]
        assert len(live) <= 2
        admitted += [i for i in live if i not in admitted]
    assert admitted == [r.id for r in requests]  # first come, first served
    for r in requests:
        assert r.tokens == expected(r, oracle(r.prompt))


def test_a_long_prompt_stalls_running_rows_by_one_chunk_per_step(llama):
    """A 40-token prompt at chunk 8 takes 5 steps (chunks ending at 8, 16, 24, 32 and 39,
    then the last position alone); the running row emits a token at every one of them."""
    _, target, oracle = llama
    engine = Engine(target, max_batch=4, prefill_chunk=8)
    short = engine.submit([7, 7, 7], RequestParams(max_tokens=N))
    engine.step()
    long = engine.submit(LONG, RequestParams(max_tokens=N))
    steps = 0
    while not long.tokens:
        before = len(short.tokens)
        engine.step()
        steps += 1
        assert len(short.tokens) == before + 1 or short.finished
        assert engine.stats()["prefilled_tokens"] <= 3 + 8 * steps
    assert steps == 5  # 8 + 8 + 8 + 8 + (7, then the last position alone)
    run_all(engine)
    assert long.tokens == oracle(LONG)
    assert short.tokens == oracle(short.prompt)


def test_stop_ids_and_logprobs(llama):
    _, target, oracle = llama
    prompt = (5, 9, 13, 17)
    truth = oracle(prompt)
    engine = Engine(target, NGramDrafter())
    stopped = engine.submit(prompt, RequestParams(max_tokens=N, stop_ids=(truth[3],)))
    scored = engine.submit(prompt, RequestParams(max_tokens=5, logprobs=True))
    plain = engine.submit(prompt, RequestParams(max_tokens=5))
    run_all(engine)
    assert stopped.tokens == truth[: truth.index(truth[3]) + 1]
    assert stopped.finish_reason == "stop"
    assert scored.finish_reason == "length" and plain.logprobs is None
    logits, _ = target(mx.array([[*prompt, *truth[:4]]]), target.init_state())
    logits = logits[0, len(prompt) - 1 :].astype(mx.float32)
    want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[
        mx.arange(5), mx.array(truth[:5])
    ]
    np.testing.assert_allclose(scored.logprobs, np.array(want), atol=1e-4)


def test_outputs_stream_what_each_request_emitted(llama):
    _, target, oracle = llama
    engine = Engine(target, NGramDrafter(), max_batch=3)
    requests = [engine.submit([3, i, 3, i], RequestParams(max_tokens=N)) for i in range(4)]
    streamed: dict[int, list[int]] = {r.id: [] for r in requests}
    finished: set[int] = set()
    while engine.has_work():
        for out in engine.step():
            assert out.request.id not in finished
            streamed[out.request.id] += out.tokens
            if out.finished:
                finished.add(out.request.id)
    for r in requests:
        assert streamed[r.id] == r.tokens == oracle(r.prompt)
    assert engine.stats()["generated_tokens"] == 4 * N


# -- the prefix cache ------------------------------------------------------------------------


@pytest.mark.parametrize("drafts", [False, True])
@pytest.mark.parametrize("fixture", ["llama", "hybrid"])
def test_a_prefix_hit_gives_the_tokens_of_a_cold_start(fixture, drafts, request):
    """The same prompts served cold and then through the cache (a repeat, an extension, a
    turn: prompt + output + more), attention-only (cut prefixes) and hybrid (exact states);
    with drafts, the turn ends after ragged commits (a turn end is served whole: see
    `_prefix_cache`)."""
    _, target, oracle = request.getfixturevalue(fixture)
    drafter = OracleDrafter(oracle, 0.7) if drafts else None
    engine = Engine(target, drafter, max_batch=4, prefill_chunk=8, prefix_cache_bytes=10**8,
                    adaptive=False)  # fmt: skip
    first = engine.submit(LONG, RequestParams(max_tokens=N))
    beside = engine.submit((5, 6), RequestParams(max_tokens=N))  # ragged with `first`
    run_all(engine)
    assert beside.tokens == oracle(beside.prompt)
    turn = (*LONG, *first.tokens, 11, 12)
    again = [
        engine.submit(LONG, RequestParams(max_tokens=N)),
        engine.submit((*LONG[:30], 1, 2, 3), RequestParams(max_tokens=N)),
        engine.submit(turn, RequestParams(max_tokens=N)),
    ]
    run_all(engine)
    for r in [first, *again]:
        assert r.tokens == oracle(r.prompt)
    assert first.cached_tokens == 0
    assert again[0].cached_tokens == len(LONG) - 1
    assert again[2].cached_tokens >= len(LONG) + N - 1  # the turn end
    cuts = engine.prefix_cache is not None and engine.prefix_cache.cuts
    assert again[1].cached_tokens == (30 if cuts else 24)  # a cut, or a block boundary
    stats = engine.stats()
    assert stats["prefix_hits"] == 3 and stats["prefix_misses"] == 2
    assert stats["prefix_hit_tokens"] == sum(r.cached_tokens for r in again)
    served = [first, beside, *again]
    assert stats["prefilled_tokens"] == sum(len(r.prompt) - r.cached_tokens for r in served)
    if drafts:
        assert stats["accepted"] > 0


def test_the_prefix_cache_stays_within_its_bound(llama):
    _, target, oracle = llama
    one = Engine(target, prefix_cache_bytes=10**8)
    one.submit(LONG, RequestParams(max_tokens=2))
    run_all(one)
    entry = one.stats()["prefix_bytes"]  # one request's: its prompt end and turn end
    engine = Engine(target, prefix_cache_bytes=int(2.5 * entry))
    prompts = [(i, *LONG[1:]) for i in range(6)]
    for p in prompts:
        r = engine.submit(p, RequestParams(max_tokens=2))
        run_all(engine)
        assert r.tokens == oracle(p)[:2]
        assert engine.stats()["prefix_bytes"] <= int(2.5 * entry)
    stats = engine.stats()
    assert stats["prefix_evictions"] >= 6
    # Least recently used first out: what stays is the last prompts'.
    cache = engine.prefix_cache
    assert cache is not None
    firsts = {k[0] for k in cache.prefixes()}
    assert {4, 5} <= firsts and not firsts & {0, 1, 2}


def test_the_prefix_cache_survives_a_restart(tmp_path, hybrid):
    _, target, oracle = hybrid
    engine = Engine(target, prefill_chunk=8, prefix_cache_bytes=10**8)
    engine.submit(LONG, RequestParams(max_tokens=4))
    run_all(engine)
    path = tmp_path / "prefix.safetensors"
    engine.save_prefix_cache(path)
    restarted = Engine(target, prefill_chunk=8, prefix_cache_bytes=10**8)
    assert restarted.load_prefix_cache(path) == len(engine.prefix_cache or ())
    r = restarted.submit((*LONG, 5), RequestParams(max_tokens=N))
    run_all(restarted)
    assert r.cached_tokens == len(LONG) - 1 and r.tokens == oracle(r.prompt)
    # An engine of other states refuses the file; one without a cache has nothing to load.
    with pytest.raises(ks.NotSupportedError, match="group size"):  # head dim 16, groups of 64
        Engine(target, kv_bits=8, prefix_cache_bytes=10**8)
    wider = wrap(tiny_model("qwen3_next", head_dim=32))
    quantized = Engine(wider, kv_bits=8, kv_group_size=32, prefix_cache_bytes=10**8)
    with pytest.raises(ks.StateError):
        quantized.load_prefix_cache(path)
    with pytest.raises(ks.StateError):
        Engine(wrap(tiny_model("llama")), prefix_cache_bytes=10**8).load_prefix_cache(path)
    assert len(quantized.prefix_cache or ()) == 0
    # The same model's dense states fit it, but not an engine of quantized rows.
    dense = Engine(wider, prefix_cache_bytes=10**8)
    dense.submit(LONG, RequestParams(max_tokens=2))
    run_all(dense)
    dense.save_prefix_cache(path)
    with pytest.raises(ks.ConfigMismatchError, match="kv_bits"):
        quantized.load_prefix_cache(path)
    with pytest.raises(ks.StateError, match="prefix_cache_bytes"):
        Engine(target).save_prefix_cache(path)


def test_a_file_that_is_no_prefix_cache_is_refused(tmp_path, llama):
    _, target, _ = llama
    path = tmp_path / "state.safetensors"
    ks.save(path, target.init_state())
    with pytest.raises(ks.FileFormatError, match="no prefix cache"):
        Engine(target, prefix_cache_bytes=10**6).load_prefix_cache(path)


# -- states and drafters ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kv",
    [
        {"bits": 4, "group_size": 32},
        # an exact tail of 6 (kvstate.quantize's exact_latest), given as quantize's keywords
        {"key_bits": 4, "value_bits": 3, "group_size": 32, "rotation": "hadamard",
         "exact_latest": 6},
    ],
    ids=["K4/V4", "K4/V3 exact 6"],
)  # fmt: skip
def test_a_quantized_target_decodes_as_quantized_states_alone(kv):
    model = tiny_model("llama", head_dim=32)
    target = wrap(model)
    oracle = Oracle(model, target, N, kv)
    engine = Engine(target, NGramDrafter(), kv_bits=kv, prefill_chunk=8,
                    prefix_cache_bytes=10**7)  # fmt: skip
    requests = [engine.submit(p, RequestParams(max_tokens=N)) for p in [LONG, (1, 2, 3), LONG]]
    run_all(engine)
    for r in requests:
        assert r.tokens == oracle(r.prompt)
    assert requests[2].cached_tokens > 0


@pytest.mark.parametrize("library", ["mlx_lm", "mlx_vlm"])
def test_turboquant_states_on_mlx_lm_and_mlx_vlm_models(library):
    """Requests on TurboQuant states give the tokens of one prompt decoded alone on such a
    state, on an mlx-lm model (its attention routed to mlx-vlm's) and an mlx-vlm one."""
    pytest.importorskip("mlx_vlm")
    if library == "mlx_vlm":
        from kvstate.adapters.vlm import wrap as wrap_vlm
        from tests.vlm_helpers import tiny_vlm

        target = wrap_vlm(tiny_vlm("llama"))
    else:
        target = wrap(tiny_model("llama", head_dim=64, scale=3.0))
    prompts = [(3, 17, 42, 8, 99, 5), (9, 9, 1)]

    def alone(prompt: tuple[int, ...]) -> list[int]:
        state = ks.ModelState(
            tuple(ks.TurboQuantKV(key_bits=3, value_bits=3) for _ in target.init_state().layers)
        )
        logits, state = target(mx.array([prompt]), state)
        out: list[int] = []
        for _ in range(6):
            out.append(int(logits[0, -1].argmax().item()))
            logits, state = target(mx.array([[out[-1]]]), state)
        return out

    with pytest.raises(ks.NotSupportedError, match=r"x\.5"):
        Engine(target, kv_bits=3.5, kv_scheme="turboquant")
    engine = Engine(target, NGramDrafter(), kv_bits=3, kv_scheme="turboquant")
    requests = [engine.submit(p, RequestParams(max_tokens=6)) for p in prompts]
    run_all(engine)
    for r in requests:
        assert r.tokens == alone(r.prompt)


@pytest.mark.parametrize("kind", ["model", "mtp"])
def test_drafters_with_a_model_admit_rows_mid_generation(hybrid, kind):
    """The draft model's (or head's) state joins and leaves with the batch's rows; with the
    target as its own draft every draft is accepted."""
    model, target, oracle = hybrid
    drafter = ModelDrafter(wrap(model)) if kind == "model" else MTPDrafter(TargetHead(model))
    engine = Engine(target, drafter, max_batch=3, prefill_chunk=8, k=3, adaptive=False)
    requests: list[Request] = []
    for i, p in enumerate([LONG, (1, 2), (4, 4, 4, 4), (8,), (5, 6, 7)]):
        requests.append(engine.submit(p, RequestParams(max_tokens=N - i)))
        engine.step()
    run_all(engine)
    for r in requests:
        assert r.tokens == expected(r, oracle(r.prompt))
    stats = engine.stats()
    assert stats["accepted"] > 0.8 * stats["drafted"] > 0


def test_sampled_and_greedy_rows_mix(llama):
    """Sampled requests beside greedy ones: the greedy ones are the argmax; a seeded sampled
    request without a drafter draws the same tokens alone and in a batch (its own key)."""
    _, target, oracle = llama
    engine = Engine(target)
    params = RequestParams(max_tokens=N, temperature=0.8, top_k=20, seed=7)
    alone = engine.submit((5, 9, 13), params)
    run_all(engine)
    mixed = Engine(target, max_batch=8)
    greedy = [mixed.submit((i, 2, 3), RequestParams(max_tokens=N)) for i in range(3)]
    other = mixed.submit((5, 9, 13), RequestParams(max_tokens=N, temperature=1.0, seed=8))
    again = mixed.submit((5, 9, 13), params)
    run_all(mixed)
    assert again.tokens == alone.tokens != other.tokens
    for r in greedy:
        assert r.tokens == oracle(r.prompt)
    assert Sampler(0.8, top_k=20) == params.sampler
