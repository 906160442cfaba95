"""A draft model as a drafter: any wrapped model with the target's vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import mlx.core as mx

from .. import (
    CommitError,
    NotSupportedError,
    StateError,
    TokenError,
    capabilities,
    commit_prefix,
    extend,
    filter,
    row_select,
    tile,
    tree_flatten,
)
from ..kinds import Composite, as_int, inherit, replace, with_parts
from . import _values as values
from ._branches import Branches, first_picks, matching_path
from ._checks import (
    checked_depth,
    checked_kept,
    checked_last,
    checked_model,
    checked_prompts,
    checked_rows,
    checked_sampler,
    started_rows,
)
from ._drafter import Drafted, DraftTree, Proposal
from ._prefill import PREFILL_STEP, prefill
from ._replay import run_kept
from ._sampling import Sampler, draw, draw_from
from ._target import Pick, Target
from ._trees import tree_of_paths


def rolls_back_by_trim(state: Any) -> bool:
    """Whether the draft model's one-token forwards from `state` roll back as one forward
    (`Capabilities.joinable_forwards`, every part: dense KV caches; not windows, whose
    rollback rebuilds from the layout one multi-token forward leaves while one-token forwards
    overwrite ring slots, nor recurrent arrays, which need checkpoints)."""
    return capabilities(state).joinable_forwards


class _Proposed(NamedTuple):
    before: Any  # the state the proposal started from (None where nothing rolls back to it)
    after: Any  # after the pending draft, the last token and drafts 1..depth-1
    final_draft: mx.array  # (B, 1) the last draft, never fed
    pending: mx.array | None  # (B, 1) the last round's kept final draft, fed first
    depth: int  # the drafts proposed per row

    @property
    def ran(self) -> int:
        """Tokens the proposal's forwards ran: the pending draft, the last token and drafts
        1..depth-1."""
        return self.depth + (self.pending is not None)


class ModelDrafter:
    """Drafts k tokens per row with a smaller model, one token at a time, and keeps the draft
    model's state in step with the target's.

    After the verify the draft state must hold every token the target kept:
    - every row kept k or k + 1 tokens: the proposing state as it is (the final draft, when
      kept, is fed at the start of the next proposal, as in mlx-lm);
    - a draft model whose state is only dense KV caches (no windows, no recurrent layers):
      the proposal's one-token forwards are stamped as one forward of their tokens and
      rolled back with one `commit_prefix` (ragged counts too), like mlx-lm's trim of its
      draft cache, instead of running the kept tokens again, unless some rows of a batch
      kept their final draft (never fed) and others did not;
    - otherwise (windows, recurrent and hybrid draft models) the kept tokens run through the
      draft model again from the state before the proposal: one plain forward when every row
      kept the same number, one capturing forward and a ragged `commit_prefix` when rows
      differ (row by row where that commit is refused: pooled windows), so those draft
      models stay exact.

    Tree drafting (`propose_tree`, batch 1): the draft model's `branches` most likely first
    tokens (distinct draws without replacement when sampling), each continued for k - 1
    more steps in one batched run over the draft state tiled to one row per branch; after
    the verify the winning branch's row is kept and rolled back as above.

    `draft`: a wrapped model (`kvstate.adapters.wrap(model)`), or any `Target`; with
    `chain` (a `ChainTarget`) its steps run on its own caches. `seed`: the key of its draws
    when it is started without one (driven by hand); `generate` hands it a key of its own,
    split from the generator's seed, so the two seeds never correlate the drafts with the
    target's draws. `pipelined`: evaluate each
    draft token asynchronously as soon as its forward is built, so the device computes step
    i while the host builds step i + 1 (mlx-lm's `async_eval` loop); None: on a GPU only.
    On MLX's CPU backend the hand-off costs more than it overlaps (measured on 2 cores:
    benchmarks/speculative.py), so the round's drafts and verify are evaluated together.
    """

    uses_hidden = False
    prefills = True  # the generator passes its prefill_step_size to `start`

    def __init__(
        self, draft: Target, seed: int = 0, *, pipelined: bool | None = None, branches: int = 3
    ) -> None:
        abilities = checked_model(draft, "ModelDrafter: draft")
        self.branches = values.integer(branches, "ModelDrafter: branches", 1)
        self.draft = draft
        self._chain = abilities.chain  # a wrapped model's steps on its caches
        self._vocab = abilities.vocab_size
        if pipelined is not None:
            values.flag(pipelined, "ModelDrafter: pipelined")
        self.pipelined = mx.default_device().type == mx.gpu if pipelined is None else pipelined
        self.key = mx.random.key(values.seed(seed, "ModelDrafter: seed"))
        self._rows: int | None = None  # the batch it was started on, as rows leave
        self.state: Any = None  # holds every token the target kept, but `pending`
        self.pending: mx.array | None = None  # (B, 1) a kept final draft not yet fed
        self._proposal: _Proposed | Branches | None = None
        self._trims: bool | None = None  # rolls_back_by_trim of the draft state, once known

    def start(
        self,
        prompts: list[list[int]],
        *,
        key: mx.array | None = None,
        prefill_step_size: int = PREFILL_STEP,
        prompt_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Prefill the draft model with `prompts` (one per row), as the generator prefills
        the target: chunks of `prefill_step_size` positions, `prompt_progress(processed,
        total)` as they go. `key`: the key of this generation's draws (the generator's, see
        `Drafter.start`; None: keep drawing from its own seed)."""
        prompts = checked_prompts(prompts, self._vocab, "ModelDrafter.start")
        if key is not None:
            self.key = values.prng_key(key, "ModelDrafter.start: key")
        _, self.state, _ = prefill(
            self.draft, prompts, step=prefill_step_size, progress=prompt_progress
        )
        self.pending, self._proposal = None, None
        self._rows = len(prompts)
        self._trims = rolls_back_by_trim(self.state)

    def add_rows(self, prompts: list[list[int]], *, prefill_step_size: int = PREFILL_STEP) -> None:
        """New rows after the current ones, whose `prompts` the target prefilled (a batch
        that admits rows between rounds): the draft model prefills them (chunks of
        `prefill_step_size`) and their states join the draft state (`extend`). Between
        rounds only (after `accept`); `start` when none were started."""
        where = "ModelDrafter.add_rows"
        if self._rows is None:
            self.start(prompts, prefill_step_size=prefill_step_size)
            return
        if self._proposal is not None:
            raise StateError(
                f"{where}: the last proposal was never accepted; add rows between rounds "
                "(after accept)"
            )
        prompts = checked_prompts(prompts, self._vocab, where)
        _, added, _ = prefill(self.draft, prompts, step=prefill_step_size)
        if self.pending is not None:
            # The kept final draft every row owes its state: fed now, so the new rows (which
            # owe none) line up with them.
            self.state = self.draft(self.pending, self.state)[1]
            self.pending = None
        self.state = extend(self.state, added)
        self._rows += len(prompts)

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        last = self._checked_call("ModelDrafter.propose", last, k, sampler)
        y = mx.array(last, mx.int32)[:, None]
        prefix = self.pending
        if prefix is not None:
            y = mx.concatenate([prefix, y], axis=1)
        tokens: list[mx.array] = []
        probs: list[mx.array] = []
        widths: list[int] = []  # each step's logits width: every draft is an id below it

        def pick(logits: mx.array) -> mx.array:  # (B, vocab), a step's last position
            widths.append(logits.shape[-1])
            if sampler.greedy:  # sampler.sample(sampler.probs(l)) is l.argmax(-1), less work
                drafted = logits.argmax(-1, keepdims=True).astype(mx.int32)  # (B, 1)
            else:
                q = sampler.probs(logits)
                self.key, key = mx.random.split(self.key)
                drafted = draw_from(sampler, q, key)[:, None]
                probs.append(q[:, None])
            if self.pipelined:
                mx.async_eval(drafted)
            tokens.append(drafted)
            return drafted

        # Nothing of batch 1 rolls back to the state before the proposal (a trim or the
        # proposing state covers every count): holding it would make the first draft step
        # copy every KV buffer instead of writing into it (copy on write), so it is handed
        # over to the draft forwards.
        handed_over = bool(self._trims) and len(last) == 1
        before = None if handed_over else self.state
        chain = self._chain
        if chain is not None:
            _, drafted, after = chain(y, self._take_state() if handed_over else before, k, pick)
        else:
            start = self._take_state() if handed_over else before
            drafted, after = _drafted_by_calls(self.draft, y, start, k, pick)
        self._proposal = _Proposed(before, after, tokens[-1], prefix, k)
        distributions = mx.concatenate(probs, axis=1) if probs else None
        return Drafted(drafted, [k] * len(last), distributions, max(widths))

    def _take_state(self) -> Any:
        state, self.state = self.state, None
        return state

    def _checked_call(self, where: str, last: Any, k: Any, sampler: Any) -> list[int]:
        """A proposal's arguments, checked (the drafter started, its last proposal accepted)."""
        rows = started_rows(self._rows, where)
        if self._proposal is not None:
            raise StateError(
                f"{where}: the last proposal was never accepted; call accept(fed, kept) after "
                "each verify (a drafter serves one generation at a time)"
            )
        checked_depth(k, where)
        checked_sampler(sampler, where)
        return checked_last(last, rows, self._vocab, where)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        proposal = self._proposal
        rows = started_rows(self._rows, "ModelDrafter.accept")
        if not isinstance(proposal, Branches):  # a tree's counts: _kept_branch checks them
            most = values.INT32_LIMIT if proposal is None else proposal.depth + 1
            kept = checked_kept(fed, kept, rows, most, "ModelDrafter.accept")
        if isinstance(proposal, Branches):  # after a tree round: the kept branch's row
            branch = _kept_branch(proposal, fed, kept)
            if branch is None:  # not a proposed path: the kept tokens again
                self._proposal, self.pending = None, None
                self._run_kept(fed, kept, proposal.pending)
                return
            proposal = branch
        self._proposal, self.pending = None, None
        uniform = len(set(kept)) == 1
        if proposal is not None and uniform and kept[0] >= proposal.depth:
            self.state = proposal.after
            if kept[0] == proposal.depth + 1:
                self.pending = proposal.final_draft
            return
        if self._trims and proposal is not None and _trims_to(proposal, kept, uniform):
            self.state = _trimmed(proposal, kept)
            return
        self._run_kept(fed, kept, None if proposal is None else proposal.pending)

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        """Up to `branches` candidate continuations of depth `k` of a batch-1 row, as a
        token tree: the draft model's most likely (or, sampling, distinct sampled) first
        tokens after `last`, each followed by the draft model's own next k - 1 picks."""
        where = "ModelDrafter.propose_tree"
        rows = started_rows(self._rows, where)
        if rows != 1:
            raise NotSupportedError(
                f"ModelDrafter.propose_tree: tree drafting takes one row; the draft state has "
                f"{rows} (use propose for a batch, or generate one prompt at a time)"
            )
        if not values.is_integer(last):
            raise TokenError(f"{where}: last must be an int token id; got {last!r}")
        last = self._checked_call(where, [last], k, sampler)[0]
        branches = self.branches
        if self._vocab is not None and branches > self._vocab:
            raise StateError(
                f"{where}: branches={branches} but the draft model has a vocabulary of "
                f"{self._vocab}; use ModelDrafter(..., branches=<= {self._vocab})"
            )
        y = mx.array([[last]], mx.int32)
        prefix = self.pending
        if prefix is not None:
            y = mx.concatenate([prefix, y], axis=1)
        step = 0
        weights: list[mx.array] = []  # (B,) sampling: each first token's probability

        def pick(logits: mx.array) -> mx.array:  # (B, vocab): every row a branch
            nonlocal step
            if step == 0:  # every row holds the same history: branch on row 0's logits
                self.key, key = mx.random.split(self.key)
                drafted, weight = first_picks(logits[0], branches, sampler, key)
                if weight is not None:
                    weights.append(weight)
            else:
                self.key, picked = draw(sampler, logits, self.key)
                drafted = picked.astype(mx.int32)
            step += 1
            if self.pipelined:
                mx.async_eval(drafted)
            return drafted[:, None]  # (B, 1): the next step's input

        # The state before stays whole (tile copies it): what a re-run rolls back to.
        tiled = tile(self.state, branches)
        ys = mx.repeat(y, branches, axis=0)
        chain = self._chain
        if chain is not None:
            _, drafted, after = chain(ys, tiled, k, pick)
        else:
            drafted, after = _drafted_by_calls(self.draft, ys, tiled, k, pick)
        del tiled
        paths = cast(list[list[int]], drafted.tolist())
        # A first token the sampler gives no mass (top-k, top-p) is never worth a branch.
        live = (
            list(range(branches))
            if not weights
            else [b for b, w in enumerate(cast(list[float], weights[0].tolist())) if w > 0]
        )
        self._proposal = Branches(after, [paths[b] for b in live], live, prefix, k)
        return DraftTree(*tree_of_paths([paths[b] for b in live]))

    def _run_kept(self, fed: mx.array, kept: list[int], pending: mx.array | None) -> None:
        """The kept tokens through the draft model again, from the state before the proposal."""
        assert self.state is not None, "a batch-1 trimmable proposal keeps no state before it"
        tokens = fed[:, : max(kept)]
        if pending is not None:  # fed at the start of the proposal, never kept in self.state
            tokens = mx.concatenate([pending, tokens], axis=1)
            kept = [n + 1 for n in kept]
        if len(set(kept)) == 1:
            self.state = self.draft(tokens, self.state)[1]
        else:
            _, verified, checkpoints = self.draft(tokens, self.state, capture=True)
            try:
                self.state = commit_prefix(verified, kept, checkpoints)
            except CommitError:  # a pooled window some row keeps only part of: row by row
                self.state = run_kept(self.draft, self.state, tokens, kept)
        if self.pipelined:
            # Set evaluating now, beside the target's next step: left lazy, the catch-up of
            # every plain step since the last proposal would run inside the next proposal's
            # first draft step, and a policy timing its rounds would charge it to that verify.
            # (Unpipelined, the drafter evaluates nothing of its own: one read a round.)
            mx.async_eval(tree_flatten(self.state)[0])

    def keep_rows(self, rows: list[int]) -> None:
        rows = checked_rows(rows, started_rows(self._rows, "ModelDrafter.keep_rows"),
                            "ModelDrafter.keep_rows")  # fmt: skip
        self.state = filter(self.state, rows)
        self._rows = len(rows)
        if self.pending is not None:
            self.pending = self.pending[mx.array(rows)]


