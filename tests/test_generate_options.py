"""`generate` with mlx-lm's inputs and options, against mlx-lm's `generate_step` given the same
ones (fp32 tiny models): prompts as a flat list or 1-d / 2-d arrays, `k=0` without a drafter,
`max_tokens=0`, `max_kv_size`, `kv_bits` / `kv_group_size` / `quantized_kv_start`,
`Sampler(min_p=)` and `logits_processors` (mlx-lm's repetition penalty), and the same options
under speculation (greedy speculation equals plain decoding with them)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import apply_min_p, make_logits_processors

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import ModelDrafter, NGramDrafter, Sampler, generate

PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5, 77, 1, 200]


def tokens_of(generation: Any, rows: int = 1) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(rows)]
    for r in generation:
        for t in r:
            out[t.row].append(t.token)
    return out


def logprobs_of(generation: Any) -> tuple[list[int], list[np.ndarray]]:
    ids, lps = [], []
    for r in generation:
        for t in r:
            ids.append(t.token)
            lps.append(np.array(t.logprobs))
    return ids, lps


def oracle(model: Any, prompt: list[int], n: int, **kw: Any) -> tuple[list[int], list[Any]]:
    steps = list(generate_step(mx.array(prompt), model, max_tokens=n, **kw))
    return [int(t) for t, _ in steps], [np.array(lp) for _, lp in steps]


def assert_like_mlx_lm(got: tuple[list[int], list[np.ndarray]], want: Any) -> None:
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)


# --------------------------------------------------------------------------- inputs


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_model("llama")


def test_prompts_in_the_shapes_mlx_lm_takes(llama: Any) -> None:
    """A flat list, a 1-d mx.array / NumPy array and a (1, n) mx.array are one prompt; a
    (2, n) array is two rows: the tokens of the list-of-rows form."""
    m = wrap(llama)
    want = tokens_of(generate(m, [PROMPT], max_tokens=5))
    for prompt in (PROMPT, tuple(PROMPT), mx.array(PROMPT), np.array(PROMPT),
                   mx.array([PROMPT]), np.array([PROMPT], np.int64)):  # fmt: skip
        assert tokens_of(generate(m, prompt, max_tokens=5)) == want, type(prompt)
    two = [PROMPT[:6], PROMPT[6:12]]
    assert tokens_of(generate(m, mx.array(two), max_tokens=4), 2) == tokens_of(
        generate(m, two, max_tokens=4), 2
    )
    assert want[0] == oracle(llama, PROMPT, 5)[0]


def test_k_0_without_a_drafter_and_max_tokens_0(llama: Any) -> None:
    m = wrap(llama)
    assert tokens_of(generate(m, PROMPT, k=0, max_tokens=4)) == [oracle(llama, PROMPT, 4)[0]]
    assert list(generate(m, PROMPT, max_tokens=0)) == []
    assert list(generate(m, PROMPT, NGramDrafter(), max_tokens=0)) == []
    with pytest.raises(ks.StateError, match="k must be an int >= 1"):
        list(generate(m, PROMPT, NGramDrafter(), k=0))


# --------------------------------------------------------------------------- max_kv_size


@pytest.mark.parametrize("step", [2048, 4])
def test_max_kv_size_is_generate_steps_rotating_cache(step: int) -> None:
    """A 14-token prompt through a window of 8 (mlx-lm's RotatingKVCache, keep 4): the tokens
    and log-probabilities of generate_step(max_kv_size=8); with a drafter, the same tokens.
    (qwen3: an mlx-lm model without a cache factory of its own.)"""
    name = "qwen3"
    model = tiny_model(name)
    m = wrap(model)
    want = oracle(model, PROMPT, 12, max_kv_size=8, prefill_step_size=step)
    got = logprobs_of(generate(m, PROMPT, max_tokens=12, max_kv_size=8, prefill_step_size=step))
    assert_like_mlx_lm(got, want)
    unbounded = oracle(model, PROMPT, 12)[1]
    assert not np.allclose(unbounded[-1], want[1][-1], atol=1e-3), "the window should count"
    for drafter in (NGramDrafter(), ModelDrafter(wrap(tiny_model(name, scale=3.8, seed=1)))):
        g = generate(m, PROMPT, drafter, max_tokens=12, max_kv_size=8, prefill_step_size=step)
        assert tokens_of(g) == [want[0]]
    state = m.init_state(max_kv_size=8)
    assert {type(layer).__name__ for layer in state.layers} == {"RotatingKV"}


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_max_kv_size_leaves_a_models_own_cache_factory(name: str) -> None:
    """llama and gemma3_text make their caches themselves: mlx-lm's max_kv_size changes
    nothing there, nor here."""
    model = tiny_model(name)
    want = oracle(model, PROMPT, 8, max_kv_size=6)
    assert_like_mlx_lm(logprobs_of(generate(wrap(model), PROMPT, max_tokens=8, max_kv_size=6)),
                       want)  # fmt: skip
    assert want[0] == oracle(model, PROMPT, 8)[0]


# --------------------------------------------------------------------------- kv_bits


@pytest.mark.parametrize(("bits", "start"), [(8, 0), (4, 10), (4, 16), (4, 5000)])
@pytest.mark.parametrize("step", [2048, 4])
def test_kv_bits_quantize_the_cache_where_generate_step_does(
    bits: int, start: int, step: int
) -> None:
    """kv_bits / kv_group_size 32 / quantized_kv_start: the quantization happens after the
    same forward as in mlx-lm (a prefill chunk, the prompt's last position or a step), so the
    tokens and log-probabilities are generate_step's."""
    model = tiny_model("llama", head_dim=32)
    options = {"kv_bits": bits, "kv_group_size": 32, "quantized_kv_start": start,
               "prefill_step_size": step}  # fmt: skip
    want = oracle(model, PROMPT, 10, **options)
    got = logprobs_of(generate(wrap(model), PROMPT, max_tokens=10, **options))
    assert_like_mlx_lm(got, want)
    if start < len(PROMPT) and bits == 4:
        assert want[0] != oracle(model, PROMPT, 10)[0], "4-bit caches should change the tokens"


def test_kv_bits_under_speculation_quantize_the_target_alike() -> None:
    """From the prompt on (start <= prompt length), speculative rounds over a quantized
    state give the plain decode's tokens, for a dense and a hybrid model."""
    for name in ("llama", "qwen3_next"):
        model = tiny_model(name, head_dim=32)
        m = wrap(model)
        options = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 8}
        plain = tokens_of(generate(m, [PROMPT, PROMPT[:9]], max_tokens=10, **options), 2)
        drafter = ModelDrafter(wrap(tiny_model(name, head_dim=32, scale=3.8, seed=1)))
        assert tokens_of(generate(m, [PROMPT, PROMPT[:9]], drafter, max_tokens=10, **options),
                         2) == plain, name  # fmt: skip
        if name == "llama":
            assert plain[0] == oracle(model, PROMPT, 10, **options)[0]


def test_kv_bits_quantizes_the_dense_layers_and_the_windows() -> None:
    """A model with sliding windows (which mlx-lm cannot quantize): its dense layers become
    QuantizedKV and its windows QuantizedRotatingKV; the states a generation keeps show it."""
    m = wrap(tiny_model("gemma3_text", head_dim=32))
    g = generate(m, PROMPT, max_tokens=4, kv_bits=8, kv_group_size=32, quantized_kv_start=0,
                 keep_states=True)  # fmt: skip
    list(g)
    kinds = {type(layer).__name__ for layer in g.states[0].layers}
    assert kinds == {"QuantizedKV", "QuantizedRotatingKV"}


# --------------------------------------------------------------------------- min_p


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_is_mlx_lms(min_p: float, temperature: float) -> None:
    """The distribution mlx-lm's sampler draws from (apply_min_p on the log-probabilities,
    then the temperature) is Sampler(temperature, min_p=...).probs."""
    logits = mx.random.normal((3, VOCAB), key=mx.random.key(0)) * 3
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = mx.softmax(apply_min_p(logprobs, min_p) * (1 / temperature), axis=-1)
    got = Sampler(temperature=temperature, min_p=min_p).probs(logits)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)
    kept = (np.array(got) > 0).sum(-1)
    assert (kept >= 1).all() and (min_p == 1.0 or kept.max() > 1)


