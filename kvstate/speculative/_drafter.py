"""The drafter protocol: what the speculative generator asks of whatever proposes tokens.

A drafter keeps whatever it needs per row of the generator's batch (a draft model's kvstate
state, a token history...) and is told, after every verify, which tokens the target kept, so
that it can roll its own state forward or back with the same transforms the target uses.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import mlx.core as mx

from ._sampling import Sampler


class Proposal(NamedTuple):
    """What a drafter proposes for each row of the batch.

    tokens: (B, depth) integer drafts, following each row's last token; positions past
        `counts[b]` are filler the generator never accepts (nor checks). An mx.array (its
        ids checked on the device, read with the round's verdict) or nested lists / NumPy
        (checked on the host).
    counts: drafted[b], the drafts worth verifying in row b (0 .. depth); all zero means
        "take a plain step". The generator verifies at most the depth it asked for (more,
        up to its `k`, are cut; past `k` a `DrafterError`).
    probs: (B, depth, vocab) float32, the distribution each draft was drawn from (after the same
        sampler transforms as the target's), or None for drafts chosen deterministically (an
        n-gram lookup, greedy drafting): exact speculative sampling then treats each draft as
        drawn from a point mass. A draft vocabulary padded wider than the target's is exact
        (ids the target lacks are rejected), so is a narrower one; a counted draft id outside
        it, probs that are not a distribution or give a draft 0 are refused (`TokenError`,
        `DrafterError`).
    """

    tokens: mx.array
    counts: list[int]
    probs: mx.array | None


class Drafted(Proposal):
    """A `Proposal` one of kvstate's drafters made (private): every counted id is a pick
    (an argmax or a draw) over `bound` ids, or an id the drafter was handed by the
    generator, so all are in 0..bound-1; `probs` (when given) are a `Sampler`'s
    distributions. The generator skips the device checks of the ids and distributions a
    user's proposal gets when `bound` fits the round (`_checks.checked_proposal`)."""

    bound: int

    def __new__(cls, tokens: mx.array, counts: list[int], probs: mx.array | None, bound: int):
        made = super().__new__(cls, tokens, counts, probs)
        made.bound = bound
        return made


def with_counts(proposal: Proposal, counts: list[int]) -> Proposal:
    """`proposal` verifying only `counts` drafts per row (each at most its own count), of the
    same class: a Drafted keeps its bound (NamedTuple's `_replace` would drop it)."""
    if isinstance(proposal, Drafted):
        return Drafted(proposal.tokens, counts, proposal.probs, proposal.bound)
    return proposal._replace(counts=counts)


class DraftTree(NamedTuple):
    """Candidate drafts of one row as a token tree: `tokens[i]` follows draft `parents[i]`
    (-1: a root, following the row's last token), parents listed before their children.
    Empty: nothing worth verifying (the generator takes a plain step)."""

    tokens: list[int]
    parents: list[int]


class Drafter(Protocol):
    """What proposes drafts for every row of the generator's batch (the words are the
    package glossary's: `kvstate.speculative`)."""

    uses_hidden: bool
    """True for drafters fed the target's final hidden states (MTP-style heads): they get
    them as a keyword, `start(prompts, hidden=[(1, L, D) per prompt])` and `accept(fed,
    kept, hidden=(B, 1 + span, D) over fed)`, and the target then runs with `hidden=True`.
    Other drafters are called exactly as below (a drafter without the attribute counts as
    False). A drafter may also say `prefills = True` (it runs a model of its own over the
    prompts in `start`: `ModelDrafter`, `MTPDrafter`): the generator then passes it its
    chunk size too, `start(prompts, prefill_step_size=n)`. And it may state its confidence:
    after `propose`, `confidence` is a list with one hashable label per row (None: none),
    by which the drafting policy learns acceptance (`NGramDrafter`: the match's (n,
    occurrences)). A label must not depend on a sampled draft's own value (the policy's
    choice of how many drafts to verify would then bias sampled output); deterministic
    drafters' labels are always fine. A drafter whose drafts are host ints may state them
    too: after `propose`, `proposed` is a list with each row's drafts, and the policy learns
    their acceptance from the tokens that follow, verified or not (`NGramDrafter`); a
    drafter computing on the device should not (reading its drafts would wait for them).
    One whose proposal is free and changes nothing may offer `peek(last, k) -> (drafts,
    labels)` (host lists): the policy peeks past the last token read in rounds built ahead,
    to know whether the next round should wait for a proposal."""

    def start(self, prompts: list[list[int]], *, key: mx.array | None = None) -> None:
        """The generator prefilled these prompts (one per row) into the target. `key`: the
        drafter's own `mx.random.key`, split from the generator's seed apart from every key
        the target draws with: a drafter that draws at random splits it for each draw, so
        its drafts never share noise with the target's draws (exact sampling for every
        seed). None: a drafter driven by hand, drawing from its own seed. (A drafter whose
        `start` takes no `key` is started without one.)"""

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        """Up to `k` drafts per row (this round's depth), following each row's `last` token
        (which no state holds yet). Sample with `sampler` (its `probs` and `sample`) so the
        drafts' distribution is the one the target's acceptance rule compares against."""
        ...

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        """The target verified `fed` (B, 1 + span): each row's last token and its drafts,
        and kept the first `kept[b]` = accepted[b] + 1 of row b (the last token and the
        accepted drafts)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows stay in the batch (the others finished), in this order."""


class TreeDrafter(Protocol):
    """What tree verification (`generate(..., tree="tree" | "paths")`, one prompt) asks of a
    drafter: `propose_tree` instead of `propose`; `start`, `accept` and `keep_rows` as for a
    `Drafter`. After a tree round `accept` gets the winning path, exactly as after a linear
    verify of that path."""

    def start(self, prompts: list[list[int]], *, key: mx.array | None = None) -> None:
        """As `Drafter.start`: `key` for any random choice of the tree (sampled branches)."""

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        """Candidate continuations of `last` (which no state holds yet), of depth at most
        `k`. Any choice made without the target's acceptance randomness is exact: the target
        tries each draft as a point mass."""
        ...

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        """`fed` (1, 1 + the winning path's drafts): the last token and the winning path's
        drafts (rejected ones included); `kept` [accepted + 1]. A drafting policy may have
        verified a subtree (the first paths, cut to a depth): the path is then a prefix of
        a proposed one, and after a round it cut to nothing (a plain step) `fed` is (1, 1)."""

    def keep_rows(self, rows: list[int]) -> None: ...


def prefills(drafter: Any) -> bool:
    """`drafter.prefills` (see `Drafter`), False for a drafter without it (or None)."""
    return bool(getattr(drafter, "prefills", False))


def uses_hidden(drafter: Any) -> bool:
    """`drafter.uses_hidden` (see `Drafter`), False for a drafter without it (or None)."""
    return bool(getattr(drafter, "uses_hidden", False))
