"""RotatingKV (sliding windows) against mlx-lm's own RotatingKVCache / BatchRotatingKVCache.

The oracle is always mlx-lm: its caches driven by the same random-init gemma3_text model
(sliding_window = 8, so a 12-token prompt or a few decode steps wrap the window), its
`generate_step`, and its batch machinery (`_merge_caches`, `filter`, `extend`, `extract`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import _merge_caches, generate_step
from mlx_lm.models.cache import (
    BatchRotatingKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.testing import assert_states_equal, frozen_copy

WINDOW = 8
ATOL, RTOL = 2e-4, 1e-4


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("gemma3_text")


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def close(a: mx.array, b: mx.array, what: str) -> None:
    a_np, b_np = np.array(a), np.array(b)
    assert a_np.shape == b_np.shape, f"{what}: shapes {a_np.shape} != {b_np.shape}"
    err = float(np.max(np.abs(a_np - b_np))) if a_np.size else 0.0
    assert np.allclose(a_np, b_np, atol=ATOL, rtol=RTOL), f"{what}: max abs diff {err}"


def reference(model: Any, chunks: Sequence[Sequence[int]], cache: Any = None) -> list[mx.array]:
    """mlx-lm alone: feed `chunks` one forward each through the model's own caches."""
    cache = make_prompt_cache(model) if cache is None else cache
    out = [model(mx.array(list(c))[None], cache=cache) for c in chunks]
    mx.eval(out)
    return out


def rotating_layers(state: ks.ModelState) -> list[ks.RotatingKV]:
    return [s for s in state.layers if isinstance(s, ks.RotatingKV)]


# ---------------------------------------------------------------------------------------
# (a) greedy decoding through wrap == generate_step
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [5, 12])
def test_greedy_matches_generate_step(model: Any, prompt_len: int) -> None:
    prompt = tokens(prompt_len, prompt_len)
    steps = 36
    ref = list(generate_step(mx.array(prompt), model, max_tokens=steps))
    m = wrap(model)
    state = m.init_state()
    logits, state = m(mx.array([prompt]), state)
    got = []
    for i, (token, logprobs) in enumerate(ref):
        last = logits[0, -1]
        close(last - mx.logsumexp(last), logprobs, f"step {i} logprobs")
        got.append(np.array(mx.argmax(last)).item())
        # teacher forcing: feed mlx-lm's token so one near-tie cannot derail the rest
        logits, state = m(mx.array([[token]]), state)
    assert got == [t for t, _ in ref]
    assert len({t for t, _ in ref}) > 3, "degenerate model output: the test would be weak"
    window = rotating_layers(state)[0]
    assert window.keys is not None and window.keys.shape[2] == WINDOW
    assert window.offset == prompt_len + steps


# ---------------------------------------------------------------------------------------
# (b) speculative verify + commit_prefix == un-speculated decoding
# ---------------------------------------------------------------------------------------

# (prompt length, decoded tokens before the verify): ring not full and the verify wraps it;
# ring exactly full; ring wrapped by the prompt and rotated mid-way.
STARTS = [(5, 0), (7, 1), (12, 3)]


