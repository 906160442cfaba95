"""The speculative generator: drafts, one verify forward for the whole batch, each row keeping
its own accepted prefix (a ragged `commit_prefix` of the target's state and the drafter's).

Built only from the public transforms and the wrapped-model protocol
(`logits, state = target(tokens, state)`, `target(tokens, state, capture=True)`), so it runs
on every architecture kvstate wraps: attention, sliding windows, recurrent and hybrid models.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import mlx.core as mx

from .._errors import CommitError, StateError, TokenError
from .._transforms import capabilities, commit_prefix, filter
from .._tree import host_ints
from ..distributed import agree, group_of
from ._drafter import Drafter, TreeDrafter
from ._emit import Token, cut, finish, logprobs_of
from ._plain import decode, draw
from ._prefill import prefill
from ._replay import commit_may_be_refused, run_kept
from ._sampling import Sampler, accept, greedy_picks
from ._tree_round import TREE_MODES, tree_round


def generate(
    target: Any,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | TreeDrafter | None = None,
    *,
    k: int = 4,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    eos: Sequence[int] = (),
    adaptive: bool = True,
    seed: int = 0,
    tree: str | None = None,
) -> Iterator[list[Token]]:
    """Generate up to `max_tokens` per prompt, yielding the tokens of each round.

    `target`: a wrapped model; `prompts`: one list of ids per row (lengths may differ);
    `drafter`: proposes up to `k` tokens per row each round (None: plain decoding, pipelined
    like mlx-lm's `generate_step`: the next step runs while a round is yielded); a round
    where it proposes nothing is a plain one-token step, not a verify of filler. `sampler`:
    greedy by default; with a temperature, exact speculative sampling keeps every token
    distributed as the target alone would sample it. A row stops at `max_tokens` or after an
    `eos` token. With `adaptive`, k grows by one after a round whose drafts were all accepted
    and shrinks by one after a round with none accepted (between 1 and the given `k`).

    `tree`: verify several candidate continuations per round, from the drafter's
    `propose_tree` (one prompt only): "tree" in one forward over one copy of the state with a
    tree attention mask, "paths" as a batch of the tree's root-to-leaf paths. Greedy keeps the
    longest agreeing path; sampling stays exact (each draft is tried as a point mass, the
    target's distribution renormalised past the rejected siblings).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise TokenError("generate: give at least one prompt, each with at least one token")
    if k < 1 or max_tokens < 1:
        raise StateError(f"generate: k and max_tokens must be >= 1; got {k}, {max_tokens}")
    sampler = sampler or Sampler()
    if tree is not None:
        _check_tree_mode(tree, prompts, drafter)
    key = mx.random.key(seed)
    group = group_of(target)  # a distributed model's ranks must decide alike; None: one process
    if drafter is None:
        yield from decode(
            target, prompts, max_tokens=max_tokens, sampler=sampler, eos=eos, key=key, group=group
        )
        return
    rows = list(range(len(prompts)))
    # A drafter with `uses_hidden` (MTP heads) also gets the target's final hidden states.
    extra = {"hidden": True} if getattr(drafter, "uses_hidden", False) else {}
    logits, state, hiddens = prefill(target, prompts, bool(extra))
    seen = {"hidden": hiddens} if extra else {}
    drafter.start([list(p) for p in prompts], **seen)
    # Fixed for the whole generation (filter keeps the kinds): whether rolling the target
    # back needs the verify's checkpoints, so a verify of attention-only targets skips them.
    capture = capabilities(state).needs_checkpoints
    # Whether a commit can be refused (pooled windows): then each verify keeps the state it
    # started from, to re-run the accepted tokens from when the commit is refused.
    keep_before = commit_may_be_refused(state)
    key, last = _sample(sampler, logits, key)
    if group is not None:
        agree(last, group, what="the first tokens")
    counts = [0] * len(rows)
    logprobs = logprobs_of(logits)
    round_tokens = [
        Token(r, t, logprobs[i], False) for i, (r, t) in enumerate(zip(rows, last, strict=True))
    ]
    done = finish(round_tokens, counts, max_tokens, eos)
    yield round_tokens
    width = k
    while True:
        alive = [i for i, d in enumerate(done) if not d]
        if not alive:
            return
        if len(alive) < len(rows):
            state = filter(state, alive)
            drafter.keep_rows(alive)
            rows, last, counts = (
                [rows[i] for i in alive],
                [last[i] for i in alive],
                [counts[i] for i in alive],
            )
        # Drafts past every row's budget would be verified only to be cut (mlx-lm too drafts
        # at most the tokens still wanted): near the end the rounds narrow.
        room = max(max_tokens - c for c in counts) - 1
        proposal = candidates = None
        if room > 0 and tree is None:
            proposal = cast(Drafter, drafter).propose(last, min(width, room), sampler)
        elif room > 0:
            candidates = cast(TreeDrafter, drafter).propose_tree(last[0], min(width, room), sampler)
        if candidates is not None and candidates.tokens:
            assert tree is not None
            sub = None
            if not sampler.greedy:
                key, sub = mx.random.split(key)
            verified_round = tree_round(tree, target, state, last[0], candidates, sampler, sub)
            del state  # the verify holds it while it runs; nothing here needs it after
            state, logits, fed = verified_round.state, verified_round.logits, verified_round.fed
            accepted = [verified_round.accepted]
            nxt = [verified_round.tokens[-1]]
            drafts: list[list[int]] = [verified_round.tokens[:-1]]
            hidden = []
            if adaptive:
                width = _adapted(width, k, accepted, verified_round.depth)
        elif proposal is None or max(proposal.counts) == 0:
            fed = mx.array(last, mx.int32)[:, None]
            logits, state, *hidden = target(fed, state, **extra)
            key, nxt = _sample(sampler, logits[:, -1], key)
            accepted = [0] * len(rows)
            drafts = [[] for _ in rows]
        else:
            span = max(proposal.counts)
            drafted = proposal.tokens
            if drafted.shape[1] != span:
                drafted = drafted[:, :span]
            if drafted.dtype != mx.int32:
                drafted = drafted.astype(mx.int32)
            fed = mx.concatenate([mx.array(last, mx.int32)[:, None], drafted], 1)
            if capture:
                logits, verified, checkpoints, *hidden = target(fed, state, capture=True, **extra)
            else:
                logits, verified, *hidden = target(fed, state, **extra)
                checkpoints = None
            # Hold nothing of the pre-verify state while the verify runs (MLX then writes the
            # KV buffers in place instead of copying them), unless a commit can be refused.
            before = state if keep_before else None
            del state
            if sampler.greedy:
                # One read: the accepted counts and the target's picks, which are the
                # accepted drafts followed by the next token.
                picked = greedy_picks(logits, drafted, proposal.counts)
                accepted = [p[0] for p in picked]
                nxt = [p[1 + p[0]] for p in picked]
                drafts = [p[1:] for p in picked]
            else:
                probs = None if proposal.probs is None else proposal.probs[:, :span]
                key, sub = mx.random.split(key)
                target_probs = sampler.probs(logits)
                verdict = accept(target_probs, drafted, probs, proposal.counts, sampler, sub)
                accepted, nxt = verdict.accepted, verdict.next_tokens
                drafts = cast(list[list[int]], drafted.tolist())  # evaluated: no wait
            kept = [a + 1 for a in accepted]
            try:
                state = commit_prefix(verified, kept, checkpoints)
            except CommitError:
                if before is None:
                    raise
                # What a plain decode of the kept tokens gives, from the state before.
                state = run_kept(target, before, fed, kept)
            # Nor the verified state: a plain verify's cache objects stay with it (the wrapped
            # model keeps them for a forward from it) and would share the committed buffers.
            del verified, checkpoints, before
            if adaptive:
                width = _adapted(width, k, accepted, span)
        if group is not None:
            agree([*rows, *accepted, *nxt], group, what="the rows, accepted counts and next tokens")
        if room > 0:  # room 0: every row ends with this round
            seen = {"hidden": hidden[0]} if extra else {}
            drafter.accept(fed, [a + 1 for a in accepted], **seen)
        logprobs = logprobs_of(logits)
        round_tokens = []
        for i, row in enumerate(rows):
            out = [
                Token(row, t, logprobs[i, j], True) for j, t in enumerate(drafts[i][: accepted[i]])
            ]
            out.append(Token(row, nxt[i], logprobs[i, accepted[i]], False))
            round_tokens += cut(out, counts[i], max_tokens, eos)
        done = finish(round_tokens, counts, max_tokens, eos, rows)
        last = nxt
        yield round_tokens


def _adapted(width: int, k: int, accepted: list[int], drafted: int) -> int:
    """The next round's draft length: one more after a round whose every row accepted all
    `drafted` drafts, one fewer after a round with none accepted (between 1 and k)."""
    if all(a == drafted for a in accepted):
        return min(k, width + 1)
    if not any(accepted):
        return max(1, width - 1)
    return width


def _check_tree_mode(tree: str, prompts: Sequence[Sequence[int]], drafter: Any) -> None:
    if tree not in TREE_MODES:
        raise StateError(f"generate: tree must be None, 'tree' or 'paths'; got {tree!r}")
    if len(prompts) != 1:
        raise StateError(
            f"generate: tree verification takes one prompt; got {len(prompts)} (verify_tree "
            "and verify_paths work on a batch-1 state): run the prompts one by one, or "
            "drop tree= for batched linear drafting"
        )
    if drafter is None or not callable(getattr(drafter, "propose_tree", None)):
        raise StateError(
            f"generate: tree={tree!r} needs a drafter with propose_tree (NGramDrafter, "
            f"ModelDrafter); got {type(drafter).__name__}"
        )
    if getattr(drafter, "uses_hidden", False):
        raise StateError(
            "generate: tree verification does not feed hidden states; an MTP-style drafter "
            "drafts linearly (drop tree=)"
        )


def _sample(sampler: Sampler, logits: mx.array, key: mx.array) -> tuple[mx.array, list[int]]:
    """One token per row of `logits` (B, vocab), read to the host (greedy: the argmax, with
    no distribution built and no key used)."""
    key, picked = draw(sampler, logits, key)
    return key, host_ints(picked)
