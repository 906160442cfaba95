"""What a ragged commit does to a dense buffer's slot order, and why it is no correctness
issue for the core but is one for cutting a prefix (which is why the engine keeps a turn
end whole).

`commit_prefix` with ragged counts (`_dense.commit_ragged`) moves each row's *oldest*
tokens into the slots its rejected drafts left, O(rejected) instead of shifting the row's
whole context. After it (and after `extract`), a row's buffer holds its positions rotated:
[d, ..., n-1, 0, ..., d-1]. Every forward kvstate runs reads a dense buffer through
attention whose keys carry their RoPE rotation and whose mask depends only on the left
padding and on the new tokens' order (appended after every kept slot), so the order of the
kept slots does not change any logit: checked here against an oracle, the same tokens run
from an empty state alone (plain decode steps and a multi-token verify). (mlx-lm's model
factories give sliding-window layers rotating caches, never a dense KV under a window mask,
the one mask that reads slot indices as positions.)

What does read slot order as position order is cutting such a buffer to a prefix
(stamping it as one forward and `commit_prefix` to fewer tokens: the prefix cache's cut, or
mlx-lm's `KVCache.trim` after `to_mlx_lm`): it would keep slots, not positions. The test
shows that the cut is then wrong, so the engine must (and does) keep a turn end only whole
(`PrefixCache.insert(..., cuttable=False)`), while a prefill's state, never committed
raggedly, cuts exactly."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.engine._prefix_cache import cut

PROMPTS = ([5, 17, 42, 8, 99, 23, 61], [3, 1, 4, 1, 5])
DRAFTS = [[7, 9, 11], [12, 14, 16]]
KEPT = [3, 1]  # row 0 keeps all three fed tokens, row 1 one: a 2-slot hole in row 1


def _committed():
    target = wrap(tiny_model("llama"))
    states = [target(mx.array([p]), target.init_state())[1] for p in PROMPTS]
    batch = ks.merge(states)
    _, batch = target(mx.array(DRAFTS), batch)  # a verify of three tokens per row
    return target, ks.commit_prefix(batch, KEPT)


def _alone(target, tokens):
    return target(mx.array([tokens]), target.init_state())


def test_a_raggedly_committed_row_serves_every_forward_as_its_tokens_alone():
    target, batch = _committed()
    for row, (prompt, drafts, kept) in enumerate(zip(PROMPTS, DRAFTS, KEPT, strict=True)):
        tokens = [*prompt, *drafts[:kept]]
        mine = ks.extract(batch, row)
        _, truth = _alone(target, tokens)
        nxt = [2, 6, 10]
        got, mine_after = target(mx.array([nxt]), mine)  # a verify-shaped forward
        want, truth_after = target(mx.array([nxt]), truth)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)
        for t in (13, 21):  # then plain steps
            got, mine_after = target(mx.array([[t]]), mine_after)
            want, truth_after = target(mx.array([[t]]), truth_after)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


def test_its_slots_are_rotated_so_a_cut_prefix_is_wrong():
    target, batch = _committed()
    prompt, drafts = PROMPTS[1], DRAFTS[1]
    tokens = [*prompt, *drafts[:1]]  # 6 tokens; the hole was 2
    mine = ks.extract(batch, 1).layers[0]
    _, truth = _alone(target, tokens)
    keys, want = np.array(mine.keys[..., : mine.length, :]), np.array(truth.layers[0].keys)
    want = want[..., : len(tokens), :]
    # Slots hold positions 2..5 then 0..1: a rotation by the hole, not position order.
    np.testing.assert_allclose(keys, np.concatenate([want[..., 2:, :], want[..., :2, :]], 2),
                               atol=1e-4)  # fmt: skip
    assert not np.allclose(keys, want, atol=1e-2)
    # A cut to the first 4 tokens keeps slots 0..3 (positions 2..5): the next logits differ
    # from those of the 4 tokens alone. A prefill's state (never committed raggedly) cuts
    # exactly: the prefix cache's cuts are only ever of such states.
    row = ks.extract(batch, 1)
    got, _ = target(mx.array([[9]]), cut(row, len(tokens), 4))
    want_logits, _ = target(mx.array([[9]]), _alone(target, tokens[:4])[1])
    assert not np.allclose(np.array(got), np.array(want_logits), atol=1e-3)
    _, prefilled = _alone(target, tokens)
    got, _ = target(mx.array([[9]]), cut(prefilled, len(tokens), 4))
    np.testing.assert_allclose(np.array(got), np.array(want_logits), atol=1e-4)
