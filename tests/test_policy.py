"""The cost-aware drafting policy (`CostAwarePolicy`): its choices for scripted acceptance
histories and cost ratios against the closed form of its rule (expected tokens per unit of
cost, maximised over the span), its cost estimates from scripted, noisy timings, and the
generator's output under its decisions: the greedy tokens (every drafter, batches, trees) and
the target's sampling distribution (exact tests, `stats`)."""

from __future__ import annotations

import math
import random
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import (
    CostAwarePolicy,
    CostModel,
    DraftTree,
    FixedCost,
    ModelDrafter,
    MTPDrafter,
    NGramDrafter,
    Sampler,
    generate,
    tree_of_paths,
)

from .helpers import ScriptedDrafter
from .stats import binomial_test, chi2_sf, conditional_chi2
from .test_mtp_drafter import TargetHead
from .test_speculative import greedy

ALPHA = 1e-4
K = 8


def leaves(tree: DraftTree) -> list[list[int]]:
    """A tree's root-to-leaf paths, as tokens."""
    out = []
    for leaf in (i for i in range(len(tree.tokens)) if i not in set(tree.parents)):
        path, at = [], leaf
        while at != -1:
            path.append(tree.tokens[at])
            at = tree.parents[at]
        out.append(path[::-1])
    return out


def linear(slope: float, overhead: float = 0.0) -> FixedCost:
    return FixedCost(lambda w: 1.0 + overhead + slope * w)


def closed_form(alphas: list[float], cost: FixedCost, most: list[int], k: int = K) -> int:
    """The span maximising sum over rows of (1 - a**(w'+1)) / (1 - a), w' = min(w, most[b]),
    over cost(w): the rule written independently of the policy's loop (first best wins)."""

    def tokens(a: float, n: int) -> float:
        return float(n + 1) if a == 1 else (1 - a ** (n + 1)) / (1 - a)

    scores = [
        sum(tokens(a, min(w, m)) for a, m in zip(alphas, most, strict=True)) / cost.ratio(1, w)
        for w in range(min(k, max(most)) + 1)
    ]
    return max(range(len(scores)), key=lambda w: (scores[w] - 1e-9 * w, -w))


def history(policy: CostAwarePolicy, rows: list[list[tuple[int, int]]]) -> None:
    """Rounds of (drafted, accepted) per row, fed to the policy as the generator does."""
    for round_ in zip(*rows, strict=True):
        room = [100] * len(round_)
        policy.depth(K, room, cheap=True)
        policy.cut([d for d, _ in round_], room)
        policy.last = policy.last._replace(probe=False)  # type: ignore[union-attr]
        policy._pending = ([d for d, _ in round_], [None] * len(round_))
        policy.observe([a for _, a in round_])


def probe_rounds(policy: CostAwarePolicy, rounds: int, kept: int = 0) -> list[int]:
    """`rounds` rounds of a row offered 8 drafts, each probe keeping `kept` of its drafts:
    the rounds that probed (every round that verifies a draft must be a probe)."""
    out = []
    for i in range(rounds):
        span = max(policy.cut([K], [1000]))
        assert policy.last is not None and (span == 0 or (policy.last.probe and span <= 2))
        if span:
            out.append(i)
        policy.observe([min(span, kept)])
    return out


