"""Construction checks, for every kind: a state whose fields disagree cannot be built.

Each property draws a valid state of a kind (its `kvstate.testing` strategy), changes one
field so that it disagrees with the others, and rebuilds it through the class's constructor
(`attrs.evolve`, as a hand-built state would be): the constructor must raise
`kvstate.ShapeError` naming that field. Kinds whose fields cannot disagree that way (one
array, nothing to agree with) are skipped example by example; each property checks that it
tested something for every kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvstate as ks
from kvstate import kinds
from kvstate.testing import STRATEGIES

LIBRARY_LAYER_KINDS = [k for k in kinds.layer_kinds() if k.__module__.startswith("kvstate.")]


# The statics that count what a state holds, for each kind, given the state: past the
# buffer's capacity (or the pending forward past what is held) they point at memory no row
# holds. RotatingKV's `offset` counts every token seen; its `index` is bounded by the buffer.
# A single-form PooledKV's `remainder` is bounded by its window (`ratio`); a batched one
# keeps per-row remainders in an array. RecurrentState holds no positions.
def capacity_statics(state: Any) -> tuple[str, ...]:
    name = type(state).__name__
    if name in ("DenseKV", "QuantizedKV", "TurboQuantKV"):
        return ("length", "appended")
    if name in ("RotatingKV", "QuantizedRotatingKV"):
        return ("index", "appended")
    if name in ("ChunkedKV", "BufferedWindowKV", "StaticPrefixKV"):
        return ("offset", "appended")
    if name == "PooledKV":
        return () if state.remainders is not None else ("remainder",)
    assert name == "RecurrentState", f"say which statics of {name} count what it holds"
    return ()


# Kinds whose arrays hold any dtype (an ArraysCache holds whatever the model writes).
ANY_DTYPE = ("RecurrentState",)


def slots(state: Any) -> Iterator[tuple[str, int | None, mx.array]]:
    """(field, index in a tuple field or None, array) of every array child of `state`
    (not inside child states: a `previous` window is a state of its own)."""
    for name in type(state).__kvstate_children__:
        value = getattr(state, name)
        if isinstance(value, mx.array):
            yield name, None, value
        elif isinstance(value, tuple):
            for i, v in enumerate(value):
                if isinstance(v, mx.array):
                    yield name, i, v


def with_slot(state: Any, name: str, index: int | None, array: mx.array) -> Any:
    """`state` rebuilt by its public constructor with one array child replaced."""
    if index is None:
        return attrs.evolve(state, **{name: array})
    items = list(getattr(state, name))
    items[index] = array
    return attrs.evolve(state, **{name: tuple(items)})


def refused(build: Callable[[], Any], *names: str) -> None:
    with pytest.raises(ks.ShapeError) as info:
        build()
    message = str(info.value)
    assert message.startswith("inconsistent "), message
    assert any(n in message for n in names), f"{names} not named in: {message}"


def grown(a: mx.array, axis: int) -> mx.array:
    """`a` with one more entry along `axis` (a copy of its first)."""
    first = mx.take(a, mx.array([0]), axis=axis)
    return mx.concatenate([a, first], axis=axis)


def for_every_kind(prop: Callable[[Any, dict[str, int]], None]) -> Callable[[Any], None]:
    """A test over `kind` running `prop(state, tested)` on drawn states of that kind, which
    must count at least one check in `tested` over all examples."""

    def test(kind: Any) -> None:
        tested = {"count": 0}

        @given(st.data())
        def run(data: Any) -> None:
            state = data.draw(STRATEGIES[kind](batch=2, appended=data.draw(st.integers(0, 2))))
            prop(state, tested)

        run()
        assert tested["count"] > 0, f"no {kind.__name__} example could be tested"

    return test


def _batch_rows(state: Any, tested: dict[str, int]) -> None:
    """One more row in any one array (per-row bookkeeping included) of a state of several
    arrays is refused, naming the array's field; so is a record of the window before the
    last forward (`previous`) of other rows than the state's."""
    found = list(slots(state))
    if len(found) < 2:
        return  # one array agrees with itself: nothing to disagree with
    for name, index, a in found:
        if a.ndim == 0:
            continue
        refused(lambda: with_slot(state, name, index, grown(a, 0)), name)  # noqa: B023
        tested["count"] += 1
    previous = getattr(state, "previous", None)
    if previous is not None and ks.tree_flatten(previous)[0]:
        rows = [0] * (kinds.batch_size_of(previous) + 1)
        refused(lambda: attrs.evolve(state, previous=ks.row_select(previous, rows)), "previous")
        tested["count"] += 1


