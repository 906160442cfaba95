"""The speculative generator: the loop over rounds. Each round the drafter proposes, one
forward verifies the whole batch, each row keeps its own accepted prefix (a ragged
`commit_prefix` of the target's state and the drafter's), and the tokens are emitted.

Built only from the public transforms and the `Target` protocol (`logits, state =
target(tokens, state)`, `target(tokens, state, capture=True)`), so it runs on every
architecture kvstate wraps: attention, sliding windows, recurrent and hybrid models. The
words (k, depth, budget, drafted, fed, accepted, kept, emitted) are the package glossary's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import mlx.core as mx

from .. import NotSupportedError, StateError, capabilities, filter
from ..distributed import agree
from ..kinds import host_ints
from ._checks import checked_call, checked_proposal, checked_tree, start_keywords
from ._drafter import Drafter, TreeDrafter, prefills, uses_hidden
from ._emit import Token, cut, finish, logprobs_of
from ._linear_round import linear_round, plain_step
from ._plain import decode
from ._prefill import PREFILL_STEP, prefill
from ._replay import commit_may_be_refused
from ._round import Round, RoundPlan
from ._sampling import Sampler, draw, generation_keys, round_key
from ._target import Target
from ._tree_round import TREE_MODES, tree_round


def generate(
    target: Target,
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
    prefill_step_size: int = PREFILL_STEP,
    prompt_progress: Callable[[int, int], None] | None = None,
) -> Iterator[list[Token]]:
    """Generate up to `max_tokens` per prompt, yielding the tokens of each round.

    `target`: a wrapped model; `prompts`: one list of ids per row (lengths may differ);
    `drafter`: proposes up to `k` tokens per row each round (None: plain decoding, pipelined
    like mlx-lm's `generate_step`: the next step runs while a round is yielded); a round
    where it proposes nothing is a plain one-token step, not a verify of filler. `sampler`:
    greedy by default; with a temperature, exact speculative sampling keeps every token
    distributed as the target alone would sample it. A row stops at `max_tokens` or after an
    `eos` token. With `adaptive`, the depth grows by one after a round whose drafts were all
    accepted and shrinks by one after a round with none accepted (between 1 and `k`).

    `tree`: verify several candidate continuations per round, from the drafter's
    `propose_tree` (one prompt only): "tree" in one forward over one copy of the state with a
    tree attention mask, "paths" as a batch of the tree's root-to-leaf paths. Greedy keeps the
    longest agreeing path; sampling stays exact (each draft is tried as a point mass, the
    target's distribution renormalised past the rejected siblings).

    `seed` (an int in 0..2**64-1): the randomness of a sampled generation, which it fixes
    whole. Its key is split into the target's and the drafter's (`Drafter.start(..., key=)`),
    so no draft shares noise with a draw of the target, and sampling is exact for every seed
    and every drafter's own seed (which applies only to a drafter driven by hand).

    Every argument is checked before anything runs (prompt ids against the target's
    vocabulary, a `TokenError`), and so is what the drafter returns each round (a
    `DrafterError` or `TokenError` naming what is wrong): on the host where it already is,
    on the device with the round's one read where it is not.

    The prompts are prefilled as mlx-lm's `generate_step` does: `prefill_step_size`
    positions per forward, each evaluated as it is built, the output projection at each
    row's last position only (a drafter with its own model prefills it in chunks of the same
    size). `prompt_progress(processed, total)`: the target's prompt tokens through the model
    so far (all rows together), 0 first and `total` last.
    """
    call = checked_call(target, prompts, drafter, k=k, max_tokens=max_tokens, sampler=sampler,
                        eos=eos, adaptive=adaptive, seed=seed, tree=tree)  # fmt: skip
    prompts, sampler, eos, abilities = call
    if prompt_progress is not None and not callable(prompt_progress):
        raise StateError(
            "generate: prompt_progress must be a callable (processed, total) or None; got "
            f"{prompt_progress!r:.60}"
        )
    hidden = uses_hidden(drafter)  # MTP heads also get the target's final hidden states
    if tree is not None:
        _check_tree_mode(tree, prompts, drafter, hidden)
    key, drafter_key = generation_keys(seed)  # never the same noise for target and drafter
    group = abilities.group  # a distributed model's ranks must decide alike; None: one process
    if drafter is None:
        yield from decode(
            target,
            prompts,
            max_tokens=max_tokens,
            sampler=sampler,
            eos=eos,
            key=key,
            group=group,
            prefill_step_size=prefill_step_size,
            prompt_progress=prompt_progress,
        )
        return
    logits, state, hiddens = prefill(
        target, prompts, hidden, step=prefill_step_size, progress=prompt_progress
    )
    vocab = abilities.vocab_size or logits.shape[-1]
    extra = start_keywords(drafter, drafter_key) | ({"hidden": hiddens} if hidden else {})
    if prefills(drafter):  # a drafter with its own model prefills in the target's chunks
        extra["prefill_step_size"] = prefill_step_size
    drafter.start([list(p) for p in prompts], **extra)
    # Fixed for the whole generation (filter keeps the kinds): whether rolling the target
    # back needs the verify's checkpoints (a verify of attention-only targets skips them),
    # and whether a commit can be refused (pooled windows: each verify then keeps the state
    # it started from, to re-run the kept tokens from).
    plan = RoundPlan(capabilities(state).needs_checkpoints, commit_may_be_refused(state), hidden)
    key, last = _sample(sampler, logits, key)
    if group is not None:
        agree(last, group, what="the first tokens")
    live = _Rows(state, last)
    del state  # `live` holds it: a round takes it over
    logprobs = logprobs_of(logits)
    out = [
        Token(r, t, logprobs[i], False)
        for i, (r, t) in enumerate(zip(live.rows, last, strict=True))
    ]
    done = finish(out, live.emitted, max_tokens, eos)
    yield out
    depth = k
    while True:
        alive = [i for i, d in enumerate(done) if not d]
        if not alive:
            return
        if len(alive) < len(live.rows):
            live.keep(alive)
            drafter.keep_rows(alive)
        # Drafts past every row's budget would be verified only to be cut (mlx-lm too drafts
        # at most the tokens still wanted): near the end the rounds narrow.
        budget = max(max_tokens - e for e in live.emitted) - 1
        proposal = candidates = None
        asked = min(depth, budget)
        if budget > 0 and tree is None:
            proposed = cast(Drafter, drafter).propose(live.last, asked, sampler)
            proposal = checked_proposal(proposed, len(live.last), asked, k, vocab)
        elif budget > 0:
            tree_drafter = cast(TreeDrafter, drafter)
            proposed_tree = tree_drafter.propose_tree(live.last[0], asked, sampler)
            candidates = checked_tree(proposed_tree, asked, k)
        key, sub = round_key(sampler, key)
        r: Round
        if candidates is not None and candidates.tokens:
            assert tree is not None
            live.state, r = tree_round(
                tree, target, live.take(), live.last[0], candidates, sampler, sub, vocab
            )
        elif proposal is None or max(proposal.counts) == 0:
            live.state, r = plain_step(target, live.take(), live.last, sampler, sub, hidden)
        else:
            live.state, r = linear_round(
                target, live.take(), live.last, proposal, sampler, sub, plan, vocab
            )
        if group is not None:
            decided = [*live.rows, *r.accepted, *r.next_tokens]
            agree(decided, group, what="the rows, accepted counts and next tokens")
        if budget > 0:  # budget 0: every row ends with this round
            drafter.accept(r.fed, r.kept, **({"hidden": r.hidden} if hidden else {}))
        if adaptive and r.span:
            depth = _adapted(depth, k, r.accepted, r.span)
        out = live.emit(r, max_tokens, eos)
        done = finish(out, live.emitted, max_tokens, eos, live.rows)
        live.last = r.next_tokens
        yield out


class _Rows:
    """The rows still generating: the target's state over them and, per row, its index in
    the prompts (`rows`), its last token (in no state yet) and its tokens out so far."""

    def __init__(self, state: Any, last: list[int]) -> None:
        self.state: Any = state
        self.rows = list(range(len(last)))
        self.last = last
        self.emitted = [0] * len(last)

    def keep(self, alive: list[int]) -> None:
        """Only the rows at positions `alive` stay, in this order."""
        self.state = filter(self.state, alive)
        self.rows = [self.rows[i] for i in alive]
        self.last = [self.last[i] for i in alive]
        self.emitted = [self.emitted[i] for i in alive]

    def take(self) -> Any:
        """The state, handed over to a round: with no other reference to it, MLX writes the
        verify's KV entries into its buffers instead of copying them."""
        state, self.state = self.state, None
        return state

    def emit(self, r: Round, max_tokens: int, eos: Sequence[int]) -> list[Token]:
        """The round's tokens, each row's accepted drafts then its next token, cut at its
        budget and its first eos."""
        logprobs = logprobs_of(r.logits)
        out: list[Token] = []
        for i, row in enumerate(self.rows):
            a = r.accepted[i]
            tokens = [Token(row, t, logprobs[i, j], True) for j, t in enumerate(r.drafts[i][:a])]
            tokens.append(Token(row, r.next_tokens[i], logprobs[i, a], False))
            out += cut(tokens, self.emitted[i], max_tokens, eos)
        return out


def _adapted(depth: int, k: int, accepted: list[int], span: int) -> int:
    """The next round's depth: one more after a round whose every row accepted all `span`
    drafts, one fewer after a round with none accepted (between 1 and k)."""
    if all(a == span for a in accepted):
        return min(k, depth + 1)
    if not any(accepted):
        return max(1, depth - 1)
    return depth


def _check_tree_mode(
    tree: str, prompts: Sequence[Sequence[int]], drafter: Any, hidden: bool
) -> None:
    """Refuse the tree modes generate does not run (each refusal written here once)."""
    if tree not in TREE_MODES:
        raise StateError(f"generate: tree must be None, 'tree' or 'paths'; got {tree!r}")
    if len(prompts) != 1:
        raise NotSupportedError(
            f"generate: tree verification takes one prompt; got {len(prompts)} (verify_tree "
            "and verify_paths work on a batch-1 state): run the prompts one by one, or "
            "drop tree= for batched linear drafting"
        )
    if drafter is None or not callable(getattr(drafter, "propose_tree", None)):
        raise NotSupportedError(
            f"generate: tree={tree!r} needs a drafter with propose_tree (NGramDrafter, "
            f"ModelDrafter); got {type(drafter).__name__}"
        )
    if hidden:
        raise NotSupportedError(
            "generate: tree verification does not feed hidden states; an MTP-style drafter "
            "drafts linearly (drop tree=)"
        )


def _sample(sampler: Sampler, logits: mx.array, key: mx.array) -> tuple[mx.array, list[int]]:
    """One token per row of `logits` (B, vocab), read to the host (greedy: the argmax, with
    no distribution built and no key used)."""
    key, picked = draw(sampler, logits, key)
    return key, host_ints(picked)