def test_min_p_sampling_through_generate_stays_inside_the_kept_set() -> None:
    m = wrap(tiny_model("llama"))
    sampler = Sampler(temperature=1.5, min_p=0.2)
    rows = tokens_of(generate(m, [PROMPT] * 40, NGramDrafter(), max_tokens=1, sampler=sampler),
                     40)  # fmt: skip
    logits, _ = m(mx.array([PROMPT]), m.init_state())
    allowed = set(np.nonzero(np.array(sampler.probs(logits[0, -1])))[0].tolist())
    assert len(allowed) < 40 and {r[0] for r in rows} <= allowed
    assert math.isclose(float(sampler.probs(logits[0, -1]).sum()), 1.0, rel_tol=1e-5)


# --------------------------------------------------------------------------- logits_processors


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "mamba2"])
def test_repetition_penalty_is_generate_steps(name: str) -> None:
    """mlx-lm's repetition penalty (make_logits_processors): generate_step's tokens and
    (processed) log-probabilities, plain; and greedy speculation (a draft model, prompt
    lookup) gives the same tokens."""
    model = tiny_model(name)
    m = wrap(model)
    processors = make_logits_processors(repetition_penalty=2.0, repetition_context_size=8)
    want = oracle(model, PROMPT, 16, logits_processors=processors)
    plain = oracle(model, PROMPT, 16)[1]
    assert not np.allclose(plain[0], want[1][0], atol=1e-3), "the penalty should count"
    got = logprobs_of(generate(m, PROMPT, max_tokens=16, logits_processors=processors))
    assert_like_mlx_lm(got, want)
    for drafter in (NGramDrafter(), ModelDrafter(wrap(tiny_model(name, scale=3.8, seed=1)))):
        g = generate(m, PROMPT, drafter, max_tokens=16, logits_processors=processors)
        assert tokens_of(g) == [want[0]], type(drafter).__name__