@pytest.mark.parametrize(("prompt_len", "decoded"), STARTS)
def test_commit_prefix_after_verify(model: Any, prompt_len: int, decoded: int) -> None:
    m = wrap(model)
    prompt = tokens(100 + prompt_len, prompt_len)
    decode = tokens(200 + decoded, decoded)
    state = m.init_state()
    _, state = m(mx.array([prompt]), state)
    for t in decode:
        _, state = m(mx.array([[t]]), state)
    ks.eval(state)

    # The reference decodes the same history, then each accepted draft token one at a time.
    ref_cache = make_prompt_cache(model)
    reference(model, [prompt, *([t] for t in decode)], ref_cache)

    for k in range(3, 7):
        draft = tokens(300 + k, k)
        verify_logits, verified = m(mx.array([draft]), state)
        window = rotating_layers(verified)[0]
        assert window.previous is not None and window.appended == k
        cache = copy.deepcopy(ref_cache)
        ref_draft: list[mx.array] = []
        for a in range(k + 1):
            if a:
                ref_draft += reference(model, [draft[a - 1 : a]], cache)
                close(verify_logits[0, a - 1], ref_draft[-1][0, -1], f"K={k} verify logit {a}")
            committed = ks.commit_prefix(verified, a)
            w = rotating_layers(committed)[0]
            assert w.appended == 0 and w.previous is None
            assert w.offset == prompt_len + decoded + a
            if a == 0:  # nothing accepted: exactly the state before the verify
                assert w.keys is rotating_layers(state)[0].keys
            elif a < k:  # the canonical state: unrotated, at most one window
                assert w.keys is not None and w.index == w.keys.shape[2] <= WINDOW
            assert_windows_match(to_mlx_lm(committed), cache, f"K={k} a={a}")
            _continue_and_compare(m, model, committed, copy.deepcopy(cache), f"K={k} a={a}")


def assert_windows_match(
    ours: list[Any], theirs: list[Any], what: str, exact: bool = False
) -> None:
    """Every sliding-window layer holds the entries mlx-lm's un-speculated cache holds: the
    newest min(offset, max_size), oldest first (mlx-lm's own RotatingKVCache._temporal_order).
    `exact`: and nothing more (extracted rows)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if not isinstance(b, RotatingKVCache):
            continue
        assert isinstance(a, RotatingKVCache) and a.offset == b.offset, f"{what}: offset"
        n = min(b.offset, b.max_size)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            got, want = a._temporal_order(x), b._temporal_order(y)[..., -n:, :]
            if exact:
                assert got.shape[2] == n, f"{what}, layer {i}: {got.shape[2]} entries, not {n}"
            close(got[..., -n:, :], want, f"{what}, layer {i}: window entries")


def _continue_and_compare(m: Any, model: Any, state: Any, cache: Any, what: str) -> None:
    """1-token, multi-token, verify+commit and 1-token forwards from `state` (kvstate) and
    `cache` (mlx-lm, un-speculated): every logit must agree."""
    c1, c2, c3, c4 = tokens(1, 1), tokens(2, 3), tokens(3, 1), tokens(4, 2)
    l1, state = m(mx.array([c1]), state)
    l2, state = m(mx.array([c2]), state)
    state = ks.commit_prefix(state, 1)  # a second speculation, only its first token kept
    l3, state = m(mx.array([c3]), state)
    l4, state = m(mx.array([c4]), state)
    r1, r2, r3, r4 = reference(model, [c1, c2[:1], c3, c4], cache)
    close(l1, r1, f"{what}: 1-token after commit")
    close(l2[:, :1], r2, f"{what}: multi-token after commit")
    close(l3, r3, f"{what}: 1-token after second commit")
    close(l4, r4, f"{what}: 2-token forward")


@pytest.mark.parametrize("rows", [1, 2])
def test_a_two_token_verify_on_a_full_window_keeps_its_rollback_record(model: Any, rows: int):
    """A 2-token forward on a full window pushes entries out; the state keeps the window
    before it (`previous`), and rejecting both tokens gives exactly that window back."""
    m = wrap(model)
    prompts = [tokens(7 + r, WINDOW + 3 + r) for r in range(rows)]
    state = ks.merge([m(mx.array([p]), m.init_state())[1] for p in prompts])
    state = m(mx.array([[1]] * rows), state)[1]  # a decode step: the ring has wrapped
    verified = m(mx.array([[2, 3]] * rows), state)[1]
    for before, after in zip(rotating_layers(state), rotating_layers(verified), strict=True):
        assert after.appended == 2 and after.previous is not None
        rolled_back = ks.commit_prefix(after, 0)
        assert_states_equal(rolled_back, ks.commit_prefix(before, before.appended))
    # And the model decodes on from each prefix as mlx-lm does on the un-speculated tokens.
    for accepted, kept in ((0, []), (1, [2])):
        state_after = ks.commit_prefix(verified, accepted)
        got = m(mx.array([[9]] * rows), state_after)[0]
        for r, p in enumerate(prompts):
            want = reference(model, [p, [1], *([t] for t in kept), [9]])[-1]
            close(got[r : r + 1], want, f"row {r}, accepted {accepted}")


def test_commit_after_one_token(model: Any) -> None:
    """A 1-token forward keeps no history: undoing it works while the window has room, and
    says what to do once the write overwrote a slot."""
    m = wrap(model)
    prompt = tokens(7, 5)
    _, state = m(mx.array([prompt]), m.init_state())
    _, one = m(mx.array([[3]]), state)
    undone = ks.commit_prefix(one, 0)
    logits, _ = m(mx.array([[9]]), undone)
    (ref,) = reference(model, [prompt, [9]])[1:]
    close(logits, ref, "undo a 1-token forward into free space")

    _, full = m(mx.array([tokens(8, 12)]), m.init_state())
    _, stepped = m(mx.array([[3]]), full)
    with pytest.raises(ks.CommitError, match="Keep the state you passed"):
        ks.commit_prefix(stepped, 0)
    assert ks.commit_prefix(stepped, 1).layers[0].appended == 0


# ---------------------------------------------------------------------------------------
# (c) batched: merge / decode / filter / extend / extract == mlx-lm's batch machinery
# ---------------------------------------------------------------------------------------


def valid_slots(lp: np.ndarray, length: int, index: int, rotated: bool) -> np.ndarray:
    """(B, length) bool: which ring slots hold a row's real entries (BatchRotatingKVCache)."""
    slots = np.arange(length)
    if rotated:
        age = (slots - index) % length  # 0 = oldest
        used = np.ones(length, bool)
    else:
        age, used = slots, slots < index
    return used[None] & (age[None] >= np.maximum(lp, 0)[:, None])


