"""`wrap` on mlx-vlm models against mlx-vlm's own generation (`generate_step`, which its
`generate` and `stream_generate` run), on tiny random-init models built in code."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx
from mlx_vlm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB
from kvstate.adapters.vlm import VLMWrappedModel, from_mlx_vlm
from kvstate.adapters.wrapped import forward as forward_module
from kvstate.kinds import config_of
from tests.helpers import speculate_with_corrupted_oracle
from tests.vlm_helpers import (
    IMAGE_TOKEN,
    IMAGE_TOKENS,
    random_image,
    tiny_llava,
    tiny_qwen2_vl,
    tiny_vlm,
    vlm_generate,
    vlm_logits,
)

TOL = {"rtol": 1e-4, "atol": 1e-4}
PROMPT = [3, 17, 42, 9, 100, 7, 1, 250, 66, 12]  # longer than gemma3's 8-token window
IMAGE_PROMPT = [1, 5, *[IMAGE_TOKEN] * IMAGE_TOKENS, 9, 33, 120]


def greedy(m, prompt: list[int], n: int, **first_inputs) -> tuple[list[int], list[mx.array]]:
    """Greedy decode through the wrapped model: the first forward carries `first_inputs`."""
    logits, state = m(mx.array([prompt]), m.init_state(), **first_inputs)
    tokens, steps = [], []
    for _ in range(n):
        last = logits[0, -1]
        steps.append(last - mx.logsumexp(last))
        tokens.append(int(last.argmax().item()))
        logits, state = m(mx.array([[tokens[-1]]]), state)
    return tokens, steps


# ---------------------------------------------------------------------------------------
# A vision-language model with its vision tower
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


def test_llava_with_an_image_equals_mlx_vlm_generate(llava):
    image = random_image()
    ref, ref_logprobs = vlm_generate(llava, IMAGE_PROMPT, 12, pixel_values=image)
    m = wrap(llava)
    assert isinstance(m, VLMWrappedModel)
    got, logprobs = greedy(m, IMAGE_PROMPT, 12, pixel_values=image)
    assert got == ref
    assert len(set(ref)) >= 4, "a degenerate oracle: the weights should make tokens vary"
    for mine, theirs in zip(logprobs, ref_logprobs, strict=True):
        np.testing.assert_allclose(np.array(mine), np.array(theirs), **TOL)
    # The image reaches the model: another image (or none) gives other logits.
    other, _ = m(mx.array([IMAGE_PROMPT]), m.init_state(), pixel_values=random_image(2))
    same, _ = m(mx.array([IMAGE_PROMPT]), m.init_state(), pixel_values=image)
    assert not np.allclose(np.array(other[0, -1]), np.array(same[0, -1]), atol=1e-2)


def test_llava_teacher_forced_logits_equal_mlx_vlm_on_its_caches(llava):
    image = random_image()
    chunks = [IMAGE_PROMPT, [7], [8, 9, 10]]
    m = wrap(llava)
    logits, state = m(mx.array([chunks[0]]), m.init_state(), pixel_values=image)
    got = [logits]
    for chunk in chunks[1:]:
        logits, state = m(mx.array([chunk]), state)
        got.append(logits)
    for mine, theirs in zip(got, vlm_logits(llava, chunks, image), strict=True):
        np.testing.assert_allclose(np.array(mine), np.array(theirs), **TOL)


def test_inputs_embeds_equal_the_pixel_path(llava):
    image = random_image()
    m = wrap(llava)
    ids = mx.array([IMAGE_PROMPT])
    embeds = llava.get_input_embeddings(ids, image).inputs_embeds
    by_pixels, _ = m(ids, m.init_state(), pixel_values=image)
    by_embeds, _ = m(ids, m.init_state(), inputs_embeds=embeds)
    np.testing.assert_array_equal(np.array(by_pixels), np.array(by_embeds))
    with pytest.raises(ks.ShapeError, match="inputs_embeds"):
        m(ids, m.init_state(), inputs_embeds=embeds[:, :3])
    with pytest.raises(ks.StateError, match="not both"):
        m(ids, m.init_state(), inputs_embeds=embeds, pixel_values=image)


def test_a_prompt_with_extra_inputs_cannot_be_a_capturing_forward(llava):
    m = wrap(llava)
    with pytest.raises(ks.StateError, match="capture=True with a prompt"):
        m(mx.array([IMAGE_PROMPT]), m.init_state(), pixel_values=random_image(), capture=True)


def test_qwen2_vl_mrope_prompts_take_the_embedding_path_like_generate():
    """Qwen-VL language models keep the last prompt's mRoPE positions on themselves. A
    conversation's first forward goes through get_input_embeddings as in generate_step, so
    positions left on the module by an earlier conversation (or by the wrapper's own shape
    probe) do not leak into the next prompt."""
    model = tiny_qwen2_vl()
    short_ref, _ = vlm_generate(model, PROMPT[:4], 3)
    ref, _ = vlm_generate(model, PROMPT, 10)
    # The wrapper's shape probe leaves the module's positions as generate left them (the
    # token steps of an image prompt read them).
    language = model.language_model
    before = (dict(language.items()), dict(vars(language)))
    m = wrap(model)
    assert m.vocab_size == VOCAB
    after = (dict(language.items()), dict(vars(language)))
    for was, now in zip(before, after, strict=True):
        assert was.keys() == now.keys()
        assert all(was[k] is now[k] for k in was)
    short, _ = greedy(m, PROMPT[:4], 3)  # leaves a 4-token prompt's positions on the module
    got, _ = greedy(m, PROMPT, 10)
    assert (short, got) == (short_ref, ref)
    assert len(set(ref)) >= 4


# ---------------------------------------------------------------------------------------
# mlx-vlm's own language models: sliding windows and hybrids
# ---------------------------------------------------------------------------------------

LANGUAGE_MODELS = ["gemma3_text", "qwen3_next", "lfm2"]


@pytest.fixture(scope="module", params=LANGUAGE_MODELS)
def language_model(request):
    return tiny_vlm(request.param)


def test_greedy_equals_mlx_vlm_generate(language_model):
    ref, ref_logprobs = vlm_generate(language_model, PROMPT, 16)
    # generate_step embeds the prompt with get_input_embeddings; pixel_values=None does too.
    got, logprobs = greedy(wrap(language_model), PROMPT, 16, pixel_values=None)
    assert got == ref
    assert len(set(ref)) >= 4, "a degenerate oracle: the weights should make tokens vary"
    for mine, theirs in zip(logprobs, ref_logprobs, strict=True):
        np.testing.assert_allclose(np.array(mine), np.array(theirs), **TOL)
    plain, _ = greedy(wrap(language_model), PROMPT, 16)  # a plain token prompt
    assert plain == ref


def test_init_state_is_what_the_language_models_own_factory_builds(language_model):
    m = wrap(language_model)
    expected = from_mlx_vlm(make_prompt_cache(language_model.language_model))
    state = m.init_state()
    assert [config_of(a) for a in state.layers] == [config_of(b) for b in expected.layers]
    kinds = {type(layer).__name__ for layer in state.layers}
    if language_model.language_model.model_type == "gemma3_text":
        windows = [layer.max_size for layer in state.layers if isinstance(layer, ks.RotatingKV)]
        assert windows == [8, 8]  # sliding_window 8 on every other layer, not full KV
    else:
        assert kinds == {"DenseKV", "RecurrentState"}
    batch = m.init_state(3)
    logits, batch = m(mx.array([PROMPT[:4]] * 3), batch)
    single, _ = m(mx.array([PROMPT[:4]]), state)
    np.testing.assert_allclose(np.array(logits[1]), np.array(single[0]), **TOL)


def test_right_padded_prompt_batch_equals_mlx_vlm_per_row(language_model):
    """`lengths=`: a right-padded batch of prompts, then two decode steps; each row's logits
    equal mlx-vlm's language model on its own caches for that row alone. (mlx-vlm's
    ArraysCache masks by left padding alone; the wrapper gives it mlx-lm's mask for the
    padded forward, or the pad tokens would reach the recurrent state.)"""
    m = wrap(language_model)
    prompts = [PROMPT, PROMPT[:3], PROMPT[4:9]]
    width = max(len(p) for p in prompts)
    padded = mx.array([p + [0] * (width - len(p)) for p in prompts])
    logits, state = m(padded, m.init_state(3), lengths=[len(p) for p in prompts])
    steps = [logits[:, -1]]
    follow = mx.array([[1], [2], [3]])
    for _ in range(2):
        out, state = m(follow, state)
        steps.append(out[:, -1])
    for row, prompt in enumerate(prompts):
        ref = vlm_logits(language_model, [prompt, [row + 1], [row + 1]])
        np.testing.assert_allclose(
            np.array(logits[row, len(prompt) - 1]), np.array(ref[0][0, -1]), **TOL
        )
        for step in (1, 2):
            np.testing.assert_allclose(
                np.array(steps[step][row]), np.array(ref[step][0, -1]), **TOL
            )


def test_ragged_commit_on_a_merged_batch_equals_mlx_vlm_per_row(language_model):
    """Rows prefilled alone, merged, verified with capture and committed to different
    lengths, then one step: each row equals mlx-vlm on its own caches for that row alone."""
    m = wrap(language_model)
    prompts = [PROMPT, PROMPT[:3], PROMPT[4:9]]
    state = ks.merge([m(mx.array([p]), m.init_state())[1] for p in prompts])
    drafts = [[20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]]
    _, after, checkpoints = m(mx.array(drafts), state, capture=True)
    accepted = [4, 0, 2]
    state = ks.commit_prefix(after, accepted, checkpoints)
    logits, _ = m(mx.array([[1], [2], [3]]), state)
    for row, prompt in enumerate(prompts):
        chunks = [prompt, drafts[row][: accepted[row]], [row + 1]]
        ref = vlm_logits(language_model, [c for c in chunks if c])
        np.testing.assert_allclose(np.array(logits[row, -1]), np.array(ref[-1][0, -1]), **TOL)


def test_known_mlx_vlm_mixers_verify_in_one_pass(language_model, monkeypatch):
    """qwen3_next's gated delta net and lfm2's short convolution are recorded, not replayed,
    and their checkpoints equal the token-by-token replay's."""
    if language_model.language_model.model_type == "gemma3_text":
        pytest.skip("no recurrent layer")
    draft = [5, 6, 7, 8, 9]
    m = wrap(language_model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    with monkeypatch.context() as patch:

        def no_replay(*args, **kwargs):
            raise AssertionError("the capturing forward replayed the model")

        patch.setattr(forward_module, "replay_checkpoints", no_replay)
        logits, after, fast = m(mx.array([draft]), state, capture=True)
    slow_logits, _, slow = wrap(language_model, record_mixers=False)(
        mx.array([draft]), state, capture=True
    )
    np.testing.assert_allclose(np.array(logits), np.array(slow_logits), **TOL)
    compared = 0
    for layer, one_pass, replayed in zip(after.layers, fast, slow, strict=True):
        if not isinstance(layer, ks.RecurrentState):
            assert one_pass is None and replayed is None
            continue
        for a, b in zip(one_pass, replayed, strict=True):
            for t in range(len(draft) + 1):
                np.testing.assert_allclose(
                    np.array(ks.checkpoint_at(a, t)), np.array(ks.checkpoint_at(b, t)), **TOL
                )
                compared += 1
    assert compared > 0


def test_speculative_decode_with_capture_and_commit_equals_mlx_vlm_generate(language_model):
    """Draft-and-verify (drafts: the oracle's tokens, a third corrupted) through capture +
    commit_prefix emits exactly mlx-vlm's greedy tokens."""
    n, k = 24, 4
    ref, _ = vlm_generate(language_model, PROMPT, n + k)
    out, accepted = speculate_with_corrupted_oracle(wrap(language_model), PROMPT, ref, n, k, VOCAB)
    assert out == ref[:n]
    assert len(set(accepted)) >= 3, "the drafts should exercise several commit lengths"


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "falcon_h1"])
def test_mlx_vlm_mamba2_mixers_record_what_replay_gives(name, monkeypatch):
    model = tiny_vlm(name)
    draft = [5, 6, 7, 8]
    m = wrap(model)
    _, state = m(mx.array([PROMPT[:6]]), m.init_state())
    with monkeypatch.context() as patch:

        def no_replay(*args, **kwargs):
            raise AssertionError("the capturing forward replayed the model")

        patch.setattr(forward_module, "replay_checkpoints", no_replay)
        _, after, fast = m(mx.array([draft]), state, capture=True)
    _, _, slow = wrap(model, record_mixers=False)(mx.array([draft]), state, capture=True)
    compared = 0
    pairs = zip(_recurrent_parts(after, fast), _recurrent_parts(after, slow), strict=True)
    for one_pass, replayed in pairs:
        for a, b in zip(one_pass, replayed, strict=True):
            for t in range(len(draft) + 1):
                got, want = np.array(ks.checkpoint_at(a, t)), np.array(ks.checkpoint_at(b, t))
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)
                compared += 1
    assert compared > 0


