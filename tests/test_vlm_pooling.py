"""mlx-vlm's PoolingCache / BatchPoolingCache <-> PooledKV, against mlx-vlm's own methods.

The caches are driven the way deepseek_v4's compressor drives them (accumulate_windows, pool
each complete window, update_and_fetch). Oracles: the round-tripped cache behaves like the
original under further forwards; kvstate's merge / filter / extend / extract give mlx-vlm's
merge / filter / extend / extract array for array; commit_prefix keeps what mlx-vlm's own
speculation transaction (start_speculation, forward, commit_speculation) keeps, or refuses
exactly where the kept window's raw tokens were pooled away.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from mlx_vlm.models import cache as V

import kvstate as ks
from kvstate import tree_flatten
from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm
from kvstate.kinds import record_forward
from kvstate.testing import assert_states_equal

R = 3  # pooling ratio
D = 4  # kv / gate / pooled dim


def tokens(batch: int, n: int, seed: int) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    kv = mx.random.normal((batch, n, D), key=key)
    return kv, mx.random.normal((batch, n, D), key=mx.random.split(key)[0])


def forward(cache: Any, n: int, seed: int, batch: int = 1, offset: int = 0) -> Any:
    """What deepseek_v4's compressor does: accumulate, pool each complete window (a gated
    sum), store the pooled tokens."""
    kv, gate = tokens(batch, n, seed)
    ready_kv, ready_gate, _ = cache.accumulate_windows(kv, gate, offset)
    windows = ready_kv.shape[1] // R
    pooled = (ready_kv * mx.sigmoid(ready_gate)).reshape(batch, windows, R, D).sum(axis=2)
    cache.update_and_fetch(pooled)
    return cache


def single(sizes: list[int], seed: int = 0, batch: int = 1) -> Any:
    cache = V.PoolingCache(R)
    for i, n in enumerate(sizes):
        forward(cache, n, seed + i, batch)
    return cache


def view(cache: Any) -> list[tuple[Any, ...]]:
    """What each row means: its pooled tokens, remainder, the remainder window's raw inputs."""
    if isinstance(cache, V.BatchPoolingCache):
        rows = list(zip(cache.remainder, cache._pool_lengths, strict=True))
        pads = list(cache.left_padding)
    else:
        width = 0 if cache.pooled is None else cache.pooled.shape[1]
        rows = [(cache.remainder, width)] * cache.batch_size
        pads = [0] * len(rows)
    out = []
    for b, (rem, pool) in enumerate(rows):
        pooled = np.array(cache.pooled[b, :pool]) if pool else None
        raw = (np.array(cache.buf_kv[b, :rem]), np.array(cache.buf_gate[b, :rem])) if rem else None
        out.append((pool, rem, pads[b], pooled, raw))
    return out


def assert_same_view(a: Any, b: Any) -> None:
    for x, y in zip(view(a), view(b), strict=True):
        assert x[:3] == y[:3]
        for p, q in ((x[3], y[3]), *zip(x[4] or (None,) * 2, y[4] or (None,) * 2, strict=True)):
            assert (p is None) == (q is None)
            if p is not None:
                np.testing.assert_array_equal(p, q)