def assert_window_equals_cache(
    state: ks.RotatingKV, cache: BatchRotatingKVCache, what: str
) -> None:
    """Bookkeeping exactly, keys and values exactly on every row's valid slots."""
    assert state.left_padding is not None and state.offsets is not None
    assert state.left_padding.tolist() == cache.left_padding.tolist(), f"{what}: left_padding"
    assert state.offsets.tolist() == cache.offset.tolist(), f"{what}: offsets"
    assert (state.offset, state.index, state.rotated, state.max_size) == (
        cache._offset,
        cache._idx,
        cache.rotated,
        cache.max_size,
    ), f"{what}: _offset/_idx/rotated"
    if cache.keys is None:
        assert state.keys is None, f"{what}: keys"
        return
    assert state.keys is not None and state.values is not None
    assert state.keys.shape == cache.keys.shape, f"{what}: keys shape"
    valid = valid_slots(
        np.array(cache.left_padding), cache.keys.shape[2], cache._idx, cache.rotated
    )
    for ours, theirs, name in (
        (state.keys, cache.keys, "keys"),
        (state.values, cache.values, "values"),
    ):
        a, b = np.array(ours), np.array(theirs)
        assert np.array_equal(a.transpose(0, 2, 1, 3)[valid], b.transpose(0, 2, 1, 3)[valid]), (
            f"{what}: {name} differ on the valid slots"
        )


def assert_model_state(state: ks.ModelState, caches: list[Any], what: str) -> None:
    for i, (s, c) in enumerate(zip(state.layers, caches, strict=True)):
        if isinstance(s, ks.RotatingKV):
            assert_window_equals_cache(s, c, f"{what}, layer {i}")


