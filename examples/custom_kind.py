"""A new kind of state in one file: the kind contract (`kvstate.kinds`) at work.

`TokenHistory` holds the token ids each row has seen, right-aligned in a (B, capacity) int32
buffer with per-row left padding, the state a prompt-lookup drafter keeps next to the model's.
Declaring the class and registering its generic functions is all it takes: every public
transform, `check`, `save` / `load`, composites (a ModelState holding it), `capabilities` and
the hypothesis strategies then work on it, and nothing else in kvstate changes.

Run: python examples/custom_kind.py
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstate as ks
from kvstate import kinds
from kvstate.kinds import Capabilities, State, replace, state_class, static_field
from kvstate.testing import accepted_counts, strategy_for


@state_class(Capabilities(trimmable=True, ragged_commit=True, batchable=True))
class TokenHistory(State):
    """ids (B, capacity) int32: row b's tokens at [left_padding[b], length)."""

    ids: mx.array | None = None
    left_padding: mx.array | None = None
    length: int = static_field(default=0)
    appended: int = static_field(default=0)


@kinds.batch_size_of.register
def _(state: TokenHistory) -> int:
    return 1 if state.ids is None else int(state.ids.shape[0])


@kinds.config_of.register
def _(state: TokenHistory) -> dict[str, Any]:
    return {"kind": "TokenHistory"}


@kinds.problems.register
def _(state: TokenHistory, values: bool) -> list[str]:
    found = [f"{n}: must be an int >= 0" for n in ("length", "appended")
             if not isinstance(getattr(state, n), int) or getattr(state, n) < 0]  # fmt: skip
    if state.ids is None:
        return found + (["length: must be 0 without ids"] if state.length else [])
    if state.ids.ndim != 2 or state.ids.dtype != mx.int32:
        return [
            *found,
            f"ids: must be (B, capacity) int32; got {state.ids.shape} {state.ids.dtype}",
        ]
    if not found and not state.appended <= state.length <= state.ids.shape[1]:
        found.append(f"appended <= length <= capacity fails: {state.appended}, {state.length}")
    return found


@kinds.take_rows.register
def _(state: TokenHistory, rows: tuple[int, ...]) -> TokenHistory:
    index = mx.array(rows)
    ids = None if state.ids is None else state.ids[index]
    padding = None if state.left_padding is None else state.left_padding[index]
    return replace(state, ids=ids, left_padding=padding)


@kinds.commit_rows.register
def _(state: TokenHistory, counts: tuple[int, ...], checkpoints: Any) -> TokenHistory:
    # Keep each row's accepted ids right-aligned: shift the row right by its rejected count.
    assert state.ids is not None
    rejected = [state.appended - c for c in counts]
    width = state.ids.shape[1]
    source = mx.arange(width)[None, :] - mx.array(rejected)[:, None]
    ids = mx.take_along_axis(state.ids, mx.maximum(source, 0), axis=1)
    padding = _padding(state) + mx.array(rejected)
    return TokenHistory(ids, padding, length=state.length, appended=0)


@kinds.merge_states.register
def _(first: TokenHistory, rest: Sequence[TokenHistory]) -> TokenHistory:
    states = [first, *rest]
    length = max(s.length for s in states)
    ids = mx.concatenate([_right_aligned(s, length) for s in states])
    padding = mx.concatenate([_padding(s) + (length - s.length) for s in states])
    return TokenHistory(ids, padding, length=length, appended=kinds.shared_appended(states))


@kinds.extract_row.register
def _(state: TokenHistory, row: int) -> TokenHistory:
    start = kinds.host_ints(_padding(state))[row]
    ids = None if state.ids is None else state.ids[row : row + 1, start : state.length]
    return TokenHistory(ids, length=state.length - start, appended=state.appended)


def _padding(state: TokenHistory) -> mx.array:
    rows = kinds.batch_size_of(state)
    return state.left_padding if state.left_padding is not None else mx.zeros((rows,), mx.int32)


