"""One round over a batch whose rows change between rounds (a serving engine's): the
generator's round, as a function of the rows' state, last tokens, drafter and sampler
alone, so a caller that admits and retires rows itself (`kvstate.engine`) runs the same
propose / verify / accept / commit. The words are the package glossary's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx

from .. import StateError, capabilities
from ._checks import Drafts, checked_proposal
from ._drafter import Drafter, uses_hidden, with_counts
from ._linear_round import linear_round, plain_step
from ._replay import commit_may_be_refused
from ._round import Round, RoundPlan
from ._sampling import Sampler
from ._target import Target


class Cutter(Protocol):
    """What cuts a round's proposal (`CostAwarePolicy.cut`): the drafts each row verifies,
    from the counts proposed, each row's room (tokens it may still emit), the drafter's
    confidence labels (None: none) and its drafts where it states them on the host (None:
    not)."""

    def cut(
        self, counts: Sequence[int], room: Sequence[int], labels: Any = None, drafts: Any = None
    ) -> list[int]: ...


def proposal_of(
    drafter: Drafter,
    last: list[int],
    asked: int,
    sampler: Sampler,
    *,
    k: int,
    vocab: int,
    policy: Cutter | None = None,
    room: Sequence[int] | None = None,
) -> Drafts:
    """`drafter`'s proposal of up to `asked` drafts per row after `last`, checked (as
    `checked_proposal` checks it), and with `policy` cut to the drafts each row verifies
    (`policy.cut(counts, room, drafter.confidence, drafter.proposed)`): what the generator
    and `batch_round` verify alike."""
    proposed = drafter.propose(last, asked, sampler)
    proposal = checked_proposal(proposed, len(last), asked, k, vocab)
    if policy is not None:
        assert room is not None
        cut = policy.cut(proposal.counts, room, getattr(drafter, "confidence", None),
                         getattr(drafter, "proposed", None))  # fmt: skip
        if cut != proposal.counts:  # fewer drafts verified: the proposal re-cut
            proposal = checked_proposal(with_counts(proposed, cut), len(last), max(cut), k, vocab)
    return proposal


def peek_past_read(drafter: Any, last: list[int], k: int, policy: Any) -> None:
    """After a round whose successor is a plain step built ahead: where the drafter can say on
    the host, changing nothing, what it would propose (`peek(last, k) -> (drafts, labels)`:
    `NGramDrafter`), its drafts after each row's newest token, told to `policy.peek` (the next
    round then waits for a proposal only where these drafts would pay)."""
    peek = getattr(drafter, "peek", None)
    if peek is None:
        return
    drafts, labels = peek(last, k)
    policy.peek([len(d) for d in drafts], labels, drafts)


def round_plan(state: Any, drafter: Any = None) -> RoundPlan:
    """What every round over states of `state`'s kinds does alike (whether the verify
    captures checkpoints, whether a commit can be refused) with `drafter` (whether the
    target returns its hidden states): decided once, since `filter`, `merge` and `extend`
    keep the kinds."""
    return RoundPlan(
        capabilities(state).needs_checkpoints, commit_may_be_refused(state), uses_hidden(drafter)
    )


def batch_round(
    target: Target,
    state: Any,
    last: list[int],
    drafter: Drafter | None,
    asked: int,
    sampler: Sampler,
    key: mx.array | None,
    plan: RoundPlan,
    *,
    k: int,
    vocab: int,
    policy: Cutter | None = None,
    room: Sequence[int] | None = None,
) -> tuple[Any, Round]:
    """One round for every row of `state`: with `drafter` and `asked` > 0, row b's drafts
    after its `last` token (at most `asked`, this round's depth; `k` the most any round
    asks) verified in one forward, and each row's accepted prefix committed (ragged); else,
    or when nothing was drafted, a plain step (one token per row). `sampler`: a `Sampler`
    or a `RowSampler` (one per row); `key`: the round's key (None when greedy): position keys
    (B, >= 1 + asked, 2), `position_keys(row_keys, emitted, 1 + asked)`, draw each row's
    token at position t with its key of t (point-mass drafts then give the tokens of plain
    decoding, see `position_keys`); one `mx.random.key` or row keys (B, 2) draw as the
    round's own noise. Returns `(state, Round)`; the caller passes `state` as its
    only reference (MLX then writes the verify into its buffers) and tells the drafter
    what was kept (`drafter.accept(r.fed, r.kept)`).

    `policy` (a `CostAwarePolicy`, or anything with its `cut`) and `room` (the tokens each
    row may still emit): the proposal is cut to the drafts `policy.cut` chooses, as the
    generator cuts it (the caller asks `policy.depth` for `asked` before, tells it
    `policy.plain(rows)` when it asks nothing, and `policy.observe(r.accepted)` after).

    Every draft is checked as the generator checks it (`DrafterError`, `TokenError`)."""
    # Hand `state` over to the round: a reference held here while the verify runs would
    # make MLX copy every KV buffer instead of writing into it.
    box = [state]
    del state
    if not sampler.greedy and key is None:
        raise StateError("batch_round: a sampled round needs a key (or row keys)")
    proposal = None
    if drafter is not None and asked > 0:
        proposal = proposal_of(drafter, last, asked, sampler, k=k, vocab=vocab, policy=policy,
                               room=room)  # fmt: skip
    if proposal is None or max(proposal.counts) == 0:
        return plain_step(target, box.pop(), last, sampler, key, plan.hidden)
    return linear_round(target, box.pop(), last, proposal, sampler, key, plan, vocab)
