"""The prefill as mlx-lm's `generate_step` runs it (`WrappedModel.prefill`, and through it
`generate`, `ModelDrafter.start`, `MTPDrafter.start`): chunks of `prefill_step_size`
positions evaluated as they are built, the logits of the last position only.

Oracles: the one-forward prefill `m(prompt, m.init_state())` (state and last logits, within
fp32 rounding; then the same decode steps from both), and mlx-lm's own `generate_step`
(first log-probabilities and greedy tokens), for attention, sliding-window (gemma3_text,
its window of 8 shorter than the prompt), recurrent and hybrid models.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

import kvstate as ks
from kvstate.adapters import to_mlx_lm, wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import ModelDrafter, MTPDrafter, NGramDrafter, generate
from kvstate.speculative._prefill import prefill, prefill_by_calls
from tests.helpers import CountingModel, greedy_reference
from tests.test_mtp_drafter import TargetHead

ARCHITECTURES = ["llama", "gemma3_text", "qwen3_next", "mamba2", "nemotron_h", "falcon_h1", "lfm2"]
PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5, 77, 1, 200, 19, 45, 88, 13, 2, 160, 9]
STEPS = [1, 4, 7, 2048]  # 4 divides the 20 positions before the last, 7 does not
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: Any) -> Any:
    return tiny_model(request.param)


def leaves(caches: Any) -> Iterator[Any]:
    for c in caches:
        if hasattr(c, "caches"):  # a CacheList
            yield from leaves(c.caches)
        else:
            yield c


def flat(state: Any) -> Iterator[Any]:
    """A cache's `state` (arrays, lists of them, offsets, None) as its leaves."""
    if isinstance(state, (list, tuple)):
        for part in state:
            yield from flat(part)
    else:
        yield state


def close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(
        np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)), **TOL
    )


def assert_same_content(a: ks.ModelState, b: ks.ModelState) -> int:
    """Both states hold the same tokens: every cache's `state` arrays (KV entries up to the
    offset, recurrent arrays), a window's newest entries in temporal order (the layout of
    its ring differs after a multi-token and a one-token last forward). Returns the arrays
    compared."""
    compared = 0
    for x, y in zip(leaves(to_mlx_lm(a)), leaves(to_mlx_lm(b)), strict=True):
        assert type(x) is type(y)
        if isinstance(x, BatchRotatingKVCache):
            continue  # merged windows: the decode steps compare them
        if isinstance(x, RotatingKVCache):
            assert x.offset == y.offset
            w = min(x.offset, x.max_size)
            for p, q in ((x.keys, y.keys), (x.values, y.values)):
                close(x._temporal_order(p)[..., -w:, :], y._temporal_order(q)[..., -w:, :])
                compared += 1
            continue
        for p, q in zip(flat(x.state), flat(y.state), strict=True):
            if not isinstance(p, mx.array) or not isinstance(q, mx.array):
                assert p == q  # None, or an offset
                continue
            assert p.shape == q.shape
            close(p, q)
            compared += 1
    return compared


def assert_decodes_alike(m: Any, a: ks.ModelState, b: ks.ModelState, rows: int = 1) -> None:
    """Twelve greedy one-token steps from each state (past gemma3's window): logits agree."""
    y = mx.array([[5]] * rows)
    for _ in range(12):
        la, a = m(y, a)
        lb, b = m(y, b)
        close(la, lb)
        y = la[:, -1].argmax(-1)[:, None]


@pytest.mark.parametrize("step", STEPS)
def test_chunked_prefill_equals_the_one_forward_prefill(model: Any, step: int) -> None:
    m = wrap(model)
    logits, reference = m(mx.array([PROMPT]), m.init_state())
    last, state = m.prefill(PROMPT, m.init_state(), step=step)
    assert last.shape == (1, VOCAB)
    close(last, logits[:, -1])
    assert assert_same_content(state, reference) > 0
    assert_decodes_alike(m, state, reference)


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "mamba2", "gemma3_text"])
def test_a_batch_of_one_length_prefills_in_chunks_like_one_forward(name: str) -> None:
    m = wrap(tiny_model(name))
    batch = [PROMPT, PROMPT[::-1]]
    logits, reference = m(mx.array(batch), m.init_state(2))
    last, state = m.prefill(mx.array(batch), m.init_state(2), step=3)
    close(last, logits[:, -1])
    assert_same_content(state, reference)
    assert_decodes_alike(m, state, reference, rows=2)


