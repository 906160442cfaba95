"""A wrapped model refuses states that do not fit it and tokens it cannot take, with a clear
error and before mlx-lm runs (these used to give wrong logits, raw MLX errors, or a crash)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def llama2():
    return wrap(tiny_model("llama", num_hidden_layers=2))


@pytest.fixture(scope="module")
def llama4():
    return wrap(tiny_model("llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def hybrid():
    return wrap(tiny_model("qwen3_next"))


def prefilled(m, tokens=(1, 2, 3)):
    return m(mx.array([list(tokens)]), m.init_state())[1]


def test_a_state_with_fewer_or_more_layers_is_refused(llama2, llama4):
    with pytest.raises(ks.ConfigMismatchError, match="state has 2 layers, the model has 4"):
        llama4(mx.array([[4]]), prefilled(llama2))
    with pytest.raises(ks.ConfigMismatchError, match="state has 4 layers, the model has 2"):
        llama2(mx.array([[4]]), prefilled(llama4))


def test_a_state_of_another_architecture_is_refused(llama4, hybrid):
    with pytest.raises(
        ks.ConfigMismatchError, match=r"layers\[0\]: model RecurrentState, state DenseKV"
    ):
        hybrid(mx.array([[4]]), prefilled(llama4))
    with pytest.raises(
        ks.ConfigMismatchError, match=r"layers\[0\]: model DenseKV, state RecurrentState"
    ):
        llama4(mx.array([[4]]), prefilled(hybrid))
    # Even an empty state says what it is.
    with pytest.raises(ks.ConfigMismatchError, match="layers"):
        llama4(mx.array([[4]]), hybrid.init_state())


def test_a_state_of_other_head_dims_is_refused_naming_every_field(llama2):
    other = wrap(tiny_model("llama", num_hidden_layers=2, head_dim=32))
    with pytest.raises(ks.ConfigMismatchError) as info:
        llama2(mx.array([[4]]), prefilled(other))
    message = str(info.value)
    for field in (
        "layers[0].key_dim: model 16, state 32",
        "layers[1].value_dim: model 16, state 32",
    ):
        assert field in message


def test_states_of_the_same_model_fit_however_they_were_made(llama2, tmp_path):
    state = prefilled(llama2)
    verified = llama2(mx.array([[4, 5, 6]]), state)[1]
    ks.save(tmp_path / "s.safetensors", state)
    for made in (
        ks.commit_prefix(verified, 1),
        ks.merge([state, prefilled(llama2, (7, 8))]),
        ks.tile(state, 2),
        ks.load(tmp_path / "s.safetensors"),
        llama2.init_state(2),
    ):
        rows = ks.batch_size(made)
        logits, _ = llama2(mx.array([[4]] * rows), made)
        assert logits.shape == (rows, 1, VOCAB)


def test_a_quantized_state_fits_the_dense_layers_it_stands_for():
    m = wrap(tiny_model("llama", num_hidden_layers=2, head_dim=32))
    quantized = ks.quantize(prefilled(m), bits=4, group_size=32)
    logits, after = m(mx.array([[4]]), quantized)
    assert isinstance(after.layers[0], ks.QuantizedKV) and logits.shape == (1, 1, VOCAB)


def _counting_checks(monkeypatch):
    import kvstate.adapters.wrapped.model as wrap_module

    calls = []
    real = wrap_module.layer_mismatches
    monkeypatch.setattr(wrap_module, "layer_mismatches", lambda *a: calls.append(1) or real(*a))
    return calls


def test_a_decode_loop_pays_for_the_check_once(llama2, monkeypatch):
    """States the wrapped model returned are known to fit: only the first call checks."""
    calls = _counting_checks(monkeypatch)
    state = ks.adapters.from_mlx_lm(ks.adapters.to_mlx_lm(prefilled(llama2)))  # not known
    for _ in range(5):
        _, state = llama2(mx.array([[4]]), state)
    assert len(calls) == 1


def test_transforms_of_known_states_are_known_too(llama2, monkeypatch):
    """A speculative loop (verify, commit_prefix) and batch surgery on states the model
    returned need no check: every transform keeps each layer's kind and configuration."""
    calls = _counting_checks(monkeypatch)
    a, b = prefilled(llama2), prefilled(llama2, (5, 6))
    _, verified = llama2(mx.array([[7, 8, 9]]), a)
    derived = [
        ks.commit_prefix(verified, 1),
        ks.merge([a, b]),
        ks.extend(a, b),
        ks.filter(ks.merge([a, b]), [1]),
        ks.row_select(ks.tile(a, 2), 0),
        ks.extract(ks.merge([a, b]), 0),
    ]
    for state in derived:
        llama2(mx.array([[4]] * ks.batch_size(state)), state)
    assert calls == []


