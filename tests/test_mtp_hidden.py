"""`wrap(model)(tokens, state, hidden=True)` against mlx-lm's own inner model on its own caches:
the hidden states are what `model.model(tokens, cache)` (or `model.backbone`) returns, and the
model's output projection maps them to the logits. Prefill, then a capturing verify."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.instruments import hidden as hidden_module
from kvstate.adapters.tiny_models import tiny_model
from kvstate.testing import assert_states_allclose

PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5]
VERIFY = [9, 200, 11, 4]

ARCHITECTURES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen3", {}),
    ("gemma3_text", {}),
    ("qwen3_next", {}),
    ("mamba2", {}),
    ("nemotron_h", {}),
    ("lfm2", {}),
    ("falcon_h1", {}),
]


def inner_and_projection(model: nn.Module) -> tuple[nn.Module, object]:
    """mlx-lm's body (embedding .. final norm) and output projection, read from each
    architecture's own `Model.__call__`."""
    body = model.model if "model" in model else model.backbone
    tied = getattr(model.args, "tie_word_embeddings", False) or "lm_head" not in model
    embedding = body.embed_tokens if "embed_tokens" in body else body.embeddings
    return body, (embedding.as_linear if tied else model.lm_head)


@pytest.mark.parametrize(("name", "overrides"), ARCHITECTURES)
def test_hidden_states_are_mlx_lms_and_project_to_the_logits(name, overrides):
    model = tiny_model(name, **overrides)
    m = wrap(model)
    body, project = inner_and_projection(model)
    caches = make_prompt_cache(model)
    logits, state, hidden = m(mx.array([PROMPT]), m.init_state(), hidden=True)
    expected = body(mx.array([PROMPT]), caches)
    np.testing.assert_allclose(np.array(hidden), np.array(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(project(hidden)), np.array(logits), rtol=1e-5, atol=1e-5)

    logits, verified, checkpoints, hidden = m(mx.array([VERIFY]), state, capture=True, hidden=True)
    expected = body(mx.array([VERIFY]), caches)
    assert hidden.shape == (1, len(VERIFY), expected.shape[-1])
    np.testing.assert_allclose(np.array(hidden), np.array(expected), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(project(hidden)), np.array(logits), rtol=1e-5, atol=1e-5)
    # The capture is unaffected: the same logits and checkpoints as without hidden states.
    plain_logits, plain, plain_checkpoints = m(mx.array([VERIFY]), state, capture=True)
    np.testing.assert_array_equal(np.array(plain_logits), np.array(logits))
    kept = ks.commit_prefix(verified, 2, checkpoints)
    assert_states_allclose(kept, ks.commit_prefix(plain, 2, plain_checkpoints))


def test_a_batch_gets_each_rows_hidden_states():
    model = tiny_model("qwen3_next")
    m = wrap(model)
    body, _ = inner_and_projection(model)
    rows = [[5, 6, 7], [8, 9, 10]]
    _, _, hidden = m(mx.array(rows), m.init_state(2), hidden=True)
    for b, row in enumerate(rows):
        expected = body(mx.array([row]), make_prompt_cache(model))
        np.testing.assert_allclose(np.array(hidden[b]), np.array(expected[0]), atol=1e-5)


def test_modules_get_their_classes_back_and_the_default_path_records_nothing(monkeypatch):
    model = tiny_model("llama", tie_word_embeddings=True)
    m = wrap(model)
    before = [type(mod) for _, mod in model.named_modules()]
    m(mx.array([PROMPT]), m.init_state(), hidden=True)
    assert [type(mod) for _, mod in model.named_modules()] == before

    def refuse(*args, **kwargs):
        raise AssertionError("recording hidden states that were not asked for")

    monkeypatch.setattr("kvstate.adapters.wrapped.forward.recording_hidden", refuse)
    _, state = m(mx.array([PROMPT]), m.init_state())
    m(mx.array([[1, 2]]), state, capture=True)


class Renamed(nn.Module):
    """A model whose output projection kvstate cannot find (named `out`), or (`twice`) one
    that projects two different arrays."""

    def __init__(self, model: nn.Module, twice: bool = False) -> None:
        super().__init__()
        self.body = model.model
        self.out = model.lm_head
        self.twice = twice
        if twice:
            self.lm_head = model.lm_head

    @property
    def layers(self):
        return self.body.layers

    def __call__(self, inputs, cache=None):
        h = self.body(inputs, cache)
        if self.twice:
            return self.lm_head(h) + self.lm_head(2 * h)
        return self.out(h)


@pytest.mark.parametrize("twice", [False, True])
def test_a_model_without_one_findable_projection_is_a_clear_error(twice):
    m = wrap(Renamed(tiny_model("llama"), twice))
    _, state = m(mx.array([PROMPT]), m.init_state())  # the default path still works
    with pytest.raises(ks.StateError, match="ambiguous" if twice else "no output projection"):
        m(mx.array([[1]]), state, hidden=True)


def test_output_projections_finds_lm_head_and_tied_embeddings():
    untied = hidden_module.output_projections(tiny_model("llama"))
    tied = hidden_module.output_projections(tiny_model("llama", tie_word_embeddings=True))
    assert sorted(p.method for p in untied) == ["__call__", "as_linear"]
    assert [p.method for p in tied] == ["as_linear"]


def test_hidden_states_with_the_replay_fallback():
    """A recurrent layer kvstate cannot record is replayed token by token after the forward;
    the hidden states are still the verify forward's own."""
    model = tiny_model("qwen3_next")
    m = wrap(model, record_mixers=False)
    body, _ = inner_and_projection(model)
    caches = make_prompt_cache(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    body(mx.array([PROMPT]), caches)
    _, _, checkpoints, hidden = m(mx.array([VERIFY]), state, capture=True, hidden=True)
    expected = body(mx.array([VERIFY]), caches)
    np.testing.assert_allclose(np.array(hidden), np.array(expected), rtol=1e-4, atol=1e-4)
    assert checkpoints is not None