def _heads_and_capacity(state: Any, tested: dict[str, int]) -> None:
    """A KV kind's arrays share heads (axis 1) and positions (axis 2): one more of either in
    one array is refused, naming it."""
    if "kv_heads" not in kinds.config_of(state):
        tested["count"] += 1  # not a KV kind: its arrays need not share heads
        return
    found = [(n, i, a) for n, i, a in slots(state) if a.ndim == 4]
    if len(found) < 2:
        return
    for name, index, a in found:
        for axis in (1, 2):
            refused(lambda: with_slot(state, name, index, grown(a, axis)), name)  # noqa: B023
            tested["count"] += 1


def _dtypes(state: Any, tested: dict[str, int]) -> None:
    """Integer arrays (per-row bookkeeping, packed codes, channel indices) hold counts and
    codes, floating ones (keys, values, scales, norms) numbers: either as the other is
    refused, naming its field."""
    for name, index, a in slots(state):
        if mx.issubdtype(a.dtype, mx.integer):
            other = a.astype(mx.float32)
        elif type(state).__name__ in ANY_DTYPE:
            continue
        else:
            other = a.astype(mx.int32)
        refused(lambda: with_slot(state, name, index, other), name)  # noqa: B023
        tested["count"] += 1


def _positions_within_capacity(state: Any, tested: dict[str, int]) -> None:
    """A count of held positions past the buffer, or a pending forward longer than what is
    held, is refused, naming the static."""
    for name in capacity_statics(state):
        refused(lambda: attrs.evolve(state, **{name: 10**6}), name)  # noqa: B023
        tested["count"] += 1


def _rebuilds(state: Any, tested: dict[str, int]) -> None:
    """What a strategy draws passes its constructor and `check` (the strategies build
    through the constructors, so they keep producing valid states)."""
    assert ks.check(attrs.evolve(state)) is not None
    tested["count"] += 1


kind_ids: dict[str, Any] = {"ids": lambda k: k.__name__}


@pytest.mark.parametrize("kind", LIBRARY_LAYER_KINDS, **kind_ids)
def test_strategies_draw_states_their_constructors_accept(kind):
    for_every_kind(_rebuilds)(kind)


@pytest.mark.parametrize("kind", LIBRARY_LAYER_KINDS, **kind_ids)
def test_an_array_of_another_batch_is_refused(kind):
    for_every_kind(_batch_rows)(kind)


@pytest.mark.parametrize("kind", LIBRARY_LAYER_KINDS, **kind_ids)
def test_kv_arrays_of_other_heads_or_capacity_are_refused(kind):
    for_every_kind(_heads_and_capacity)(kind)


@pytest.mark.parametrize("kind", LIBRARY_LAYER_KINDS, **kind_ids)
def test_arrays_of_the_wrong_dtype_are_refused(kind):
    for_every_kind(_dtypes)(kind)


@pytest.mark.parametrize("kind", LIBRARY_LAYER_KINDS, **kind_ids)
def test_positions_past_the_capacity_are_refused(kind):
    if kind.__name__ == "RecurrentState":
        pytest.skip("a RecurrentState holds no positions (its arrays have a fixed size)")
    for_every_kind(_positions_within_capacity)(kind)


def test_composites_refuse_parts_of_another_batch():
    """A ModelState or ListState whose parts hold rows of different batches is refused,
    naming the part (a part that holds no arrays yet fits any batch)."""
    tested = {"count": 0}
    layer = st.sampled_from(LIBRARY_LAYER_KINDS)

    @given(st.data())
    def run(data: Any) -> None:
        batch = data.draw(st.integers(2, 3))
        layers = [data.draw(layer.flatmap(lambda k: STRATEGIES[k](batch=batch, appended=0)))]
        other = data.draw(layer.flatmap(lambda k: STRATEGIES[k](batch=1, appended=0)))
        if not ks.tree_flatten(other)[0] or kinds.batch_size_of(layers[0]) != batch:
            return
        for make in (ks.ModelState, ks.ListState):
            refused(lambda: make((*layers, other)), "[1]: batch 1, but other parts have")  # noqa: B023
            tested["count"] += 1

    run()
    assert tested["count"] > 0
