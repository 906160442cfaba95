"""Shared test helpers: oracles built from mlx-lm's own caches."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import _merge_caches, _right_pad_prompts, generate_step
from mlx_lm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.speculative import Proposal, Sampler


def greedy_reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy decode: the oracle for token equality."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(tok) for tok, _ in steps]


def raw_logits(model: Any, tokens: list[int], chunks: list[int]) -> list[np.ndarray]:
    """Logits of mlx-lm's model on its own caches, feeding `tokens` in chunks of the given sizes."""
    caches = make_prompt_cache(model)
    out, at = [], 0
    for size in chunks:
        logits = model(mx.array([tokens[at : at + size]]), cache=caches)
        out.append(np.array(logits.astype(mx.float32)))
        at += size
    return out


def mlx_lm_batch_prefill(model: Any, prompts: list[list[int]]) -> tuple[mx.array, list[Any]]:
    """mlx-lm's batch machinery, as in PromptProcessingBatch.prompt: merged empty caches,
    right-padded prompts, prepare/finalize."""
    caches = _merge_caches([make_prompt_cache(model) for _ in prompts])
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    for c in caches:
        c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
    logits = model(_right_pad_prompts(prompts), cache=caches)
    for c in caches:
        c.finalize()
    return logits, caches


def decode_side_by_side(
    model: Any,
    wrapped: Any,
    caches: list[Any],
    state: Any,
    y: mx.array,
    steps: int,
    assert_layer: Any,
) -> set[int]:
    """Greedy 1-token steps on mlx-lm's caches and through `wrapped` from `state`: logits
    agree and `assert_layer(layer_state, cache)` holds after every step. Returns the
    distinct tokens decoded (to tell a degenerate oracle)."""
    distinct: set[int] = set()
    for _ in range(steps):
        ref = model(y, cache=caches)
        logits, state = wrapped(y, state)
        np.testing.assert_allclose(np.array(logits), np.array(ref), rtol=1e-5, atol=1e-5)
        for layer, cache in zip(state.layers, caches, strict=True):
            assert_layer(layer, cache)
        y = ref[:, -1].argmax(-1)[:, None]
        distinct.update(np.array(y).ravel().tolist())
    return distinct


def assert_teacher_forced_logits_match(
    model: Any, wrapped: Any, tokens: list[int], chunks: list[int], tol: float = 1e-4
) -> None:
    """Feed `tokens` in `chunks` through `wrapped` and through mlx-lm's own caches: the logits
    of every chunk agree."""
    state, at = wrapped.init_state(), 0
    for size, ref in zip(chunks, raw_logits(model, tokens, chunks), strict=True):
        logits, state = wrapped(mx.array([tokens[at : at + size]]), state)
        np.testing.assert_allclose(np.array(logits), ref, rtol=tol, atol=tol)
        at += size


Commit = Callable[[Any, Any, list[int], Any], Any]
"""`(state, verified, kept tokens, checkpoints) -> the state after them`."""


def commit_kept(state: Any, verified: Any, kept: list[int], checkpoints: Any) -> Any:
    """The plain commit of a speculative round: commit_prefix of the kept tokens."""
    return ks.commit_prefix(verified, len(kept), checkpoints)


def speculate_with_corrupted_oracle(
    m: Any,
    prompt: list[int],
    ref: list[int],
    n: int,
    k: int = 4,
    vocab: int = 256,
    keep: float = 0.67,
    commit: Commit = commit_kept,
) -> tuple[list[int], list[int]]:
    """A draft-and-verify loop through `m` (a wrapped model): drafts are the reference's next
    tokens, each kept with probability `keep` (else corrupted); each round verifies with
    capture=True and keeps the agreeing prefix with `commit` (commit_prefix). Returns (the
    first n emitted tokens, the commit length of every round)."""
    rng = np.random.default_rng(0)
    logits, state = m(mx.array([prompt]), m.init_state())
    y = int(logits[0, -1].argmax().item())
    out: list[int] = []
    accepted: list[int] = []
    while len(out) < n:
        out.append(y)
        at = len(out)
        draft = [
            ref[at + i] if rng.random() < keep else (ref[at + i] + 1) % vocab for i in range(k - 1)
        ]
        logits, verified, checkpoints = m(mx.array([[y, *draft]]), state, capture=True)
        preds = np.array(logits[0].argmax(-1)).tolist()
        ok = 0
        while ok < k - 1 and draft[ok] == preds[ok]:
            ok += 1
        state = commit(state, verified, [y, *draft[:ok]], checkpoints)
        accepted.append(1 + ok)
        out.extend(draft[:ok])
        y = preds[ok]
    return out[:n], accepted