def _recurrent_parts(state: ks.ModelState, checkpoints: tuple) -> list:
    found = []
    for layer, c in zip(state.layers, checkpoints, strict=True):
        if isinstance(layer, ks.ListState):
            found += [p for s, p in zip(layer.states, c, strict=True) if p is not None]
        elif c is not None:
            found.append(c)
    return found


# ---------------------------------------------------------------------------------------
# Outputs and errors
# ---------------------------------------------------------------------------------------


def test_outputs_that_carry_state_outside_the_cache_are_refused():
    from mlx_vlm.models.base import LanguageModelOutput

    from kvstate.adapters.wrapped.vlm import logits_of

    logits = mx.zeros((1, 1, 4))
    assert logits_of(logits) is logits
    assert logits_of(LanguageModelOutput(logits=logits)) is logits
    carried = LanguageModelOutput(logits=logits, encoder_outputs=[logits])
    with pytest.raises(ks.StateError, match="encoder_outputs"):
        logits_of(carried)
    with pytest.raises(ks.StateError, match=r"without \.logits"):
        logits_of(object())


def test_readme_mlx_vlm_example_decodes_like_mlx_vlm_generate(llava, monkeypatch):
    """The README's mlx-vlm block, run with `mlx_vlm.load` giving the tiny llava."""
    import re
    from pathlib import Path

    import mlx_vlm

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## mlx-vlm models", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its mlx-vlm code block"
    monkeypatch.setattr(mlx_vlm, "load", lambda path: (llava, None))
    image = random_image()
    namespace = {
        "MODEL": "tiny",
        "input_ids": mx.array([IMAGE_PROMPT]),
        "pixel_values": image,
        "mask": None,
    }
    exec(compile(match.group(1), "README.md", "exec"), namespace)
    tokens = [int(t.item()) for t in namespace["tokens"]]
    assert tokens == vlm_generate(llava, IMAGE_PROMPT, len(tokens), pixel_values=image)[0]
    caches = namespace["caches"]
    assert [type(c).__module__ for c in caches] == ["mlx_vlm.models.cache"] * len(caches)


def test_what_is_not_available_for_mlx_vlm_models_says_so(llava):
    m = wrap(llava)
    with pytest.raises(ks.StateError, match="hidden=True"):
        m(mx.array([[1, 2]]), m.init_state(), hidden=True)
    with pytest.raises(ks.StateError, match="tree_forward"):
        m.tree_forward(mx.array([[1, 2]]), m.init_state(), [-1, 0])


def test_a_subclass_of_an_mlx_vlm_model_is_wrapped_as_one(llava):
    class Mine(type(llava)):  # defined outside mlx_vlm
        pass

    mine = Mine(llava.config)
    mine.update(llava.parameters())
    assert isinstance(wrap(mine), VLMWrappedModel)