def test_the_first_token_is_generate_steps(model: Any) -> None:
    """generate's first log-probabilities are mlx-lm's `generate_step`'s, and the greedy
    tokens too, for every chunk size."""
    _, reference = next(generate_step(mx.array(PROMPT), model))
    want = greedy_reference(model, PROMPT, 8)
    target = wrap(model)
    for step in (1, 7, 2048):
        rounds = list(generate(target, [PROMPT], None, max_tokens=8, prefill_step_size=step))
        close(rounds[0][0].logprobs, reference)
        assert [t.token for r in rounds for t in r] == want


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "nemotron_h"])
def test_ragged_prompts_generate_mlx_lms_tokens_per_row(name: str) -> None:
    model = tiny_model(name)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:12]]
    want = [greedy_reference(model, p, 8) for p in prompts]
    for drafter in (None, NGramDrafter(), ModelDrafter(wrap(model))):
        got: list[list[int]] = [[] for _ in prompts]
        for r in generate(wrap(model), prompts, drafter, max_tokens=8, prefill_step_size=3):
            for t in r:
                got[t.row].append(t.token)
        assert got == want, type(drafter).__name__


def test_progress_counts_up_to_the_total_in_chunks() -> None:
    m = wrap(tiny_model("llama"))
    seen: list[tuple[int, int]] = []
    m.prefill([PROMPT, PROMPT], m.init_state(2), step=8, progress=lambda *a: seen.append(a))
    # 21 positions: chunks of 8, 8 and 4 before the last; two rows each
    assert seen == [(0, 42), (16, 42), (32, 42), (40, 42), (42, 42)]


def test_generates_progress_is_the_whole_batchs_and_ends_at_its_total() -> None:
    m = wrap(tiny_model("llama"))
    prompts = [PROMPT, PROMPT[:5], [4]]
    seen: list[tuple[int, int]] = []
    list(generate(m, prompts, None, max_tokens=2, prefill_step_size=4,
                  prompt_progress=lambda *a: seen.append(a)))  # fmt: skip
    counts = [done for done, _ in seen]
    assert {total for _, total in seen} == {27}
    assert counts[0] == 0 and counts[-1] == 27
    assert all(a < b for a, b in itertools.pairwise(counts)), counts
    assert len(counts) > len(prompts) + 1  # the long prompt reported chunk by chunk


def test_the_prefill_holds_one_positions_logits_not_the_prompts() -> None:
    """With a 32k vocabulary and 512 positions, all logits are 65 MB: the prefill's peak
    stays far below (the projection runs at the last position only), the one forward's
    does not."""
    vocab = 32_000
    m = wrap(tiny_model("llama", vocab_size=vocab))
    prompt = [(7 * i) % vocab for i in range(512)]
    assert m.vocab_size == vocab  # the probe forward, before the measurement

    def peak(run: Any) -> int:
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = run()
        mx.eval(out)
        return mx.get_peak_memory() - base

    logits_bytes = len(prompt) * vocab * 4
    chunked = peak(lambda: m.prefill(prompt, m.init_state())[0])
    whole = peak(lambda: m(mx.array([prompt]), m.init_state())[0][:, -1])
    assert whole > logits_bytes
    assert chunked < logits_bytes / 4, (chunked, logits_bytes)


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_hidden_states_of_every_position(name: str) -> None:
    m = wrap(tiny_model(name))
    logits, _, hidden = m(mx.array([PROMPT]), m.init_state(), hidden=True)
    last, _, chunked = m.prefill(PROMPT, m.init_state(), step=6, hidden=True)
    assert chunked.shape == hidden.shape
    close(chunked, hidden)
    close(last, logits[:, -1])


def test_a_target_without_prefill_gets_the_same_chunks_through_its_calls() -> None:
    m = wrap(tiny_model("qwen3_next"))
    counting = CountingModel(m)
    last, state = prefill_by_calls(counting, mx.array([PROMPT]), m.init_state(), step=8)
    assert counting.calls == 4  # 8 + 8 + 4 positions, then the last
    reference_last, reference = m.prefill(PROMPT, m.init_state(), step=8)
    close(last, reference_last)
    assert_same_content(state, reference)
    logits, _, hiddens = prefill(counting, [PROMPT, PROMPT[:4]], hidden=True, step=5)
    assert [h.shape[1] for h in hiddens] == [len(PROMPT), 4]
    assert logits.shape == (2, VOCAB)


