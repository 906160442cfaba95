"""`WrappedModel.chain` (adapters/_chain.py): a forward then one-token forwards fed a pick of
the last logits, on the model's own caches, read back once. Oracles: mlx-lm's model on its
own caches fed the same picks (logits, picks), and the same sequence of `m(...)` calls (the
final state, arrays and statics); the state then continues like mlx-lm's caches."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.kinds import vouched
from kvstate.speculative import ModelDrafter, Sampler
from kvstate.speculative._model_drafter import _stamped
from kvstate.testing import assert_states_allclose

from .helpers import mlx_lm_batch_prefill

# dense, window (gemma3_text's window of 8 wraps during the chain), two hybrids
ARCHITECTURES = ["llama", "gemma3_text", "qwen3_next", "nemotron_h"]
PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [7, 1], [40, 41, 42, 43, 44]]
TOL = {"rtol": 1e-4, "atol": 1e-4}
_MODELS: dict[str, Any] = {}


def _model(name: str) -> Any:
    if name not in _MODELS:
        _MODELS[name] = tiny_model(name)
    return _MODELS[name]


def _pick(logits: mx.array) -> mx.array:
    """A varied, in-vocabulary pick: a random-init model's argmax repeats itself."""
    return ((logits.argmax(-1) * 7 + 3) % VOCAB).astype(mx.int32)


def _prefill(model: Any, m: Any, rows: int) -> tuple[list[Any], Any]:
    """mlx-lm's caches and a wrapped state after the first `rows` prompts (left-padded when
    several, as mlx-lm batches them)."""
    prompts = PROMPTS[:rows]
    if rows == 1:
        caches = make_prompt_cache(model)
        model(mx.array(prompts), cache=caches)
        return caches, m(mx.array(prompts), m.init_state())[1]
    _, caches = mlx_lm_batch_prefill(model, prompts)
    width = max(len(p) for p in prompts)
    padded = [p + [0] * (width - len(p)) for p in prompts]
    state = m(mx.array(padded), m.init_state(rows), lengths=[len(p) for p in prompts])[1]
    return caches, state


def _mlx_lm_chain(model: Any, caches: list[Any], tokens: mx.array, steps: int) -> tuple[Any, Any]:
    logits, lasts, picks = model(tokens, cache=caches), [], []
    for step in range(steps):
        lasts.append(np.array(logits[:, -1]))
        picks.append(_pick(logits[:, -1])[:, None])
        if step + 1 < steps:
            logits = model(picks[-1], cache=caches)
    return np.stack(lasts, 1), np.array(mx.concatenate(picks, 1))


def _calls_chain(m: Any, tokens: mx.array, state: Any, steps: int) -> Any:
    logits, state = m(tokens, state)
    for _ in range(steps - 1):
        logits, state = m(_pick(logits[:, -1])[:, None], state)
    return state


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_chain_equals_mlx_lm_and_the_sequence_of_calls(name: str, rows: int) -> None:
    model = _model(name)
    m = wrap(model)
    tokens = mx.array([[5, 9], [11, 2], [60, 61]][:rows])  # a 2-token first forward
    for steps in range(1, 6):
        caches, state = _prefill(model, m, rows)
        logits, picks, new = m.chain(tokens, state, steps, _pick)
        kept = m.kept._state  # the chain's caches, kept for a plain forward from `new`
        assert kept is not None and kept() is new
        ref_logits, ref_picks = _mlx_lm_chain(model, caches, tokens, steps)
        assert logits.shape == (rows, steps, VOCAB)
        np.testing.assert_allclose(np.array(logits), ref_logits, **TOL)
        np.testing.assert_array_equal(np.array(picks), ref_picks)
        assert steps * rows == 1 or len(set(ref_picks.ravel().tolist())) > 1  # varied
        # The same state as the calls give (kinds, statics, the last forward's stamp).
        assert_states_allclose(new, _calls_chain(m, tokens, state, steps), **TOL)
        assert vouched(new, m._voucher)
        # It continues like mlx-lm's caches (on the chain's kept caches, then converted).
        nxt = picks[:, -1:]
        ref = model(nxt, cache=caches)
        for _ in range(2):
            np.testing.assert_allclose(np.array(m(nxt, new)[0]), np.array(ref), **TOL)


def test_an_out_of_vocabulary_pick_gives_nan_logits_where_it_was_fed() -> None:
    model = _model("llama")
    m = wrap(model)
    _, state = _prefill(model, m, 3)
    calls = []

    def pick(logits: mx.array) -> mx.array:  # row 1's second pick is outside the vocabulary
        y = _pick(logits)
        calls.append(1)
        return mx.where(mx.array([False, len(calls) == 2, False]), VOCAB + 5, y)

    logits, picks, _ = m.chain(mx.array([[5], [6], [7]]), state, 4, pick)
    nan = np.isnan(np.array(logits)).all(-1)
    expected = np.zeros((3, 4), bool)
    expected[1, 2] = True  # the forward fed that pick
    np.testing.assert_array_equal(nan, expected)
    assert int(picks[1, 1]) == VOCAB + 5  # picks are what the caller's function returned


def test_an_out_of_vocabulary_first_token_poisons_its_forward() -> None:
    m = wrap(_model("llama"))
    _, state = _prefill(_model("llama"), m, 1)
    logits, _, _ = m.chain(mx.array([[3, VOCAB]]), state, 3, _pick)
    np.testing.assert_array_equal(np.isnan(np.array(logits)).all(-1), [[True, False, False]])


