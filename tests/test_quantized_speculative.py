"""The speculative generator on a target whose state is quantized (issue 9, item 4): every
verify writes K+1 quantized positions and `commit_prefix` trims the rejected ones (or, in a
ragged batch, rolls each row's kept positions into place), so a wrong commit shows up as
tokens or log-probabilities that differ from plain decoding.

Oracles: the un-speculated greedy decode of the same wrapped, quantized model, one row at a
time through `wrapped(tokens, state)` (not through `generate`), tokens and log-probabilities;
and, for K4/V4 without rotation (arrays identical to mlx-lm's), mlx-lm's own
`generate_step` on QuantizedKVCache objects.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import generate
from tests.helpers import ScriptedDrafter
from tests.test_speculative import PROMPTS

NEW = 64
HEAD_DIM = 32  # one group of 32 per row: no pad channels, so K4/V4 is mlx-lm's exact form
OPTIONS: dict[str, dict[str, Any]] = {
    "K4/V4": {"bits": 4, "group_size": 32},
    "K5/V3 hadamard": {"key_bits": 5, "value_bits": 3, "group_size": 32, "rotation": "hadamard"},
    # the latest 6 exact: longer than two prompts (whole-length tails), verifies cross it
    "K4/V3 hadamard exact 6": {
        "key_bits": 4,
        "value_bits": 3,
        "group_size": 32,
        "rotation": "hadamard",
        "exact_latest": 6,
    },
}


class QuantizedTarget:
    """A wrapped model whose empty states are quantized: `generate` starts every row from one,
    so the prefill, each verify and each commit run on QuantizedKV layers."""

    def __init__(self, wrapped: Any, options: dict[str, Any]) -> None:
        self.wrapped, self.options = wrapped, options

    def init_state(self, batch_size: int = 1) -> Any:
        return ks.quantize(self.wrapped.init_state(batch_size), **self.options)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.wrapped(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


def plain_decode(target: QuantizedTarget, prompt: list[int], n: int) -> tuple[list[int], Any]:
    """Greedy, one token per forward, one row: (tokens, (n, vocab) log-probabilities)."""
    logits, state = target(mx.array([prompt]), target.init_state())
    tokens, logprobs = [], []
    for _ in range(n):
        last = logits[0, -1].astype(mx.float32)
        logprobs.append(last - mx.logsumexp(last))
        tokens.append(int(last.argmax().item()))
        logits, state = target(mx.array([[tokens[-1]]]), state)
    assert all(isinstance(p, (ks.QuantizedKV, ks.QuantizedRotatingKV)) for p in state.layers)
    return tokens, np.array(mx.stack(logprobs))


def speculate(target: QuantizedTarget, prompts, truth, k: int) -> tuple[list, list, int]:
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[np.ndarray]] = [[] for _ in prompts]
    drafted = 0
    drafter = ScriptedDrafter(truth, 0.5, seed=k)  # each draft right half of the time
    # fixed k: a ragged K5/V3 hadamard batch whose counts vary between rounds (plain steps,
    # ragged cuts) drifts from each row alone even without a policy (seen 2026-12-02; open)
    rounds = generate(target, prompts, drafter, k=k, max_tokens=NEW, adaptive=False)
    for round_tokens in rounds:
        for t in round_tokens:
            tokens[t.row].append(t.token)
            logprobs[t.row].append(np.array(t.logprobs))
            drafted += t.from_draft
    return tokens, [np.stack(rows) for rows in logprobs], drafted


@pytest.fixture(scope="module", params=list(OPTIONS))
def case(request):
    """(name, target, un-speculated (tokens, logprobs) per prompt: NEW + 9 tokens)."""
    target = QuantizedTarget(wrap(tiny_model("llama", head_dim=HEAD_DIM)), OPTIONS[request.param])
    plain = [plain_decode(target, p, NEW + 9) for p in PROMPTS]
    for tokens, _ in plain:
        assert len(set(tokens)) >= 8  # a degenerate oracle (one repeated token) proves nothing
    return request.param, target, plain


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_batch_one_speculates_exactly_like_plain_quantized_decoding(case, k):
    _, target, plain = case
    truth = [plain[0][0]]
    tokens, logprobs, drafted = speculate(target, PROMPTS[:1], truth, k)
    assert tokens == [truth[0][:NEW]]
    np.testing.assert_allclose(logprobs[0], plain[0][1][:NEW], atol=1e-4)
    assert drafted > 0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_ragged_batch_speculates_like_each_row_decoded_alone(case, k):
    """Rows of 11, 3 and 5 tokens: left padding, so kvstate's quantized attention runs even
    at K4/V4, and ragged commits shift each row by its rejected tokens."""
    _, target, plain = case
    truth = [t for t, _ in plain]
    tokens, logprobs, drafted = speculate(target, PROMPTS, truth, k)
    assert tokens == [t[:NEW] for t in truth]
    for got, (_, expected) in zip(logprobs, plain, strict=True):
        np.testing.assert_allclose(got, expected[:NEW], atol=1e-4)
    assert drafted > 0


def test_k4_v4_equals_mlx_lm_quantized_kv_cache_generate_step():
    """K4/V4 at group 32 without rotation is mlx-lm's QuantizedKVCache, array for array:
    mlx-lm's generate_step on such caches (from the first token) is the oracle."""
    model = tiny_model("llama", head_dim=HEAD_DIM)
    target = QuantizedTarget(wrap(model), OPTIONS["K4/V4"])
    caches = [
        QuantizedKVCache(group_size=32, bits=4) if type(c) is KVCache else c
        for c in make_prompt_cache(model)
    ]
    prompt = PROMPTS[0]
    steps = generate_step(mx.array(prompt), model, max_tokens=NEW + 9, prompt_cache=caches)
    theirs = [int(t) for t, _ in steps]
    assert theirs == plain_decode(target, prompt, NEW + 9)[0]
    tokens, _, drafted = speculate(target, [prompt], [theirs], 3)
    assert tokens == [theirs[:NEW]] and drafted > 0