class ScriptedDrafter:
    """Proposes each row's true greedy continuation, each token right with probability `p`
    (a wrong token otherwise): acceptance 0 (p=0), all (p=1), or random."""

    def __init__(self, truth: list[list[int]], p: float, seed: int = 0) -> None:
        self.truth, self.p = truth, p
        self.rng = np.random.default_rng(seed)
        self.rows = list(range(len(truth)))
        self.emitted = [1] * len(truth)  # the first token comes from the prefill

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        drafts = []
        for row, at in zip(self.rows, self.emitted, strict=True):
            true = (self.truth[row] + [0] * (k + 1))[at : at + k]
            # A wrong token inside any vocabulary that holds the true one.
            drafts.append([t if self.rng.random() < self.p else (t - 1 if t else 1) for t in true])
        return Proposal(mx.array(drafts, mx.int32), [k] * len(drafts), None)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        self.emitted = [e + n for e, n in zip(self.emitted, kept, strict=True)]

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]
        self.emitted = [self.emitted[i] for i in rows]


def second_tokens_checked(
    target: Any,
    prompt: list[int],
    sampler: Sampler,
    pairs: dict[int, list[int]],
    least: int,
    bound: float,
) -> int:
    """For each first token sampled at least `least` times, the second tokens sampled after
    it follow the target's own sampling distribution given prompt + first, within total
    variation `bound` (the wrapped `target` computes that distribution). Returns how many
    first tokens were checked."""
    checked = 0
    for first, seconds in pairs.items():
        if len(seconds) < least:
            continue
        logits, _ = target(mx.array([[*prompt, first]]), target.init_state())
        want = np.array(sampler.probs(logits[0, -1]))
        got = np.bincount(seconds, minlength=want.size) / len(seconds)
        assert 0.5 * np.abs(got - want).sum() < bound, (first, len(seconds))
        checked += 1
    return checked


class CountingModel:
    """A wrapped model that counts its plain forwards (a draft model's re-runs show up here).
    `chain`: pass the wrapped model's `chain` through; without it a ModelDrafter drafts call
    by call, and those calls are counted too."""

    def __init__(self, wrapped: Any, chain: bool = False) -> None:
        self.wrapped, self.calls = wrapped, 0
        if chain:
            self.chain = wrapped.chain

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.wrapped(*args, **kwargs)

    def init_state(self, *args: Any) -> Any:
        return self.wrapped.init_state(*args)


def two_rows_through_a_ragged_commit(
    m: Any,
    state: Any,
    steps: list[list[int]],
    drafts: list[list[int]],
    counts: list[int],
    after: list[list[int]],
) -> tuple[list[list[np.ndarray]], Any]:
    """A two-row `state` decodes `steps` (one token a row per step), verifies `drafts` and
    keeps `counts` of them per row (`commit_prefix`, checked), then decodes `after`: each
    row's logits (1, V) of every step, and the final state."""
    got: list[list[np.ndarray]] = [[], []]

    def step(tokens: tuple[int, int]) -> None:
        nonlocal state
        logits, state = m(mx.array([[tokens[0]], [tokens[1]]]), state)
        for r in range(2):
            got[r].append(np.array(logits[r]))

    for pair in zip(*steps, strict=True):
        step(pair)
    _, verified = m(mx.array(drafts), state)
    state = ks.check(ks.commit_prefix(verified, counts))
    for pair in zip(*after, strict=True):
        step(pair)
    return got, state


def logged_forwards_and_reads(target: Any, monkeypatch: Any) -> list[tuple[str, Any]]:
    """Every forward of `target` ("forward", its tokens) and every read of an array ("read",
    its values), in order, from now until `monkeypatch` is undone."""
    events: list[tuple[str, Any]] = []
    forward, real = type(target).__call__, mx.array.tolist

    def logged_forward(self: Any, tokens: Any, *a: Any, **k: Any) -> Any:
        events.append(("forward", tokens))
        return forward(self, tokens, *a, **k)

    def logged_read(a: mx.array) -> Any:
        values = real(a)
        events.append(("read", values))
        return values

    monkeypatch.setattr(type(target), "__call__", logged_forward)
    monkeypatch.setattr(mx.array, "tolist", logged_read)
    return events


def built_ahead(events: list[tuple[str, Any]]) -> int:
    """How many one-token forwards were fed exactly the values the read right after them
    returned: a step built from the last step's tokens before they were read (a synchronous
    loop reads each step's tokens after its own forward, which was fed the ones before)."""
    ahead = 0
    for (kind, fed), (then, values) in itertools.pairwise(events):
        if kind == "forward" and then == "read" and isinstance(fed, mx.array):
            ahead += fed.shape[-1] == 1 and np.array(fed).reshape(-1).tolist() == values
    return ahead