@pytest.mark.parametrize("slope", [0.02, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("rate", [0.0, 0.2, 0.5, 0.8, 0.95, 1.0])
def test_the_span_maximises_expected_tokens_per_unit_of_cost(rate, slope):
    """A row whose drafts were accepted at `rate` (scripted rounds of 8 drafts) at cost
    1 + slope * w: the span chosen is the closed form's for the acceptance it estimates, and
    the estimate follows the history."""
    rng = random.Random(7)
    policy = CostAwarePolicy(cost=linear(slope))
    policy.begin(1)
    rounds = []
    for _ in range(30):
        a = next((i for i in range(K) if rng.random() >= rate), K)
        rounds.append((K, a))
    history(policy, [rounds])
    alpha = policy.acceptance[0]
    want = closed_form([alpha], linear(slope), [K])
    got = policy.cut([K], [100])
    assert max(got) == want, (alpha, got, want)
    assert policy.last is not None and policy.last.span == want
    if rate in (0.0, 1.0):
        assert abs(alpha - rate) < 0.1


def test_it_drafts_when_drafts_pay_and_stops_when_they_do_not():
    policy = CostAwarePolicy(cost=linear(0.1))
    policy.begin(1)
    history(policy, [[(K, K)] * 10])
    assert policy.cut([K], [100]) == [K]  # every draft accepted, cheap verifies: all
    history(policy, [[(K, 0)] * 30])
    assert policy.cut([K], [100]) == [0]  # every draft rejected lately: a plain step
    # acceptance 0.5: drafting pays at a cost of 0.1 per draft, not at 0.6 per draft
    for slope, drafts in ((0.1, True), (0.6, False)):
        policy = CostAwarePolicy(cost=linear(slope))
        policy.begin(1)
        history(policy, [[(2, 1)] * 20])
        assert (max(policy.cut([K], [100])) > 0) is drafts, (slope, policy.acceptance)


def test_the_room_left_caps_the_drafts():
    policy = CostAwarePolicy(cost=linear(0.01))
    policy.begin(2)
    history(policy, [[(K, K)] * 5, [(K, K)] * 5])
    assert policy.cut([K, K], [3, 100]) == [2, K]  # row 0 may emit 3 more: 2 drafts
    assert policy.depth(K, [1, 1]) == 0  # no row can use a draft


def test_rows_that_draft_and_rows_that_do_not_share_the_span_that_pays_the_batch():
    """One verify feeds every row 1 + span tokens: the span maximises the batch's expected
    tokens over its cost; rows with nothing drafted verify nothing."""
    cost = linear(0.15)
    policy = CostAwarePolicy(cost=cost)
    policy.begin(4)
    good, poor = [(K, K)] * 8, [(K, 0)] * 8
    history(policy, [good, poor, poor, poor])
    alphas = policy.acceptance
    want = closed_form(alphas, cost, [K, K, K, 0])
    got = policy.cut([K, K, K, 0], [100] * 4)
    assert want > 0 and got == [want, want, want, 0], (alphas, got, want)
    # more poor rows make the same verify dearer per token: four of them at a steeper cost
    cost = linear(0.6)
    policy = CostAwarePolicy(cost=cost)
    policy.begin(4)
    history(policy, [[(K, 4)] * 8, poor, poor, poor])
    assert max(policy.cut([K] * 4, [100] * 4)) == closed_form(policy.acceptance, cost, [K] * 4)


def test_held_back_rows_probe_more_rarely_after_failed_probes_and_resume_after_recovery():
    """All drafts rejected: plain steps, but for probes spaced `probe`, 2 * probe, 4 *
    probe... rounds apart; once a probe is accepted, the row drafts again (probes not priced:
    `probe_budget=math.inf`)."""
    policy = CostAwarePolicy(cost=linear(0.2), probe=4, probe_most=16, probe_budget=math.inf)
    policy.begin(1)
    history(policy, [[(K, 0)] * 6])
    probes = probe_rounds(policy, 60)
    gaps = np.diff(probes).tolist()
    assert gaps[:3] == [8, 16, 16] and all(g == 16 for g in gaps[3:]), probes
    # the drafter recovers: the next probe keeps its drafts, and drafting resumes
    recovered = []
    for _ in range(40):
        span = max(policy.cut([K], [1000]))
        policy.observe([span])
        recovered.append(span)
    first = next(i for i, s in enumerate(recovered) if s)
    assert first < 16 and all(s > 0 for s in recovered[first:]), recovered
    assert recovered[-1] == K


def test_probes_that_keep_a_draft_but_leave_drafts_unpaid_still_grow_apart():
    """A poor drafter's probe keeps a draft now and then: where verifies are dear (0.6 of a
    plain step a draft) one of two drafts kept does not make drafts pay, so the probes keep
    growing apart (they used to come back to every `probe` rounds after any draft kept)."""
    policy = CostAwarePolicy(cost=linear(0.6), probe=4, probe_most=32, probe_budget=math.inf)
    policy.begin(1)
    history(policy, [[(K, 0)] * 6])
    probes = probe_rounds(policy, 120, kept=1)  # each probe keeps 1 of its 2 drafts
    gaps = np.diff(probes).tolist()
    assert gaps[:3] == [8, 16, 32] and all(g == 32 for g in gaps[3:]), probes


def test_probes_are_priced_as_rounds_are():
    """Where a verify of 2 drafts costs 1.7 plain steps (the hybrid on the 2-core CPU) and
    drafts are rejected, a probe is expected to lose ~0.7 plain steps: at `probe_budget`
    0.01, once the first probe (after `probe` rounds, not priced: the drafts paid lately)
    has failed, they stay ~60 rounds apart (the doubling from `probe` cost ~2-3% of the time
    on the CPU at p = 0.2); where a verify costs ~1.15 plain steps (the H200), a probe loses
    little (0.07 plain steps: 7 rounds) and they come `probe`, 2 * `probe`, ... rounds apart
    as before."""

    def probes(cost: FixedCost) -> list[int]:
        policy = CostAwarePolicy(cost=cost, probe=8, probe_most=64)
        policy.begin(1)
        history(policy, [[(K, 0)] * 6])
        return probe_rounds(policy, 200)

    dear, cheap = probes(linear(0.2, overhead=0.3)), probes(linear(0.03, overhead=0.1))
    assert dear[0] == 7 and all(60 <= g <= 64 for g in np.diff(dear)), dear
    assert cheap[0] == 7 and np.diff(cheap).tolist()[:3] == [16, 32, 64], cheap


def test_no_probe_in_the_last_tokens():
    """A probe's finding pays back over the rounds after it: none in a row's last `probe`
    tokens (at 128 tokens the doubling schedule put the fourth probe at round ~125, its
    finding used by none)."""
    policy = CostAwarePolicy(cost=linear(0.03, overhead=0.1), probe=4, probe_budget=math.inf)
    policy.begin(1)
    history(policy, [[(K, 0)] * 6])
    for _ in range(3):
        assert policy.cut([K], [1000]) == [0]
        policy.observe([0])
    assert policy.cut([3], [4]) == [0]  # a probe is due, but 4 tokens are left
    assert policy.last is not None and not policy.last.probe
    assert policy.depth(K, [4]) == 0  # nor asked for
    policy.plain(1)
    policy.observe([0])
    assert policy.cut([K], [100]) == [2] and policy.last.probe  # due, with room left


def test_a_drafter_confidence_label_with_good_history_lifts_a_row():
    """Labels (an n-gram match's length and count) carry their own acceptance: a row whose
    drafts failed lately (short matches) still drafts after a label whose drafts were
    accepted on another row (long matches), and not after its failing one."""
    cost = linear(0.2)
    policy = CostAwarePolicy(cost=cost)
    policy.begin(2)
    for _ in range(20):  # row 0: long matches, accepted; row 1: short ones, rejected
        policy.depth(K, [100, 100], cheap=True)
        policy.cut([4, 4], [100, 100], [(3, 3), (1, 1)])
        policy.observe([4, 0])
    assert policy.cut([0, 4], [100, 100], [None, (1, 1)]) == [0, 0]
    assert policy.cut([0, 4], [100, 100], [None, None]) == [0, 0]
    policy.observe([0, 0])
    assert policy.cut([0, 4], [100, 100], [None, (3, 3)]) == [0, 4]
    policy.observe([0, 4])


def test_a_plain_step_is_known_ahead_only_when_no_label_would_pay():
    """`plain_ahead` (the generator's pipelined plain steps): a plain step when the rows'
    acceptance says drafts do not pay and no confidence label learnt would pay either; a row
    whose own drafts fail, beside a label whose drafts were accepted, keeps the proposal
    (its cut may draft after that label)."""

    def learnt(labels: list, first_row_accepts: bool) -> CostAwarePolicy:
        # a plain step of 1 s: proposals (microseconds apart) make the drafter cheap
        cost = FixedCost(lambda w: 1.3 + 0.2 * w, plain=1.0)
        policy = CostAwarePolicy(cost=cost, probe=64)
        policy.begin(2)
        for _ in range(20):  # row 1's drafts rejected; row 0's accepted or not
            policy.depth(K, [100, 100], cheap=True)
            counts = policy.cut([4, 4], [100, 100], labels)
            policy.observe([counts[0] if first_row_accepts else 0, 0])
        policy.keep([1])  # the row whose own drafts fail stays
        return policy

    failing = learnt([(3, 3), (1, 1)], False)  # every label's drafts failed
    assert failing.plain_ahead(K, [100])
    assert failing.last is not None and failing.last.span == 0  # noted plain
    assert not learnt([(3, 3), (1, 1)], True).plain_ahead(K, [100])  # (3, 3) pays


def test_every_decision_says_why():
    """`Decision.reason`: the rule's span ("drafts pay"), the rule's plain step ("drafts do
    not pay"), no draft or no room ("nothing drafted"), a plain step to time one
    ("calibrating"), half the span to time a second width ("exploring"), a probe."""

    def why(policy: CostAwarePolicy) -> str:
        assert policy.last is not None
        return policy.last.reason

    policy = CostAwarePolicy(cost=linear(0.2), probe=4, probe_most=16, probe_budget=math.inf)
    policy.begin(1)
    assert policy.depth(K, [1]) == 0
    policy.plain(1)
    assert why(policy) == "nothing drafted"
    policy.cut([0], [100])
    assert why(policy) == "nothing drafted"
    history(policy, [[(K, K)] * 6])
    policy.cut([K], [100])
    assert why(policy) == "drafts pay"
    history(policy, [[(K, 0)] * 30])
    reasons = []
    for _ in range(8):
        policy.cut([K], [1000])
        reasons.append(why(policy))
        policy.observe([0])
    assert set(reasons) == {"drafts do not pay", "probe"}, reasons
    assert policy.depth(K, [100], cheap=False) == 0
    policy.plain(1)
    assert why(policy) == "drafts do not pay"

    model = CostModel(overhead=0.7, slope=0.5)  # one plain step timed: calibration may run
    model.observe(1, 0, 0.010)
    for width in (1, 2, 1, 2):
        model.observe(1, width, 0.010 * (0.85 + 0.25 * width))
    policy = CostAwarePolicy(cost=model, clock=lambda: 0.0, prior=0.5)
    policy.begin(1)
    policy.plain(1)
    policy.observe([0])  # a first round (untimed: the clock stands still)
    assert policy.cut([1], [100]) == [0]  # 1 draft promises 1.5 / 1.1 < 1.5x: calibrate
    assert why(policy) == "calibrating"

    model = CostModel()  # one verify width timed: the rule's span is halved to time another
    for width, times in ((0, 3), (1, 2)):
        for _ in range(times):
            model.observe(1, width, 0.010 * (1 + 0.1 * width))
    policy = CostAwarePolicy(cost=model, clock=lambda: 0.0)
    policy.begin(1)
    history(policy, [[(K, K)] * 4])
    asked = policy.depth(K, [100], cheap=False)
    policy.cut([asked], [100])
    assert asked == K // 2 and why(policy) == "exploring"


def test_calibration_counts_the_plain_steps_of_every_batch_size():
    """Calibration (plain steps taken to time one) counts the plain steps timed at every
    batch size: in the engine's batch, rows come and go, and each batch size used to ask for
    its own three (31-48 plain rounds a run on the H100 where fixed k took none). Here 8 rows
    have three plain steps timed, 7 rows one, and both the same verifies: at 7 rows the
    drafts that pay (1.35x a plain step's tokens per unit of time, under the 1.5x beyond
    which calibration never runs) are verified, not put off for a plain step."""
    model = CostModel()
    for rows, plain in ((8, 3), (7, 1)):
        for _ in range(plain):
            model.observe(rows, 0, 0.010)
        for width, seconds in ((2, 0.013), (4, 0.015), (2, 0.013), (4, 0.015)):
            model.observe(rows, width, seconds)
    assert model.plain_timings(7) == 4 and model.widths(7) == 2
    assert model.ratio(7, 2) == pytest.approx(1.3)
    policy = CostAwarePolicy(cost=model, clock=lambda: 0.0)  # the rounds below stay untimed
    policy.begin(7)
    policy.plain(7)
    policy.observe([0] * 7)  # a first round
    assert policy.cut([K] * 7, [100] * 7) == [2] * 7
    assert policy.last is not None and policy.last.reason == "drafts pay"


def test_after_rounds_without_drafts_most_plain_steps_are_known_ahead():
    """A label learnt to pay (another row's long matches) keeps `plain_ahead` from building
    the next plain step before the proposal; once `probe` rounds in a row verified no draft
    (the rows' own labels fail, and so do the probes, which come 8, 16, 32 rounds apart),
    only every `probe`-th round and the probes wait for the proposal, the rest are plain
    ahead (pipelined)."""
    policy = CostAwarePolicy(cost=FixedCost(lambda w: 1 + 0.2 * w, plain=1.0), probe=8,
                             probe_most=64, probe_budget=math.inf)  # fmt: skip
    policy.begin(2)
    for _ in range(20):  # row 0's long matches accepted, row 1's short ones rejected
        policy.depth(K, [100, 100], cheap=True)
        counts = policy.cut([4, 4], [100, 100], [(3, 3), (1, 1)])
        policy.observe([counts[0], 0])
    policy.keep([1])
    ahead, probes = [], []
    for i in range(40):
        ahead.append(policy.plain_ahead(K, [100]))
        if not ahead[-1]:
            policy.depth(K, [100], cheap=True)
            if policy.cut([4], [100], [(1, 1)]) != [0]:
                assert policy.last is not None and policy.last.probe
                probes.append(i)
        policy.observe([0])
    assert probes == [7, 23], probes  # 8 rounds after the drafts, then 16 after that probe
    # the proposal rounds ask a cheap drafter; between them it is not asked either (so the
    # engine's round is a plain step built before the read, and the next known ahead)
    asked = []
    for _ in range(9):  # rounds 16-24 since the last probe
        asked.append(policy.depth(K, [100], cheap=True))
        if asked[-1]:
            assert policy.cut([4], [100], [(1, 1)]) == [0]
        else:
            policy.plain(1)
        policy.observe([0])
    assert asked == [K] + [0] * 7 + [K], asked
    no, yes = [False], [True]
    # rounds since drafts (or a probe): 0-7 wait, 8 waits, 9-14 ahead, 15 the probe; ...
    want = no * 8 + no * 8 + no + yes * 6 + no + no * 8 + no + yes * 7
    assert ahead == want, ahead


def test_a_calibration_plain_step_is_known_ahead_so_it_is_timed():
    """No plain step timed yet (so the drafter is not known cheap, and `depth` judges by
    the rows' acceptance), drafts that pay a little (1.35x a plain step's tokens per unit of
    time: under the 1.5x beyond which calibration never runs): the round is a plain step to
    time one, and `plain_ahead` says so, so that it is built ahead and timed, whatever a
    label promises (the drafter is not asked). It used to say no where a label paid, so the
    engine built each calibration step after the read and could not time it: 42 calibration
    rounds of ~140 on the 2-core CPU, none timed. Drafts that pay more than 1.5x keep their
    proposal."""

    def taught(drafts: list[tuple[tuple[int, int], int]]) -> CostAwarePolicy:
        model = CostModel()  # verifies of 1 and 2 drafts timed twice; no plain step
        for width, seconds in ((1, 0.012), (2, 0.013), (1, 0.012), (2, 0.013)):
            model.observe(1, width, seconds)
        policy = CostAwarePolicy(cost=model, clock=lambda: 0.0)  # the rounds stay untimed
        policy.begin(1)
        for _ in range(4):
            for label, accepted in drafts:  # 4 drafts after `label`, `accepted` of them kept
                policy.depth(K, [100], cheap=True)
                policy.cut([4], [100], [label])
                policy._pending = ([4], [label])
                policy.observe([accepted])
        return policy

    half = taught([((3, 3), 1)] * 4)  # half the drafts kept
    # a label whose drafts are all kept, beside three times as many of another all rejected
    mixed = taught([((3, 3), 4), ((1, 1), 0), ((1, 1), 0), ((1, 1), 0)])
    assert mixed._labels[(3, 3)].mean(0.5, 1.0) > 0.9 and mixed.acceptance[0] < 0.55
    for policy in (half, mixed):
        assert policy.cost.plain_timings(1) == 0
        assert policy.plain_ahead(K, [100])
        assert policy.last is not None and policy.last.reason == "calibrating"
    assert not taught([((3, 3), 4)] * 4).plain_ahead(K, [100])  # all kept: the proposal stays


def test_the_cost_model_is_robust_to_stalls_and_fits_widths_not_timed():
    """Scripted timings: a plain step 10 ms, a verify of w drafts 10 * (1.2 + 0.3 w) ms, and
    one round in four stalled 3x to 6x (a shared machine): the estimates stay within 5%,
    for widths never timed too."""
    rng = random.Random(3)
    model = CostModel()
    for _ in range(40):
        for w in (0, 2, 5):
            t = 0.010 * (1 if w == 0 else 1.2 + 0.3 * w)
            if rng.random() < 0.25:
                t *= rng.uniform(3, 6)
            model.observe(4, w, t)
    for w in (1, 2, 3, 5, 8):
        assert abs(model.ratio(4, w) - (1.2 + 0.3 * w)) < 0.05 * (1.2 + 0.3 * w), w
    assert model.ratio(4, 0) == 1.0
    assert abs(model.ratio(3, 4) - 2.4) < 0.12  # a batch size not timed: the nearest one's
    for _ in range(2):  # ... until its own plain step and verify are timed
        model.observe(3, 0, 0.010)
        model.observe(3, 4, 0.030)
    assert model.ratio(3, 4) == pytest.approx(3.0)
    # no plain step timed yet: its cost is the line's intercept over 1 + overhead
    fresh = CostModel(overhead=0.2)
    for w in (2, 4, 2, 4):  # each width timed twice: confirmed (a first timing may compile)
        fresh.observe(1, w, 0.010 * (1.2 + 0.3 * w))
    assert abs(fresh.ratio(1, 4) - 2.4) < 0.01
    assert CostModel(overhead=0.1, slope=0.05).ratio(1, 4) == pytest.approx(1.3)  # the prior


def test_one_slow_first_timing_of_a_width_does_not_price_it_out():
    """What the H200 showed at 8 rows: a plain step 10 ms, verifies of 1 draft 11.6 ms, and
    the one verify of 2 drafts timed 46 ms (its first round at that shape compiles). One
    figure is not a width's cost: it stands on the line of the confirmed widths until a
    second timing confirms it."""
    model = CostModel()
    for _ in range(3):
        model.observe(8, 0, 0.010)
    for _ in range(9):
        model.observe(8, 1, 0.0116)
    model.observe(8, 2, 0.0456)
    assert model.ratio(8, 2) < 1.3
    assert model.widths(8) == 1
    model.observe(8, 2, 0.0450)  # confirmed dear
    assert model.ratio(8, 2) == pytest.approx(4.5)
    assert model.widths(8) == 2


def test_the_policy_is_not_stuck_by_the_compile_of_a_new_width():
    """An injected clock where each verify width's first round costs 35 ms more (compiling
    its shapes), then a plain step 10 ms and a verify of w drafts 10 * (1.1 + 0.05 w) ms;
    the drafter has 1 draft a row for 30 rounds, then 4, and every draft is accepted: the
    policy ends up verifying all 4, as the costs without the compile say it should (it used
    to stay at 1 draft for good: the first timing of 2 priced 2 and more out)."""
    now = [0.0]
    policy = CostAwarePolicy(clock=lambda: now[0])
    rows, compiled = 8, set()
    policy.begin(rows)
    spans = []
    for i in range(100):
        asked = policy.depth(4, [1000] * rows)
        span = 0
        if asked:
            span = max(policy.cut([min(asked, 1 if i < 30 else 4)] * rows, [1000] * rows))
        else:
            policy.plain(rows)
        now[0] += 0.010 * (1 if span == 0 else 1.1 + 0.05 * span)
        if span not in compiled:
            compiled.add(span)
            now[0] += 0.035
        policy.observe([span] * rows)
        spans.append(span)
    assert spans[-20:] == [4] * 20, spans


def test_a_drafter_asked_for_half_the_span_verifies_all_it_was_asked_for():
    """While one verify width is timed, the rule times a second at half its span: a drafter
    that is not cheap is asked for that half, and the cut verifies every draft it asked for
    (it used to halve the proposal again: 2 drafts where the rule wanted 8, then 4)."""
    model = CostModel()
    for _ in range(3):
        model.observe(1, 0, 0.010)
    for _ in range(2):
        model.observe(1, 1, 0.011)
    policy = CostAwarePolicy(cost=model, clock=lambda: 0.0)  # the rounds below stay untimed
    policy.begin(1)
    history(policy, [[(K, K)] * 4])
    assert model.widths(1) == 1 and policy.cost_ratio(K) < 1.5  # the rule wants every draft
    asked = policy.depth(K, [100], cheap=False)
    assert asked == K // 2
    assert policy.cut([asked], [100]) == [K // 2]
    assert policy.depth(K, [100], cheap=True) == K  # a cheap drafter's proposal: halved once
    assert policy.cut([K], [100]) == [K // 2]


def test_the_cut_keeps_the_depth_judged_for_a_drafter_that_is_not_cheap():
    """Calibration is judged by the rule's span: where 2 drafts promise over 1.5x a plain
    step's tokens per unit of time but 1 draft does not, and half the span (1) is to be timed,
    the depth asks for 1 and the cut verifies it. It used to judge 1 draft's promise again
    and take a plain step to calibrate; a plain step after a proposal is not pipelined, so
    it is not timed, so the next round did the same (7 rounds in a row on the CPU)."""
    model = CostModel()
    model.observe(1, 0, 0.010)  # one plain step timed: fewer than 3, so calibration may run
    for _ in range(2):
        model.observe(1, 2, 0.0135)  # one verify width timed: the exploration halves
    policy = CostAwarePolicy(cost=model, clock=lambda: 0.0, prior=0.64)
    policy.begin(1)
    policy.plain(1)
    policy.observe([0])  # a first round, untimed (the clock stands still)
    # one width timed: every width priced at it, until a second is timed
    assert (policy.cost_ratio(1), policy.cost_ratio(2)) == pytest.approx((1.35, 1.35))
    room = [3]  # 2 drafts at most: 2.05 tokens / 1.35 > 1.5, 1.64 / 1.35 < 1.5
    asked = policy.depth(K, room, cheap=False)
    assert asked == 1
    assert policy.cut([asked], room) == [1]


def test_the_policy_times_rounds_with_its_clock():
    """An injected clock: plain steps take 10 ms, a verify of w drafts 10 * (1 + 0.5 w) ms;
    the policy's cost ratios follow them, and it stops drafting where drafts do not pay."""
    now = [0.0]
    policy = CostAwarePolicy(clock=lambda: now[0])
    policy.begin(1)
    for i in range(40):
        asked = policy.depth(K, [1000])
        span = 0
        if asked:
            span = max(policy.cut([asked], [1000]))
        else:
            policy.plain(1)
        if i < 4:  # force a few plain steps and verifies of 1 and 3 drafts to be timed
            span = [0, 1, 3, 0][i]
            policy._pending = ([span], [None])
        now[0] += 0.010 * (1 + 0.5 * span)
        policy.observe([span // 2])  # half the drafts accepted
    assert policy.cost_ratio(4) == pytest.approx(3.0, rel=0.01)
    assert policy.cost_ratio(0) == 1.0


def test_tree_mode_keeps_the_paths_and_depth_that_pay():
    """Tree mode: one path while it is right; a wider tree once the first path fails and
    the second would have been right (learnt from the rounds: what each narrower subtree
    kept is known); nothing past the room left."""
    paths = [[1, 2, 3, 4], [1, 2, 9, 9], [5, 6, 7, 8]]
    tree = DraftTree(*tree_of_paths(paths))
    policy = CostAwarePolicy(cost=linear(0.05))
    policy.begin(1)
    for _ in range(6):  # the first path is right
        kept = policy.tree(tree, 100)
        policy.observe_tree([1, 2, 3, 4, 0])
    assert kept.tokens[:4] == [1, 2, 3, 4] and 5 not in kept.tokens
    widths = []
    for _ in range(12):  # from now on the second path is
        kept = policy.tree(tree, 100)
        widths.append(len(leaves(kept)))
        policy.observe_tree([1, 2, *([9, 9] if 9 in kept.tokens else [5]), 0][:5])
    assert widths[-1] >= 2 and 9 in kept.tokens, widths
    assert all(len(p) <= 2 for p in leaves(policy.tree(tree, 3)))


class Chaotic(FixedCost):
    """Cost ratios drawn at random at every query: the policy's decisions (spans, cuts,
    plain steps, tree sizes) vary at random, independently of the target."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        super().__init__(lambda w: 1.0 + rng.uniform(0.0, 1.5) * w)


def tokens_of(rounds: Any, rows: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(rows)]
    for r in rounds:
        for t in r:
            out[t.row].append(t.token)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_every_drafter_under_random_decisions_gives_the_greedy_tokens(name):
    """Random spans, per-row cuts and plain steps (a chaotic cost), batches where rows that
    draft and rows that do not share rounds: every row's tokens are mlx-lm's greedy ones."""
    model = tiny_model(name)
    target = wrap(model)
    repetitive = [3, 17, 42, 99, 3, 17, 42, 99, 3, 17]
    prompts = [repetitive, [100, 101, 102, 5, 6], [7, 7, 40, 41, 42, 43, 7]]
    n = 24
    truth = [greedy(model, p, n + 9) for p in prompts]
    drafters: dict[str, Any] = {
        "ngram": lambda: NGramDrafter(),
        "scripted": lambda: ScriptedDrafter(truth, 0.6, seed=1),
        "model": lambda: ModelDrafter(wrap(tiny_model(name, scale=3.8))),
        "mtp": lambda: MTPDrafter(TargetHead(tiny_model(name, scale=3.8))),
    }
    for seed, (label, make) in enumerate(drafters.items()):
        policy = CostAwarePolicy(cost=Chaotic(seed), probe=2)
        g = generate(target, prompts, make(), k=4, max_tokens=n, policy=policy)
        assert tokens_of(g, 3) == [t[:n] for t in truth], label
        assert g.policy is policy and len(policy.acceptance) >= 1
    for mode in ("tree", "paths"):
        for label, drafter in (("ngram", NGramDrafter()),
                               ("model", ModelDrafter(wrap(tiny_model(name, scale=3.8))))):  # fmt: skip
            policy = CostAwarePolicy(cost=Chaotic(5), probe=2)
            g = generate(target, prompts[:1], drafter, k=4, max_tokens=n, tree=mode, policy=policy)
            assert tokens_of(g, 1) == [truth[0][:n]], (mode, label)


def test_the_default_policy_is_exact_and_exposes_its_estimates():
    model = tiny_model("llama")
    prompts = [[3, 17, 42, 99, 3, 17, 42, 99, 3, 17], [100, 101, 102, 5, 6]]
    truth = [greedy(model, p, 40) for p in prompts]
    g = generate(wrap(model), prompts, NGramDrafter(), max_tokens=32)
    assert tokens_of(g, 2) == [t[:32] for t in truth]
    policy = g.policy
    assert isinstance(policy, CostAwarePolicy) and policy.last is not None
    assert all(0 <= a <= 1 for a in policy.acceptance)
    assert policy.cost_ratio(0) == 1.0 and policy.cost_ratio(4) >= 1.0
    fixed = generate(wrap(model), prompts, NGramDrafter(), max_tokens=32, adaptive=False)
    assert fixed.policy is None and tokens_of(fixed, 2) == [t[:32] for t in truth]


def test_sampling_under_random_decisions_follows_the_target_distribution():
    """A draft model unlike the target (q != p: rejections and residual draws), k = 2, and
    random spans per generation (a chaotic cost): each row's second token is distributed
    as the target's p2(. | first), exact binomial and chi-square at 1e-4, 4000 rows."""
    vocab = 32
    shape = dict(num_hidden_layers=1, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                 head_dim=8)  # fmt: skip
    model = tiny_model("llama", scale=3.0, **shape)
    draft = wrap(tiny_model("llama", seed=1, scale=3.0, **shape))
    sampler = Sampler(temperature=1.0)
    prompt = [5, 9, 13, 17]
    target = wrap(model)
    logits, _ = target(mx.array([prompt]), target.init_state())
    p1 = np.array(sampler.probs(logits[0, -1]), np.float64)
    logits, _ = target(mx.array([[*prompt, x] for x in range(vocab)]), target.init_state(vocab))
    p2 = np.array(sampler.probs(logits[:, -1]), np.float64)
    p1, p2 = p1 / p1.sum(), p2 / p2.sum(1, keepdims=True)
    pairs, drafted = [], 0
    for s in range(10):
        policy = CostAwarePolicy(cost=Chaotic(s), probe=1)
        out: list[list[int]] = [[] for _ in range(400)]
        for r in generate(target, [prompt] * 400, ModelDrafter(draft), k=2, max_tokens=3,
                          sampler=sampler, seed=s, policy=policy):  # fmt: skip
            for t in r:
                out[t.row].append(t.token)
                drafted += t.from_draft and len(out[t.row]) == 2
        pairs += [(r[0], r[1]) for r in out]
    # some generations verified drafts (some accepted), others took plain steps
    assert 0.05 * len(pairs) < drafted < 0.95 * len(pairs), drafted
    repeats = sum(x == y for x, y in pairs)
    p_repeat = binomial_test(repeats, len(pairs), float(np.sum(p1 * np.diag(p2))))
    statistic, df = conditional_chi2(pairs, p2)
    assert p_repeat > ALPHA and chi2_sf(statistic, df) > ALPHA, (p_repeat, statistic, df)


def shadow_rounds(policy: CostAwarePolicy, rounds: int, *, state: bool) -> list[int]:
    """A cheap drafter proposes 4 drafts with one label every round, and the target's tokens
    always follow them (a repeated pattern); the label's acceptance starts low (two verifies
    that kept nothing). `state`: the drafts are given to the cut. Returns the spans."""
    spans, at = [], 0
    for _ in range(rounds):
        assert policy.depth(K, [100], cheap=True) == K
        drafts = [7 + (at + i) % 4 for i in range(4)]  # 7 8 9 10 7 8 ..., each right
        span = policy.cut([4], [100], ["L"], [drafts] if state else None)[0]
        policy.emitted([[7 + (at + i) % 4 for i in range(span + 1)]])
        at += span + 1
        policy.observe([span])
        spans.append(span)
    return spans


def test_drafts_not_verified_are_learnt_from_the_tokens_that_follow():
    """A label's acceptance learnt low (two verifies of 4 drafts that kept none) would hold
    its drafts back for good: a refused draft is never verified, so nothing contradicts the
    estimate (SmolLM2 code on the H100: the drafts of one trigram refused in rounds where
    5-6 would have been kept). With the drafts stated (`cut(..., drafts=)`) their
    acceptance is learnt from the tokens each round emits, verified or not: the label's
    drafts pay again within a few rounds. Without them they never do (probes aside)."""
    spans = {}
    for state in (True, False):
        policy = CostAwarePolicy(cost=FixedCost(lambda w: 1.5 + 0.2 * w), probe=1 << 20,
                                 probe_most=1 << 20)  # fmt: skip
        policy.begin(1)
        for _ in range(2):  # two verifies after the label that kept nothing
            policy.depth(K, [100], cheap=True)
            policy.cut([4], [100], ["L"])
            policy.observe([0])
        assert policy.cut([4], [100], ["L"]) == [0]  # refused
        policy.plain(1)
        policy.observe([0])
        spans[state] = shadow_rounds(policy, 12, state=state)
    assert spans[False] == [0] * 12
    assert spans[True][0] == 0 and spans[True][-1] == 4, spans[True]
    assert spans[True].index(4) <= 6, spans[True]


def test_a_shadowed_proposal_is_resolved_over_the_rounds_that_follow():
    """Drafts refused in one round are compared with the tokens of the next rounds, one by
    one, until one differs (or all matched): 3 of 4 drafts kept over three plain rounds,
    then a miss, counts as 3 hits of 4 tries; rows keep their own proposals across `keep`."""
    policy = CostAwarePolicy(cost=FixedCost(lambda w: 100.0), prior_weight=1e-9, memory=0.0)
    policy.begin(2)
    policy.depth(K, [100, 100], cheap=True)
    assert policy.cut([4, 2], [100, 100], ["a", "b"], [[1, 2, 3, 4], [5, 6]]) == [0, 0]
    policy.emitted([[1], [9]])  # row 1's first draft missed: 0 of 1
    policy.observe([0, 0])
    assert policy.acceptance[1] == pytest.approx(0.0, abs=1e-6)
    policy.keep([0])  # row 1 leaves; row 0's proposal stays with it
    for token in (2, 3):
        policy.plain(1)
        policy.emitted([[token]])
        policy.observe([0])
    assert policy.acceptance[0] == pytest.approx(0.5, abs=1e-6)  # still pending: the prior alone
    policy.plain(1)
    policy.emitted([[0]])  # the fourth draft missed
    policy.observe([0])
    assert policy.acceptance[0] == pytest.approx(3 / 4, abs=1e-6)


def asked_rounds(policy: CostAwarePolicy, now: list[float], rounds: int) -> int:
    """`rounds` rounds driven as `generate` drives a cheap drafter that proposes nothing: a
    plain step built ahead takes 10 ms, one that waited for the proposal 15 ms. Returns how
    many rounds asked the drafter."""
    asked, ahead = 0, False
    for _ in range(rounds):
        if not ahead:
            assert policy.depth(K, [1000], cheap=True) > 0
            policy.cut([0], [1000], [None], [[]])
            asked += 1
        now[0] += 0.010 if ahead else 0.015
        policy.observe([0])
        ahead = policy.plain_ahead(K, [999])
        policy.emitted([[5]])
    return asked


def test_rounds_that_wait_for_proposals_in_vain_stop_asking():
    """A row whose acceptance says drafts pay (three verifies that kept every draft) but
    whose drafter then proposes nothing: each round waits for the proposal, so its plain
    step runs after the read (15 ms against 10 ms built ahead) and earns one token. The
    rounds that asked are judged end to end (1 token in 1.5 plain steps' time): once the
    verifies' worth fades the policy asks only every `probe`-th round, and builds the others
    ahead. Its acceptance estimate alone would ask every round (nothing proposed, nothing
    learnt): the H100's prose, 91 of 170 rounds waiting for a proposal, 0.74x plain."""
    now = [0.0]
    policy = CostAwarePolicy(cost=FixedCost(lambda w: 1.2, plain=0.010), clock=lambda: now[0])
    policy.begin(1)
    for _ in range(3):
        policy.depth(K, [1000], cheap=True)
        policy.cut([4], [1000], ["L"], [[1, 2, 3, 4]])
        now[0] += 0.012
        policy.emitted([[1, 2, 3, 4, 5]])
        policy.observe([4])
    assert policy.acceptance[0] > 0.8
    # the verifies' worth fades (memory 0.9 a round that asked), then one round in 8 asks
    assert asked_rounds(policy, now, 32) < 32
    assert asked_rounds(policy, now, 32) == 32 // policy.probe
    assert policy.ask_worth is not None and policy.ask_worth < 0
    assert policy.acceptance[0] > 0.8  # the estimate did not move: the gate did it


def test_a_peek_past_the_read_decides_whether_the_next_round_waits_for_a_proposal():
    """After a round built ahead, the generator peeks at what a free drafter would propose
    past the last token read (`peek`). The next round waits for the drafter's proposal only
    where those drafts would pay: a label that pays peeked -> wait; nothing peeked -> the
    round is built ahead, though the best label learnt would pay (the rule without the peek
    waits then, and on code's lulls waited in vain). The peeked drafts are learnt from too."""
    policy = CostAwarePolicy(cost=FixedCost(lambda w: 1.2, plain=0.010), clock=lambda: 0.0)
    policy.begin(1)
    for _ in range(3):  # label "L" kept every draft
        policy.depth(K, [1000], cheap=True)
        policy.cut([4], [1000], ["L"])
        policy.observe([4])
    policy.plain(1)
    policy.observe([0])
    assert policy.plain_ahead(K, [999]) is False  # no peek: the best label pays, so wait
    policy.plain(1)
    policy.observe([0])
    policy.peek([0], [None], [[]])  # nothing past the read
    assert policy.plain_ahead(K, [999]) is True
    policy.emitted([[3]])
    policy.peek([4], ["L"], [[5, 6, 7, 8]])
    policy.observe([0])
    assert policy.plain_ahead(K, [999]) is False
    before = policy.acceptance[0]
    policy.emitted([[9]])  # the peeked first draft missed: learnt
    assert policy.acceptance[0] < before


def test_a_round_left_to_wait_for_a_proposal_asks_for_it_though_drafts_stopped():
    """Drafts stopped paying on the row (idle: a cheap drafter is then asked only every
    `probe`-th round), but a peek past the read shows a label that pays: `plain_ahead` leaves
    the round to wait for the proposal, and `depth` asks for it. Before, `depth`'s idle rule
    did not ask, and the round waited for nothing: an unpipelined plain step (on the H100
    1.5 pipelined ones; 16 of 190 rounds in the chat replay)."""
    ratio = [1.2]
    policy = CostAwarePolicy(cost=FixedCost(lambda w: ratio[0], plain=0.010), clock=lambda: 0.0)
    policy.begin(1)
    for _ in range(3):  # label "L" kept every draft
        policy.depth(K, [1000], cheap=True)
        policy.cut([4], [1000], ["L"])
        policy.observe([4])
    ratio[0] = 2.5  # verifies dear now: only a label as good as "L" pays
    for _ in range(20):  # "M" proposals, learnt from the tokens: every first draft missed
        if policy.depth(K, [1000], cheap=True):
            policy.cut([1], [1000], ["M"], [[9]])
        else:
            policy.plain(1)
        policy.emitted([[1]])
        policy.observe([0])
    assert policy.acceptance[0] < 0.2 and policy.depth(K, [1000], cheap=True) == 0  # idle
    policy.plain(1)
    policy.observe([0])
    policy.peek([4], ["L"], [[5, 6, 7, 8]])
    assert policy.plain_ahead(K, [999]) is False  # wait for the proposal: "L" pays
    assert policy.depth(K, [1000], cheap=True) == K


def test_the_ngram_drafters_peek_is_its_proposal_and_changes_nothing():
    """`NGramDrafter.peek` (what the policy peeks past the read): the drafts and labels its
    `propose` gives for the same rows, on the host, and nothing it states changes."""
    drafter = NGramDrafter()
    drafter.start([[1, 2, 3, 4, 1, 2], [5, 6, 7]])
    drafter.propose([9, 9], 4, Sampler())  # what it states now: nothing matched
    stated = (list(drafter.proposed), list(drafter.confidence))
    peeked = drafter.peek([3, 9], 4)
    assert (drafter.proposed, drafter.confidence) == stated
    proposal = drafter.propose([3, 9], 4, Sampler())
    assert peeked == (drafter.proposed, drafter.confidence)
    assert peeked[0] == [[4, 1, 2, 3], []] and proposal.counts == [4, 0]


def test_learning_from_the_tokens_equals_learning_from_the_verify_when_all_is_verified():
    """Where every proposal is verified whole, what `emitted` learns from the tokens (drafts
    stated) is what `observe` learnt from the accepted counts (drafts not stated): the same
    acceptance per row and per label, round after round (random proposals and outcomes)."""
    rng = random.Random(7)
    stated = CostAwarePolicy(cost=FixedCost(lambda w: 1.0), clock=lambda: 0.0)
    counted = CostAwarePolicy(cost=FixedCost(lambda w: 1.0), clock=lambda: 0.0)
    for policy in (stated, counted):
        policy.begin(2)
    for _ in range(40):
        drafts = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 4))] for _ in range(2)]
        labels = [rng.choice("ab") for _ in range(2)]
        kept = [rng.randint(0, len(d)) for d in drafts]
        tokens = [[*d[:a], 0] for d, a in zip(drafts, kept, strict=True)]  # 0: never a draft
        counts = [len(d) for d in drafts]
        for policy in (stated, counted):
            policy.depth(K, [1000, 1000], cheap=True)
        # every row's whole proposal verified (a flat cost: the longest span pays most)
        assert stated.cut(counts, [1000, 1000], labels, drafts) == counts
        assert counted.cut(counts, [1000, 1000], labels) == counts
        for policy in (stated, counted):
            policy.emitted(tokens)
            policy.observe(kept)
        assert stated.acceptance == pytest.approx(counted.acceptance)
    assert stated._alpha(0, "a") == pytest.approx(counted._alpha(0, "a"))
    assert stated._alpha(1, "b") == pytest.approx(counted._alpha(1, "b"))
