"""A whole model's state (ModelState) through `kvstate.adapters.wrap` as a state machine.

The reference is the simplest possible one: each row's token list. The oracle is mlx-lm
itself: after every forward, row b's logits must equal those of the same random-init model
run by mlx-lm on its own fresh caches over row b's tokens (teacher forcing), and its greedy
token must agree wherever the top two logits are not a near tie. Between forwards the state
goes through every transform (ragged commits after capturing verifies included), so a
transform that loses, moves or corrupts anything a later forward needs shows up as a logit
mismatch, in every kind of layer the model has at once.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from mlx_lm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.kinds import appended_of
from kvstate.testing import accepted_counts

from ._machine import MAX_BATCH, RowMachine
from ._reference import Witness

TOL = {"rtol": 2e-4, "atol": 2e-4}


@functools.cache
def model(name: str) -> Any:
    return tiny_model(name)


@functools.cache
def oracle_logits(name: str, tokens: tuple[int, ...]) -> np.ndarray:
    """mlx-lm's logits (T, vocab) for `tokens` on fresh caches of its own."""
    logits = model(name)(mx.array([tokens]), cache=make_prompt_cache(model(name)))
    return np.array(logits[0].astype(mx.float32))


def assert_matches_oracle(name: str, logits: mx.array, rows: list[list[int]], k: int) -> None:
    """Row b's last-k logits == mlx-lm's for row b's tokens; greedy tokens agree."""
    got = np.array(logits.astype(mx.float32))
    for b, tokens in enumerate(rows):
        want = oracle_logits(name, tuple(tokens))[-k:]
        np.testing.assert_allclose(got[b, -k:], want, **TOL, err_msg=f"row {b}")
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-3
        assert (got[b, -k:].argmax(-1) == want.argmax(-1))[clear].all(), f"row {b} greedy"