def _drafted_by_calls(
    draft: Target, y: mx.array, state: Any, depth: int, pick: Pick
) -> tuple[Any, Any]:
    """A draft model without `chain`: `depth` wrapped calls, each fed the last one's pick."""
    tokens = []
    for _ in range(depth):
        logits, state = draft(y, state)
        y = pick(logits[:, -1])
        tokens.append(y)
    return (tokens[0] if depth == 1 else mx.concatenate(tokens, axis=1)), state


def _kept_branch(proposal: Branches, fed: mx.array, kept: list[int]) -> _Proposed | None:
    """After a tree verify: the branch the target kept as a linear proposal of its row (then
    rolled back like one), or None when the kept drafts are no proposed path. Refuses counts
    a depth-k tree cannot keep, before anything changes."""
    if len(kept) != 1 or fed.shape[0] != 1:
        raise StateError(
            f"ModelDrafter.accept: a tree proposal takes one row; got fed {fed.shape}, kept {kept}"
        )
    n = as_int(kept[0], "ModelDrafter.accept: kept", StateError)
    if not 1 <= n <= min(fed.shape[1], proposal.depth + 1):
        raise StateError(
            f"ModelDrafter.accept: kept {n} of {fed.shape[1]} fed tokens after a depth-"
            f"{proposal.depth} tree; it must be 1 .. {min(fed.shape[1], proposal.depth + 1)}"
        )
    path = matching_path(proposal, cast(list[int], fed[0, 1:n].tolist()))
    if path is None:
        return None
    return _Proposed(
        None,
        row_select(proposal.after, proposal.rows[path]),
        mx.array([[proposal.paths[path][-1]]], mx.int32),
        proposal.pending,
        proposal.depth,
    )