def prefilled(model: Any, prompt: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    return cache


def test_batched_matches_mlx_lm_batch_machinery(model: Any) -> None:
    m = wrap(model)
    prompts = [tokens(10 + n, n) for n in (5, 9, 13)]

    batch = _merge_caches([prefilled(model, p) for p in prompts])
    singles = [m(mx.array([p]), m.init_state())[1] for p in prompts]
    state = ks.merge(singles)
    assert_model_state(state, batch, "merge")

    def decode(state: Any, batch: list[Any], steps: int, seed: int, what: str) -> Any:
        rows = ks.batch_size(state)
        for i, step in enumerate(np.random.default_rng(seed).integers(0, VOCAB, (steps, rows))):
            x = mx.array(step)[:, None]
            theirs = model(x, cache=batch)
            ours, state = m(x, state)
            assert np.array_equal(np.array(ours), np.array(theirs)), f"{what}: logits, step {i}"
        assert_model_state(state, batch, what)
        return state

    state = decode(state, batch, 12, 0, "decode")

    state = ks.filter(state, [0, 2])
    for c in batch:
        c.filter(mx.array([0, 2]))
    assert_model_state(state, batch, "filter")

    # extend with a freshly merged (unrotated, different _idx) batch: both rings unrolled
    new_prompt = tokens(77, 7)
    other = _merge_caches([prefilled(model, new_prompt)])
    other_state = ks.merge([m(mx.array([new_prompt]), m.init_state())[1]])
    state = ks.extend(state, other_state)
    for c, o in zip(batch, other, strict=True):
        c.extend(o)
    assert_model_state(state, batch, "extend (unrolled)")
    state = decode(state, batch, 10, 1, "decode after extend")

    # split and re-join: same _idx and both rotated, so the rings are kept as they are
    left, right = ks.filter(state, [0]), ks.filter(state, [1, 2])
    right_caches = copy.deepcopy(batch)
    for c, rc in zip(batch, right_caches, strict=True):
        c.filter(mx.array([0]))
        rc.filter(mx.array([1, 2]))
        c.extend(rc)
    assert rotating_layers(left)[0].rotated and rotating_layers(right)[0].rotated
    state = ks.extend(left, right)
    assert_model_state(state, batch, "extend (rotated, same index)")
    state = decode(state, batch, 4, 2, "decode after re-join")

    for row in range(3):
        ours = ks.extract(state, row)
        theirs = [c.extract(row) for c in batch]
        for i, (s, c) in enumerate(zip(ours.layers, theirs, strict=True)):
            if not isinstance(s, ks.RotatingKV):
                continue
            assert isinstance(c, RotatingKVCache) and s.left_padding is None
            assert (s.offset, s.index, s.max_size, s.keep) == (c.offset, c._idx, c.max_size, c.keep)
            assert np.array_equal(np.array(s.keys), np.array(c.keys)), f"extract {row} layer {i}"
            assert np.array_equal(np.array(s.values), np.array(c.values))
        # and the extracted row decodes like mlx-lm's extracted cache
        x = mx.array([[5]])
        close(m(x, ours)[0], model(x, cache=theirs), f"decode extracted row {row}")


# ---------------------------------------------------------------------------------------
# (e) ragged commit on a batched state == per-row un-speculated decoding
# ---------------------------------------------------------------------------------------


RAGGED = [
    ((5, 9, 13), 2, [2, 4, 0]),  # rotated ring, row 0 still padded (needs the mask fix)
    ((5, 9, 13), 5, [3, 0, 1]),
    ((5, 9, 13), 0, [4, 1, 2]),
    ((3, 4, 5), 0, [0, 2, 1]),  # the committed window is not full
    ((2, 3, 6), 1, [1, 0, 3]),
]


@pytest.mark.parametrize(("lengths", "decoded", "accepted"), RAGGED)
def test_ragged_commit_matches_per_row_reference(
    model: Any, lengths: tuple[int, ...], decoded: int, accepted: list[int]
) -> None:
    m = wrap(model)
    prompts = [tokens(20 + n, n) for n in lengths]
    state = ks.merge([m(mx.array([p]), m.init_state())[1] for p in prompts])
    steps = np.random.default_rng(decoded).integers(0, VOCAB, (decoded, 3)).tolist()
    for step in steps:
        _, state = m(mx.array(step)[:, None], state)
    drafts = np.random.default_rng(99).integers(0, VOCAB, (3, 4)).tolist()
    verify_logits, verified = m(mx.array(drafts), state)
    committed = ks.commit_prefix(verified, accepted)
    for w in rotating_layers(committed):
        assert w.keys is not None and w.previous is None
        assert not w.rotated and w.index == w.keys.shape[2] <= WINDOW

    multi, single = tokens(5, 3 * 3), tokens(6, 3)
    l1, after = m(mx.array(multi).reshape(3, 3), committed)  # multi-token right after commit
    l2, _ = m(mx.array(single)[:, None], after)
    for b, prompt in enumerate(prompts):
        history = [prompt, *([s[b]] for s in steps), *([t] for t in drafts[b][: accepted[b]])]
        cache = make_prompt_cache(model)
        ref = reference(model, history, cache)
        row_caches = [c.extract(b) for c in to_mlx_lm(committed)]  # mlx-lm's own extract
        assert_windows_match(row_caches, cache, f"row {b}", exact=True)
        for a in range(accepted[b]):  # the verify itself, per row (needs the mask fix)
            close(verify_logits[b, a], ref[1 + decoded + a][0, -1], f"row {b} verify {a}")
        r1, r2 = reference(model, [multi[3 * b : 3 * b + 3], single[b : b + 1]], cache)
        close(l1[b : b + 1], r1, f"row {b}: multi-token after ragged commit")
        close(l2[b : b + 1], r2, f"row {b}: 1-token after ragged commit")


def test_mlx_lm_multi_token_mask_bug_is_still_there(model: Any) -> None:
    """mlx-lm 0.32's BatchRotatingKVCache masks a valid entry in a multi-token forward on a
    rotated ring with padded rows; adapters corrects it (kvstate.adapters.caches.compat.fixed_make_mask).
    If this fails, mlx-lm fixed it: drop the correction."""
    prompts = [tokens(20 + n, n) for n in (5, 9, 13)]
    fixed = _merge_caches([prefilled(model, p) for p in prompts])
    plain = copy.deepcopy(fixed)
    assert type(fixed[0]) is BatchRotatingKVCache
    fixed = [from_mlx_lm(c) if isinstance(c, BatchRotatingKVCache) else c for c in fixed]
    fixed = [to_mlx_lm(c) if isinstance(c, ks.RotatingKV) else c for c in fixed]
    assert type(fixed[0]) is BatchRotatingKVCache  # mlx-lm's save_prompt_cache keeps working
    for x in (mx.array([[1], [2], [3]]), mx.array([[4, 5, 6]] * 3)):
        out_fixed, out_plain = model(x, cache=fixed), model(x, cache=plain)
    cache = make_prompt_cache(model)
    (*_, ref) = reference(model, [prompts[0], [1], [4, 5, 6]], cache)
    close(out_fixed[:1], ref, "fixed mask")
    assert not np.allclose(np.array(out_plain[:1]), np.array(ref), atol=1e-2)


# ---------------------------------------------------------------------------------------
# (d) adapters round trip; nothing changes its input
# ---------------------------------------------------------------------------------------


def _caches_of_every_shape(model: Any) -> list[Any]:
    """Single-sequence and batched windows: empty, partial, full, after concat, rotated."""
    out: list[Any] = [RotatingKVCache(WINDOW, keep=0)]
    for chunks in ([tokens(1, 5)], [tokens(1, 5), [1]], [tokens(2, 12)], [tokens(2, 12), [1], [2]]):
        cache = make_prompt_cache(model)
        reference(model, chunks, cache)
        out.append(cache[0])
    keep = RotatingKVCache(WINDOW, keep=4)
    for n in (3, 1, 1, 4, 1, 1, 1):
        kv = mx.random.normal((1, 2, n, 16), key=mx.random.key(n))
        keep.update_and_fetch(kv, kv)
    out.append(keep)
    batch = _merge_caches([prefilled(model, tokens(3, n)) for n in (4, 10)])
    out.append(copy.deepcopy(batch[0]))
    model(mx.array([[1], [2]]), cache=batch)
    out.append(copy.deepcopy(batch[0]))
    out.append(_merge_caches([make_prompt_cache(model)] * 2)[0])
    return out


FIELDS = (
    "keys",
    "values",
    "offset",
    "max_size",
    "_idx",
    "keep",
    "left_padding",
    "_offset",
    "rotated",
)


def _fields(cache: Any) -> dict[str, Any]:
    out = {}
    for name in FIELDS:
        if hasattr(cache, name):
            value = getattr(cache, name)
            out[name] = np.array(value) if isinstance(value, mx.array) else value
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
                return False
            if x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


def test_adapter_round_trips(model: Any) -> None:
    for i, cache in enumerate(_caches_of_every_shape(model)):
        state = from_mlx_lm(cache)
        back = to_mlx_lm(state)
        assert isinstance(back, type(cache))
        assert _same(_fields(cache), _fields(back)), f"cache {i}: cache -> state -> cache"
        if cache.keys is not None:
            assert state.keys is not cache.keys and back.keys is not state.keys
        again = from_mlx_lm(back)
        assert _same(_fields(to_mlx_lm(again)), _fields(cache)), f"cache {i}: state round trip"
        assert ks.tree_flatten(again)[1] == ks.tree_flatten(state)[1]


def test_adapter_refuses_prepared_batch(model: Any) -> None:
    batch = _merge_caches([prefilled(model, tokens(3, n)) for n in (4, 10)])[0]
    batch.prepare(lengths=[2, 3], right_padding=[1, 0])
    with pytest.raises(ks.StateError, match="finalize"):
        from_mlx_lm(batch)
    batch.finalize()
    from_mlx_lm(batch)


def test_batched_cache_through_mlx_lm_save_load(model: Any, tmp_path: Any) -> None:
    """to_mlx_lm's batched caches stay plain BatchRotatingKVCache objects: mlx-lm saves,
    loads (from_state skips __init__, so no `_lengths`) and deep-copies them."""
    m = wrap(model)
    state = ks.merge([m(mx.array([tokens(9, n)]), m.init_state())[1] for n in (4, 11)])
    state = m(mx.array([[1], [2]]), state)[1]
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, copy.deepcopy(to_mlx_lm(state)))
    loaded = from_mlx_lm(load_prompt_cache(path))
    for ours, back in zip(rotating_layers(state), rotating_layers(loaded), strict=True):
        assert _same(_fields(to_mlx_lm(ours)), _fields(to_mlx_lm(back)))


