"""The engine under random arrivals, cancellations, prompt lengths, max_tokens, stop ids and
samplers (a hypothesis state machine per architecture): every greedy request's tokens equal
mlx-lm's `generate_step` of its prompt alone (fp32 models), whatever ran beside it and
whatever the prefix cache served; a cancelled request leaves at the next step, with its
row; the batch never holds a finished row; the drafter's rows are the batch's; the prefix
cache stays within its bound. Prompts share prefixes longer than a prefill chunk, so the
cache serves cut prefixes (llama, qwen3), block boundaries, prompt ends and turn ends
(windows, recurrent and hybrid models; every model's next turns), after ragged commits
(drafts each right with probability 0.85, counts at random), and every row kind joins a
batch of rows of other lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.engine import Engine, Request, RequestParams
from kvstate.speculative import CostAwarePolicy, FixedCost, ModelDrafter, NGramDrafter

from .engine_helpers import Oracle, OracleDrafter, expected

MOST = 7  # max_tokens at most: the oracle decodes this many
CHUNK = 5  # prefill_chunk: prompts of 12+ tokens take several steps
MAX_BATCH = 3
CACHE_BYTES = 1_500_000  # some entries: evictions happen
PREFIXES = [
    (3, 17, 42, 8, 99, 5, 61, 7, 23, 11, 4, 90),
    (3, 17, 42, 8, 99, 5, 61, 7),
    (200, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233),
    (77,),
]


class Case(NamedTuple):
    model: Any
    target: Any
    drafter: Callable[[Oracle], Any]
    kv: dict[str, Any] | None


def _case(name: str, drafter: Callable[[Oracle], Any], kv: Any = None, **over: Any) -> Case:
    model = tiny_model(name, **over)
    return Case(model, wrap(model), drafter, kv)


CASES: dict[str, Callable[[], Case]] = {
    "llama+oracle drafts": lambda: _case("llama", lambda o: OracleDrafter(o, 0.85)),
    "gemma3_text window 4+oracle drafts": lambda: _case(
        "gemma3_text", lambda o: OracleDrafter(o, 0.85), sliding_window=4
    ),
    "qwen3_next+oracle drafts": lambda: _case("qwen3_next", lambda o: OracleDrafter(o, 0.85)),
    "nemotron_h+ngram": lambda: _case("nemotron_h", lambda o: NGramDrafter()),
    "qwen3 plain": lambda: _case("qwen3", lambda o: None),
    "llama K4/V4+draft model": lambda: _case(
        "llama", lambda o: ModelDrafter(o.wrapped), {"bits": 4, "group_size": 32}, head_dim=32
    ),
}
# Cases whose rounds the cost-aware policy chooses (a scripted cost, so the examples are
# reproducible: ragged per-row cuts, plain steps, probes); the others draft at fixed k.
POLICY = {"llama+oracle drafts", "qwen3_next+oracle drafts", "nemotron_h+ngram"}
_built: dict[str, tuple[Case, Oracle]] = {}


def built(name: str) -> tuple[Case, Oracle]:
    """The case's model and its oracle, memoised across examples (the oracle's decodes too)."""
    if name not in _built:
        case = CASES[name]()
        _built[name] = case, Oracle(case.model, case.target, MOST, case.kv)
    return _built[name]


class EngineMachine(RuleBasedStateMachine):
    name = ""

    def __init__(self) -> None:
        super().__init__()
        self.case, self.oracle = built(self.name)
        self.drafter = self.case.drafter(self.oracle)
        self.engine = Engine(
            self.case.target,
            self.drafter,
            max_batch=MAX_BATCH,
            prefill_chunk=CHUNK,
            prefix_cache_bytes=CACHE_BYTES,
            kv_bits=self.case.kv,
            k=3,
            **(
                {"policy": CostAwarePolicy(cost=FixedCost(lambda w: 1.0 + 0.3 * w))}
                if self.name in POLICY
                else {"adaptive": False}
            ),
        )
        self.requests: list[Request] = []
        self.cancelled: list[Request] = []  # cancelled since the last step

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=4),
        max_tokens=st.integers(1, MOST),
        sampler=st.sampled_from(["greedy", "greedy", "t=1", "t=0.7 top_k=5 top_p=0.9"]),
        stop_at=st.one_of(st.none(), st.integers(0, MOST - 1)),
        seed=st.integers(0, 2**64 - 1),
    )
    def submit(self, prefix, suffix, max_tokens, sampler, stop_at, seed):
        prompt = (*prefix, *suffix)
        stops = () if stop_at is None else (self.oracle(prompt)[stop_at],)
        params = {
            "greedy": {},
            "t=1": {"temperature": 1.0},
            "t=0.7 top_k=5 top_p=0.9": {"temperature": 0.7, "top_k": 5, "top_p": 0.9},
        }[sampler]
        request = self.engine.submit(
            prompt, RequestParams(max_tokens=max_tokens, stop_ids=stops, seed=seed, **params)
        )
        self.requests.append(request)

    @precondition(
        lambda self: any(r.finish_reason == "length" and r.params.temperature == 0
                         for r in self.requests)
    )  # fmt: skip
    @rule(data=st.data(), more=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3))
    def continue_turn(self, data, more):
        """The next turn of a finished conversation: its prompt, its output and more (the
        prefix cache holds its turn end)."""
        done = [
            r for r in self.requests if r.finish_reason == "length" and r.params.temperature == 0
        ]
        earlier = data.draw(st.sampled_from(done))
        prompt = (*earlier.prompt, *earlier.tokens, *more)
        self.requests.append(self.engine.submit(prompt, RequestParams(max_tokens=MOST)))

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(data=st.data())
    def cancel(self, data):
        live = [r for r in self.requests if not r.finished]
        request = data.draw(st.sampled_from(live))
        self.engine.cancel(request)
        self.engine.cancel(request)  # idempotent
        self.cancelled.append(request)

    @rule()
    def step(self):
        outputs = self.engine.step()
        for out in outputs:
            assert out.finished == out.request.finished
            assert out.finish_reason == out.request.finish_reason
        reported = {out.request.id: out for out in outputs}
        for request in self.cancelled:  # freed at this step, with its row
            assert request.finished
            if request.finish_reason == "cancelled":
                assert reported[request.id].finish_reason == "cancelled"
                assert request not in self.engine.running
        self.cancelled = []

    @invariant()
    def the_batch_holds_no_finished_row(self):
        running = self.engine.running
        assert not any(r.finished for r in running)
        assert len(running) + len(self.engine.prefilling) <= MAX_BATCH
        stats = self.engine.stats()
        assert stats["running"] == len(running)
        assert (stats["running_bytes"] == 0) == (not running)
        if running:
            assert ks.batch_size(self.engine._batch.state) == len(running)
        assert stats["prefix_bytes"] <= CACHE_BYTES

    @invariant()
    def the_drafter_has_the_batchs_rows(self):
        rows = len(self.engine.running)
        drafter = self.drafter
        if isinstance(drafter, OracleDrafter) and rows:
            assert len(drafter.prompts) == rows
        if isinstance(drafter, NGramDrafter) and rows:
            assert len(drafter.history) == rows
        if isinstance(drafter, ModelDrafter) and rows:
            assert ks.batch_size(drafter.state) == rows
        policy = self.engine.policy
        assert (policy is not None) == (self.name in POLICY)
        if policy is not None:
            assert len(policy.acceptance) == rows

    @invariant()
    def greedy_requests_decode_as_alone(self):
        for request in self.requests:
            if request.params.temperature == 0:
                truth = expected(request, self.oracle(request.prompt))
                if request.finish_reason == "cancelled" or not request.finished:
                    assert request.tokens == truth[: len(request.tokens)], request
                else:
                    assert request.tokens == truth, (request, request.cached_tokens)
            else:
                assert len(request.tokens) <= request.params.max_tokens
                assert all(0 <= t < VOCAB for t in request.tokens)
            stops = request.params.stop_ids
            assert not any(t in stops for t in request.tokens[:-1])

    def teardown(self):
        steps = 0
        while self.engine.has_work():
            self.engine.step()
            steps += 1
            assert steps < 500
        self.greedy_requests_decode_as_alone()
        for request in self.requests:
            assert request.finished
            if request.finish_reason == "length":
                assert len(request.tokens) == request.params.max_tokens
            if request.finish_reason == "stop":
                assert request.tokens[-1] in request.params.stop_ids
        stats = self.engine.stats()
        assert stats["running"] == stats["queued"] == stats["prefilling"] == 0
        assert stats["running_bytes"] == 0


@pytest.mark.parametrize("name", list(CASES))
def test_the_engine_serves_random_arrivals_exactly(name):
    machine = type(f"Engine[{name}]", (EngineMachine,), {"name": name})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=10,
            stateful_step_count=30,
            derandomize=True,
            database=None,
            deadline=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
