"""`generate` without a drafter (pipelined plain decoding) against mlx-lm's `generate_step`:
tokens and log-probabilities per row, rows that stop at different times, and sampling
against the target's own distribution."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import Sampler, generate

from .helpers import second_tokens_checked

PROMPTS = [[3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5], [100, 101, 102], [7, 7, 40, 41, 42]]


def oracle(model, prompt: list[int], n: int) -> list[tuple[int, mx.array]]:
    return [(int(t), lp) for t, lp in generate_step(mx.array(prompt), model, max_tokens=n)]


def rows_of(rounds, n_rows: int) -> list[list]:
    out: list[list] = [[] for _ in range(n_rows)]
    for tokens in rounds:
        assert len({t.row for t in tokens}) == len(tokens)  # one token per live row a round
        for t in tokens:
            assert not t.from_draft
            out[t.row].append(t)
    return out


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "nemotron_h"])
def test_plain_decoding_gives_mlx_lm_greedy_tokens_and_logprobs_per_row(name):
    """A ragged batch of 3 with an end token that stops the rows at different rounds (the
    batch shrinks while a step is in flight): each row is mlx-lm's greedy continuation up to
    and including its first end token, with mlx-lm's log-probabilities."""
    model = tiny_model(name, scale=4.0)
    n = 24
    truth = [oracle(model, p, n) for p in PROMPTS]
    ids = [[t for t, _ in row] for row in truth]
    stop = ids[1][4]  # row 1 stops at its 5th token; the others where it first comes up
    want = [row[: row.index(stop) + 1] if stop in row else row for row in ids]
    assert len({len(w) for w in want}) > 1, "the rows should stop at different rounds"
    got = rows_of(generate(wrap(model), PROMPTS, None, max_tokens=n, eos=[stop]), 3)
    assert [[t.token for t in row] for row in got] == want
    for row, expected in zip(got, truth, strict=False):
        for t, (_, lp) in zip(row, expected, strict=False):
            np.testing.assert_allclose(np.array(t.logprobs), np.array(lp), atol=2e-4)


def test_plain_decoding_stops_at_max_tokens_without_a_step_past_it(monkeypatch):
    """max_tokens 1 is the prefill's token alone; n tokens take n - 1 one-token forwards
    (the pipelined loop builds no step that nobody reads)."""
    model = tiny_model("llama")
    target = wrap(model)
    calls: list[tuple[Any, ...]] = []
    original, prefill = type(target).__call__, type(target).prefill

    def counted(self, tokens, state, **kw):
        calls.append(tuple(mx.array(tokens).shape))
        return original(self, tokens, state, **kw)

    def counted_prefill(self, tokens, state, **kw):
        calls.append(("prefill", *mx.array(tokens).shape))
        return prefill(self, tokens, state, **kw)

    monkeypatch.setattr(type(target), "__call__", counted)
    monkeypatch.setattr(type(target), "prefill", counted_prefill)
    for n in (1, 5):
        calls.clear()
        rounds = list(generate(target, PROMPTS[:2], None, max_tokens=n))
        assert [len(r) for r in rounds] == [2] * n
        # two prompts, then steps
        assert calls == [("prefill", 1, 11), ("prefill", 1, 3)] + [(2, 1)] * (n - 1)


def test_plain_sampling_follows_the_target_distribution():
    """300 rows (3 generations of 100: MLX CUDA fails a step of >= 128 rows, README) sample
    one prompt at temperature 1 (top_k 6): the first tokens follow the target's distribution
    after the prompt, the second ones its distribution after each first token (total
    variation < 0.25)."""
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    target = wrap(model)
    sampler = Sampler(temperature=1.0, top_k=6)
    prompt = [5, 9, 13]
    rows = [
        row
        for seed in range(3)
        for row in rows_of(
            generate(target, [prompt] * 100, None, max_tokens=2, sampler=sampler, seed=seed), 100
        )
    ]
    firsts = [row[0].token for row in rows]
    logits, _ = target(mx.array([prompt]), target.init_state())
    want = np.array(sampler.probs(logits[0, -1]))
    got = np.bincount(firsts, minlength=want.size) / len(firsts)
    assert 0.5 * np.abs(got - want).sum() < 0.15
    pairs: dict[int, list[int]] = {}
    for row in rows:
        pairs.setdefault(row[0].token, []).append(row[1].token)
    assert second_tokens_checked(target, prompt, sampler, pairs, least=60, bound=0.25) >= 1


def test_a_hundred_ragged_prompts_prefill_one_by_one_and_decode_like_greedy():
    """120 prompts of 1-6 tokens (below the 128 rows that fail on MLX CUDA, README): each is
    prefilled alone and set evaluating at once, then merged; rows decode mlx-lm's greedy
    tokens."""
    model = tiny_model("llama", num_hidden_layers=2, scale=4.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200, rng.integers(1, 7)).tolist() for _ in range(120)]
    got = rows_of(generate(wrap(model), prompts, None, max_tokens=3), len(prompts))
    for i in range(0, 120, 13):
        assert [t.token for t in got[i]] == [t for t, _ in oracle(model, prompts[i], 3)], i