def test_nothing_changes_its_input(model: Any) -> None:
    m = wrap(model)
    prompts = [tokens(40 + n, n) for n in (5, 12, 9)]
    single = m(mx.array([prompts[1]]), m.init_state())[1]
    single = m(mx.array([[1]]), single)[1]  # wrapped ring
    batched = ks.merge([m(mx.array([p]), m.init_state())[1] for p in prompts])
    batched = m(mx.array([[1], [2], [3]]), batched)[1]
    short = ks.merge([m(mx.array([prompts[0][:3]]), m.init_state())[1]])
    verified_single = m(mx.array([[4, 5, 6, 7]]), single)[1]
    verified_batch = m(mx.array([[4, 5, 6]] * 3), batched)[1]
    cases: list[tuple[str, Any, Any]] = [
        ("1-token forward", single, lambda s: m(mx.array([[3]]), s)),
        ("multi-token forward", single, lambda s: m(mx.array([[3, 4, 5]]), s)),
        ("batched 1-token forward", batched, lambda s: m(mx.array([[3]] * 3), s)),
        ("batched multi-token forward", batched, lambda s: m(mx.array([[3, 4]] * 3), s)),
        ("commit", verified_single, lambda s: ks.commit_prefix(s, 2)),
        ("commit 0", verified_single, lambda s: ks.commit_prefix(s, 0)),
        ("batched commit", verified_batch, lambda s: ks.commit_prefix(s, 1)),
        ("ragged commit", verified_batch, lambda s: ks.commit_prefix(s, [0, 3, 1])),
        ("tile", single, lambda s: ks.tile(s, 3)),
        (
            "ragged commit of a tiled state",
            ks.tile(verified_single, 2),
            lambda s: ks.commit_prefix(s, [1, 3]),
        ),
        ("row_select", batched, lambda s: ks.row_select(s, [2, 0])),
        ("filter", batched, lambda s: ks.filter(s, [1])),
        ("merge", single, lambda s: ks.merge([s, s])),
        ("extend", batched, lambda s: ks.extend(s, ks.merge([single]))),
        ("extend (padded on the left)", short, lambda s: ks.extend(batched, s)),
        ("extend (first, padded on the left)", short, lambda s: ks.extend(s, batched)),
        ("extract", batched, lambda s: ks.extract(s, 1)),
        ("snapshot", single, ks.snapshot),
    ]
    for what, state, fn in cases:
        before = frozen_copy(state)
        ks.eval(fn(state))
        assert_states_equal(state, before, what=f"{what} changed its input")
    # the tiled ragged commit (unpadded form -> batched form) is right as well
    tiled = ks.commit_prefix(ks.tile(verified_single, 2), [1, 3])
    x = mx.array([[7], [8]])
    got, _ = m(x, tiled)
    for row, a in enumerate((1, 3)):
        cache = make_prompt_cache(model)
        reference(model, [prompts[1], [1], *([t] for t in [4, 5, 6, 7][:a])], cache)
        (ref,) = reference(model, [[7 + row]], cache)
        close(got[row : row + 1], ref, f"tiled ragged commit, row {row}")