def successor_only(tokens: mx.array, logits: mx.array) -> mx.array:
    """Allow only the two ids after the last token: a processor that reads its position."""
    last = int(tokens[-1].item())
    keep = mx.zeros((logits.shape[-1],), mx.bool_)
    keep[(last + 1) % VOCAB] = True
    keep[(last + 2) % VOCAB] = True
    return mx.where(keep, logits, -mx.inf)


def test_sampled_speculation_processes_every_verified_position_with_its_own_tokens() -> None:
    """A processor that allows only the successors of the token before: sampled rounds with
    a draft model that knows nothing of it emit only allowed tokens (each verified position
    processed after its own prefix), and its continuation state is right too."""
    m = wrap(tiny_model("llama", num_hidden_layers=2))
    drafter = ModelDrafter(wrap(tiny_model("llama", num_hidden_layers=2, seed=1)))
    prompts = [PROMPT, PROMPT[:5], [9, 10]]
    g = generate(m, prompts, drafter, max_tokens=12, sampler=Sampler(temperature=1.0),
                 logits_processors=[successor_only], seed=2)  # fmt: skip
    rows = tokens_of(g, 3)
    for prompt, row in zip(prompts, rows, strict=True):
        seq = [prompt[-1], *row]
        assert all((b - a) % VOCAB in (1, 2) for a, b in itertools.pairwise(seq)), seq
    plain = tokens_of(generate(m, prompts, max_tokens=12, logits_processors=[successor_only]), 3)
    greedy = tokens_of(generate(m, prompts, ModelDrafter(drafter.draft), max_tokens=12,
                                logits_processors=[successor_only]), 3)  # fmt: skip
    assert greedy == plain


def test_processors_see_the_history_of_a_continued_state() -> None:
    """With `history`, the processors see what the state holds: continuing equals the
    whole conversation with the penalty too."""
    m = wrap(tiny_model("llama"))
    processors = make_logits_processors(repetition_penalty=2.0, repetition_context_size=30)
    first = generate(m, PROMPT[:8], max_tokens=6, keep_states=True, logits_processors=processors)
    out = tokens_of(first)[0]
    history = PROMPT[:8] + out
    cont = generate(m, PROMPT[8:], NGramDrafter(), max_tokens=8, states=first.states,
                    history=[history], logits_processors=processors)  # fmt: skip
    whole = generate(m, history + PROMPT[8:], max_tokens=8, logits_processors=processors)
    assert tokens_of(cont) == tokens_of(whole)


def test_processors_with_tree_verification_are_not_supported() -> None:
    m = wrap(tiny_model("llama", num_hidden_layers=2))
    with pytest.raises(ks.NotSupportedError, match="logits_processors"):
        list(generate(m, PROMPT, NGramDrafter(), tree="tree", logits_processors=[successor_only]))
