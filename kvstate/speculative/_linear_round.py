"""The generator's batched rounds: a linear round (verify every row's drafts in one forward,
accept, commit each row's kept prefix) and a plain step (one token per row, no drafts).
Both return `(state, Round)`; the words are the package glossary's (`kvstate.speculative`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx

from .. import CommitError, StateError, commit_prefix
from ..kinds import host_ints
from ._checks import Drafts, marked_message, refused
from ._emit import kept_drafts
from ._position_keys import is_position_keys, token_keys
from ._replay import run_kept
from ._round import Round, RoundPlan
from ._sampling import Sampler, greedy_picks, pick, sampled_verdict
from ._target import Target
from ._values import raise_marked

Process = Callable[[mx.array, mx.array], mx.array]
"""`process(logits (B, T, vocab), fed (B, T)) -> logits`: the logits processors over a
forward's positions (`Processors.verify`)."""


class Stops(NamedTuple):
    """Where the rows of a round end: `room[b]` tokens row b may still emit, and the end
    tokens. A row keeps no draft past either (`kept_drafts`), so the target's state never
    holds a token the row did not emit."""

    room: list[int]
    eos: Sequence[int]


def plain_step(
    target: Target,
    state: Any,
    last: list[int],
    sampler: Sampler,
    key: mx.array | None,
    hidden: bool,
    process: Process | None = None,
) -> tuple[Any, Round]:
    """One forward of each row's `last` token from `state` and the target's next token per
    row (drawn with `key`: position keys (B, >= 1, 2) of each row's next positions,
    `_position_keys`, or one key or row keys; None when greedy): a round with nothing
    drafted."""
    fed = mx.array(last, mx.int32)[:, None]
    launched = launch_plain(target, state, fed, sampler, key, hidden, process)
    del state
    return launched.state, launched.read()


class Launched:
    """A plain step built, its tokens not read yet (`read`): the generator builds the next
    plain step from `next_tokens` before reading this one's, as plain decoding does.
    `state`: the state after its forward (the caller takes it over)."""

    def __init__(
        self, state: Any, fed: mx.array, logits: mx.array, nxt: mx.array, seen: mx.array | None
    ) -> None:
        self.state = state
        self.fed = fed
        self.logits = logits
        self.next_tokens = nxt
        self.hidden = seen

    def keep(self, alive: list[int]) -> None:
        """Only the rows at positions `alive` stay (the caller filters `state`)."""
        index = mx.array(alive)
        self.fed = self.fed[index]
        self.logits = self.logits[index]
        self.next_tokens = self.next_tokens[index]
        if self.hidden is not None:
            self.hidden = self.hidden[index]

    def read(self) -> Round:
        """The step's Round (its tokens read: the one wait on the device)."""
        nxt = host_ints(self.next_tokens)
        rows = len(nxt)
        return Round(self.fed, self.logits, [0] * rows, nxt, [[] for _ in range(rows)],
                     self.hidden, 0)  # fmt: skip


def launch_plain(
    target: Target,
    state: Any,
    fed: mx.array,
    sampler: Sampler,
    key: mx.array | None,
    hidden: bool,
    process: Process | None = None,
) -> Launched:
    """`plain_step`'s forward of `fed` (B, 1) (an unread array: the last step's tokens)
    from `state`, its next tokens drawn; nothing read or evaluated (the caller that builds
    more before reading sets them evaluating)."""
    logits, state, *seen = target(fed, state, **({"hidden": True} if hidden else {}))
    if process is not None:
        logits = process(logits, fed)
    if key is not None and is_position_keys(key):
        key = token_keys(key[:, 0])
    return Launched(state, fed, logits, pick(sampler, logits[:, -1], key), _one(seen))


