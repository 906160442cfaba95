"""The engine's plain steps run pipelined, as mlx-lm's `BatchGenerator` and `generate`'s plain
decoding do (`engine._round.run_round`): each step builds the next plain step from its own
unread tokens before reading them, so the device runs one step while the host reads, emits
and the caller streams. Rows finish, are cancelled, join and end turns into the prefix cache
between such steps; every request keeps the tokens it gets alone."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.engine import Engine, RequestParams
from kvstate.speculative import CostAwarePolicy, FixedCost, NGramDrafter, generate

from .engine_helpers import run_all
from .helpers import built_ahead, logged_forwards_and_reads

PROMPTS = [(3, 17, 42, 59, 7, 25, 31, 8, 12, 6, 5), (10, 11, 12), (7, 7, 40, 41, 42, 7, 7)]


@pytest.fixture(scope="module")
def target() -> Any:
    return wrap(tiny_model("llama", num_hidden_layers=2, vocab_size=64, scale=3.0))


def alone(target: Any, prompt: tuple[int, ...], params: RequestParams) -> list[int]:
    """The tokens of `generate([prompt])` with the request's sampler, seed and stop ids."""
    out = generate(target, [list(prompt)], max_tokens=params.max_tokens, sampler=params.sampler,
                   seed=params.seed or 0, eos=params.stop_ids)  # fmt: skip
    return [t.token for r in out for t in r]


def drafts_never_pay() -> CostAwarePolicy:
    """A policy that takes plain steps but for its probes (a verify costs 100 steps; probes
    not priced, `probe_budget=math.inf`: priced, none would come within a run here)."""
    return CostAwarePolicy(cost=FixedCost(lambda w: 100.0, plain=1.0), probe_budget=math.inf)


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_each_plain_step_is_built_before_the_last_tokens_are_read(target, monkeypatch, drafter):
    """Without a drafter every step after the first of a run is built ahead; with the n-gram
    drafter under a policy whose verifies never pay, the plain runs between its probes."""
    policy = drafts_never_pay() if drafter else None
    engine = Engine(target, NGramDrafter() if drafter else None, policy=policy)
    requests = [engine.submit(p, RequestParams(max_tokens=30)) for p in PROMPTS]
    events = logged_forwards_and_reads(target, monkeypatch)
    steps = run_all(engine)
    monkeypatch.undo()
    assert built_ahead(events) >= (25 if drafter is None else 18), (built_ahead(events), steps)
    for r in requests:
        assert r.tokens == alone(target, r.prompt, r.params)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t=1"])
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_requests_that_end_join_and_leave_mid_run_keep_their_tokens(target, temperature, drafter):
    """Rows end at a stop id and at their budgets while a step is launched ahead, requests
    arrive while others run (a join: the launched step is read, none built), one is
    cancelled between steps: each request's tokens are those it gets alone (greedy, and
    sampled with its seed: position keys one step ahead)."""
    engine = Engine(target, drafter, max_batch=3,
                    policy=drafts_never_pay() if drafter else None)  # fmt: skip
    plain = alone(target, PROMPTS[0], RequestParams(max_tokens=24, temperature=temperature, seed=5))
    params = [
        RequestParams(max_tokens=24, temperature=temperature, seed=5, stop_ids=(plain[9],)),
        RequestParams(max_tokens=7, temperature=temperature, seed=6),
        RequestParams(max_tokens=30, temperature=temperature, seed=7),
    ]
    requests = [engine.submit(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    for _ in range(4):
        engine.step()
    late = [engine.submit(p, RequestParams(max_tokens=12, temperature=temperature, seed=8 + i))
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    doomed = engine.submit((9, 9, 9), RequestParams(max_tokens=40, temperature=temperature, seed=1))
    while not doomed.tokens:
        engine.step()
    engine.step()
    engine.cancel(doomed)
    run_all(engine)
    assert doomed.finish_reason == "cancelled"
    assert requests[0].finish_reason == "stop" and len(requests[0].tokens) <= 10
    for r in [*requests, *late]:
        assert r.tokens == alone(target, r.prompt, r.params), r.id
    assert doomed.tokens == alone(target, doomed.prompt, doomed.params)[: len(doomed.tokens)]
    assert engine.stats()["running"] == 0


@pytest.mark.parametrize("end", ["stop", "length"])
def test_a_turn_end_is_cached_with_every_token_its_state_holds(target, end):
    """A row that stops at a stop id mid-run had its next step launched ahead, fed its last
    token: its turn end holds the prompt and every emitted token. A row at its budget had
    none launched (no room left): the prompt and all but its last. A next turn from either
    gets the tokens of a cold start."""
    engine = Engine(target, prefix_cache_bytes=10**8)
    stops = (alone(target, PROMPTS[0], RequestParams(max_tokens=12))[5],) if end == "stop" else ()
    first = engine.submit(PROMPTS[0], RequestParams(max_tokens=12, stop_ids=stops))
    run_all(engine)
    assert first.finish_reason == end
    turn = (*PROMPTS[0], *first.tokens, 4, 5)
    again = engine.submit(turn, RequestParams(max_tokens=12))
    run_all(engine)
    held = len(PROMPTS[0]) + len(first.tokens) - (end == "length")
    assert again.cached_tokens == held
    assert again.tokens == alone(target, turn, again.params)


class Told(CostAwarePolicy):
    """The policy, what it is told written down: each row's tokens, round after round
    (`emitted`), and how many peeks past the read came."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.streams: dict[int, list[int]] = {}
        self.peeks = 0

    def emitted(self, tokens: Any) -> None:
        for b, row in enumerate(tokens):
            self.streams.setdefault(b, []).extend(row)
        super().emitted(tokens)

    def peek(self, counts: Any, labels: Any = None, drafts: Any = None) -> None:
        self.peeks += 1
        super().peek(counts, labels, drafts)


def test_the_policy_is_told_every_rounds_tokens_and_peeks_where_rounds_are_built_ahead(target):
    """`generate` and the engine tell the policy each round's tokens (what its learning from
    unverified drafts and its end-to-end timing rest on): one request's stream of them is its
    output after the prefill's token; and in rounds built ahead they peek past the read (the n-gram drafter's `peek`)."""
    prompt = [3, 17, 42, 59, 3, 17, 42, 59, 3, 17]  # repeats: the drafter finds matches
    policy = Told(cost=FixedCost(lambda w: 100.0, plain=1.0), probe_budget=math.inf)
    out = [t.token for r in generate(target, [prompt], NGramDrafter(), max_tokens=30,
                                     policy=policy) for t in r]  # fmt: skip
    # the first token comes from the prefill, the rest from rounds
    assert len(out) == 30 and policy.streams[0][:29] == out[1:]
    assert policy.peeks > 0
    policy = Told(cost=FixedCost(lambda w: 100.0, plain=1.0), probe_budget=math.inf)
    engine = Engine(target, NGramDrafter(), policy=policy)
    request = engine.submit(prompt, RequestParams(max_tokens=30))
    run_all(engine)
    assert request.tokens == out and policy.streams[0][:29] == out[1:]
    assert policy.peeks > 0
