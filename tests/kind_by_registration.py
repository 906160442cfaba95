"""A kind kvstate has never seen, made to work in tree verification and in ModelDrafter's
rollback by registering only (run by tests/test_kinds.py in a process of its own, so the
registry of the test session stays the library's).

`TokenLog` keeps the token ids a row has seen, (B, T) int32, in order. `LogModel` is a target
whose only layer is a TokenLog (a "model" whose next token is always its input + 1 mod V),
with a `tree_forward` that appends the T tokens of a tree in input order, as a wrapped model's
does. Nothing here is an adapter: the speculative package reaches the kind through the kind
contract (`keep_path`, `gather_path`, `Capabilities.joinable_forwards`) alone.

Run: python tests/kind_by_registration.py   (prints "ok")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

import kvstate as ks
from kvstate import kinds
from kvstate.kinds import Capabilities, State, replace, state_class, static_field
from kvstate.speculative import ModelDrafter, Sampler, verify_tree

VOCAB = 50


@state_class(
    Capabilities(trimmable=True, ragged_commit=False, batchable=False, joinable_forwards=True)
)
class TokenLog(State):
    """ids (B, T) int32: every token each row has seen, oldest first."""

    ids: mx.array
    appended: int = static_field(default=0)


@kinds.batch_size_of.register
def _(state: TokenLog) -> int:
    return int(state.ids.shape[0])


@kinds.config_of.register
def _(state: TokenLog) -> dict[str, Any]:
    return {"kind": "TokenLog"}


@kinds.problems.register
def _(state: TokenLog, values: bool) -> list[str]:
    return [] if state.ids.dtype == mx.int32 else [f"ids: must be int32; got {state.ids.dtype}"]


@kinds.take_rows.register
def _(state: TokenLog, rows: tuple[int, ...]) -> TokenLog:
    return replace(state, ids=state.ids[mx.array(rows)])


@kinds.commit_rows.register
def _(state: TokenLog, counts: tuple[int, ...], checkpoints: Any) -> TokenLog:
    count = kinds.uniform_count(state, counts)
    return TokenLog(state.ids[:, : state.ids.shape[1] - (state.appended - count)])


@kinds.merge_states.register
def _(first: TokenLog, rest: Sequence[TokenLog]) -> TokenLog:
    return TokenLog(mx.concatenate([first.ids, *(r.ids for r in rest)]))


@kinds.extract_row.register
def _(state: TokenLog, row: int) -> TokenLog:
    return replace(state, ids=state.ids[row : row + 1])


@kinds.gather_path.register
def _(state: TokenLog, positions: tuple[int, ...]) -> mx.array:
    start = state.ids.shape[1] - state.appended
    return state.ids[:, mx.array([start + q for q in positions])]


@kinds.keep_path.register
def _(state: TokenLog, positions: tuple[int, ...], checkpoints: Any, gathered: Any) -> TokenLog:
    start = state.ids.shape[1] - state.appended
    ids = state.ids if gathered is None else mx.concatenate([state.ids[:, :start], gathered], 1)
    return TokenLog(ids[:, : start + len(positions)])


class LogModel:
    """A target over one TokenLog layer: next token = input + 1 (mod VOCAB), certain."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.calls = 0

    def init_state(self, batch_size: int = 1) -> ks.ModelState:
        return ks.ModelState((TokenLog(mx.zeros((batch_size, 0), mx.int32)),))

    def __call__(self, tokens: Any, state: ks.ModelState, *, capture: bool = False) -> Any:
        self.calls += 1
        tokens = mx.array(tokens, mx.int32)
        log = state.layers[0]
        new = ks.ModelState((TokenLog(mx.concatenate([log.ids, tokens], 1), tokens.shape[1]),))
        logits = _next_logits(tokens)
        return (logits, new, (None,)) if capture else (logits, new)

    def tree_forward(self, tokens: Any, state: ks.ModelState, parents: Sequence[int]) -> Any:
        # The next token depends on the input token alone, so a tree's logits at q are
        # those of a linear forward of q's path, as a real tree forward's are.
        logits, new, checkpoints = self(tokens, state, capture=True)
        return logits, new, checkpoints


def _next_logits(tokens: mx.array) -> mx.array:
    return 10.0 * (mx.arange(VOCAB)[None, None] == ((tokens + 1) % VOCAB)[..., None])


def ids(state: ks.ModelState) -> list[int]:
    return state.layers[0].ids[0].tolist()


def tree_commit() -> None:
    """A tree whose agreeing path is not in place: its entries are gathered into place."""
    target = LogModel()
    _, state = target(mx.array([[3, 4, 5]]), target.init_state())
    state = ks.commit_prefix(state, 3)
    last = 6
    # Drafts: 0: 9 (wrong root), 1: 7 (right root), 2: 9 (wrong child of 1), 3: 8 (right
    # child of 1), 4: 9 (right child of 3). The path 7 -> 8 -> 9 sits at input positions
    # 0, 2, 4, 5: not in place.
    verdict = verify_tree(target, state, last, [9, 7, 9, 8, 9], [-1, -1, 1, 1, 3])
    assert verdict.accepted == 3 and verdict.tokens == [7, 8, 9, 10], verdict
    assert ids(verdict.state) == [3, 4, 5, 6, 7, 8, 9], ids(verdict.state)
    assert verdict.state.layers[0].appended == 0
    # A path already in place (the first root accepted) keeps a prefix.
    verdict = verify_tree(target, state, last, [7, 9], [-1, 0])
    assert ids(verdict.state) == [3, 4, 5, 6, 7], ids(verdict.state)


def draft_rollback() -> None:
    """ModelDrafter rolls a TokenLog draft back by one commit (no forward re-run)."""
    draft = LogModel()
    drafter = ModelDrafter(draft)
    drafter.start([[1, 2, 3]])
    proposal = drafter.propose([4], 3, Sampler())  # 4: the target's token after the prompt
    assert proposal.tokens.tolist() == [[5, 6, 7]], proposal
    calls = draft.calls
    drafter.accept(mx.array([[4, 5, 6, 7]]), [2])  # the last token and one draft kept
    assert draft.calls == calls, "the draft model ran again: it did not roll back by a trim"
    assert ids(drafter.state) == [1, 2, 3, 4, 5], ids(drafter.state)


if __name__ == "__main__":
    tree_commit()
    draft_rollback()
    print("TokenLog ok")
