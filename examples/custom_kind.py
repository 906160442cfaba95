"""A new kind of state in one file: the kind contract (`kvstate.kinds`) at work.

`TokenHistory` holds the token ids each row has seen, right-aligned in a (B, capacity) int32
buffer with per-row left padding, the state a prompt-lookup drafter keeps next to the model's.
Declaring the class and registering its generic functions is all it takes: every public
transform, `check`, `save` / `load`, composites (a ModelState holding it), `capabilities` and
the hypothesis strategies then work on it, and nothing else in kvstate changes.

At the model boundary, `TokenHistoryCache` is the same state as an mlx-lm-style cache object
(what a model's `make_cache` returns and its forward updates), registered with
`kvstate.adapters.caches`; `HistoryModel` is a tiny llama whose cache list ends with one. Then
`wrap`, the speculative generator with a draft model (whose rollback is one commit, since the
kind declares `joinable_forwards`) and token-tree verification (`keep_path` / `gather_path`)
work on it too: checked against plain greedy decoding.

Run: python examples/custom_kind.py (the hypothesis strategy's property check runs when
hypothesis is installed: the `test` extra).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate import kinds
from kvstate.adapters import wrap
from kvstate.adapters.caches import fresh, register_from, to_cache
from kvstate.adapters.tiny_models import tiny_model
from kvstate.kinds import Capabilities, State, replace, state_class, static_field, trusted
from kvstate.speculative import ModelDrafter, generate


# joinable_forwards: k one-token forwards commit as one (their ids simply follow each other),
# so a draft model with this layer rolls back by one commit.
@state_class(
    Capabilities(trimmable=True, ragged_commit=True, batchable=True, joinable_forwards=True)
)
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


@kinds.gather_path.register
def _(state: TokenHistory, positions: tuple[int, ...]) -> mx.array:
    # A tree forward appended its T tokens in input order: the path's ids, gathered.
    assert state.ids is not None
    start = state.length - state.appended
    return state.ids[:, mx.array([start + q for q in positions])]


@kinds.keep_path.register
def _(state: TokenHistory, positions: tuple[int, ...], checkpoints: Any, gathered: Any) -> Any:
    assert state.ids is not None
    start = state.length - state.appended
    ids = state.ids if gathered is None else mx.concatenate([state.ids[:, :start], gathered], 1)
    kept = start + len(positions)
    return TokenHistory(ids[:, :kept], state.left_padding, length=kept, appended=0)


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


# ---------------------------------------------------------------------------------------
# The model boundary: the kind as an mlx-lm-style cache object, in a model.
# ---------------------------------------------------------------------------------------


class TokenHistoryCache:
    """A TokenHistory as mlx-lm keeps state: a mutable object the model's forward updates.
    ids (B, T) int32, right-aligned; left_padding (B,) int32 or None."""

    def __init__(self, ids: mx.array | None = None, left_padding: mx.array | None = None):
        self.ids, self.left_padding = ids, left_padding

    def update(self, tokens: mx.array) -> None:
        old = self.ids if self.ids is not None else mx.zeros((tokens.shape[0], 0), mx.int32)
        self.ids = mx.concatenate([old, tokens.astype(mx.int32)], axis=1)

    @classmethod
    def merge(cls, caches: list[TokenHistoryCache]) -> TokenHistoryCache:
        """A batch of fresh caches, one per row (what mlx-lm's batching of a model's caches
        calls; kvstate merges filled states itself, with `ks.merge`)."""
        assert all(c.ids is None for c in caches), "merges fresh caches only"
        rows = len(caches)
        return cls(mx.zeros((rows, 0), mx.int32), mx.zeros((rows,), mx.int32))


# in_input_order: the cache holds one entry per token, in input order, and takes no part in
# attention, so a token-tree forward runs it as it is (keep_path keeps the winning path).
@register_from(TokenHistoryCache, in_input_order=True)
def _(cache: TokenHistoryCache, appended: int = 0) -> TokenHistory:
    # Trusted: a converter's result is checked by from_mlx_lm, or read back from a cache the
    # model has just written.
    length = 0 if cache.ids is None else cache.ids.shape[1]
    return trusted(TokenHistory)(fresh(cache.ids), fresh(cache.left_padding), length, appended)


@to_cache.register
def _(state: TokenHistory, lib: Any = None) -> TokenHistoryCache:
    ids = None if state.ids is None else state.ids[:, : state.length]
    return TokenHistoryCache(ids, fresh(state.left_padding))


class HistoryModel(nn.Module):
    """An mlx-lm model whose cache list ends with a TokenHistoryCache: the ids it has seen."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.args = inner.args  # vocab_size, as mlx-lm models carry it

    @property
    def layers(self) -> Any:
        return self.inner.layers

    def make_cache(self) -> list[Any]:
        return [*make_prompt_cache(self.inner), TokenHistoryCache()]

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        *layers, history = cache
        logits = self.inner(inputs, cache=layers, **kwargs)
        history.update(inputs)
        return logits


