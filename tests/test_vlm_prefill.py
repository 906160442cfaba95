"""`VLMWrappedModel.prefill` against mlx-vlm's own `generate_step` (which prefills in chunks
of its `prefill_step_size`): the prompt's inputs built once, chunks of `step` positions, the
last position alone; a model that refuses chunks runs in one forward."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx
from mlx_vlm.generate.ar import generate_step

from kvstate.adapters import wrap
from kvstate.speculative import generate
from tests.test_vlm_models import IMAGE_PROMPT, PROMPT
from tests.test_vlm_pooling_models import PROMPT as POOLED_PROMPT
from tests.test_vlm_pooling_models import tiny_deepseek_v4, tiny_glm5_next
from tests.vlm_helpers import random_image, tiny_llava, tiny_qwen2_vl, tiny_vlm, vlm_generate

TOL = {"rtol": 1e-4, "atol": 1e-4}


def greedy_from(m: Any, last: mx.array, state: Any, n: int) -> tuple[list[int], list[Any]]:
    """Greedy tokens (and log-probabilities) after a prefill's last logits."""
    tokens, steps = [], []
    for _ in range(n):
        steps.append(last[0] - mx.logsumexp(last[0]))
        tokens.append(int(last[0].argmax().item()))
        logits, state = m(mx.array([[tokens[-1]]]), state)
        last = logits[:, -1]
    return tokens, steps


def assert_alike(got: list[Any], want: list[Any]) -> None:
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(mine), np.array(theirs), **TOL)


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next", "lfm2"])
def test_language_models_prefill_in_chunks_like_generate_step(name: str) -> None:
    model = tiny_vlm(name)
    ref, ref_logprobs = vlm_generate(model, PROMPT, 10)
    m = wrap(model)
    for step in (1, 3, 2048):
        last, state = m.prefill(PROMPT, m.init_state(), step=step)
        tokens, logprobs = greedy_from(m, last, state, 10)
        assert tokens == ref, step
        assert_alike(logprobs, ref_logprobs)
        rounds = generate(m, [PROMPT], None, max_tokens=10, prefill_step_size=step)
        assert [t.token for r in rounds for t in r] == ref


def test_an_image_prompt_prefills_in_chunks_like_generate_step() -> None:
    llava, image = tiny_llava(), random_image()
    ref, ref_logprobs = vlm_generate(llava, IMAGE_PROMPT, 8, pixel_values=image)
    m = wrap(llava)
    seen: list[tuple[int, int]] = []
    last, state = m.prefill(
        IMAGE_PROMPT, m.init_state(), step=2, pixel_values=image, progress=lambda *a: seen.append(a)
    )
    tokens, logprobs = greedy_from(m, last, state, 8)
    assert tokens == ref
    assert_alike(logprobs, ref_logprobs)
    total = len(IMAGE_PROMPT)
    assert seen[0] == (0, total) and seen[-1] == (total, total) and len(seen) > 3


def test_qwen2_vl_mrope_positions_follow_the_chunks() -> None:
    model = tiny_qwen2_vl()
    ref, _ = vlm_generate(model, PROMPT, 8)
    m = wrap(model)
    last, state = m.prefill(PROMPT, m.init_state(), step=3)
    assert greedy_from(m, last, state, 8)[0] == ref


@pytest.mark.parametrize("make", [tiny_deepseek_v4, tiny_glm5_next], ids=lambda f: f.__name__)
def test_pooled_attention_prefills_in_chunks_like_generate_step(make: Any) -> None:
    """Against generate_step with the same chunk size: deepseek_v4's tokens depend on it in
    mlx-vlm itself (its compressed pools, fed chunks of up to 4, decode otherwise than
    after one 9-token chunk)."""
    model = make()
    m = wrap(model)
    for step in (1, 3, 2048):
        ref = [
            int(t)
            for t, _ in generate_step(
                mx.array([POOLED_PROMPT]), model, None, None, max_tokens=10, temperature=0.0,
                prefill_step_size=step,
            )
        ]  # fmt: skip
        rounds = generate(m, [POOLED_PROMPT], None, max_tokens=10, prefill_step_size=step)
        assert [t.token for r in rounds for t in r] == ref, step


def test_a_model_that_refuses_chunks_runs_the_prompt_in_one_forward() -> None:
    model = tiny_vlm("gemma3_text")
    ref, _ = vlm_generate(model, PROMPT, 6)
    model.no_chunked_prefill = True  # what mlx-vlm's encoder-decoder models say
    m = wrap(model)
    seen: list[tuple[int, int]] = []
    last, state = m.prefill(PROMPT, m.init_state(), step=2, progress=lambda *a: seen.append(a))
    assert seen == [(0, len(PROMPT)), (len(PROMPT), len(PROMPT))]
    assert greedy_from(m, last, state, 6)[0] == ref