def assert_same_fields(ours: Any, theirs: Any) -> None:
    """The two caches hold the same arrays (bitwise) and bookkeeping."""
    assert type(ours) is type(theirs) and ours.ratio == theirs.ratio
    for name in ("buf_kv", "buf_gate", "pooled"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=name)
    names = ["remainder"]
    if isinstance(theirs, V.BatchPoolingCache):
        names += ["_pool_lengths", "_processed", "left_padding", "_lengths"]
    for name in names:
        assert list(np.ravel(getattr(ours, name))) == list(np.ravel(getattr(theirs, name))), name


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[], [2], [3], [5], [4, 1, 1], [7, 1, 1, 1, 2]])
@pytest.mark.parametrize("batch", [1, 2])
def test_pooling_cache_round_trips_and_behaves_the_same(sizes, batch):
    cache = single(sizes, batch=batch)
    state = from_mlx_vlm(cache)
    assert isinstance(state, ks.PooledKV) and state.remainders is None
    back = to_mlx_vlm(state)
    assert_same_fields(back, cache)
    assert not {id(a) for a in tree_flatten(state)[0]} & {
        id(a) for a in (cache.buf_kv, cache.buf_gate, cache.pooled, back.buf_kv, back.pooled)
    }
    for i, n in enumerate([1, 2, 4, 1]):  # both go on the same way
        forward(cache, n, 100 + i, batch)
        forward(back, n, 100 + i, batch)
        assert_same_fields(back, cache)
        assert (
            cache.make_mask(n, 5) is None
            or (np.array(back.make_mask(n, 5)) == np.array(cache.make_mask(n, 5))).all()
        )
    assert_states_equal(from_mlx_vlm(back), from_mlx_vlm(cache))


def test_batch_pooling_cache_round_trips_with_pending_padding_and_behaves_the_same():
    cache = V.BatchPoolingCache(R, [2, 0, 1])
    state = from_mlx_vlm(cache)
    assert state.left_padding.tolist() == [2, 0, 1]
    back = to_mlx_vlm(state)
    assert_same_fields(back, cache)
    for i, n in enumerate([5, 1, 1, 3, 1]):  # the padded prompt, then steps
        forward(cache, n, 10 + i, 3)
        state = from_mlx_vlm(cache)
        forward(back, n, 10 + i, 3)
        assert_same_fields(back, cache)
        back = to_mlx_vlm(from_mlx_vlm(back))  # through the state at every step
    assert cache.left_padding == [0, 0, 0] and cache._pool_lengths == [3, 3, 3]
    assert cache.remainder == [0, 2, 1]  # 9, 11 and 10 real tokens
    assert_states_equal(from_mlx_vlm(back), state)


def test_caches_in_the_middle_of_a_forward_or_transaction_are_refused():
    speculating = single([2])
    speculating.start_speculation(2)
    with pytest.raises(ks.StateError, match="speculation transaction"):
        from_mlx_vlm(speculating)
    batch = V.BatchPoolingCache(R, [0, 1])
    batch.prepare(lengths=[2, 1])
    with pytest.raises(ks.StateError, match="between prepare"):
        from_mlx_vlm(batch)
    half = V.BatchPoolingCache(R, [0])
    half.accumulate_windows(*tokens(1, 4, 0), 0)  # update_and_fetch not yet called
    with pytest.raises(ks.StateError, match="between accumulate_windows"):
        from_mlx_vlm(half)


# ---------------------------------------------------------------------------------------
# Batch transforms against mlx-vlm's
# ---------------------------------------------------------------------------------------

ROWS = [[], [2], [3, 1], [5], [4, 1, 1, 1]]  # remainders 0, 2, 1, 2, 1; pooled 0, 0, 1, 1, 2


def test_merge_equals_mlx_vlm_merge_array_for_array():
    caches = [single(sizes, seed=10 * i) for i, sizes in enumerate(ROWS)]
    ours = ks.merge([from_mlx_vlm(c) for c in caches])
    theirs = V.BatchPoolingCache.merge(caches)
    assert_same_fields(to_mlx_vlm(ours), theirs)
    forward(theirs, 2, 77, len(ROWS))
    assert_states_equal(ks.check(from_mlx_vlm(forward(to_mlx_vlm(ours), 2, 77, len(ROWS)))),
                        from_mlx_vlm(theirs))  # fmt: skip


def test_merge_of_empty_caches_equals_mlx_vlm_merge():
    caches = [V.PoolingCache(R), V.PoolingCache(R)]
    ours = ks.merge([from_mlx_vlm(c) for c in caches])
    assert_same_fields(to_mlx_vlm(ours), V.BatchPoolingCache.merge(caches))