def test_states_not_only_from_this_model_are_checked(llama2, monkeypatch):
    other = wrap(tiny_model("llama", num_hidden_layers=2))  # same config, another model
    calls = _counting_checks(monkeypatch)
    mine, theirs = prefilled(llama2), prefilled(other)
    llama2(mx.array([[4]] * 2), ks.merge([mine, theirs]))
    llama2(mx.array([[4]]), theirs)
    llama2(mx.array([[4]]), ks.tree_map(lambda a: a, mine))  # tree_map may change anything
    assert len(calls) == 3


def test_a_state_known_to_one_model_is_still_refused_by_another(llama2, llama4):
    state = ks.commit_prefix(llama4(mx.array([[1, 2]]), llama4.init_state())[1], 1)
    with pytest.raises(ks.ConfigMismatchError, match="layers"):
        llama2(mx.array([[3]]), state)


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        (mx.array([[1.0, 2.0]]), "must be integers; got dtype mlx.core.float32"),
        ([[1.5, 2.0]], "must be integers; got dtype float64"),
        (np.array([[True, False]]), "must be integers; got dtype bool"),
        (mx.zeros((1, 0), mx.int32), r"non-empty \(batch, K\) array of ids; got shape \(1, 0\)"),
        (mx.zeros((1, 1, 1), mx.int32), r"got shape \(1, 1, 1\)"),
        ([[1, 2], [3]], "rectangular"),
        (mx.array([[1, 2]] * 3), "tokens have 3 rows but the state has 1"),
        ([[VOCAB, 3, -1]], rf"ids \[-1, {VOCAB}\] are outside the vocabulary \(0..{VOCAB - 1}\)"),
        (np.array([[2**40]]), "outside the vocabulary"),
    ],
)
def test_tokens_the_model_cannot_take_raise_token_error(llama2, tokens, match):
    state = prefilled(llama2)
    with pytest.raises(ks.TokenError, match=match):
        llama2(tokens, state)


def test_an_empty_state_takes_the_batch_of_its_first_forward(llama2):
    logits, state = llama2(mx.array([[1, 2]] * 3), llama2.init_state())
    assert ks.batch_size(state) == 3 and logits.shape == (3, 2, VOCAB)


def test_ids_from_lists_and_numpy_equal_mx_array_ids(llama2):
    state = prefilled(llama2)
    want = np.array(llama2(mx.array([[5, 6]]), state)[0])
    for tokens in ([[5, 6]], [5, 6], np.array([[5, 6]], np.int64), (5, 6)):
        np.testing.assert_array_equal(np.array(llama2(tokens, state)[0]), want)


def test_out_of_vocabulary_mx_array_ids_give_nan_logits_not_a_crash(llama2):
    """MLX's CPU gather does not check bounds (an id past the vocabulary segfaulted): ids in
    an mx.array are not read back, so the bad position's logits become NaN instead."""
    state = prefilled(llama2)
    logits, _ = llama2(mx.array([[5, VOCAB + 10**6, 6], [5, -3, 6]]), ks.tile(state, 2))
    rows = np.array(logits)
    assert np.isnan(rows[:, 1]).all()
    assert np.isfinite(rows[:, 0]).all() and np.isfinite(rows[:, 2]).all()
    # The valid positions are what the valid ids give.
    good = np.array(llama2(mx.array([[5]]), state)[0])
    np.testing.assert_allclose(rows[0, 0], good[0, 0], rtol=1e-5, atol=1e-5)
    assert llama2.vocab_size == VOCAB


@pytest.mark.parametrize(
    "dtype", [mx.int8, mx.uint8, mx.int16, mx.uint16, mx.uint32, mx.int64, mx.uint64]
)
def test_ids_of_every_integer_dtype_are_bounded_by_the_vocabulary(llama2, dtype):
    """The vocabulary size does not fit an int8 / uint8 id: the guard must not compare in the
    ids' own dtype (it did: 256 became 0 and every int8 / uint8 id read as outside)."""
    state = prefilled(llama2)
    want = np.array(llama2(mx.array([[5, 6]]), state)[0])
    np.testing.assert_array_equal(np.array(llama2(mx.array([[5, 6]], dtype=dtype), state)[0]), want)
    if mx.iinfo(dtype).max >= VOCAB:
        logits, _ = llama2(mx.array([[5, VOCAB]], dtype=dtype), state)
        assert np.isnan(np.array(logits)[0, 1]).all() and np.isfinite(np.array(logits)[0, 0]).all()


def test_capture_checks_too(hybrid):
    state = prefilled(hybrid)
    with pytest.raises(ks.TokenError):
        hybrid(mx.array([[1.0]]), state, capture=True)
    logits, _, _ = hybrid(mx.array([[4, VOCAB]]), state, capture=True)
    assert np.isnan(np.array(logits)[0, 1]).all()
