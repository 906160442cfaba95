"""Hybrid and recurrent mlx-lm models through wrap, capture and commit_prefix, against
mlx-lm's own caches and generate_step (the oracle)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap, wrap_options
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.adapters.wrapped import forward as forward_module
from kvstate.testing import assert_states_allclose, assert_states_equal, frozen_copy
from tests.helpers import (
    assert_teacher_forced_logits_match,
    greedy_reference,
    speculate_with_corrupted_oracle,
)

PROMPT = [3, 17, 42, 99, 7, 250, 31, 8]
DRAFT = [11, 12, 13, 14]
FOLLOW = [5, 6, 7]
MODELS = ["qwen3_next", "mamba2", "nemotron_h", "falcon_h1", "lfm2"]
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return tiny_model(request.param)


def has_recurrent(state: ks.ModelState) -> bool:
    def any_recurrent(s):
        if isinstance(s, ks.ListState):
            return any(any_recurrent(c) for c in s.states)
        return isinstance(s, ks.RecurrentState)

    return any(any_recurrent(s) for s in state.layers)


def parts(state: ks.ModelState) -> list:
    """Every layer state, the parts of a ListState flattened in."""
    return [p for s in state.layers for p in (s.states if isinstance(s, ks.ListState) else (s,))]


def parts_of_checkpoints(state: ks.ModelState, checkpoints: tuple) -> list:
    """`parts` for checkpoints, which mirror the state: a ListState's entry has one per part."""
    out = []
    for layer, c in zip(state.layers, checkpoints, strict=True):
        out.extend(c if isinstance(layer, ks.ListState) else (c,))
    return out


def mlx_lm_logits(model, chunks: list[list[int]]) -> list[np.ndarray]:
    """mlx-lm's model on its own caches, fed the given chunks in order (batch 1)."""
    caches = make_prompt_cache(model)
    return [np.array(model(mx.array([c]), cache=caches)) for c in chunks]


def test_greedy_tokens_equal_generate_step(model):
    expected = greedy_reference(model, PROMPT, 40)
    assert len(set(expected)) > 10, "the oracle decode is degenerate; the test would be weak"
    m = wrap(model)
    logits, state = m(mx.array([PROMPT]), m.init_state())
    assert has_recurrent(state)
    tokens = []
    for _ in range(40):
        y = logits[:, -1].argmax(-1)
        tokens.append(int(y.item()))
        logits, state = m(y[:, None], state)
    assert tokens == expected


def test_logits_equal_mlx_lm_under_teacher_forcing(model):
    tokens = PROMPT + greedy_reference(model, PROMPT, 24)
    chunks = [len(PROMPT)] + [1] * 10 + [3, 2, 1, 4] + [1] * 4
    assert_teacher_forced_logits_match(model, wrap(model), tokens, chunks, tol=TOL["rtol"])


@pytest.fixture(scope="module", params=["fast", "replay"])
def path(request):
    """Which capturing path runs: recording inside the known mixers, or (with no mixer
    known) the automatic fallback that replays the whole model token by token."""
    with wrap_options(record_mixers=request.param != "replay"):
        yield request.param


@pytest.fixture(scope="module")
def verified(model, path):
    """(state after the prompt, verify logits, state after the verify, checkpoints)."""
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    logits, after, checkpoints = m(mx.array([DRAFT]), state, capture=True)
    return state, logits, after, checkpoints