def batched(seed: int = 0) -> Any:
    return V.BatchPoolingCache.merge([single(sizes, seed=seed + i) for i, sizes in enumerate(ROWS)])


@pytest.mark.parametrize("rows", [[0], [4, 1], [2, 2, 0], [3]])
def test_filter_equals_mlx_vlm_filter(rows):
    theirs = batched()
    ours = ks.filter(from_mlx_vlm(theirs), rows)
    theirs.filter(rows)
    assert_same_fields(to_mlx_vlm(ours), theirs)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_extend_equals_mlx_vlm_extend(split):
    a = batched()
    a.filter(list(range(split)))
    b = batched(seed=50)
    b.filter(list(range(split, len(ROWS))))
    forward(b, 1, 9, len(ROWS) - split)  # b's buffers differ from a's
    ours = ks.extend(from_mlx_vlm(a), from_mlx_vlm(b))
    a.extend(b)
    assert_same_fields(to_mlx_vlm(ours), a)


def test_extend_with_empty_rows_equals_mlx_vlm_extend():
    a = V.BatchPoolingCache(R, [0])
    b = batched()
    ours = ks.extend(from_mlx_vlm(a), from_mlx_vlm(b))
    a.extend(b)
    assert_same_fields(to_mlx_vlm(ours), a)


@pytest.mark.parametrize("row", range(len(ROWS)))
def test_extract_equals_mlx_vlm_extract(row):
    theirs = batched()
    ours = ks.extract(from_mlx_vlm(theirs), row)
    assert_same_fields(to_mlx_vlm(ours), theirs.extract(row))


# ---------------------------------------------------------------------------------------
# commit_prefix against mlx-vlm's speculation transaction
# ---------------------------------------------------------------------------------------


def refused(rem0: int, n: int, keep: int) -> bool:
    """The kept window is incomplete and is not the window the forward ended in."""
    windows_after, windows_kept = (rem0 + n) // R, (rem0 + keep) // R
    return keep > 0 and (rem0 + keep) % R != 0 and windows_kept != windows_after


@pytest.mark.parametrize("prefix", [[], [1], [2], [3, 1]])
@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_commit_prefix_keeps_what_mlx_vlm_commit_speculation_keeps(prefix, n):
    outcomes = set()
    for keep in range(n + 1):
        before = single(prefix, batch=2)
        rem0 = before.remainder
        state_before = from_mlx_vlm(before)
        oracle = to_mlx_vlm(state_before)
        oracle.start_speculation(n)
        forward(oracle, n, 5, 2)
        oracle.commit_speculation(keep)
        verified = record_forward(from_mlx_vlm(forward(before, n, 5, 2)), state_before, n)
        if refused(rem0, n, keep):
            with pytest.raises(ks.CommitError, match="pooled its raw tokens"):
                ks.commit_prefix(verified, keep)
            assert not ks.capabilities(verified).can_roll_back
            outcomes.add("refused")
            continue
        committed = ks.check(ks.commit_prefix(verified, keep))
        assert committed.appended == 0 and committed.previous is None
        ours = to_mlx_vlm(committed)
        assert_same_view(ours, oracle)
        forward(ours, 2, 6, 2)  # and they go on the same way
        forward(oracle, 2, 6, 2)
        assert_same_view(ours, oracle)
        outcomes.add("kept")
    assert "kept" in outcomes


def test_ragged_commit_on_a_batch_keeps_what_mlx_vlm_keeps_per_row():
    before = batched()
    state_before = from_mlx_vlm(before)
    rem0 = list(before.remainder)
    n = 4
    keeps = [next((k for k in range(1, n) if not refused(r, n, k)), 0) for r in rem0]
    assert len(set(keeps)) > 1  # ragged
    oracle = to_mlx_vlm(state_before)
    oracle.start_speculation(n)
    forward(oracle, n, 3, len(ROWS))
    oracle.commit_speculation(keeps)
    verified = record_forward(from_mlx_vlm(forward(before, n, 3, len(ROWS))), state_before, n)
    committed = ks.check(ks.commit_prefix(verified, keeps))
    assert_same_view(to_mlx_vlm(committed), oracle)