def test_the_model_drafters_state_after_start_is_the_one_forwards() -> None:
    """The draft state `start` builds in chunks holds what the per-row one-forward prefill
    and merge held (the prefill before chunks), and decodes alike."""
    for name in ("llama", "gemma3_text", "qwen3_next", "falcon_h1"):
        m = wrap(tiny_model(name))
        prompts = [PROMPT, PROMPT[:6]]
        old = ks.merge([m(mx.array([p]), m.init_state())[1] for p in prompts])
        drafter = ModelDrafter(m)
        drafter.start(prompts, prefill_step_size=4)
        assert assert_same_content(drafter.state, old) > 0
        assert_decodes_alike(m, drafter.state, old, rows=2)


def test_generate_passes_its_chunk_size_to_drafters_that_prefill(monkeypatch: Any) -> None:
    m = wrap(tiny_model("llama"))
    got: list[dict[str, Any]] = []
    for cls in (ModelDrafter, MTPDrafter):
        start = cls.start

        def recorded(self: Any, *args: Any, _start: Any = start, **kw: Any) -> None:
            got.append(kw)
            _start(self, *args, **kw)

        monkeypatch.setattr(cls, "start", recorded)
    list(generate(m, [PROMPT], ModelDrafter(m), max_tokens=3, prefill_step_size=5))
    list(generate(m, [PROMPT], MTPDrafter(TargetHead(tiny_model("llama"))), max_tokens=3,
                  prefill_step_size=6))  # fmt: skip
    assert got[0]["prefill_step_size"] == 5 and set(got[0]) == {"prefill_step_size", "key"}
    assert got[1]["prefill_step_size"] == 6
    list(generate(m, [PROMPT], NGramDrafter(), max_tokens=3, prefill_step_size=5))  # no keyword


def test_an_mtp_head_prefilled_in_chunks_drafts_as_before() -> None:
    model = tiny_model("qwen3_next")
    target = wrap(model)
    want = greedy_reference(model, PROMPT, 10)
    states = []
    for step in (3, 2048):
        drafter = MTPDrafter(TargetHead(model))
        got = [t.token for r in generate(target, [PROMPT], drafter, k=3, max_tokens=10,
                                         prefill_step_size=step) for t in r]  # fmt: skip
        assert got == want
        drafter.start([PROMPT], [mx.zeros((1, len(PROMPT), 64))], prefill_step_size=step)
        states.append(drafter.state)
    assert_same_content(*states)


def test_ids_outside_the_vocabulary() -> None:
    """From lists: refused. In an mx.array (never read back): the row's last logits are
    NaN, wherever the id was (a chunk's logits are never computed)."""
    m = wrap(tiny_model("llama"))
    with pytest.raises(ks.TokenError, match="outside the vocabulary"):
        m.prefill([3, VOCAB + 1, 4], m.init_state())
    ids = mx.array([[3, VOCAB + 1, 4, 5, 6], [3, 2, 4, 5, 6]])
    last, _ = m.prefill(ids, m.init_state(2), step=2)
    assert np.isnan(np.array(last[0])).all()
    assert not np.isnan(np.array(last[1])).any()


def test_a_chunk_size_must_be_a_positive_int() -> None:
    m = wrap(tiny_model("llama"))
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(ks.StateError, match="prefill_step_size"):
            m.prefill(PROMPT, m.init_state(), step=bad)  # type: ignore[arg-type]
        with pytest.raises(ks.StateError, match="prefill_step_size"):
            next(generate(m, [PROMPT], None, prefill_step_size=bad))  # type: ignore[arg-type]


def test_a_prefill_continues_a_state_it_did_not_start() -> None:
    """From a state holding a conversation: the same as the one forward from it, and the
    state the caller keeps is left as it was."""
    m = wrap(tiny_model("gemma3_text"))
    _, start = m(mx.array([PROMPT[:9]]), m.init_state())
    kept = [np.array(a) for a in ks.tree_flatten(start)[0]]
    logits, reference = m(mx.array([PROMPT[9:]]), start)
    last, state = m.prefill(PROMPT[9:], start, step=4)
    close(last, logits[:, -1])
    assert_decodes_alike(m, state, reference)
    for a, b in zip(kept, ks.tree_flatten(start)[0], strict=True):
        np.testing.assert_array_equal(a, np.array(b))