@pytest.mark.parametrize("rows", [1, 3])
def test_commit_prefix_after_a_chain_stamped_as_one_forward(rows: int) -> None:
    """What ModelDrafter does with a dense draft: the chain's forwards stamped as one, one
    ragged commit; then it continues like mlx-lm's caches over the kept tokens only."""
    model = _model("llama")
    m = wrap(model)
    tokens = mx.array([[5], [9], [60]][:rows])
    kept = [1, 4, 2][:rows]
    _, picks, after = m.chain(tokens, _prefill(model, m, rows)[1], 4, _pick)
    committed = ks.commit_prefix(_stamped(after, 4), kept)
    fed = np.concatenate([np.array(tokens), np.array(picks)[:, :3]], axis=1)
    for row, n in enumerate(kept):
        caches = make_prompt_cache(model)
        model(mx.array([PROMPTS[row]]), cache=caches)
        model(mx.array([fed[row, :n].tolist()]), cache=caches)
        expected = model(mx.array([[17]]), cache=caches)
        single = ks.filter(committed, [row])
        np.testing.assert_allclose(np.array(m(mx.array([[17]]), single)[0]), expected, **TOL)


def test_chain_refuses_bad_steps_and_picks() -> None:
    m = wrap(_model("llama"))
    state = m(mx.array([[1, 2]]), m.init_state())[1]
    with pytest.raises(ks.ShapeError, match="steps"):
        m.chain(mx.array([[3]]), state, 0, _pick)
    with pytest.raises(ks.TokenError, match="pick"):
        m.chain(mx.array([[3]]), state, 2, lambda logits: logits[:, :1])  # floats
    with pytest.raises(ks.TokenError, match="pick"):
        m.chain(mx.array([[3]]), state, 2, lambda logits: mx.zeros((2, 1), mx.int32))
    with pytest.raises(ks.ConfigMismatchError):
        m.chain(mx.array([[3]]), wrap(_model("gemma3_text")).init_state(), 2, _pick)


class _CallsOnly:
    """A wrapped model without `chain`: the drafter's loop of calls."""

    def __init__(self, m: Any) -> None:
        self.m = m

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.m(*args, **kwargs)

    def init_state(self, batch_size: int = 1) -> Any:
        return self.m.init_state(batch_size)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_proposes_the_same_through_chain_and_calls(temperature: float) -> None:
    m = wrap(_model("qwen3_next"))
    sampler = Sampler(temperature=temperature)
    proposals = []
    for draft in (m, _CallsOnly(m)):
        drafter = ModelDrafter(draft, seed=3, pipelined=True)
        drafter.start([PROMPTS[0], PROMPTS[2]])
        first = drafter.propose([5, 6], 4, sampler)
        drafter.accept(mx.concatenate([first.tokens, mx.array([[1], [2]])], 1), [5, 5])
        second = drafter.propose([8, 9], 3, sampler)  # fed the pending draft first
        proposals.append((first, second))
    # The first round as the drafter's loop of calls was written before `chain`: one key
    # split per draft, the sample of the step's last-position distribution.
    state = ks.merge([m(mx.array([p]), m.init_state())[1] for p in (PROMPTS[0], PROMPTS[2])])
    key, y, tokens, probs = mx.random.key(3), mx.array([[5], [6]]), [], []
    for _ in range(4):
        logits, state = m(y, state)
        if temperature:
            q = sampler.probs(logits[:, -1])
            key, sub = mx.random.split(key)
            y = sampler.sample(q, sub)[:, None]
            probs.append(q[:, None])
        else:
            y = logits[:, -1:].argmax(-1).astype(mx.int32)
        tokens.append(y)
    first = proposals[0][0]
    np.testing.assert_array_equal(np.array(first.tokens), np.array(mx.concatenate(tokens, 1)))
    if temperature:
        np.testing.assert_allclose(np.array(first.probs), np.array(mx.concatenate(probs, 1)), **TOL)
    for a, b in zip(*proposals, strict=True):
        np.testing.assert_array_equal(np.array(a.tokens), np.array(b.tokens))
        if temperature:
            np.testing.assert_allclose(np.array(a.probs), np.array(b.probs), **TOL)
        else:
            assert a.probs is None and b.probs is None


def test_an_mlx_vlm_model_chains_by_its_own_calls() -> None:
    """mlx-vlm's wrap differs (its caches, its language model): the chain is its calls."""
    pytest.importorskip("mlx_vlm")
    from kvstate.adapters import vlm

    from .vlm_helpers import tiny_vlm

    m = vlm.wrap(tiny_vlm("gemma3_text"))
    state = m(mx.array([PROMPTS[0]]), m.init_state())[1]
    logits, picks, new = m.chain(mx.array([[5, 9]]), state, 3, _pick)
    expected, y, ref = [], mx.array([[5, 9]]), state
    for _ in range(3):
        out, ref = m(y, ref)
        expected.append(np.array(out[:, -1]))
        y = _pick(out[:, -1])[:, None]
    np.testing.assert_allclose(np.array(logits), np.stack(expected, 1), **TOL)
    np.testing.assert_array_equal(np.array(picks[:, -1:]), np.array(y))
    assert_states_allclose(new, ref, **TOL)