# ---------------------------------------------------------------------------------------
# (f) errors
# ---------------------------------------------------------------------------------------


def test_errors(model: Any) -> None:
    m = wrap(model)
    a = m(mx.array([tokens(1, 10)]), m.init_state())[1]
    other_size = wrap(tiny_model("gemma3_text", sliding_window=16))
    b = other_size(mx.array([tokens(1, 10)]), other_size.init_state())[1]
    with pytest.raises(ks.ConfigMismatchError, match="16"):
        ks.merge([a, b])
    with pytest.raises(ks.ConfigMismatchError):
        ks.extend(ks.merge([a]), ks.merge([b]))

    kv = mx.ones((1, 2, 3, 16))
    w0 = ks.RotatingKV(kv, kv, max_size=8, offset=3, index=3)
    w4 = ks.RotatingKV(kv, kv, max_size=8, keep=4, offset=3, index=3)
    with pytest.raises(ks.ConfigMismatchError, match="0 != 4"):
        ks.merge([w0, w4])
    with pytest.raises(ks.ConfigMismatchError, match="keep=4"):
        ks.merge([w4, w4])  # BatchRotatingKVCache has no keep prefix

    verified = m(mx.array([[1, 2, 3]]), a)[1]
    with pytest.raises(ks.CommitError, match="exceeds the 3 tokens"):
        ks.commit_prefix(verified, 4)
    with pytest.raises(ks.CommitError):
        ks.commit_prefix(verified, -1)
    with pytest.raises(ks.CommitError, match="no pending forward"):
        ks.commit_prefix(ks.commit_prefix(verified, 2), 1)
    with pytest.raises(ks.CommitError, match="previous"):
        ks.commit_prefix(ks.RotatingKV(kv, kv, max_size=8, offset=3, index=3, appended=3), 1)
    with pytest.raises(ks.RowError):
        ks.extract(ks.merge([a, a]), 2)
