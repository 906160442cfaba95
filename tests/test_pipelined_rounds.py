"""The plain steps the drafting policy chooses inside `generate` run pipelined, as plain
decoding does (`_generate._rounds`): the next step's forward is built before this step's
tokens are read. On the 2-core CPU the synchronous loop ran at 0.77-0.85x of plain decoding
(benchmarks/probes/plain_steps_in_rounds.py), below issue 24's floor of 0.97x. The tokens
stay the plain decode's: greedy and sampled, rows ending at their eos or budget mid-run."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import CostAwarePolicy, FixedCost, NGramDrafter, Sampler, generate

from .helpers import ScriptedDrafter, built_ahead, logged_forwards_and_reads

PROMPTS = [[3, 17, 42, 59, 7, 25, 31, 8, 12, 6, 5], [10, 11, 12], [7, 7, 40, 41, 42, 7, 7]]


@pytest.fixture(scope="module")
def target() -> Any:
    return wrap(tiny_model("llama", num_hidden_layers=2, vocab_size=64, scale=3.0))


def drafts_never_pay() -> CostAwarePolicy:
    """A policy that takes plain steps but for its probes (a verify costs 100 steps; probes
    not priced, `probe_budget=math.inf`: priced, none would come within a run here)."""
    return CostAwarePolicy(cost=FixedCost(lambda w: 100.0, plain=1.0), probe_budget=math.inf)


def rows_of(target: Any, drafter: Any, **options: Any) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in PROMPTS]
    for r in generate(target, PROMPTS, drafter, **options):
        for t in r:
            rows[t.row].append(t.token)
    return rows


def test_a_plain_run_builds_each_forward_before_reading_the_last_tokens(target, monkeypatch):
    """Each plain step's forward is fed the last step's tokens before they are read: the
    read that follows a forward returns what that forward was fed (a synchronous loop reads
    each step's tokens right after its own forward, which was fed the ones before)."""
    events = logged_forwards_and_reads(target, monkeypatch)
    plain = [[1] * 40]  # wrong drafts (mostly): the probes are rejected
    rounds = generate(target, PROMPTS[:1], ScriptedDrafter(plain, 0.0), max_tokens=40,
                      policy=drafts_never_pay())  # fmt: skip
    list(rounds)
    monkeypatch.undo()
    ahead = built_ahead(events)
    assert ahead >= 25, ahead  # ~36 plain steps, each built before the last one's read


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "t=1"])
def test_plain_runs_give_the_plain_decodes_tokens_as_rows_end(target, sampler):
    """Rows end at their eos (a token the plain decode emits) and at the budget, mid-run."""
    plain = rows_of(target, None, max_tokens=30, sampler=sampler, seed=4)
    eos = [plain[1][9]]  # row 1 ends at its 10th token (or earlier), the others run on
    want = rows_of(target, None, max_tokens=30, sampler=sampler, seed=4, eos=eos)
    assert len(want[1]) <= 10 < max(len(r) for r in want)
    for drafter in (NGramDrafter(), ScriptedDrafter(want, 0.5)):
        got = rows_of(target, drafter, max_tokens=30, sampler=sampler, seed=4, eos=eos,
                      policy=drafts_never_pay())  # fmt: skip
        assert got == want, type(drafter).__name__
    # and under the default policy, whose timings decide between plain runs and verifies
    got = rows_of(target, NGramDrafter(), max_tokens=30, sampler=sampler, seed=4, eos=eos)
    assert got == want


def test_the_policy_times_a_pipelined_plain_step_not_the_first_of_a_run(target):
    """The first plain step of a run is observed before it was waited for (its timing would
    be the host's building alone): untimed. A plain step built while the one before ran is
    timed (its round spans a whole pipelined step), as every verify is."""
    policy = drafts_never_pay()
    seen: list[tuple[int, bool]] = []  # (span, timed) of each round, in order
    observe = policy.observe

    def logged(accepted: Any, width: Any = None, *, timed: bool = True) -> None:
        seen.append((policy.last.span if policy.last else 0, timed))
        observe(accepted, width, timed=timed)

    policy.observe = logged  # type: ignore[method-assign]
    rows_of(target, ScriptedDrafter([[1] * 60] * 3, 0.0), max_tokens=60, policy=policy)
    untimed = [i for i, (_, timed) in enumerate(seen) if not timed]
    assert len(untimed) >= 3  # the first round and one after each probe, at least
    for i in untimed:  # a plain round after a verify (or the first round)
        assert seen[i][0] == 0 and (i == 0 or seen[i - 1][0] > 0), (i, seen)
    runs = [i for i in range(1, len(seen) - 2) if seen[i][0] == 0 == seen[i - 1][0]]
    assert len(runs) >= 30 and all(seen[i][1] for i in runs), seen