class Counted:
    """A wrapped model that counts its plain forwards (a draft model's proposals run as
    `chain`; a plain call after the prompts is a re-run of kept tokens)."""

    def __init__(self, m: Any) -> None:
        self.m, self.calls = m, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.m, name)

    def __call__(self, tokens: Any, state: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.m(tokens, state, **kwargs)


def through_a_wrapped_model() -> None:
    """The kind in a wrapped model: plain, speculative (linear and token-tree) generation give
    the same tokens, and the history layer holds exactly the tokens each row has seen."""
    target = wrap(HistoryModel(tiny_model("llama", seed=0)))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    plain = _collect(generate(target, prompts, max_tokens=12))
    draft = Counted(wrap(HistoryModel(tiny_model("llama", seed=1))))  # another model
    # Fixed k (adaptive=False): every round proposes (the default policy's plain steps run
    # the last token through the draft model, which is no rollback).
    drafted = _collect(
        generate(target, prompts, ModelDrafter(draft), k=3, max_tokens=12, adaptive=False)
    )
    assert drafted == plain, (drafted, plain)
    # The prompts run through the draft model's prefill, then only proposals: every
    # rejected draft was rolled back by one commit of the draft state, none by a plain
    # forward running kept tokens again.
    assert draft.calls == 0, draft.calls
    tree = _collect(
        generate(target, prompts[:1], ModelDrafter(draft, branches=2), tree="tree", max_tokens=12)
    )
    assert tree == plain[:1], (tree, plain[:1])
    print("wrapped HistoryModel: plain, draft-model and tree generation agree:", plain[0][:6])

    # The state after a prompt and a verify, committed: the history is what the row kept.
    _, state = target(mx.array([prompts[0]]), target.init_state())
    _, verified = target(mx.array([[11, 12, 13]]), state)
    kept = ks.commit_prefix(verified, 2)
    assert rows_of(kept.layers[-1]) == [[*prompts[0], 11, 12]], rows_of(kept.layers[-1])


def _collect(rounds: Any) -> list[list[int]]:
    rows: dict[int, list[int]] = {}
    for tokens in rounds:
        for t in tokens:
            rows.setdefault(t.row, []).append(t.token)
    return [rows[r] for r in sorted(rows)]


def property_check() -> bool:
    """The kind's hypothesis strategy, registered with `kvstate.testing.strategy_for`, and a
    property of its commit checked over it. Needs hypothesis (the `test` extra: `pip install
    -e ".[cpu,test]"`); False when it is not installed (the rest of the example runs)."""
    try:
        from hypothesis import given, settings
        from hypothesis import strategies as st

        from kvstate.testing import accepted_counts, strategy_for
    except ImportError:
        return False

    @strategy_for(TokenHistory)
    @st.composite
    def token_histories(draw: Any, *, batch: Any = None, appended: Any = None) -> TokenHistory:
        """The kind's strategy: rows of random ids, the last `appended` from one forward."""
        batch = draw(st.integers(1, 3)) if batch is None else batch
        appended = draw(st.integers(0, 3)) if appended is None else appended
        length = draw(st.integers(appended, appended + 5))
        ids = draw(st.lists(st.integers(0, 999), min_size=batch * length, max_size=batch * length))
        rows = mx.array(ids, mx.int32).reshape(batch, length)
        start = TokenHistory(mx.zeros((batch, 0), mx.int32), length=0)
        before = record(start, rows[:, : length - appended])
        return record(before, rows[:, length - appended :])

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

    commit_keeps_each_rows_accepted_prefix()
    return True


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
    try:  # the constructor checks the fields from their shapes (the kind's problems)
        TokenHistory(mx.zeros((1, 4), mx.int32), length=9)
    except ks.ShapeError as e:
        print("constructor:", str(e).split(".")[0])
    print(repr(loaded))

    if property_check():
        print("the kind's hypothesis strategy: commit keeps each row's accepted prefix")
    else:
        print("(hypothesis is not installed: the property check is skipped; pip install -e "
              "'.[cpu,test]' runs it)")  # fmt: skip
    through_a_wrapped_model()
    print(f"kinds now: {[k.__name__ for k in kinds.kinds()]}")
    print("ok")


if __name__ == "__main__":
    main()
