"""One round for every running row: how many drafts it verifies (the engine's
`CostAwarePolicy`, or fixed k), the sampler and keys of this round's rows, the round itself
(`kvstate.speculative.batch_round`: a plain step, or propose / cut / verify / accept /
commit), and what each row emits: its accepted drafts and next token, cut at its own
`max_tokens` and first stop id, with their log-probabilities when asked for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx

from ..speculative import (
    CostAwarePolicy,
    Launched,
    Round,
    RoundPlan,
    RowSampler,
    Sampler,
    Target,
    batch_round,
    launch_plain,
    position_keys,
)
from ..speculative._batch_round import peek_past_read
from ._drafting import Drafting
from ._rows import Batch, Row
from ._stats import Counters


class Emitted(NamedTuple):
    """What one row emitted this round, and why it finished (None: it goes on)."""

    tokens: list[int]
    logprobs: list[float] | None
    reason: str | None


class FixedDepth:
    """The engine's drafting at fixed k (`Engine(adaptive=False)`): every round asks for
    `k` drafts (fewer near the rows' ends) and verifies what the drafter proposed; it keeps
    the counts verified (what `CostAwarePolicy.last.counts` holds for the policy)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def cut(
        self, counts: Sequence[int], room: Sequence[int], labels: Any = None, drafts: Any = None
    ) -> list[int]:
        self.counts = list(counts)
        return self.counts


def run_round(
    target: Target,
    batch: Batch,
    drafting: Drafting | None,
    policy: CostAwarePolicy | None,
    *,
    k: int,
    plan: RoundPlan,
    vocab: int,
    counters: Counters,
    ahead: bool = False,
    quiet: bool = True,
) -> tuple[list[Emitted], int]:
    """One round over `batch` (at least one row): each row's emission, in batch order, and
    the depth the drafter was asked for. With a drafter, `policy` (None: fixed k) chooses
    the depth and each row's drafts, as the generator drives it (`depth`, `cut` or `plain`,
    `observe`). The batch's state, keys and rows' last tokens and histories move on; rows
    stay (the caller retires the finished ones).

    Plain steps run pipelined, as plain decoding does: the round reads the step launched
    ahead last round (`batch.launched`) if there is one, and with `ahead` (nothing joins the
    batch before the next round) builds the next plain step from this one's unread tokens
    before reading them, when the next round is plain: always without a drafter, when
    `policy.plain_ahead` says so with one (a plain round's observation needs no token).
    `quiet`: nothing but this round ran on the device this step (else a pipelined step's
    time, which spans the step, is not a plain step's: it is not timed)."""
    rows = batch.rows
    room = [r.remaining for r in rows]
    budget = max(room) - 1  # drafts any row can still use
    step, batch.launched = batch.launched, None
    pipelined = step is not None  # the plain step launched last round: the policy noted it
    asked = 0
    if step is None and drafting is not None and budget > 0:
        asked = min(k, budget) if policy is None else policy.depth(k, room)
    if step is None and policy is not None and asked == 0:
        policy.plain(len(rows))
    if step is None and asked == 0:
        fed = mx.array([row.last for row in rows], mx.int32)[:, None]
        step = _launch(target, batch, fed, plan, ahead=0)
    fixed = FixedDepth() if policy is None else None
    observed = False
    if step is not None:
        # Without a drafter the next round is plain; with one only the policy can say so
        # (at fixed k every round drafts), once the next round has drafts to ask for.
        if ahead and (max(room) > 1 if drafting is None else policy is not None and budget > 1):
            if not pipelined:  # the device runs it while the next is built
                mx.async_eval(step.next_tokens)
            if policy is not None:  # observed before its read: this round drafted nothing
                policy.observe([0] * len(rows), timed=pipelined and quiet)
                observed = True
            if policy is None or policy.plain_ahead(k, [r - 1 for r in room]):
                batch.launched = _launch(target, batch, step.next_tokens[:, None], plan, ahead=1)
                mx.async_eval(batch.launched.next_tokens)
        r = step.read()
    else:
        sampler, key = _round_sampler(batch, 1 + asked)
        drafter = drafting.drafter if drafting is not None else None
        batch.state, r = batch_round(
            target, batch.take(), [row.last for row in rows], drafter, asked, sampler, key,
            plan, k=k, vocab=vocab, policy=policy if fixed is None else fixed, room=room,
        )  # fmt: skip
    if drafting is not None and budget > 0:  # budget 0: every row ends with this round
        drafting.accept(r.fed, r.kept, r.hidden)
    counters.rounds += 1
    if fixed is not None:  # the drafts verified (after the policy's cuts)
        counters.drafted += sum(fixed.counts)
    elif policy is not None:
        if r.span and policy.last is not None:
            counters.drafted += sum(policy.last.counts)
        policy.emitted(r.tokens)  # before the verify's observation: a probe is judged on it
        if not observed:
            policy.observe(r.accepted, timed=quiet or not pipelined)
    if r.span:
        counters.accepted += sum(r.accepted)
    out = _emitted(rows, r)
    if batch.launched is not None and policy is not None and drafting is not None:
        peek_past_read(drafting.drafter, [row.last for row in rows], k, policy)
    return out, asked


def _launch(
    target: Target, batch: Batch, fed: mx.array, plan: RoundPlan, *, ahead: int
) -> Launched:
    """A plain step over the batch's rows fed `fed` (B, 1), built and not read (`ahead`: it
    draws the token after the one not counted yet); the batch's state is then its
    forward's output."""
    sampler, key = _round_sampler(batch, 1, ahead)
    step = launch_plain(target, batch.take(), fed, sampler, key, plan.hidden)
    batch.state, step.state = step.state, None
    return step


def _round_sampler(batch: Batch, width: int, ahead: int = 0) -> tuple[Sampler, mx.array | None]:
    """The round's sampler (greedy when every row is; one Sampler when the rows share it;
    else a RowSampler) and keys (each row's keys of its next `width` positions, from its
    request's key, `ahead` positions on (a step launched before the last one's tokens are
    counted): a request's tokens are then its plain decode's, whatever the drafts and the
    batch; None when greedy)."""
    samplers = [row.request.params.sampler for row in batch.rows]
    if all(s.greedy for s in samplers):
        return Sampler(), None
    assert batch.keys is not None
    emitted = [len(row.request.tokens) + ahead for row in batch.rows]
    key = position_keys(batch.keys, emitted, width)
    first = samplers[0]
    if all(s == first for s in samplers):
        return first, key
    return RowSampler.of(samplers), key


def _emitted(rows: list[Row], r: Round) -> list[Emitted]:
    """Each row's tokens of round `r`, cut at its budget and first stop id; its state now
    holds its last token and accepted drafts (`history`), its next token is its last."""
    cuts: list[list[int]] = []
    reasons: list[str | None] = []
    for b, row in enumerate(rows):
        accepted = r.drafts[b][: r.accepted[b]]
        row.history += [row.last, *accepted]
        row.last = r.next_tokens[b]
        tokens, reason = cut(
            [*accepted, r.next_tokens[b]], row.remaining, row.request.params.stop_ids
        )
        cuts.append(tokens)
        reasons.append(reason)
    wanted = [b for b, row in enumerate(rows) if row.request.params.logprobs]
    logprobs: dict[int, list[float]] = {}
    if wanted:
        logprobs = chosen_logprobs(r.logits, {b: cuts[b] for b in wanted})
    return [Emitted(cuts[b], logprobs.get(b), reasons[b]) for b in range(len(rows))]


def cut(tokens: list[int], remaining: int, stops: tuple[int, ...]) -> tuple[list[int], str | None]:
    """A row's new `tokens` kept up to `remaining` and through its first stop id, and why it
    finished: "stop", "length" or None."""
    within = tokens[:remaining]
    for j, t in enumerate(within):
        if t in stops:
            return within[: j + 1], "stop"
    return within, "length" if len(within) >= remaining else None


def chosen_logprobs(logits: mx.array, tokens: dict[int, list[int]]) -> dict[int, list[float]]:
    """Row b's log-probability of each of its `tokens[b]`, token j under `logits[b, j]`
    (B, T, vocab) (the target's log-softmax, as mlx-lm's `logprobs`), in one read."""
    rows = list(tokens)
    width = max((len(t) for t in tokens.values()), default=0)
    if width == 0:
        return {b: [] for b in rows}
    ids = mx.array([t + [0] * (width - len(t)) for t in tokens.values()], mx.int32)
    picked = logits[mx.array(rows), :width].astype(mx.float32)
    scores = mx.take_along_axis(picked, ids[..., None], axis=-1)[..., 0]
    values = cast(list[list[float]], (scores - mx.logsumexp(picked, axis=-1)).tolist())
    return {b: values[i][: len(tokens[b])] for i, b in enumerate(rows)}
