"""The speculative generator: the loop over rounds. Each round the drafter proposes, one
forward verifies the whole batch, each row keeps its own accepted prefix (a ragged
`commit_prefix` of the target's state and the drafter's), and the tokens are emitted.

Built only from the public transforms and the `Target` protocol (`logits, state =
target(tokens, state)`, `target(tokens, state, capture=True)`), so it runs on every
architecture kvstate wraps: attention, sliding windows, recurrent and hybrid models. The
words (k, depth, budget, drafted, fed, accepted, kept, emitted) are the package glossary's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import mlx.core as mx

from .. import NotSupportedError, StateError, capabilities, filter
from ..distributed import agree, group_of
from ..kinds import host_ints
from ._batch_round import peek_past_read, proposal_of
from ._checks import (
    Extras,
    checked_call,
    checked_extras,
    checked_tree,
    is_linked,
    start_keywords,
)
from ._drafter import Drafter, DraftTree, TreeDrafter, prefills, uses_hidden
from ._emit import Token, cut, finish, logprobs_of
from ._generation import Counts, Finals, Generation
from ._kv_quantization import QUANTIZED_KV_START, KVQuantization
from ._linear_round import Launched, Stops, launch_plain, linear_round
from ._plain import decode
from ._policy import CostAwarePolicy, check_policy_arguments
from ._position_keys import TREE, fold_in, position_keys, rows_of, token_keys
from ._prefill import PREFILL_STEP, prefill
from ._processors import Processor, Processors
from ._replay import commit_may_be_refused
from ._round import Round, RoundPlan
from ._sampling import Sampler, generation_keys, pick
from ._target import Target
from ._tree_round import TREE_MODES, tree_round
from ._values import Made


def generate(
    target: Target,
    prompts: Any,
    drafter: Drafter | TreeDrafter | None = None,
    *,
    k: int = 8,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    eos: Sequence[int] = (),
    adaptive: bool = True,
    policy: CostAwarePolicy | None = None,
    seed: int = 0,
    tree: str | None = None,
    prefill_step_size: int = PREFILL_STEP,
    prompt_progress: Callable[[int, int], None] | None = None,
    states: Sequence[Any] | None = None,
    history: Sequence[Sequence[int] | None] | None = None,
    keep_states: bool = False,
    logits_processors: Sequence[Processor] | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = QUANTIZED_KV_START,
) -> Generation:
    """Generate up to `max_tokens` per prompt, yielding the tokens of each round.

    `target`: a wrapped model; `prompts`: token ids as mlx-lm takes them: one flat list or
    a 1-d array (one prompt), or one list of ids per row, or a 2-d array (rows, ids); rows
    may differ in length. `drafter`: proposes up to `k` tokens per row each round (None:
    plain decoding, pipelined like mlx-lm's `generate_step`: the next step runs while a
    round is yielded; `k` then means nothing); a round where it proposes nothing is a plain
    one-token step, not a verify of filler. `sampler`: greedy by default; with a
    temperature, exact speculative sampling keeps every token distributed as the target
    alone would sample it. A row stops at `max_tokens` (0: nothing is generated; the
    prompts are still prefilled, as mlx-lm's `generate_step` does, so `keep_states` gives
    them as a prompt cache) or after an `eos` token.

    `adaptive` (the default): each round a `CostAwarePolicy` (`policy`, or a fresh one)
    chooses how many drafts each row verifies, 0 .. `k` (0 for every row: a plain step, the
    drafter not even asked when its drafts do not pay), and in tree mode how wide and deep a
    tree, to maximise the expected tokens per unit of time: from each row's recent
    acceptance, the drafter's confidence (`NGramDrafter`'s match lengths) and the cost of a
    verify relative to a plain step, timed online. It only chooses how much to propose, so
    greedy output is unchanged and sampled tokens keep their distribution. With point-mass
    drafts (`NGramDrafter`, a drafter proposing ids without probabilities) a seed gives
    the tokens of the same generation without a drafter, whatever the policy chose (each
    token is drawn with its row's key of its position: `position_keys`); with a draft
    model's distributions which tokens a seed gives depends on those choices, and timings
    vary, so for those a seed reproduces under `adaptive=False` or a policy over a
    `FixedCost`. Its estimates: `Generation.policy` (`acceptance`,
    `cost_ratio(w)`, `last`). `adaptive=False`: every round asks for `k` drafts.

    `tree`: verify several candidate continuations per round, from the drafter's
    `propose_tree` (one prompt only): "tree" in one forward over one copy of the state with a
    tree attention mask, "paths" as a batch of the tree's root-to-leaf paths. Greedy keeps the
    longest agreeing path; sampling stays exact (each draft is tried as a point mass, the
    target's distribution renormalised past the rejected siblings).

    `seed` (an int in 0..2**64-1): the randomness of a sampled generation, which it fixes
    whole. Its key is split into the target's and the drafter's (`Drafter.start(..., key=)`),
    so no draft shares noise with a draw of the target, and sampling is exact for every seed
    and every drafter's own seed (which applies only to a drafter driven by hand).

    Continuing (a chat, a prompt cache): `states[b]` (a batch-1 state, or None to start
    fresh) is what row b continues: its prompt is the new tokens after it (at least one),
    and the generation is the one of the whole sequence (what the state holds, then the
    prompt). `history[b]`: the ids `states[b]` holds (None: not given); the drafter is
    started on history + prompt (a `ModelDrafter` prefills its draft model over it, and
    needs it for every row with a state; `NGramDrafter` looks up in it; an MTP head starts
    on the new prompt only, as the target's hidden states over the history are not in a
    state), and logits processors see it. `keep_states=True`: the returned generation's
    `states` gives each row's final state (its prompt and every token it emitted, as
    mlx-lm's prompt cache holds them): pass it as `states` with the next turn's prompt.

    mlx-lm's decoding options: `logits_processors` (callables `(tokens, logits) ->
    logits`, e.g. `mlx_lm.sample_utils.make_logits_processors(repetition_penalty=...)`),
    applied before the sampler, with a drafter to every verified position (`_processors`);
    not with `tree`. `max_kv_size`: rotating caches of that many positions for the rows
    that start fresh (mlx-lm's `make_prompt_cache(model, max_kv_size)`: models with a cache
    factory of their own keep it). `kv_bits` / `kv_group_size` / `quantized_kv_start`: the
    target's dense KV layers quantized once its state holds `quantized_kv_start` positions
    (`_kv_quantization`).

    Every argument is checked before anything runs (prompt ids against the target's
    vocabulary, a `TokenError`), and so is what the drafter returns each round (a
    `DrafterError` or `TokenError` naming what is wrong): on the host where it already is,
    on the device with the round's one read where it is not. (The checks run when the
    generation is first iterated.)

    The prompts are prefilled as mlx-lm's `generate_step` does: `prefill_step_size`
    positions per forward, each evaluated as it is built, the output projection at each
    row's last position only (a drafter with its own model prefills it in chunks of the same
    size). `prompt_progress(processed, total)`: the target's prompt tokens through the model
    so far (all rows together), 0 first and `total` last.

    Returns a `Generation`: iterate it for each round's tokens.
    """
    finals = Finals(target) if keep_states is True else None
    counts = Counts()
    chosen = policy
    if policy is None and adaptive is True and drafter is not None and group_of(target) is None:
        chosen = CostAwarePolicy()
    rounds = _rounds(
        target,
        prompts,
        drafter,
        k=k,
        max_tokens=max_tokens,
        sampler=sampler,
        eos=eos,
        adaptive=adaptive,
        policy=chosen,
        seed=seed,
        tree=tree,
        prefill_step_size=prefill_step_size,
        prompt_progress=prompt_progress,
        finals=finals,
        counts=counts,
        options={
            "states": states,
            "history": history,
            "keep_states": keep_states,
            "logits_processors": logits_processors,
            "max_kv_size": max_kv_size,
            "kv_bits": kv_bits,
            "kv_group_size": kv_group_size,
            "quantized_kv_start": quantized_kv_start,
        },
    )
    return Generation(rounds, finals, counts, chosen)


def _rounds(
    target: Target,
    prompts: Any,
    drafter: Drafter | TreeDrafter | None,
    *,
    k: int,
    max_tokens: int,
    sampler: Sampler | None,
    eos: Sequence[int],
    adaptive: bool,
    policy: CostAwarePolicy | None,
    seed: int,
    tree: str | None,
    prefill_step_size: int,
    prompt_progress: Callable[[int, int], None] | None,
    finals: Finals | None,
    counts: Counts,
    options: dict[str, Any],
) -> Iterator[list[Token]]:
    """`generate`'s rounds (its arguments as given, checked here)."""
    call = checked_call(target, prompts, drafter, k=k, max_tokens=max_tokens, sampler=sampler,
                        eos=eos, adaptive=adaptive, seed=seed, tree=tree)  # fmt: skip
    prompts, sampler, eos, abilities = call
    policy = _policy_of(adaptive, policy, drafter, split=group_of(target) is not None)
    if prompt_progress is not None and not callable(prompt_progress):
        raise StateError(
            "generate: prompt_progress must be a callable (processed, total) or None; got "
            f"{prompt_progress!r:.60}"
        )
    extras = checked_extras(len(prompts), abilities.vocab_size, **options)
    hidden = uses_hidden(drafter)  # MTP heads also get the target's final hidden states
    if tree is not None:
        _check_tree_mode(tree, prompts, drafter, hidden)
        if extras.processors is not None:
            raise NotSupportedError(
                "generate: logits_processors with tree verification: verify_tree and "
                "verify_paths accept on the target's own logits; drop tree= (linear "
                "drafting applies the processors to every verified position)"
            )
    if extras.states is not None and drafter is not None:
        _check_drafter_history(drafter, hidden, extras)
    key, drafter_key = generation_keys(seed)  # never the same noise for target and drafter
    row_keys = None if sampler.greedy else rows_of(key, len(prompts))  # see _position_keys
    group = abilities.group  # a distributed model's ranks must decide alike; None: one process
    quantization = None if extras.kv is None else KVQuantization(*extras.kv)
    if finals is not None:
        finals.begin(len(prompts))
    logits, state, hiddens = prefill(
        target,
        prompts,
        hidden and max_tokens > 0,
        step=prefill_step_size,
        progress=prompt_progress,
        states=extras.states,
        fresh=_fresh(target, extras.max_kv_size),
        quantization=quantization,
    )
    if max_tokens == 0:  # the prompts are in the state: nothing to emit
        if finals is not None:
            positions = list(range(len(prompts)))
            finals.finish(state, positions, positions, [None] * len(prompts))
        return
    contexts = [h + p for h, p in zip(extras.history, prompts, strict=True)]
    processors = None
    if extras.processors is not None:
        processors = Processors(extras.processors, contexts)
        logits = processors.first(logits)
    if drafter is None:
        yield from decode(target, logits, state, max_tokens=max_tokens, sampler=sampler,
                          eos=eos, keys=row_keys, group=group, processors=processors,
                          quantization=quantization, finals=finals)  # fmt: skip
        return
    vocab = abilities.vocab_size or logits.shape[-1]
    extra = start_keywords(drafter, drafter_key) | ({"hidden": hiddens} if hidden else {})
    if prefills(drafter):  # a drafter with its own model prefills in the target's chunks
        extra["prefill_step_size"] = prefill_step_size
    drafter.start(prompts if hidden else contexts, **extra)
    # Fixed for the whole generation (filter keeps the kinds): whether rolling the target
    # back needs the verify's checkpoints (a verify of attention-only targets skips them),
    # and whether a commit can be refused (pooled windows: each verify then keeps the state
    # it started from, to re-run the kept tokens from).
    plan = RoundPlan(capabilities(state).needs_checkpoints, commit_may_be_refused(state), hidden)
    first_keys = None if row_keys is None else token_keys(fold_in(row_keys, 0))
    last = host_ints(pick(sampler, logits, first_keys))
    if group is not None:
        agree(last, group, what="the first tokens")
    live = _Rows(state, last, row_keys)
    del state  # `live` holds it: a round takes it over
    logprobs = logprobs_of(logits)
    out = [
        Token(r, t, logprobs[i], False)
        for i, (r, t) in enumerate(zip(live.rows, last, strict=True))
    ]
    done = finish(out, live.emitted, max_tokens, eos)
    process = None if processors is None else processors.verify
    if policy is not None:
        policy.begin(len(live.rows))
    # Plain steps the policy chooses run pipelined, as plain decoding does: a plain round's
    # observation needs no token (nothing was drafted), so the policy decides the next round
    # before this one's tokens are read, and a next plain step is built from them unread.
    # Not with the options that read or hold each step's tokens or state between steps.
    ahead = (policy is not None and tree is None and group is None and finals is None
             and processors is None and quantization is None and not hidden)  # fmt: skip
    launched: Launched | None = None  # the next plain step, built before the last was read
    asked_ahead: int | None = None  # the next round's depth, asked of the policy already
    while True:
        if finals is not None:
            live.record(finals, done, out)
            finals.hold(live.view(done))
        yield out
        if finals is not None:
            finals.release()
        alive = [i for i, d in enumerate(done) if not d]
        if not alive:
            return
        if len(alive) < len(live.rows):
            live.keep(alive)  # the state after a launched step's forward too
            if launched is not None:
                launched.keep(alive)
            drafter.keep_rows(alive)
            if policy is not None:
                policy.keep(alive)
            if processors is not None:
                processors.keep(alive)
        # Drafts past every row's budget would be verified only to be cut (mlx-lm too drafts
        # at most the tokens still wanted): near the end the rounds narrow.
        room = [max_tokens - e for e in live.emitted]
        budget = max(room) - 1
        proposal = candidates = None
        if asked_ahead is not None:  # asked while the last round ran (0: its plain noted)
            asked, told = asked_ahead, asked_ahead == 0
        else:
            asked, told = (min(k, budget) if budget > 0 else 0), False
            if policy is not None and budget > 0:
                asked = policy.depth(k, room, cheap=True if tree is not None else None)
        asked_ahead = None
        if asked > 0 and tree is None:
            proposal = proposal_of(cast(Drafter, drafter), Made(live.last), asked, sampler,
                                   k=k, vocab=vocab, policy=policy, room=room)  # fmt: skip
        elif asked > 0:
            tree_drafter = cast(TreeDrafter, drafter)
            proposed_tree = tree_drafter.propose_tree(live.last[0], asked, sampler)
            candidates = pruned_at_ends(checked_tree(proposed_tree, asked, k), eos)
            if policy is not None and is_linked(candidates):  # else the tree round refuses it
                candidates = policy.tree(candidates, room[0])
        elif policy is not None and not told:
            policy.plain(len(live.rows))
        r: Round
        observed = False
        if candidates is not None and candidates.tokens:
            assert tree is not None
            live.state, r = tree_round(tree, target, live.take(), live.last[0], candidates,
                                       sampler, live.tree_key(), vocab)  # fmt: skip
        elif proposal is None or max(proposal.counts) == 0:
            if launched is not None:  # built last round: `live` holds its state already
                step, launched, pipelined = launched, None, True
            else:
                step = launch_plain(target, live.take(), mx.array(live.last, mx.int32)[:, None],
                                    sampler, live.keys_at(1), hidden, process)  # fmt: skip
                live.state, step.state, pipelined = step.state, None, False
            if ahead and max(room) > 2:  # the next round has drafts to ask for
                assert policy is not None
                if not pipelined:  # the device runs it while the next is built
                    mx.async_eval(step.next_tokens)
                policy.observe([0] * len(live.rows), timed=pipelined)
                observed = True
                if policy.plain_ahead(k, [r - 1 for r in room]):
                    asked_ahead = 0
                    launched = launch_plain(target, live.take(), step.next_tokens[:, None],
                                            sampler, live.keys_at(1, ahead=1), hidden)  # fmt: skip
                    live.state, launched.state = launched.state, None
                    mx.async_eval(launched.next_tokens)
            r = step.read()
        else:
            keys = live.keys_at(1 + max(proposal.counts))
            live.state, r = linear_round(target, live.take(), live.last, proposal, sampler,
                                         keys, plan, vocab, Stops(room, eos), process)  # fmt: skip
        if policy is not None:  # before the verify's observation: a probe is judged on it
            policy.emitted(r.tokens)
        if quantization is not None:
            live.state = quantization.after(live.state)
        counts.drafted += len(candidates.tokens) if candidates is not None else _drafted(proposal)
        counts.accepted += sum(r.accepted)
        if processors is not None:
            processors.commit(r.fed, r.kept)
        if group is not None:
            decided = [*live.rows, *r.accepted, *r.next_tokens]
            agree(decided, group, what="the rows, accepted counts and next tokens")
        if budget > 0:  # budget 0: every row ends with this round
            drafter.accept(r.fed, Made(r.kept), **({"hidden": r.hidden} if hidden else {}))
        if policy is not None and candidates is not None:
            policy.observe_tree([*r.drafts[0][: r.accepted[0]], r.next_tokens[0]])
        elif policy is not None and not observed:
            policy.observe(r.accepted)
        out = live.emit(r, max_tokens, eos)
        done = finish(out, live.emitted, max_tokens, eos, live.rows)
        live.last = r.next_tokens
        if asked_ahead == 0 and policy is not None and not all(done):  # the next: built ahead
            peek_past_read(drafter, live.last, k, policy)


def _policy_of(
    adaptive: Any, policy: Any, drafter: Any, *, split: bool = False
) -> CostAwarePolicy | None:
    """The generation's drafting policy: `policy`, or a fresh `CostAwarePolicy` when
    `adaptive`; None for fixed k (`adaptive=False`), without a drafter, and by default on a
    model split over processes (`split`): each rank would time its own rounds and choose
    differently, and ranks running forwards of different shapes hang in the model's own
    collectives before `agree` could catch it."""
    check_policy_arguments("generate", adaptive, policy)
    if drafter is None or not adaptive or (split and policy is None):
        return None
    return CostAwarePolicy() if policy is None else policy


def _drafted(proposal: Any) -> int:
    """The drafts a linear round verified (none for a plain step)."""
    return 0 if proposal is None else sum(proposal.counts)


def _fresh(target: Target, max_kv_size: int | None) -> Callable[[int], Any] | None:
    """The empty states of rows that start fresh: the target's own (None), or with
    `max_kv_size` its rotating caches of that size (a target whose `init_state` takes
    `max_kv_size`: a wrapped model)."""
    if max_kv_size is None:
        return None
    try:
        takes = "max_kv_size" in inspect.signature(target.init_state).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        raise NotSupportedError(
            f"generate: max_kv_size needs a target whose init_state takes max_kv_size (a "
            f"wrapped model); a {type(target).__name__}'s does not"
        )
    return lambda rows: target.init_state(rows, max_kv_size=max_kv_size)  # type: ignore[call-arg]


def _check_drafter_history(drafter: Any, hidden: bool, extras: Extras) -> None:
    """A drafter with a model of its own (`prefills`, not an MTP head) continues rows with
    states only from their history: its model must hold what the target's state holds."""
    assert extras.states is not None
    if hidden or not prefills(drafter):
        return
    missing = [
        i for i, (s, h) in enumerate(zip(extras.states, extras.history, strict=True))
        if s is not None and not h
    ]  # fmt: skip
    if missing:
        raise StateError(
            f"generate: states[{missing[0]}] is continued with a {type(drafter).__name__}, "
            "whose draft model must see what the state holds: pass history=[the ids each "
            "state holds, per prompt] (it prefills the draft model over history + prompt)"
        )


def pruned_at_ends(tree: DraftTree, eos: Sequence[int]) -> DraftTree:
    """`tree` without the nodes below an end token (a row ends there: what follows would be
    verified only to be cut, and the state must not hold it). Parents stay listed first."""
    if not eos or not any(t in eos for t in tree.tokens):
        return tree
    kept: list[int] = []
    new: dict[int, int] = {}
    for i, p in enumerate(tree.parents):
        if p == -1 or (p in new and tree.tokens[p] not in eos):
            new[i] = len(kept)
            kept.append(i)
    return DraftTree(
        [tree.tokens[i] for i in kept],
        [-1 if tree.parents[i] == -1 else new[tree.parents[i]] for i in kept],
    )


class _Rows:
    """The rows still generating: the target's state over them and, per row, its index in
    the prompts (`rows`), its last token (in no state yet), its tokens out so far and its
    key (`keys` (B, 2); None when greedy)."""

    def __init__(self, state: Any, last: list[int], keys: mx.array | None) -> None:
        self.state: Any = state
        self.rows = list(range(len(last)))
        self.last = last
        self.emitted = [0] * len(last)
        self.keys = keys

    def keys_at(self, width: int, ahead: int = 0) -> mx.array | None:
        """(B, width, 2) the keys of each row's next `width` positions, `ahead` positions
        on (a step built before the last one's tokens were counted; None when greedy)."""
        if self.keys is None:
            return None
        return position_keys(self.keys, [e + ahead for e in self.emitted], width)

    def tree_key(self) -> mx.array | None:
        """A tree round's one key (its one row's), from its first position's key."""
        keys = self.keys_at(1)
        return None if keys is None else fold_in(keys[0, 0], TREE)

    def record(self, finals: Finals, done: list[bool], out: list[Token]) -> None:
        """The final states of the rows `done` ends, into `finals`: each holds its tokens,
        its last one too (a next token, never in the state, runs through the target)."""
        ended = [i for i, d in enumerate(done) if d]
        if ended:
            finals.finish(self.state, ended, [self.rows[i] for i in ended],
                          self.pending(ended, out))  # fmt: skip

    def pending(self, positions: list[int], out: list[Token]) -> list[int | None]:
        """Per row at `positions`, its last emitted token when the state does not hold it
        (the target's own next token), else None (an accepted draft: committed)."""
        last = {t.row: t for t in out}
        return [None if last[self.rows[i]].from_draft else last[self.rows[i]].token
                for i in positions]  # fmt: skip

    def view(self, done: list[bool]) -> Any:
        """The rows still generating, for `Finals.hold`: read when called (no reference
        to the state is held)."""
        alive = [i for i, d in enumerate(done) if not d]
        pending = [self.last[i] for i in alive]
        return lambda: (self.state, alive, [self.rows[i] for i in alive], pending)

    def keep(self, alive: list[int]) -> None:
        """Only the rows at positions `alive` stay, in this order."""
        self.state = filter(self.state, alive)
        self.rows = [self.rows[i] for i in alive]
        self.last = [self.last[i] for i in alive]
        self.emitted = [self.emitted[i] for i in alive]
        if self.keys is not None:
            self.keys = self.keys[mx.array(alive)]

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
