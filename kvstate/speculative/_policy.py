"""The cost-aware drafting policy: how many drafts each round verifies (0: a plain step), and
in tree mode how wide a tree, chosen to maximise the expected tokens per unit of time.

Per row, a running estimate of the drafter's per-draft acceptance (the chance that a draft
is accepted given the ones before it were): a Beta posterior over its recent drafts (older
ones weigh `memory` per draft verified since), refined by the drafter's confidence where it states one
(`Drafter.confidence`: a label per row, e.g. the n-gram match's length and count: a row's
acceptance after a label is learnt from its own drafts of that label, starting from every
row's). A row that expects `alpha` per draft
emits 1 + alpha + ... + alpha**w tokens from w drafts.

Per width w, what a round verifying w drafts costs relative to a plain step: timed online
(`CostModel`): each round's wall time from its proposal to its verdict, kept per batch size
and width as the least of the last few (a shared machine's noise only ever adds time),
and extended to widths not yet timed by a line fitted robustly (Theil-Sen) to the timed
ones; a prior line only until the first timings.

A verify feeds every row 1 + span tokens, so a round's cost is set by its widest row: the
round picks the span w maximising sum over rows of E[tokens of row b | min(w, drafted[b])]
divided by cost(w), and every row drafts up to w. The held-back rows (span 0) probe on
rounds spaced `probe`, 2 * `probe`, ... rounds apart (doubling after a probe after which drafts
still do not pay, back to `probe` after one after which they do), so the policy resumes
drafting when the drafter recovers. After a probe that failed, probes are priced as any
round is: where one is expected to cost `loss` plain steps more than its tokens are worth (a
verify dear against a plain step, drafts rarely kept), they stay at least
`loss / probe_budget` rounds apart (so they spend about `probe_budget` of the time at most);
and none is taken in a row's last `probe` tokens, too few rounds to use what it finds.

Exact by construction: the policy only chooses how many of the drafts to verify, from what
happened in earlier rounds and the drafter's deterministic confidence (never from a sampled
draft's own probability), so every token is still the target's (greedy) or distributed as
the target's (sampling).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from .. import StateError
from ._drafter import DraftTree
from ._trees import root_to_leaf_paths, tree_of_paths

Clock = Callable[[], float]


class Decision(NamedTuple):
    """What the policy chose for a round, and why.

    asked: the depth the drafter was asked for (0: not asked; a plain step).
    counts: the drafts each row verifies (after the policy's cut).
    span: max(counts): the verify's width (0: a plain step); a tree round: its nodes.
    expected: the expected tokens of the round (all rows), for that span.
    ratio: the estimated cost of the round relative to a plain step.
    probe: whether it was a probe of held-back rows.
    reason: why that span: "drafts pay" (the span the rule chose),
    "drafts do not pay" (a plain step by the rule), "nothing drafted" (no row had a draft
    or room for one), "calibrating" (a plain step to time one), "exploring" (half the
    rule's span, to time a second width), "probe" (held-back rows tried).
    """

    asked: int
    counts: list[int]
    span: int
    expected: float
    ratio: float
    probe: bool
    reason: str = "drafts pay"


class CostModel:
    """The cost of a round that verifies `width` drafts over `rows` rows, relative to a plain
    step over as many rows, from timings (`observe`). Robust to noise: each (rows, width)
    keeps the median of its last `window` timings, and widths not yet timed follow a line
    fitted by Theil-Sen (median of pairwise slopes) to the timed ones. A width's figure is the
    least of its last `window` timings: contention on a shared machine only adds time (rounds
    measured 6x their cost were seen on 2 shared cores), so the least tracks the cost a round
    can have, and stalled rounds move nothing. Timings older than `age` rounds are dropped (a width not
    chosen lately is re-estimated from the line), and no width is estimated dearer than
    `1 + 2 * width` plain steps (its forward over 1 + width tokens, and as many draft
    steps). A verify width counts as timed once it has `confirm` timings: its first round at
    a new shape includes compiling that shape's kernels (on the H200 a first 8-row verify of
    2 drafts took 46 ms against 12 ms after), and one such figure would otherwise price the
    width out for `age` rounds (it is not chosen again, so never re-timed). Before any timing: the
    prior `1 + overhead + slope * width`; with one width timed, that width's figure for every
    width (flat: optimistic for the wider ones, until a second width is timed).
    A plain step not yet timed is estimated as the line's intercept over 1 + overhead.

    Replace it by any object with `observe(rows, width, seconds)`, `ratio(rows, width)`,
    `plain_timings(rows)`, `plain_age(rows)`, `widths(rows)`, `confirmed(rows, width)` and
    `plain_seconds(rows)` (tests script the ratios: `FixedCost`)."""

    def __init__(
        self,
        *,
        window: int = 9,
        age: int = 256,
        overhead: float = 0.1,
        slope: float = 0.05,
        confirm: int = 2,
    ) -> None:
        if window < 1 or age < 1 or overhead < 0 or slope < 0 or not 1 <= confirm <= window:
            raise StateError(
                f"CostModel: need window >= 1, age >= 1, overhead >= 0, slope >= 0, "
                f"1 <= confirm <= window; got {window}, {age}, {overhead}, {slope}, {confirm}"
            )
        self.window, self.age, self.overhead, self.slope = window, age, overhead, slope
        self.confirm = confirm
        self._times: dict[int, dict[int, deque[tuple[int, float]]]] = {}
        self._cache: dict[int, tuple[float | None, float | None, float | None]] = {}
        # `_nearest`'s and `ratio`'s answers since the last timing (asked per span per round)
        self._near: dict[int, int] = {}
        self._ratios: dict[tuple[int, int], float] = {}
        self._seen = 0

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A round over `rows` rows that verified `width` drafts took `seconds`."""
        if not seconds > 0:  # a clock that did not move (or went back): nothing learned
            return
        self._seen += 1
        table = self._times.setdefault(rows, {})
        table.setdefault(width, deque(maxlen=self.window)).append((self._seen, float(seconds)))
        if self._seen % 16 == 0:  # drop what is too old, now and then
            for t in self._times.values():
                for w in list(t):
                    while t[w] and t[w][0][0] <= self._seen - self.age:
                        t[w].popleft()
                    if not t[w]:
                        del t[w]
            self._cache.clear()
        self._cache.pop(rows, None)
        self._near.clear()
        self._ratios.clear()

    def plain_timings(self, rows: int) -> int:
        """How many plain steps are kept, over every batch size: what calibration counts (a
        batch of rows that come and go meets many batch sizes, and each used to ask for its
        own few plain steps; a plain step's figure at one is the nearest one's until its own
        plain steps come, as the policy's ordinary plain rounds and probes bring them)."""
        return sum(len(t.get(0, ())) for t in self._times.values())

    def plain_age(self, rows: int) -> int:
        """Rounds timed since the last plain step was (any batch size; large: never)."""
        last = [t[0][-1][0] for t in self._times.values() if t.get(0)]
        return self._seen - max(last) if last else 1 << 30

    def confirmed(self, rows: int, width: int) -> bool:
        """Whether `width` over `rows` rows (or the nearest batch size) has its `confirm`
        timings (a width with fewer counts as not timed)."""
        return len(self._times.get(self._nearest(rows), {}).get(width, ())) >= self.confirm

    def widths(self, rows: int) -> int:
        """How many verify widths over `rows` rows (or the nearest batch size) are timed."""
        table = self._times.get(self._nearest(rows), {})
        return sum(1 for w, t in table.items() if w > 0 and len(t) >= self.confirm)

    def plain_seconds(self, rows: int) -> float | None:
        """A plain step's seconds (lower quartile) over `rows` rows (or the nearest batch size timed)."""
        return self._fit(self._nearest(rows))[0]

    def ratio(self, rows: int, width: int) -> float:
        """cost(width) / cost(plain step), >= 1 (1 for width 0)."""
        if width <= 0:
            return 1.0
        ratio = self._ratios.get((rows, width))
        if ratio is None:
            ratio = self._ratios[rows, width] = self._priced(rows, width)
        return ratio

    def _priced(self, rows: int, width: int) -> float:
        plain, a, b = self._fit(self._nearest(rows))
        prior = 1.0 + self.overhead + self.slope * width
        if a is None or b is None:
            return prior
        if plain is None:
            plain = a / (1.0 + self.overhead)
        return min(1.0 + 2.0 * width, max(1.0, (a + b * width) / plain))

    def _nearest(self, rows: int) -> int:
        """The batch size whose timings stand for `rows`: itself once it has a plain step and
        a verify timed, else the nearest one that has, else itself."""
        near = self._near.get(rows)
        if near is None:
            near = rows
            if not _complete(self._times.get(rows, {}), self.confirm):
                complete = [r for r, t in self._times.items() if _complete(t, self.confirm)]
                if complete:
                    near = min(complete, key=lambda r: (abs(r - rows), r))
            self._near[rows] = near
        return near

    def _fit(self, rows: int) -> tuple[float | None, float | None, float | None]:
        """(plain-step median or None, intercept, slope) for `rows`' verify widths."""
        if rows in self._cache:
            return self._cache[rows]
        table = self._times.get(rows, {})
        medians = {
            w: _low([x for _, x in t])
            for w, t in table.items()
            if len(t) >= (1 if w == 0 else self.confirm)
        }
        plain = medians.pop(0, None)
        if not medians:
            fit: tuple[float | None, float | None, float | None] = (plain, None, None)
            if plain is not None:  # the prior's shape on the timed plain step
                fit = (plain, plain * (1 + self.overhead), plain * self.slope)
        elif len(medians) == 1:
            # One width timed says nothing of the slope: every width is priced at its figure
            # until a second is timed (the rule then asks for more drafts, and `_explored`
            # halves that span to time a second width). The prior's slope scaled to the width
            # priced wider spans out for good on a host-bound GPU, where a verify of 8 costs
            # what one of 1 does: the rule kept choosing the one width it had timed.
            ((_, t),) = medians.items()
            fit = (plain, t, 0.0)
        else:
            ws = sorted(medians)
            slopes = [
                (medians[j] - medians[i]) / (j - i) for x, i in enumerate(ws) for j in ws[x + 1 :]
            ]
            b = max(0.0, statistics.median(slopes))
            a = statistics.median(medians[w] - b * w for w in ws)
            fit = (plain, a, b)
        self._cache[rows] = fit
        return fit


def _low(times: list[float]) -> float:
    """The least of `times`: the noise of a shared machine only ever adds time."""
    return min(times)


def _complete(table: dict[int, Any], confirm: int) -> bool:
    """Whether a batch size has a plain step and a verify width timed (`confirm` times)."""
    return 0 in table and any(w > 0 and len(t) >= confirm for w, t in table.items())


class FixedCost:
    """A cost model with given ratios (`ratio(width)` -> cost relative to a plain step), for
    tests and for users who measured their own; timings are ignored."""

    def __init__(self, ratio: Callable[[int], float], plain: float | None = None) -> None:
        self._ratio, self._plain = ratio, plain

    def observe(self, rows: int, width: int, seconds: float) -> None:
        pass

    def plain_timings(self, rows: int) -> int:
        return 1 << 30

    def widths(self, rows: int) -> int:
        return 1 << 30

    def confirmed(self, rows: int, width: int) -> bool:
        return True

    def plain_age(self, rows: int) -> int:
        return 0

    def plain_seconds(self, rows: int) -> float | None:
        """`plain`: a plain step's seconds, against which proposals are timed (None: no
        drafter counts as cheap)."""
        return self._plain

    def ratio(self, rows: int, width: int) -> float:
        return 1.0 if width <= 0 else float(self._ratio(width))


class _Rate:
    """A decayed Beta posterior of a per-draft acceptance: `hits` of `tries`."""

    __slots__ = ("hits", "tries")

    def __init__(self) -> None:
        self.hits = 0.0
        self.tries = 0.0

    def add(self, hits: float, tries: float, memory: float) -> None:
        """`hits` of `tries` more, the old ones weighed `memory` per new try."""
        fade = memory**tries
        self.hits = self.hits * fade + hits
        self.tries = self.tries * fade + tries

    def mean(self, prior: float, weight: float) -> float:
        return (self.hits + prior * weight) / (self.tries + weight)


class _Shadow:
    """A proposal's drafts (`label`: the drafter's confidence), `matched` of them equal to
    the tokens emitted since."""

    __slots__ = ("drafts", "label", "matched")

    def __init__(self, drafts: list[int], label: Any) -> None:
        self.drafts, self.label, self.matched = drafts, label, 0


class CostAwarePolicy:
    """Chooses each round how many drafts to verify, per row (see the module docstring), and
    keeps what it measured: `acceptance` (per row), `cost_ratio(width)`, `last` (a
    `Decision`). One policy serves one generation at a time (`generate` starts it); its cost
    timings carry over to the next generation on the same model and machine.

    `cost`: a `CostModel` (default) or any object like it (`FixedCost` in tests); `clock`: the
    time source (seconds), injectable for tests; `memory`: the weight of a row's older
    drafts per draft verified since (0.9: about the last ten count); `prior` / `prior_weight`: a new row's acceptance belief
    (its mean and its weight in draft tries); `probe`: rounds between probes of held-back
    rows (doubling after a probe after which drafts still do not pay, up to `probe_most`);
    `probe_budget`: the share of the time probes may lose at most (after a failed probe, a
    probe expected to lose `loss` plain steps comes at least `loss / probe_budget` rounds
    after the last drafts, up to `probe_most`; `math.inf`: probes are not priced)."""

    def __init__(
        self,
        *,
        cost: Any = None,
        clock: Clock = time.perf_counter,
        memory: float = 0.9,
        prior: float = 0.5,
        prior_weight: float = 1.0,
        probe: int = 8,
        probe_most: int = 64,
        probe_budget: float = 0.01,
    ) -> None:
        if not (
            0 <= memory < 1
            and 0 < prior < 1
            and prior_weight > 0
            and 1 <= probe <= probe_most
            and probe_budget > 0
        ):
            raise StateError(
                "CostAwarePolicy: need 0 <= memory < 1, 0 < prior < 1, prior_weight > 0, "
                f"1 <= probe <= probe_most, probe_budget > 0; got memory={memory}, "
                f"prior={prior}, prior_weight={prior_weight}, probe={probe}, "
                f"probe_most={probe_most}, probe_budget={probe_budget}"
            )
        self.cost = CostModel() if cost is None else cost
        self.clock = clock
        self.memory, self.prior, self.prior_weight = memory, prior, prior_weight
        self.probe, self.probe_most, self.probe_budget = probe, probe_most, probe_budget
        self.last: Decision | None = None
        self._rows: list[_Rate] = []
        self._row_labels: list[dict[Hashable, _Rate]] = []  # per row, per label
        self._labels: dict[Hashable, _Rate] = {}  # acceptance per drafter confidence label
        self._widths: dict[int, _Rate] = {}  # tree mode: per tree width (paths kept)
        self._interval = probe
        self._since = 0  # rounds since a row last verified drafts
        self._rounds = 0
        self._started_at: float | None = None
        self._proposed_at: float | None = None
        self._propose_times: deque[float] = deque(maxlen=9)
        self._pending: tuple[list[int], list[Any]] | None = None
        self._tree_paths: list[list[int]] | None = None
        self._judged = False  # `depth` judged calibration and exploration for the cut
        self._probed: list[list[Any]] | None = None  # a probe's rows: their drafts' labels
        # What asking the drafter earns: per round that asked, the tokens it emitted per row
        # less its period (end to end, waits for the proposal included) in pipelined plain
        # steps; `emitted` keeps the periods and the mean (see `_asking_pays`).
        self._ask_value: float | None = None
        self._ahead_periods: deque[float] = deque(maxlen=9)
        self._last_end: float | None = None
        self._asked = False  # this round asked the drafter (`cut`)
        self._ahead_now = self._ahead_next = False  # this / the next round built ahead
        self._since_ask = 0  # rounds since the drafter was last asked
        self._peeked: list[list[Any]] | None = None  # the drafts' labels seen past the read
        self._wait_for_proposal = False  # `plain_ahead` said the round asks (`depth` does)
        # per row, the proposals whose acceptance the tokens to come will tell (`emitted`)
        self._shadows: list[list[_Shadow]] = []
        self._shadowed: list[bool] = []  # this round's rows whose proposal is shadowed
        self._why = "nothing drafted"  # why `depth` asked what it asked (`Decision.reason`)

    # -- the batch ---------------------------------------------------------------------

    def begin(self, rows: int) -> None:
        """A generation of `rows` rows starts: fresh acceptance estimates (the costs stay)."""
        self._rows = [_Rate() for _ in range(rows)]
        self._row_labels = [{} for _ in range(rows)]
        self._shadows = [[] for _ in range(rows)]
        self._shadowed = []
        self._last_end, self._asked, self._since_ask = None, False, 0
        self._ahead_now = self._ahead_next = False
        self._peeked, self._wait_for_proposal = None, False
        self._interval, self._since, self._rounds = self.probe, 0, 0
        self._pending = self._tree_paths = self._probed = None
        self._judged = False
        self._why = "nothing drafted"
        self.last = None

    def join(self, n: int) -> None:
        """`n` rows join the batch, after the current ones."""
        self._rows += [_Rate() for _ in range(n)]
        self._row_labels += [{} for _ in range(n)]
        self._shadows += [[] for _ in range(n)]

    def keep(self, alive: Sequence[int]) -> None:
        """Only the rows at positions `alive` stay, in this order."""
        self._rows = [self._rows[i] for i in alive]
        self._row_labels = [self._row_labels[i] for i in alive]
        self._shadows = [self._shadows[i] for i in alive]
        self._shadowed = []
        self._peeked = None

    # -- what it measured ----------------------------------------------------------------

    @property
    def acceptance(self) -> list[float]:
        """Each row's estimated per-draft acceptance (the chance a draft is accepted after
        the ones before it were)."""
        return [self._alpha(b, None) for b in range(len(self._rows))]

    @property
    def ask_worth(self) -> float | None:
        """What the rounds that asked the drafter lately earned per row: their tokens less
        their time in pipelined plain steps (a decayed mean; None before any). Below 0 only
        every `probe`-th round asks (`plain_ahead`)."""
        return self._ask_value

    def cost_ratio(self, width: int, rows: int | None = None) -> float:
        """The estimated cost of a round verifying `width` drafts over `rows` rows (default:
        the current batch) relative to a plain step."""
        return self.cost.ratio(len(self._rows) if rows is None else rows, width)

    # -- a round -------------------------------------------------------------------------

    def depth(self, k: int, room: Sequence[int], *, cheap: bool | None = None) -> int:
        """Before the proposal: the depth to ask the drafter for (0: do not ask; the round is
        a plain step). `k`: the most drafts a round may use; `room[b]`: the tokens row b may
        still emit. A drafter whose proposals take under 5% of a plain step (timed; `cheap`
        overrides) is asked for every draft the rows can use, and `cut` decides with its
        confidence (but while `_idle`: after `probe` rounds without drafts, it is asked only
        on every `probe`-th round or where the rows' acceptance says drafts pay); any other
        is asked for the best depth by the rows' acceptance alone (or none, but on probe
        rounds)."""
        self._started_at = self.clock()
        self._proposed_at = None
        limits = [max(0, min(k, r - 1)) for r in room]
        most = max(limits, default=0)
        if most == 0:
            self._why = "nothing drafted"
            return 0
        best, expected, ratio = self._best([[None] * d for d in limits], len(room))
        self._why = "drafts pay" if best else "drafts do not pay"
        if best and self._calibrating(len(room), expected / ratio):
            best, self._why = 0, "calibrating"
        explored = self._explored(len(room), best)
        if explored != best:
            self._why = "exploring"
        if cheap is None:
            cheap = self._cheap()
        self._judged = not cheap
        # `plain_ahead` left this round to wait for the proposal (a peek said its drafts
        # pay): asked, as it said; else the round waited for nothing (on the H100 16 plain
        # steps of 190 in the chat replay, each 1.5 pipelined ones)
        waited, self._wait_for_proposal = self._wait_for_proposal, False
        if cheap and (waited or not (explored == 0 and self._idle())):
            return most
        if explored == 0 and self._probe_due(max(room), len(room)):
            self._why = "probe"
            return min(most, 2)
        return explored

    def plain_ahead(self, k: int, room: Sequence[int]) -> bool:
        """Before a round's proposal, with no token of the last round read: whether the round
        is a plain step whatever the drafter would propose (so the caller may build it from
        the last round's unread tokens). Asks `depth` by the rows' acceptance alone (as for a
        drafter that is not cheap), and says no when the drafter's best confidence label
        learnt so far would pay for the rows (a cheap drafter's proposal is cut by its labels;
        one not known cheap is not asked); but once `probe` rounds in a row have verified no
        draft, only every `probe`-th round waits for the proposal (a round built after its
        read runs unpipelined: on the 2-core CPU the engine's prose rounds, cut to plain steps
        after the proposal in 115 of 120, ran 7% slower than plain steps built ahead), and a
        label's drafts that pay again are taken at most `probe` rounds late. Before all that,
        the rounds that asked the drafter lately are judged by what they earned, end to end
        (`_asking_pays`: their tokens against the pipelined plain steps their time would have
        run): where they lost, only every `probe`-th round asks (the labels and acceptance
        estimates know what a verify costs, not what waiting for a proposal does). Then,
        where the drafter was peeked past the last read (`peek`), the round waits for its
        proposal only where the peeked drafts would pay (not for the best label learnt), and
        the next `depth` then asks for it (idle or not).
        After True the round is noted plain here (`plain`); after False ask `depth` again."""
        # rounds since the drafter was asked, this one (not yet `emitted`) included
        since_ask = 0 if self._asked else self._since_ask + 1
        if since_ask + 1 < self.probe and not self._asking_pays():
            return self._built_ahead(len(room), clock=True)
        peeked, self._peeked = self._peeked, None
        limits = [max(0, min(k, r - 1)) for r in room]
        if peeked is not None and len(peeked) == len(room):
            # what the drafter proposed past the last read: its drafts likely go on after
            # the token being read (a match goes on where its first draft is right)
            chains = [c[:n] for c, n in zip(peeked, limits, strict=True)]
            if self._best(chains, len(room))[0] > 0:
                self._wait_for_proposal = True
                return False
            return self._built_ahead(len(room), clock=True)
        if self.depth(k, room, cheap=False) != 0:
            return False
        # A drafter not known cheap (none before a plain step is timed) is not asked when
        # `depth` says 0, so the round is plain whatever its labels promise: known now, the
        # step is built ahead and timed (built after a read it is not, and a calibration
        # step came again and again: 42 of ~140 rounds on the 2-core CPU, none timed).
        if self._labels and not self._idle() and self._cheap():
            # the cut's own rule, every row's drafts after the best label
            label = max(self._labels, key=lambda x: self._labels[x].mean(self.prior,
                                                                          self.prior_weight))  # fmt: skip
            if self._best([[label] * d for d in limits], len(room))[0] > 0:
                return False
        return self._built_ahead(len(room), clock=False)

    def _built_ahead(self, rows: int, *, clock: bool) -> bool:
        """`plain_ahead`'s yes: the round is a plain step, built before the read (`clock`:
        its round clock starts here, `depth` not having started it)."""
        if clock:
            self._started_at, self._proposed_at = self.clock(), None
            self._why = "drafts do not pay"
        self.plain(rows)
        self._ahead_next = True
        return True

    def cut(
        self,
        counts: Sequence[int],
        room: Sequence[int],
        labels: Any = None,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> list[int]:
        """After the proposal: the drafts each row verifies (`counts[b]`: row b's drafts;
        `labels`: the drafter's confidence per row, or None; `drafts`: the proposal's token
        ids per row, where the drafter states them on the host: then each row's acceptance
        is learnt from every proposal, verified or not, as the tokens that follow are told
        (`emitted`)). Records the `Decision`."""
        self._proposed_at = self.clock()
        if self._started_at is not None:
            self._propose_times.append(self._proposed_at - self._started_at)
        rows = len(counts)
        usable = [max(0, min(c, r - 1)) for c, r in zip(counts, room, strict=True)]
        row_labels = _labels_of(labels, rows)
        self._shadowed = self._shadow(drafts, usable, row_labels)
        self._asked = True
        chains = [[row_labels[b]] * usable[b] for b in range(rows)]
        span, expected, ratio = self._best(chains, rows)
        # A drafter that is not cheap was asked for what `depth` judged by the rule's own
        # span (a plain step to calibrate, or half the span to time a second width): judged
        # again on the shorter proposal, the cut would halve a halved span, or calibrate on
        # the half's promise with a plain step that follows a proposal, so is not pipelined,
        # so is never timed, round after round.
        judged, self._judged = self._judged, False
        why = "drafts pay" if span else "drafts do not pay"
        if judged and self._why in ("calibrating", "exploring"):
            why = self._why  # the proposal was asked short for it
        if not judged and span and self._calibrating(rows, expected / ratio):
            span, expected, ratio, why = 0, float(rows), 1.0, "calibrating"
        if not judged and self._explored(rows, span) != span:
            span, why = self._explored(rows, span), "exploring"
            expected = sum(self._expected(b, chains[b][:span]) for b in range(rows))
            ratio = self.cost.ratio(rows, span)
        probe = False
        self._probed = None
        if span == 0 and max(usable, default=0) > 0 and self._probe_due(max(room), rows):
            span, probe, self._probed, why = min(max(usable), 2), True, chains, "probe"
            expected = sum(self._expected(b, chains[b][:span]) for b in range(rows))
            ratio = self.cost.ratio(rows, span)
        if max(usable, default=0) == 0:
            why = "nothing drafted"
        out = [min(u, span) for u in usable]
        self.last = Decision(max(counts, default=0), out, span, expected, ratio, probe, why)
        self._pending = (out, row_labels)
        return out

    def plain(self, rows: int) -> None:
        """The round is a plain step (nothing asked or nothing drafted)."""
        # not asked (the rule, calibration, no room), or asked and nothing came back
        why = self._why if self._why in ("drafts do not pay", "calibrating") else "nothing drafted"
        self.last = Decision(0, [0] * rows, 0, float(rows), 1.0, False, why)
        self._pending = ([0] * rows, [None] * rows)

    def observe(
        self, accepted: Sequence[int], width: int | None = None, *, timed: bool = True
    ) -> None:
        """After the verify: row b accepted `accepted[b]` of the drafts it verified; `width`:
        the verify's width when not the decision's span (a tree round: its nodes). Updates
        the estimates and times the round (`timed=False`: not; the generator observes the
        first plain step of a pipelined run before it has waited for it)."""
        end = self.clock()
        counts, labels = self._pending or ([0] * len(accepted), [None] * len(accepted))
        self._pending = None
        span = max(counts, default=0) if width is None else width
        if timed and self._started_at is not None:  # a first round's warm-up errs dear
            self.cost.observe(len(accepted), span, end - self._started_at)
        self._started_at = None
        self._rounds += 1
        if span == 0:
            self._since += 1
            return
        probe = self.last is not None and self.last.probe
        self._since = 0
        shadowed, self._shadowed = self._shadowed, []
        for b, (d, a) in enumerate(zip(counts, accepted, strict=True)):
            if d and not (b < len(shadowed) and shadowed[b]):  # else `emitted` learns it
                self._learn(b, labels[b], a, a + (1 if a < d else 0))
        probed, self._probed = self._probed, None
        if probe:
            # Probes come back to every `probe` rounds once the drafts pay again, not after
            # any draft kept: a poor drafter keeps one now and then (at p = 0.2 one probe in
            # five), and each such probe brought them back to every 8 rounds, where each costs
            # half a plain step or more (a verify of 2 drafts on the CPU: 1.7 plain steps).
            if probed is not None:
                resumed = self._best(probed, len(accepted))[0] > 0
            else:  # a tree's probe
                resumed = sum(accepted) > 0
            self._interval = self.probe if resumed else min(self.probe_most, 2 * self._interval)

    def emitted(self, tokens: Sequence[Sequence[int]]) -> None:
        """The tokens each row emitted this round, in batch order (before `keep` drops the
        finished rows): they tell how many drafts of each proposal stated on the host
        (`cut(..., drafts=)`) a verify of all of them would have kept, whether the round
        verified them or not (the target's tokens are the same either way: greedy, or
        drawn as the target's), so acceptance is learnt in rounds that do not draft too.
        Before `observe` on a verify round: a probe's outcome is judged on it. Called once
        a round, after its tokens are read: it also times the round end to end."""
        self._period(sum(len(row) for row in tokens) / max(1, len(tokens)))
        for b, row in enumerate(tokens):
            if b >= len(self._shadows) or not self._shadows[b]:
                continue
            pending = self._shadows[b]
            for token in row:
                still = []
                for shadow in pending:
                    if shadow.drafts[shadow.matched] != token:
                        self._learn(b, shadow.label, shadow.matched, shadow.matched + 1)
                    elif shadow.matched + 1 == len(shadow.drafts):
                        self._learn(b, shadow.label, len(shadow.drafts), len(shadow.drafts))
                    else:
                        shadow.matched += 1
                        still.append(shadow)
                pending = still
            self._shadows[b] = pending

    def peek(self, counts: Sequence[int], labels: Any = None, drafts: Any = None) -> None:
        """A proposal made past the last read, in a round built ahead (a drafter that is free
        to ask, e.g. `NGramDrafter`): `counts`, `labels` and `drafts` as `cut` takes them.
        Nothing is verified; the next `plain_ahead` asks the drafter again (after the read)
        where these drafts would pay, and their acceptance is learnt from the tokens to come
        (their first predicts the token now in flight)."""
        rows = len(counts)
        labels_of = _labels_of(labels, rows)
        self._peeked = [[labels_of[b]] * int(counts[b]) for b in range(rows)]
        self._shadow(drafts, list(counts), labels_of)

    def _period(self, tokens: float) -> None:
        """The round that emitted `tokens` per row ended: its period (since the last round
        ended) is a pipelined plain step's where it was built ahead, and where it asked the
        drafter, the round's worth is its tokens less its period in such steps."""
        now = self.clock()
        period = None if self._last_end is None else now - self._last_end
        self._last_end = now
        ahead, asked = self._ahead_now, self._asked
        self._ahead_now, self._ahead_next, self._asked = self._ahead_next, False, False
        self._since_ask = 0 if asked else self._since_ask + 1
        if period is None or not period > 0:
            return
        if ahead:
            self._ahead_periods.append(period)
            return
        # a plain step built ahead: its period, else the cost model's (timed ahead too)
        step = (statistics.median(self._ahead_periods) if self._ahead_periods
                else self.cost.plain_seconds(len(self._rows)))  # fmt: skip
        if asked and step:
            value = tokens - period / step
            old = self._ask_value
            self._ask_value = (
                value if old is None else self.memory * old + (1 - self.memory) * value
            )

    def _asking_pays(self) -> bool:
        """Whether the rounds that asked the drafter lately emitted more tokens than
        pipelined plain steps would have in their time (unknown: yes). On the H100 a plain
        step that waited for a proposal took 1.5x one built ahead (9.9 against 6.5 ms, one
        SmolLM2 row) and a verify 1.7-2x: on prose the policy asked in 91 of 170 rounds
        for drafts it mostly did not verify, and decoded at 0.74x plain."""
        return self._ask_value is None or self._ask_value > 0

    def _shadow(self, drafts: Any, usable: list[int], labels: list[Any]) -> list[bool]:
        """Keep a proposal's first `usable[b]` drafts of each row until `emitted` tells how
        many a verify would keep; returns the rows kept (none where no drafts are stated)."""
        if drafts is None or len(drafts) != len(usable) or len(self._shadows) != len(usable):
            return []
        kept = []
        for b, (row, n) in enumerate(zip(drafts, usable, strict=True)):
            kept.append(n > 0 and len(row) >= n)
            if kept[-1]:
                self._shadows[b].append(_Shadow([int(t) for t in row[:n]], labels[b]))
        return kept

    def _learn(self, row: int, label: Any, hits: int, tries: int) -> None:
        """Row `row`'s drafter had `hits` of `tries` drafts accepted after `label`."""
        self._rows[row].add(hits, tries, self.memory)
        if label is not None:
            self._labels.setdefault(label, _Rate()).add(hits, tries, 0.99)
            self._row_labels[row].setdefault(label, _Rate()).add(hits, tries, self.memory)

    # -- tree mode ------------------------------------------------------------------------

    def tree(self, tree: DraftTree, room: int) -> DraftTree:
        """After a tree proposal (batch 1): the subtree to verify, its first m paths cut at
        depth d, (m, d) maximising expected tokens over cost (empty: a plain step). The
        expected tokens of m paths follow the per-draft acceptance learnt for trees of m
        paths (every tree round also tells what its narrower subtrees would have kept)."""
        self._proposed_at = self.clock()
        self._probed = None
        paths = root_to_leaf_paths(tree) if tree.tokens else []
        most = max(0, room - 1)
        paths = [p[:most] for p in paths if most > 0]
        best: tuple[float, int, int, int, float] = (1.0, 0, 0, 0, 1.0)
        for m in range(1, len(paths) + 1):
            alpha = self._width_alpha(m)
            for d in range(1, max(len(p) for p in paths[:m]) + 1):
                nodes = len(tree_of_paths([p[:d] for p in paths[:m]])[0])
                expected = 1.0 + sum(alpha**i for i in range(1, d + 1))
                ratio = self.cost.ratio(1, nodes)
                if expected / ratio > best[0] * (1 + 1e-9):
                    best = (expected / ratio, m, d, nodes, ratio)
        _, m, d, nodes, ratio = best
        probe = False
        if m == 0 and paths and self._probe_due(room, 1):
            m, d, probe = len(paths), min(2, max(len(p) for p in paths)), True
            nodes = len(tree_of_paths([p[:d] for p in paths])[0])
            ratio = self.cost.ratio(1, nodes)
        kept = [p[:d] for p in paths[:m]]
        self._tree_paths = kept
        expected = 1.0 + sum(self._width_alpha(max(m, 1)) ** i for i in range(1, d + 1))
        why = "probe" if probe else "drafts pay" if m else "drafts do not pay"
        self.last = Decision(len(tree.tokens), [nodes], nodes, expected if m else 1.0,
                             ratio if m else 1.0, probe, why if paths else "nothing drafted")  # fmt: skip
        self._pending = ([nodes], [None])
        return DraftTree(*tree_of_paths(kept))

    def observe_tree(self, emitted: Sequence[int]) -> None:
        """After a tree round: `emitted`, its accepted drafts then its next token. Every
        narrower subtree's acceptance is known from it (the target's tokens are)."""
        paths, self._tree_paths = self._tree_paths or [], None
        nodes = len(tree_of_paths(paths)[0]) if paths else 0
        self.observe([len(emitted) - 1], width=nodes)
        for m in range(1, len(paths) + 1):
            d = max(len(p) for p in paths[:m])
            a = max(_common(p, emitted) for p in paths[:m])
            self._widths.setdefault(m, _Rate()).add(a, a + (1 if a < d else 0), self.memory)

    # -- the rule --------------------------------------------------------------------------

    def _best(self, chains: list[list[Any]], rows: int) -> tuple[int, float, float]:
        """The span maximising expected tokens / cost over `chains` (row b's draft labels),
        with its expected tokens and cost ratio."""
        most = max((len(c) for c in chains), default=0)
        best = (0, float(rows), 1.0)
        score = float(rows)
        # Each row's expected tokens after 0 .. len(chain) drafts, in one pass per row (a
        # row with fewer drafts than w keeps its last figure).
        totals = [self._running(b, c) for b, c in enumerate(chains)]
        padded = [t + t[-1:] * (most + 1 - len(t)) for t in totals]
        by_span = [sum(col) for col in zip(*padded, strict=True)]
        for w in range(1, most + 1):
            expected = by_span[w]
            ratio = self.cost.ratio(rows, w)
            if expected / ratio > score * (1 + 1e-9):
                best, score = (w, expected, ratio), expected / ratio
        return best

    def _running(self, row: int, labels: list[Any]) -> list[float]:
        """Row `row`'s expected tokens from its first 0, 1, .. len(labels) drafts."""
        out, total, chance = [1.0], 1.0, 1.0
        seen: Any = _UNSEEN
        alpha = 0.0
        for label in labels:
            if label is not seen:  # a chain repeats one label: its acceptance looked up once
                seen, alpha = label, self._alpha(row, label)
            chance *= alpha
            total += chance
            out.append(total)
        return out

    def _expected(self, row: int, labels: list[Any]) -> float:
        """Row `row`'s expected tokens from drafts with these labels (and its next token)."""
        return self._running(row, labels)[-1]

    def _alpha(self, row: int, label: Any) -> float:
        """Row `row`'s per-draft acceptance: without a label (or one never verified), its
        own; with a label, its own drafts of that label, shrunk toward every row's drafts of
        that label (a hierarchical prior: a new label on a row is what it is elsewhere)."""
        if row >= len(self._rows):
            return self.prior
        if label is None or label not in self._labels:
            alpha = self._rows[row].mean(self.prior, self.prior_weight)
        else:
            overall = self._labels[label].mean(self.prior, self.prior_weight)
            mine = self._row_labels[row].get(label)
            alpha = overall if mine is None else mine.mean(overall, 2 * self.prior_weight)
        return min(0.995, max(0.0, alpha))

    def _width_alpha(self, m: int) -> float:
        """Tree mode: the per-draft acceptance of trees of m paths. A wider tree keeps at
        least what a narrower one does, and one never verified is given the benefit of the
        doubt (its extra path catches a draft the narrower tree misses with the prior's
        chance), so that it is tried once it might pay."""
        if m == 1:
            return (
                self._widths[1].mean(self.prior, self.prior_weight)
                if 1 in self._widths
                else self.prior
            )
        narrower = self._width_alpha(m - 1)
        # one more candidate: a draft the narrower tree misses is caught with the prior chance
        floor = narrower + (1 - narrower) * self.prior
        if m in self._widths:
            return max(narrower, self._widths[m].mean(floor, self.prior_weight))
        return floor

    def _explored(self, rows: int, span: int) -> int:
        """`span`, or half of it while fewer than two verify widths are timed (one width
        leaves the slope of cost over width unknown: the prior's would stand in for it);
        `span` itself when its half is the width timed already, so a second one is."""
        if span >= 2 and self._rounds >= 1 and self.cost.widths(rows) < 2:
            half = span // 2
            return span if self.cost.confirmed(rows, half) else half
        return span

    def _calibrating(self, rows: int, score: float) -> bool:
        """Whether to take a plain step to time one (fewer than 3 kept, or none in the last
        48 rounds: the machine's load moves) rather than draft:
        only where drafting promises under 1.5x a plain step's tokens per unit of time (an
        untimed plain step is the reference of every ratio; where drafts pay more than
        that, the estimate from the verifies' line is close enough)."""
        if self._rounds < 1 or score >= 1.5 * rows:
            return False
        return self.cost.plain_timings(rows) < 3 or self.cost.plain_age(rows) > 48

    def _idle(self) -> bool:
        """Whether `probe` rounds in a row have verified no draft, and this round is not
        every `probe`-th one: a cheap drafter is then asked only when the rows' acceptance
        says drafts pay (not for its labels' sake), so the round's plain step is known before
        the read and runs pipelined (`plain_ahead`)."""
        return self._since >= self.probe and self._since % self.probe != 0

    def _probe_due(self, left: int, rows: int) -> bool:
        """Whether held-back rows probe this round: `interval` rounds after the last drafts
        (or more, once a probe has failed, where a probe is dear: see `probe_budget`), and the
        rows have more than `probe` tokens left (`left`) to use what it finds. The first
        probe after drafts stopped is not priced: drafts paid a few rounds ago, and an
        estimate that dipped by chance (at p = 0.8 one does every few dozen rounds) would
        otherwise hold a good drafter back for `loss / probe_budget` rounds."""
        if left <= self.probe or self._since + 1 < self._interval:
            return False
        if self._interval <= self.probe:
            return True
        # a probe of 2 drafts: its cost over its tokens' worth at the rows' acceptance, in plain steps
        tokens = sum(self._expected(b, [None] * 2) for b in range(rows))
        loss = self.cost.ratio(rows, 2) - tokens / max(1, rows)
        return self._since + 1 >= min(self.probe_most, loss / self.probe_budget)

    def _cheap(self) -> bool:
        if len(self._propose_times) < 3 or not self.cost.plain_timings(len(self._rows)):
            return False
        plain = self.cost.plain_seconds(len(self._rows))
        return plain is not None and statistics.median(self._propose_times) < 0.05 * plain


def check_policy_arguments(who: str, adaptive: Any, policy: Any) -> None:
    """`adaptive` / `policy` as `generate` and the serving engine (`who`) take them: a bool,
    and a CostAwarePolicy or None, not both a policy and fixed k."""
    if not isinstance(adaptive, bool):
        raise StateError(f"{who}: adaptive must be a bool; got {adaptive!r}")
    if policy is not None and not isinstance(policy, CostAwarePolicy):
        raise StateError(
            f"{who}: policy must be a kvstate.speculative.CostAwarePolicy or None; got a "
            f"{type(policy).__name__}"
        )
    if policy is not None and not adaptive:
        raise StateError(
            f"{who}: adaptive=False verifies k drafts every round; it takes no policy "
            "(drop policy=, or adaptive=False)"
        )


_UNSEEN = object()  # no drafter label is it


def _labels_of(labels: Any, rows: int) -> list[Any]:
    """The drafter's confidence labels, one hashable per row (None: none given)."""
    if labels is None or not isinstance(labels, (list, tuple)) or len(labels) != rows:
        return [None] * rows
    out = []
    for label in labels:
        try:
            hash(label)
        except TypeError:
            label = None
        out.append(label)
    return out


def _common(path: Sequence[int], emitted: Sequence[int]) -> int:
    """The drafts of `path` a greedy target keeps given its tokens `emitted`."""
    n = 0
    for p, e in zip(path, emitted, strict=False):
        if p != e:
            break
        n += 1
    return min(n, len(emitted) - 1)