def test_capturing_forward_equals_the_plain_forward(model, path, verified):
    """The replay path returns exactly the plain forward's logits and state; the fast path
    runs the recurrent mixers token by token, so equal up to rounding."""
    state, logits, after, checkpoints = verified
    plain_logits, plain = wrap(model)(mx.array([DRAFT]), state)
    if path == "replay":
        assert_states_equal((logits, after), (plain_logits, plain))
    else:
        assert_states_allclose((logits, after), (plain_logits, plain), **TOL)
    (ref,) = mlx_lm_logits(model, [PROMPT, DRAFT])[1:]
    np.testing.assert_allclose(np.array(logits), ref, **TOL)
    # Entry 0 of a checkpoint is the state before the verify, entry K the state after it.
    for b, a, c in zip(
        parts(state), parts(after), parts_of_checkpoints(after, checkpoints), strict=True
    ):
        if not isinstance(a, ks.RecurrentState):
            assert c is None
            continue
        for x, y, z in zip(b.arrays, a.arrays, c, strict=True):
            np.testing.assert_array_equal(np.array(ks.checkpoint_at(z, 0)), np.array(x))
            last = np.array(ks.checkpoint_at(z, len(DRAFT)))
            np.testing.assert_allclose(last, np.array(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("accepted", range(len(DRAFT) + 1))
def test_commit_with_checkpoints_equals_decoding_only_the_accepted_prefix(
    model, verified, accepted
):
    """Keep `accepted` of the 4 verified tokens, then decode: the logits are those of an
    un-speculated mlx-lm decode of exactly the accepted tokens, one at a time."""
    _, _, after, checkpoints = verified
    before = frozen_copy((after, checkpoints))
    state = ks.commit_prefix(after, accepted, checkpoints)
    assert_states_equal((after, checkpoints), before)
    m = wrap(model)
    got = []
    for t in FOLLOW:
        logits, state = m(mx.array([[t]]), state)
        got.append(np.array(logits))
    chunks = [PROMPT] + [[t] for t in DRAFT[:accepted]] + [[t] for t in FOLLOW]
    expected = mlx_lm_logits(model, chunks)[-len(FOLLOW) :]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, **TOL)


def test_commit_without_checkpoints_raises_unless_everything_is_kept(model, verified):
    _, _, after, _ = verified
    before = frozen_copy(after)
    with pytest.raises(ks.CheckpointRequiredError, match=r"capture=True.*checkpoints"):
        ks.commit_prefix(after, 2)
    assert_states_equal(after, before)
    kept = ks.commit_prefix(after, len(DRAFT))  # nothing to roll back: no checkpoints needed
    assert ks.commit_prefix(kept, 0) is not None  # appended is 0 now: committing 0 is a no-op
    # The same arrays as before (only the pending count differs).
    assert_states_equal(ks.tree_flatten(kept)[0], ks.tree_flatten(before)[0])


def test_known_mixers_need_no_replay_and_get_their_classes_back(model, monkeypatch):
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    classes = [type(mod) for mod in model.modules()]

    def no_replay(*args, **kwargs):
        raise AssertionError("the capturing forward replayed the model")

    monkeypatch.setattr(forward_module, "replay_checkpoints", no_replay)
    _, _, checkpoints = m(mx.array([DRAFT]), state, capture=True)
    assert any(c is not None for c in checkpoints)
    assert [type(mod) for mod in model.modules()] == classes


def test_ragged_commit_equals_per_row_decode(model, path):
    """Three rows of one batch keep different prefixes of their verify; each row then
    decodes like a batch-1 mlx-lm decode of exactly its accepted tokens."""
    m = wrap(model)
    prompts = [PROMPT, PROMPT[:5], [66, 12, 130, 4, 4, 9]]
    state = ks.merge([m(mx.array([p]), m.init_state())[1] for p in prompts])
    drafts = [[20, 21, 22, 23, 24], [30, 31, 32, 33, 34], [40, 41, 42, 43, 44]]
    _, after, checkpoints = m(mx.array(drafts), state, capture=True)
    accepted = [5, 0, 3]
    state = ks.commit_prefix(after, accepted, checkpoints)
    follow = [[7, 8], [9, 10], [11, 12]]
    got = []
    for step in range(2):
        logits, state = m(mx.array([[f[step]] for f in follow]), state)
        got.append(np.array(logits[:, -1]))
    for row in range(3):
        chunks = [prompts[row]] + [[t] for t in drafts[row][: accepted[row]] + follow[row]]
        expected = mlx_lm_logits(model, chunks)[-2:]
        for step in range(2):
            np.testing.assert_allclose(got[step][row], expected[step][0, -1], **TOL)


def test_speculative_greedy_decode_equals_generate_step(model, path):
    """A draft-and-verify loop (drafts: the oracle's tokens, a third of them corrupted)
    through capture + commit_prefix emits exactly mlx-lm's greedy tokens."""
    n, k = 36, 4
    ref = greedy_reference(model, PROMPT, n + k)
    out, accepted = speculate_with_corrupted_oracle(wrap(model), PROMPT, ref, n, k, VOCAB)
    assert out == ref[:n]
    assert len(set(accepted)) >= 3, "the drafts should exercise several commit lengths"


def first_recurrent(state):
    for s in state.layers:
        for part in s.states if isinstance(s, ks.ListState) else (s,):
            if isinstance(part, ks.RecurrentState):
                return part
    raise AssertionError("no recurrent layer")


def test_checkpoints_of_the_wrong_shape_raise_shape_error(verified):
    """Every mismatch of a layer is reported at once."""
    _, _, after, checkpoints = verified

    broken = ks.tree_map(lambda c: c[:, :-1], checkpoints)  # one token short, every array
    n = len(first_recurrent(after).arrays)
    expected = r".*".join(rf"\[{i}\]: (expected shape|StepStates.before)" for i in range(n))
    with pytest.raises(ks.ShapeError, match=expected):
        ks.commit_prefix(after, 1, broken)
    with pytest.raises(ks.ShapeError, match="must be a tuple"):
        ks.commit_prefix(first_recurrent(after), 1, ())


def test_one_pass_checkpoints_equal_the_token_by_token_ones(model, monkeypatch):
    """The recording path (each mixer once over K tokens) and the replay path (the whole
    model token by token) give the same state after every token of the verify."""
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    _, _, fast = m(mx.array([DRAFT]), state, capture=True)
    _, after, slow = wrap(model, record_mixers=False)(mx.array([DRAFT]), state, capture=True)
    pairs = zip(parts_of_checkpoints(after, fast), parts_of_checkpoints(after, slow), strict=True)
    compared = 0
    for one_pass, replayed in pairs:
        for a, b in zip(one_pass or (), replayed or (), strict=True):
            for t in range(len(DRAFT) + 1):
                got, want = ks.checkpoint_at(a, t), ks.checkpoint_at(b, t)
                np.testing.assert_allclose(np.array(got), np.array(want), **TOL)
                compared += 1
    assert compared > 0
    assert any(
        isinstance(c, ks.ConvWindow) for p in parts_of_checkpoints(after, fast) for c in p or ()
    )
