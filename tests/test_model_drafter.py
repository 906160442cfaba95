"""ModelDrafter's draft state against an oracle: after every round it must hold exactly the
tokens the target kept. The oracle is mlx-lm's own model and cache run over each row's
history from scratch; the trimmed rollback (attention-only drafts) is also compared with
the re-run it replaces, and the draft models that cannot trim (windows, recurrent, hybrid)
must still take the exact re-run path."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, Proposal, Sampler, generate
from kvstate.speculative import _model_drafter as drafter_module
from kvstate.testing import assert_states_allclose

from .helpers import CountingModel

PROMPTS = [[3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5], [100, 101, 102], [7, 7, 40, 41, 42]]
NEW = 24


class Checked:
    """Drives a ModelDrafter and, before every proposal, checks its state against mlx-lm:
    the draft model's next-token logits from (state, pending draft, last token) equal those
    of mlx-lm's model run from a fresh cache over the row's whole history and last token."""

    def __init__(self, draft_model: Any, k_seen: set[str], pipelined: bool = False) -> None:
        self.model = draft_model
        self.counting = CountingModel(wrap(draft_model))
        self.inner = ModelDrafter(self.counting, pipelined=pipelined)
        self.history: list[list[int]] = []
        self.seen = k_seen  # which acceptance cases occurred: "none", "partial", "all"
        self.reruns = 0  # draft forwards run while accepting (not proposing)
        self.avoidable = 0  # of those, in rounds where no row kept its final draft
        self.checks = 0

    def start(self, prompts: list[list[int]]) -> None:
        self.history = [list(p) for p in prompts]
        self.inner.start(prompts)

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        self._check(last)
        self.k = k
        return self.inner.propose(last, k, sampler)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        rows = cast(list[list[int]], fed.tolist())
        for b, n in enumerate(kept):
            self.history[b] += rows[b][:n]
            self.seen.add("none" if n == 1 else "all" if n == self.k + 1 else "partial")
        before = self.counting.calls
        self.inner.accept(fed, kept)
        self.reruns += self.counting.calls - before
        if max(kept) <= self.k:
            self.avoidable += self.counting.calls - before

    def keep_rows(self, rows: list[int]) -> None:
        self.history = [self.history[i] for i in rows]
        self.inner.keep_rows(rows)

    def _check(self, last: list[int]) -> None:
        y = mx.array(last, mx.int32)[:, None]
        if self.inner.pending is not None:
            y = mx.concatenate([self.inner.pending, y], axis=1)
        ours = self.counting.wrapped(y, self.inner.state)[0][:, -1]
        for b, tokens in enumerate(self.history):
            cache = make_prompt_cache(self.model)
            want = self.model(mx.array([[*tokens, last[b]]]), cache=cache)[0, -1]
            np.testing.assert_allclose(
                np.array(ours[b]), np.array(want), rtol=1e-3, atol=1e-3, err_msg=f"row {b}"
            )
        self.checks += 1


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def run(
    name: str,
    prompts: list[list[int]],
    k: int,
    sampler: Sampler | None = None,
    pipelined: bool = False,
) -> Any:
    model = tiny_model(name)
    seen: set[str] = set()
    drafter = Checked(tiny_model(name, scale=3.0), seen, pipelined)
    out: list[list[int]] = [[] for _ in prompts]
    # fixed k: every round proposes k (the policy's plain steps would re-run the draft model
    # over the last token, which is what they must do, not a rollback to count)
    rounds = generate(
        wrap(model), prompts, drafter, k=k, max_tokens=NEW, sampler=sampler, adaptive=False
    )
    for tokens in rounds:
        for t in tokens:
            out[t.row].append(t.token)
    return model, drafter, out


@pytest.mark.parametrize(
    ("name", "batch", "pipelined"),
    [("llama", 1, False), ("llama", 3, True), ("qwen3", 1, True), ("qwen3", 3, False)],
)
def test_an_attention_draft_rolls_back_by_trimming_and_holds_exactly_the_kept_tokens(
    name, batch, pipelined
):
    prompts = PROMPTS[:batch]
    model, drafter, out = run(name, prompts, k=4, pipelined=pipelined)
    assert out == [greedy(model, p, NEW) for p in prompts]
    # No kept token ran through the draft model twice, but in a batch where some rows kept
    # their final draft (never fed) and others did not: those rows catch up with a re-run.
    assert drafter.avoidable == 0
    if batch == 1:
        assert drafter.reruns == 0
    assert drafter.seen == {"none", "partial", "all"}  # every rollback case was exercised
    assert drafter.checks >= 5


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next", "falcon_h1"])
def test_drafts_that_cannot_trim_re_run_the_kept_tokens_exactly(name):
    model, drafter, out = run(name, PROMPTS, k=3, pipelined=name == "qwen3_next")
    assert out == [greedy(model, p, NEW) for p in PROMPTS]
    assert drafter.reruns > 0
    assert "partial" in drafter.seen


def test_the_trimmed_draft_state_equals_the_re_run_one(monkeypatch):
    """Same drafts, same tokens, and after every round the same draft state (the entries a
    state holds; the trimmed one keeps rejected entries past its length, as mlx-lm's trim
    does) whether the proposing state was trimmed or the kept tokens were run again."""

    def states(trims: bool) -> tuple[list[Any], list[list[int]]]:
        monkeypatch.setattr(drafter_module, "rolls_back_by_trim", lambda state: trims)
        draft = ModelDrafter(wrap(tiny_model("llama", scale=3.0)))
        after: list[Any] = []
        accept = draft.accept

        def recording(fed: mx.array, kept: list[int]) -> None:
            accept(fed, kept)
            after.append((draft.state, draft.pending))

        draft.accept = recording  # type: ignore[method-assign]
        out = [
            [t.token for t in r]
            for r in generate(wrap(tiny_model("llama")), PROMPTS[:1], draft, k=4, max_tokens=NEW)
        ]
        return after, out

    trimmed, out = states(True)
    rerun, same = states(False)
    assert out == same
    assert len(trimmed) == len(rerun) > 3
    for i, ((a, pa), (b, pb)) in enumerate(zip(trimmed, rerun, strict=True)):
        assert (pa is None) == (pb is None), f"round {i}"
        if pa is not None:
            assert pa.tolist() == pb.tolist()
        for j, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
            assert x.length == y.length, f"round {i} layer {j}"
            used = (slice(None), slice(None), slice(0, x.length))
            assert_states_allclose(
                (x.keys[used], x.values[used]),
                (y.keys[used], y.values[used]),
                rtol=1e-4,
                atol=1e-4,
                what=f"round {i} layer {j}",
            )


def test_sampled_drafting_keeps_the_draft_state_exact():
    """With a temperature the drafts are random: the trimmed state must still hold exactly
    the kept tokens (the oracle check runs before every proposal)."""
    _, drafter, out = run("llama", PROMPTS, k=3, sampler=Sampler(temperature=1.0))
    assert all(len(o) == NEW for o in out)
    assert drafter.avoidable == 0 and drafter.checks >= 5
    assert "partial" in drafter.seen or "none" in drafter.seen


def test_which_drafts_trim():
    assert drafter_module.rolls_back_by_trim(wrap(tiny_model("llama")).init_state())
    for name in ("gemma3_text", "qwen3_next", "mamba2", "falcon_h1"):
        state = wrap(tiny_model(name))(mx.array([[1, 2]]), wrap(tiny_model(name)).init_state())[1]
        assert not drafter_module.rolls_back_by_trim(state), name