def test_refused_commit_names_the_row_and_leaves_the_state_intact():
    state_before = from_mlx_vlm(single([], batch=1))
    after = forward(to_mlx_vlm(state_before), 5, 1)
    verified = record_forward(from_mlx_vlm(after), state_before, 5)
    with pytest.raises(ks.CommitError, match="row 0: keeping 2 of the 5 tokens") as err:
        ks.commit_prefix(verified, 2)
    assert "window 0" in str(err.value) and "snapshot" in str(err.value)
    assert ks.commit_prefix(verified, 3).pooled.shape[1] == 1  # a window boundary
    assert ks.commit_prefix(verified, 4).remainder == 1  # within the forward's last window
    assert ks.commit_prefix(verified, 0).pooled is None  # the state before it


def test_a_partial_commit_needs_the_record_of_the_state_before():
    stamped = ks.kinds.replace(from_mlx_vlm(forward(single([1]), 2, 3)), appended=2)
    assert ks.commit_prefix(stamped, 2).appended == 0  # keeping it all needs no record
    with pytest.raises(ks.CommitError, match="no record of the state before"):
        ks.commit_prefix(stamped, 1)


@pytest.mark.parametrize("keep", [0, 3, 5, [1, 0, 2], [2, 3, 4], [3, 4, 5], [0, 5, 1], [4, 1, 5]])
def test_commit_after_a_padded_prompt_keeps_what_mlx_vlm_keeps(keep):
    """The forward's first tokens of a padded row are padding: a count covers them first."""
    pads = (2, 0, 3)
    state_before = from_mlx_vlm(V.BatchPoolingCache(R, list(pads)))
    oracle = to_mlx_vlm(state_before)
    oracle.start_speculation(5)
    forward(oracle, 5, 8, 3)
    oracle.commit_speculation(keep)
    after = forward(to_mlx_vlm(state_before), 5, 8, 3)
    verified = record_forward(from_mlx_vlm(after), state_before, 5)
    counts = keep if isinstance(keep, list) else [keep] * 3
    real = [max(0, k - pad) for pad, k in zip(pads, counts, strict=True)]
    if any(refused(0, 5 - pad, k) for pad, k in zip(pads, real, strict=True)):
        with pytest.raises(ks.CommitError):
            ks.commit_prefix(verified, keep)
        return
    committed = to_mlx_vlm(ks.check(ks.commit_prefix(verified, keep)))
    assert_same_view(committed, oracle)
    assert committed.left_padding == oracle.left_padding


@pytest.mark.parametrize("form", ["single", "batched"])
def test_commit_after_extract_is_extract_after_commit(form):
    """A row extracted from a verified state keeps its own record of the state before the
    verify: committing it gives (what the row means) that row of the committed batch, for
    every count kvstate can honour (rows differ in content, and in the batched form in
    remainders)."""
    before = single([2], batch=3) if form == "single" else batched()
    state_before = from_mlx_vlm(before)
    n = 3
    verified = record_forward(
        from_mlx_vlm(forward(to_mlx_vlm(state_before), n, 4, ks.batch_size(state_before))),
        state_before,
        n,
    )
    checked = 0
    for keep in range(n + 1):
        try:
            whole = ks.commit_prefix(verified, keep)
        except ks.CommitError:
            continue
        for row in range(1, ks.batch_size(verified)):
            alone = ks.commit_prefix(ks.extract(verified, row), keep)
            assert_same_view(to_mlx_vlm(alone), to_mlx_vlm(ks.extract(whole, row)))
            checked += 1
    assert checked >= 2