def linear_round(
    target: Target,
    state: Any,
    last: list[int],
    proposal: Drafts,
    sampler: Sampler,
    key: mx.array | None,
    plan: RoundPlan,
    vocab: int,
    stops: Stops | None = None,
    process: Process | None = None,
) -> tuple[Any, Round]:
    """Verify `proposal` (drafted[b] = `proposal.counts[b]` drafts after row b's `last`
    token, at least one row with some; checked by `_checks.checked_proposal`) from `state`
    in one forward of 1 + span tokens, accept each row's longest agreeing prefix (greedy) or
    by exact speculative sampling (drawing with `key`, position keys (B, 1 + span, 2) of
    each row's next positions, `_position_keys`; None when greedy), and commit each
    row's kept tokens. A draft id outside the target's `vocab` (marked on the device) is
    refused after the round's one read, before anything is committed.

    Pass `state` as the only reference to it (MLX then writes the verify's KV entries into
    its buffers instead of copying them); it is kept past the verify only when `plan` says
    a commit can be refused, to re-run the kept tokens from.

    `stops`: each row keeps no accepted draft past its room or its first end token (its
    next token is then the draft after its kept ones, never emitted). `process`: the
    logits processors, applied to the verify's logits before the acceptance rule."""
    drafted = proposal.counts
    span = max(drafted)
    drafts = proposal.tokens
    fed = mx.concatenate([mx.array(last, mx.int32)[:, None], proposal.fed], 1)
    extra = {"hidden": True} if plan.hidden else {}
    if plan.capture:
        logits, verified, checkpoints, *seen = target(fed, state, capture=True, **extra)
    else:
        logits, verified, *seen = target(fed, state, **extra)
        checkpoints = None
    if process is not None:
        logits = process(logits, fed)
    # Hold nothing of the pre-verify state while the verify runs (MLX then writes the KV
    # buffers in place instead of copying them), unless a commit can be refused.
    before = state if plan.keep_before else None
    del state
    emitted_drafts: list[list[int]]
    if sampler.greedy:
        # One read: the accepted counts and the target's picks, which are the accepted
        # drafts followed by the next token.
        picked, marks = greedy_picks(logits, drafts, drafted, proposal.marks)
        raise_marked(marks, marked_message(proposal, vocab))
        accepted = [p[0] for p in picked]
        nxt = [p[1 + p[0]] for p in picked]
        emitted_drafts = [p[1:] for p in picked]
    else:
        target_probs = sampler.probs(logits)
        try:
            verdict = sampled_verdict(target_probs, drafts, proposal.probs, drafted, sampler,
                                      key, proposal.made)  # fmt: skip
        except StateError as e:  # what the drafter proposed, as its refusal
            raise refused(e) from None
        accepted, nxt = verdict.accepted, verdict.next_tokens
        emitted_drafts = cast(list[list[int]], drafts.tolist())  # evaluated: no wait
    if stops is not None:
        accepted, nxt = _stopped(accepted, nxt, emitted_drafts, stops)
    kept = [a + 1 for a in accepted]
    try:
        state = commit_prefix(verified, kept, checkpoints)
    except CommitError:
        if before is None:
            raise
        # What a plain decode of the kept tokens gives, from the state before.
        state = run_kept(target, before, fed, kept)
    # Nor the verified state: a plain verify's cache objects stay with it (the wrapped model
    # keeps them for a forward from it) and would share the committed buffers.
    del verified, checkpoints, before
    return state, Round(fed, logits, accepted, nxt, emitted_drafts, _one(seen), span)


def _stopped(
    accepted: list[int], nxt: list[int], drafts: list[list[int]], stops: Stops
) -> tuple[list[int], list[int]]:
    """`accepted` cut at each row's room and first end token (`kept_drafts`); a row cut
    short gets its next kept-out draft as its next token (never emitted: it ended)."""
    cut = [kept_drafts(d, a, r, stops.eos) for d, a, r in zip(drafts, accepted, stops.room,
                                                               strict=True)]  # fmt: skip
    if cut == accepted:
        return accepted, nxt
    return cut, [n if c == a else d[c] for n, c, a, d in zip(nxt, cut, accepted, drafts,
                                                             strict=True)]  # fmt: skip


def _one(seen: list[mx.array]) -> mx.array | None:
    """The hidden states a forward returned last, when asked for (else None)."""
    return seen[0] if seen else None