def _trims_to(proposal: _Proposed, kept: list[int], uniform: bool) -> bool:
    """Whether a trim of the proposing state gives these counts: no row kept the final
    draft (never fed), and ragged counts only where the kinds take them."""
    if max(kept) > proposal.depth:
        return False
    return uniform or capabilities(proposal.after).ragged_commit


def _stamped(state: Any, n: int) -> Any:
    """A state whose parts have joinable forwards (`Capabilities.joinable_forwards`) as if
    its last `n` tokens came from one forward: such a kind records a forward by its
    `appended` alone (what `kinds.record_forward` does for it), so no state before is
    needed."""
    if isinstance(state, Composite):
        return with_parts(state, tuple(_stamped(p, n) for p in state.parts))
    return replace(state, appended=n)


def _trimmed(proposal: _Proposed, kept: list[int]) -> Any:
    """The proposing state rolled back to the state before it plus each row's kept tokens:
    the proposal's forwards (prefix + depth tokens) stamped as one, then one commit."""
    # The stamp keeps every layer's kind and configuration, so the states the draft model
    # already trusts stay trusted (its next forward skips the fit check).
    stamped = inherit(_stamped(proposal.after, proposal.ran), proposal.after)
    prefix = proposal.ran - proposal.depth
    return commit_prefix(stamped, [prefix + n for n in kept])