def _right_aligned(state: TokenHistory, length: int) -> mx.array:
    rows = kinds.batch_size_of(state)
    ids = state.ids[:, : state.length] if state.ids is not None else mx.zeros((rows, 0), mx.int32)
    return mx.pad(ids, [(0, 0), (length - state.length, 0)])


def record(state: TokenHistory, new: mx.array) -> TokenHistory:
    """The forward of this kind: append (B, K) ids."""
    rows = new.shape[0]
    old = state.ids[:, : state.length] if state.ids is not None else mx.zeros((rows, 0), mx.int32)
    ids = mx.concatenate([old, new.astype(mx.int32)], axis=1)
    return TokenHistory(ids, _padding(state), length=ids.shape[1], appended=new.shape[1])


def rows_of(state: TokenHistory) -> list[list[int]]:
    pads = kinds.host_ints(_padding(state))
    return [r[p : state.length] for r, p in zip(state.ids.tolist(), pads, strict=True)]  # type: ignore[union-attr]


@strategy_for(TokenHistory)
@st.composite
def token_histories(draw: Any, *, batch: Any = None, appended: Any = None) -> TokenHistory:
    """The kind's strategy: rows of random ids, the last `appended` from one forward."""
    batch = draw(st.integers(1, 3)) if batch is None else batch
    appended = draw(st.integers(0, 3)) if appended is None else appended
    length = draw(st.integers(appended, appended + 5))
    ids = draw(st.lists(st.integers(0, 999), min_size=batch * length, max_size=batch * length))
    start = TokenHistory(mx.zeros((batch, 0), mx.int32), length=0)
    before = record(start, mx.array(ids, mx.int32).reshape(batch, length)[:, : length - appended])
    return record(before, mx.array(ids, mx.int32).reshape(batch, length)[:, length - appended :])


@settings(max_examples=30, deadline=None, database=None, derandomize=True)
@given(st.data())
def commit_keeps_each_rows_accepted_prefix(data: Any) -> None:
    state = data.draw(token_histories())
    accepted = data.draw(accepted_counts(state))
    counts = accepted if isinstance(accepted, list) else [accepted] * ks.batch_size(state)
    expected = [
        r[: len(r) - state.appended + c] for r, c in zip(rows_of(state), counts, strict=True)
    ]
    assert rows_of(ks.commit_prefix(state, accepted)) == expected


def main() -> None:
    a = record(TokenHistory(), mx.array([[1, 2, 3, 4]]))
    b = record(TokenHistory(), mx.array([[7, 8]]))
    batch = ks.merge([a, b])
    verified = record(batch, mx.array([[5, 6, 9], [9, 10, 11]]))
    committed = ks.commit_prefix(verified, [3, 1])  # ragged: its declared capability
    print("rows after a ragged commit:", rows_of(committed))
    assert rows_of(committed) == [[1, 2, 3, 4, 5, 6, 9], [7, 8, 9]]
    assert rows_of(ks.extract(ks.tile(committed, 2), 3)) == [[7, 8, 9]]
    print("capabilities:", ks.capabilities(committed))

    # Composites, save / load and the checks come from registration alone.
    model_state = ks.ModelState((committed, committed))
    with tempfile.TemporaryDirectory() as tmp:
        ks.save(Path(tmp) / "history.safetensors", model_state)
        loaded = ks.load(Path(tmp) / "history.safetensors")
    assert rows_of(loaded.layers[1]) == rows_of(committed)
    try:
        ks.check(TokenHistory(mx.zeros((1, 4), mx.int32), length=9))
    except ks.ShapeError as e:
        print("check:", str(e).split(".")[0])
    print(repr(loaded))

    commit_keeps_each_rows_accepted_prefix()
    print(f"kinds now: {[k.__name__ for k in kinds.kinds()]}")
    print("ok")


if __name__ == "__main__":
    main()