class ModelMachine(RowMachine):
    name = "llama"

    @initialize(data=st.data(), batch=st.integers(1, 2), batched_prefill=st.booleans())
    def start(self, data: Any, batch: int, batched_prefill: bool) -> None:
        self.m = wrap(model(self.name))
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        self.checkpoints: Any = None
        self.partner_rows: dict[int, list[list[int]]] = {}
        self.data, self.witness = data, Witness()
        prompts = [self.prompt() for _ in range(batch)]
        if batched_prefill and batch > 1:
            # One right-padded forward with `lengths=`, as mlx-lm's batch prefill does.
            width = max(len(p) for p in prompts)
            tokens = mx.array([p + [0] * (width - len(p)) for p in prompts])
            init = self.witness.hold(self.m.init_state(batch), "init_state")
            _, state = self.m(tokens, init, lengths=[len(p) for p in prompts])
        else:
            state = self.prefill(prompts)
        self.state = self.witness.hold(state, "initial")
        self.rows = prompts
        self.pending = appended_of(state)
        # A right-padded prompt forward has no prefix of fewer tokens (its rows advanced by
        # different counts): only accepting all of it is defined, until the next forward.
        self.whole_only = batched_prefill and batch > 1
        self.last = "initial"

    def prompt(self) -> list[int]:
        return self.rng.integers(0, VOCAB, size=int(self.rng.integers(1, 6))).tolist()

    def prefill(self, prompts: list[list[int]]) -> ks.ModelState:
        """Each prompt through its own batch-1 forward, then merged (left padding)."""
        states = []
        for p in prompts:
            logits, s = self.m(mx.array([p]), self.m.init_state())
            assert_matches_oracle(self.name, logits, [p], len(p))
            states.append(self.witness.hold(s, "prefilled row"))
        return states[0] if len(states) == 1 else ks.merge(states)

    def draw_state(self, label: str, batch: int | None = None) -> ks.ModelState:
        n = batch or self.data.draw(st.integers(1, 2), label=label)
        rows = [self.prompt() for _ in range(n)]
        state = self.prefill(rows)
        self.partner_rows[id(state)] = rows
        return state

    def read_rows(self, state: Any) -> list[Any]:
        return self.rows if state is self.state else self.partner_rows[id(state)]

    def combine(self, parts: list[list[Any]], kind: str) -> list[Any]:
        return [r for p in parts for r in p]

    def gather_pending(self, indices: list[int]) -> None:
        # Rows keep the pending forward, unless a row holds fewer tokens than it appended (a
        # right-padded prompt): then every layer settles it.
        self.pending = self.kept_pending(self.pending)
        if self.checkpoints is not None:
            index = mx.array(indices)
            self.checkpoints = ks.tree_map(lambda c: c[index], self.checkpoints)

    def combined_pending(self, states: list[Any], pendings: list[int]) -> int:
        return self.kept_pending(super().combined_pending(states, pendings))

    def kept_pending(self, expected: int) -> int:
        """A layer kind may not keep a pending forward through a transform (a window whose
        one-token forward overwrote a slot, a right-padded row); then the state has none."""
        kept = appended_of(self.state)
        assert kept in (expected, 0), f"pending forward {kept}, expected {expected} or 0"
        if kept == 0:
            self.checkpoints = None
        return kept

    def forget_pending(self) -> None:
        self.checkpoints = None

    def assert_rows(self) -> None:
        pass  # checked against mlx-lm at every forward (and at teardown)

    # -- forwards ------------------------------------------------------------------------

    @rule(k=st.integers(1, 3), capture=st.booleans())
    def forward(self, k: int, capture: bool) -> None:
        tokens = self.rng.integers(0, VOCAB, size=(self.batch, k))
        out = self.m(mx.array(tokens), self.state, capture=capture)
        ks.eval(out[1])
        self.witness.check()  # a wrapped forward never changes the state it was given
        self.rows = [r + t for r, t in zip(self.rows, tokens.tolist(), strict=True)]
        assert_matches_oracle(self.name, out[0], self.rows, k)
        self.state = self.witness.hold(out[1], "forward")
        self.checkpoints = out[2] if capture else None
        self.pending, self.last = k, "forward"
        self.whole_only = False

    @precondition(lambda self: self.pending > 0)
    @rule(data=st.data())
    def commit(self, data: Any) -> None:
        if self.whole_only or (self.checkpoints is None and self.needs_checkpoints()):
            accepted: Any = self.pending  # keeping everything needs no checkpoints
        else:
            accepted = data.draw(accepted_counts(self.state), label="accepted")
        counts = [accepted] * self.batch if isinstance(accepted, int) else accepted
        self.state = self.apply(
            "commit_prefix", ks.commit_prefix, self.state, accepted, self.checkpoints
        )
        self.rows = [r[: len(r) - self.pending + c] for r, c in zip(self.rows, counts, strict=True)]
        self.pending = 0
        self.checkpoints = None

    @rule(k=st.integers(1, 3), data=st.data())
    def speculate(self, k: int, data: Any) -> None:
        """A capturing verify forward of k draft tokens, then ragged acceptance."""
        self.forward(k, capture=True)
        self.commit(data)

    def needs_checkpoints(self) -> bool:
        def recurrent(s: Any) -> bool:
            if isinstance(s, ks.ListState):
                return any(recurrent(c) for c in s.states)
            return isinstance(s, ks.RecurrentState)

        return any(recurrent(s) for s in self.state.layers)

    @precondition(lambda self: self.batch < MAX_BATCH)
    @rule(data=st.data(), first=st.booleans())
    def merge(self, data: Any, first: bool) -> None:
        super().merge(data, first)
        self.last = "merge"

    @invariant()
    def appended_matches(self) -> None:
        assert appended_of(self.state) == self.pending

    def teardown(self) -> None:
        """One more forward of one token: every row still continues as mlx-lm would."""
        if not hasattr(self, "state"):
            return
        tokens = self.rng.integers(0, VOCAB, size=(self.batch, 1))
        logits, _ = self.m(mx.array(tokens), self.state)
        rows = [r + t for r, t in zip(self.rows, tokens.tolist(), strict=True)]
        assert_matches_oracle(self.name, logits, rows, 1)


class Qwen3NextMachine(ModelMachine):
    """Attention (DenseKV) and gated delta net (RecurrentState) layers."""

    name = "qwen3_next"


class Mamba2Machine(ModelMachine):
    """Mamba2 mixers only (RecurrentState conv + SSM state)."""

    name = "mamba2"


class LlamaMachine(ModelMachine):
    """Attention only (DenseKV)."""

    name = "llama"


TestQwen3NextMachine = Qwen3NextMachine.TestCase
TestMamba2Machine = Mamba2Machine.TestCase
TestLlamaMachine = LlamaMachine.TestCase


class Gemma3Machine(ModelMachine):
    """Sliding-window (RotatingKV, window 8) and global attention (DenseKV) layers."""

    name = "gemma3_text"


class Lfm2Machine(ModelMachine):
    """Short convolutions (RecurrentState) and attention (DenseKV) layers."""

    name = "lfm2"


TestGemma3Machine = Gemma3Machine.TestCase
TestLfm2Machine = Lfm2Machine.TestCase
