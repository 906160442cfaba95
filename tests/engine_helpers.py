"""What the engine's tests share: mlx-lm's own greedy decode as the oracle, a drafter that
proposes each row's true continuation (often wrong on purpose: ragged acceptance), and a
driver that runs an engine to the end."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import kvstate as ks
from kvstate.engine import Engine, Request
from kvstate.speculative import Proposal, Sampler


class Oracle:
    """Greedy continuations of prompts decoded alone, memoised: mlx-lm's `generate_step` on
    the model's own caches, or (`kv_bits`) a one-token-a-time decode of the wrapped model on
    quantized states from the first token (mlx-lm's generate quantizes only after a prompt)."""

    def __init__(self, model: Any, wrapped: Any, n: int, kv: dict[str, Any] | None = None) -> None:
        self.model, self.wrapped, self.n, self.kv = model, wrapped, n, kv
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: tuple[int, ...]) -> list[int]:
        if prompt not in self._memo:
            self._memo[prompt] = self._decode(list(prompt))
        return self._memo[prompt]

    def _decode(self, prompt: list[int]) -> list[int]:
        if self.kv is None:
            steps = generate_step(mx.array(prompt), self.model, max_tokens=self.n)
            return [int(t) for t, _ in steps]
        state = ks.quantize(self.wrapped.init_state(), **self.kv)
        logits, state = self.wrapped(mx.array([prompt]), state)
        out: list[int] = []
        for _ in range(self.n):
            out.append(int(logits[0, -1].argmax().item()))
            logits, state = self.wrapped(mx.array([[out[-1]]]), state)
        return out


def expected(request: Request, truth: list[int]) -> list[int]:
    """What a greedy request emits given its prompt's greedy continuation `truth`: up to its
    max_tokens and through its first stop id."""
    params = request.params
    within = truth[: params.max_tokens]
    for j, t in enumerate(within):
        if t in params.stop_ids:
            return within[: j + 1]
    return within


class OracleDrafter:
    """Proposes each row's true greedy continuation (from `oracle`), each draft right with
    probability `p` (else a neighbouring id): rows accept different counts. Admits rows
    between rounds (`add_rows`), as the engine needs."""

    uses_hidden = False

    def __init__(self, oracle: Oracle, p: float, seed: int = 0) -> None:
        self.oracle, self.p = oracle, p
        self.rng = np.random.default_rng(seed)
        self.prompts: list[tuple[int, ...]] = []
        self.out: list[int] = []  # tokens kept in each row's state past its prompt

    def start(self, prompts: list[list[int]], *, key: Any = None) -> None:
        self.prompts, self.out = [], []
        self.add_rows(prompts)

    def add_rows(self, prompts: list[list[int]]) -> None:
        self.prompts += [tuple(p) for p in prompts]
        self.out += [0] * len(prompts)

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        assert len(last) == len(self.prompts)
        drafts = []
        for prompt, at in zip(self.prompts, self.out, strict=True):
            true = (self.oracle(prompt) + [0] * (k + 2))[at + 1 : at + 1 + k]
            drafts.append([t if self.rng.random() < self.p else (t + 1) % 7 for t in true])
        counts = [int(self.rng.integers(0, k + 1)) for _ in drafts]
        return Proposal(mx.array(drafts, mx.int32), counts, None)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        self.out = [o + n for o, n in zip(self.out, kept, strict=True)]

    def keep_rows(self, rows: list[int]) -> None:
        self.prompts = [self.prompts[i] for i in rows]
        self.out = [self.out[i] for i in rows]


def run_all(engine: Engine, most: int = 10_000) -> int:
    """Step `engine` until it has no work; the steps taken."""
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < most, "the engine does not finish"
    return steps
