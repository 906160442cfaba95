"""Sampling, the same for the target and its drafter, and the speculative acceptance rule.

Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023): row b accepts its draft
i, drawn from q_i, with probability min(1, p_i(x) / q_i(x)), stops at its first rejection, and
then draws the next token from norm(max(0, p - q)) at that position, or from p after the last
draft if all were accepted. Every emitted token is then distributed exactly as if the target
had sampled it alone, provided each draft was drawn from its q_i with noise of its own: noise
that the target's draws (the token before the drafts, the acceptance uniforms, the next token)
do not share. Greedy decoding (temperature 0) is the limit where p is a point mass: a draft
is accepted iff it is the target's argmax; it uses no key.

Keys: exact for every seed. A generation's randomness comes from its seed alone, and no two
draws share a key. `generation_keys(seed)` splits `mx.random.key(seed)` into the target's key
and the drafter's key. Inside `generate` and the engine the target draws with position keys
(`_position_keys`): row b's token at position t with `fold_in(fold_in(target key, b), t)`,
its acceptance uniform there from a stream of that key, and point-mass drafts are accepted by
the coupled rule (the draft is accepted iff it equals the target's own draw at its position),
so the tokens are the plain decode's whatever the rounds were. Called by hand (`accept` with
one key), the target's draws take successive splits of its key; the drafter is handed
its key in `Drafter.start(prompts, key=...)` and splits it for each of its own draws (every
draft step, a tree's branches). Inside one draw each row of the batch gets its own noise (the
key covers the whole (B, ...) array), so rows are independent too, in every mode (linear,
tree, paths, MTP heads, n-gram drafts, ragged batches). A drafter's own `seed=` applies only
when it is started without a key (driven by hand): inside `generate` neither it nor any choice
of the generator's seed can make a draft reuse the noise of the token it is checked against.
The same `generate(..., seed=s)` call gives the same tokens: with point-mass drafts (n-gram)
those of the decode without a drafter, whatever the draft counts; with a draft model's
distributions when the rounds' draft counts are the same (fixed `k`, or a policy over a
`FixedCost`: the default policy times its rounds, and another count gives other, equally
distributed, tokens); greedy output does not depend on the seed or the counts at all. A draw
may also take row keys, (B, 2), one key per row (`_row_keys`): a serving engine's rows are
requests with seeds of their own, and row b's noise is then a function of its key alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import attrs
import mlx.core as mx
import numpy as np

from .. import ShapeError, StateError, TokenError
from ._position_keys import categorical_at, is_position_keys, token_keys, uniform_at
from ._row_keys import categorical, checked_key, split_pair, uniform
from ._values import (
    DRAFT_ID,
    DRAFT_PROBS,
    DRAFT_UNLIKELY,
    SUM_TOLERANCE,
    TARGET_NAN,
    DrafterError,
    counts_of,
    is_integer,
    raise_marked,
)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
        x, (bool, np.bool_)
    )


@attrs.frozen
class Sampler:
    """temperature 0 is greedy; top_k 0, top_p 1.0 and min_p 0.0 leave the distribution
    whole. Applied identically to the target's and the drafter's logits: min_p drops the
    tokens less likely than min_p times the most likely one (under the logits as they are,
    before the temperature: mlx-lm's `make_sampler(min_p=...)`; the most likely token always
    stays), the temperature divides the logits, top_k keeps the k largest (ties at the k-th
    kept too), top_p the smallest set of most likely tokens whose mass reaches top_p (the
    token that crosses it included)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __attrs_post_init__(self) -> None:
        bad = []
        t, p, k, m = self.temperature, self.top_p, self.top_k, self.min_p
        if not (_number(t) and math.isfinite(t) and t >= 0):
            bad.append(f"temperature={t!r} (must be a finite number >= 0)")
        if not (_number(p) and 0 < p <= 1):
            bad.append(f"top_p={p!r} (must be a number in (0, 1])")
        if not (is_integer(k) and k >= 0):
            bad.append(f"top_k={k!r} (must be an int >= 0)")
        if not (_number(m) and 0 <= m <= 1):
            bad.append(f"min_p={m!r} (must be a number in [0, 1])")
        if bad:
            raise StateError(f"Sampler: {', '.join(bad)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: mx.array) -> mx.array:
        """The sampling distribution (..., vocab) float32 of `logits` (..., vocab)."""
        if not isinstance(logits, mx.array):
            raise StateError(
                f"Sampler.probs: logits must be an mx.array (..., vocab); got "
                f"{type(logits).__name__}"
            )
        logits = logits.astype(mx.float32)
        if self.greedy:
            return (mx.arange(logits.shape[-1]) == logits.argmax(-1, keepdims=True)).astype(
                mx.float32
            )
        if self.min_p > 0:
            # p_i < min_p * p_max, as log-probabilities: l_i - max(l) < log(min_p).
            floor = logits.max(-1, keepdims=True) + math.log(self.min_p)
            logits = mx.where(logits < floor, -mx.inf, logits)
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = mx.sort(logits, axis=-1)[..., -self.top_k][..., None]
            logits = mx.where(logits < kth, -mx.inf, logits)
        probs = mx.softmax(logits, axis=-1)
        if self.top_p < 1:
            # Keep the smallest set of most likely tokens whose mass reaches top_p.
            order = mx.argsort(-probs, axis=-1)
            sorted_probs = mx.take_along_axis(probs, order, axis=-1)
            before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
            kept_sorted = before < self.top_p
            kept = mx.put_along_axis(mx.zeros_like(kept_sorted), order, kept_sorted, axis=-1)
            probs = mx.where(kept, probs, 0)
            probs = probs / probs.sum(-1, keepdims=True)
        return probs

    def sample(self, probs: mx.array, key: mx.array | None = None) -> mx.array:
        """One token per distribution of `probs` (..., vocab) (argmax when greedy). `probs`
        must be distributions (no NaN, none negative, each summing to 1): checked with one
        read of a flag per distribution (a `StateError` naming the rows); the package's own
        draws, from distributions it made, skip the check and the read (`draw_from`).
        `key`: one `mx.random.key`, or row keys (B, 2), one per row of `probs`
        (B, ..., vocab): row b then draws with its own key (`_row_keys`)."""
        if not isinstance(probs, mx.array):
            raise StateError(
                f"Sampler.sample: probs must be an mx.array (..., vocab); got {type(probs).__name__}"
            )
        if probs.ndim == 0 or not mx.issubdtype(probs.dtype, mx.floating):
            raise StateError(
                f"Sampler.sample: probs must be float distributions (..., vocab); got shape "
                f"{tuple(probs.shape)} and dtype {probs.dtype}"
            )
        if key is not None and not self.greedy:
            checked_key(key, "Sampler.sample: key", probs.shape[0] if probs.ndim > 1 else None)
        p = probs.astype(mx.float32)
        whole = (mx.abs(p.sum(-1) - 1) <= SUM_TOLERANCE) & (p.min(-1) >= 0)  # NaN fails both
        bad = [i for i, ok in enumerate(cast(list[bool], whole.reshape(-1).tolist())) if not ok]
        if bad:
            raise StateError(
                f"Sampler.sample: probs must be distributions (no NaN, none negative, each "
                f"summing to 1); distributions {bad[:8]} (flattened over the leading axes) "
                f"are not (minimum {mx.min(p).item():.4g}): pass sampler.probs(logits)"
            )
        return draw_from(self, probs, key)


def draw_from(sampler: Sampler, probs: mx.array, key: mx.array | None) -> mx.array:
    """`sampler.sample(probs, key)` without its checks and read: for distributions the
    package made (`Sampler.probs` of logits, the acceptance rule's residuals), unevaluated."""
    if sampler.greedy:
        return probs.argmax(-1).astype(mx.int32)
    return categorical(mx.log(probs), key).astype(mx.int32)


def generation_keys(seed: int) -> tuple[mx.array, mx.array]:
    """(the target's key, the drafter's key) of a generation seeded with `seed`: the two
    halves of `mx.random.split(mx.random.key(seed))`, so every key either side derives is
    distinct from every key of the other side (and of any other seed's)."""
    target, drafter = mx.random.split(mx.random.key(seed))
    return target, drafter


def round_key(sampler: Sampler, key: mx.array) -> tuple[mx.array, mx.array | None]:
    """(the generator's next key, the key of this draw): a greedy draw uses no key (None)
    and leaves `key` as it is."""
    if sampler.greedy:
        return key, None
    key, sub = mx.random.split(key)
    return key, sub


def pick(sampler: Sampler, logits: mx.array, key: mx.array | None) -> mx.array:
    """One token per row of `logits` (B, vocab), unevaluated (greedy: the argmax, with no
    distribution built and no key used)."""
    if sampler.greedy:
        return logits.argmax(-1)
    return draw_from(sampler, sampler.probs(logits), key)


def draw(sampler: Sampler, logits: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """One token per row of `logits` (B, vocab), unevaluated, and the key for the next pick
    (greedy: the argmax, with no distribution built and no key used)."""
    key, sub = round_key(sampler, key)
    return key, pick(sampler, logits, sub)


class Verdict(NamedTuple):
    accepted: list[int]  # accepted[b]: the drafts row b's target agreed with
    next_tokens: list[int]  # row b's next (bonus) token, after its accepted drafts


def accept(
    target: mx.array,
    drafts: mx.array,
    draft_probs: mx.array | None,
    counts: list[int],
    sampler: Sampler,
    key: mx.array | None = None,
) -> Verdict:
    """The acceptance rule over a batch.

    target: (B, span+1, V) the target's sampling distributions after its last token and
    after each of the span drafts; drafts: (B, span) int; draft_probs: (B, span, V') or None
    (point masses); counts: drafted[b], the drafts that count in row b (<= span); key: one
    `mx.random.key` or row keys (B, 2). One host sync for the whole batch.

    Draft ids that `draft_probs` covers but the target's vocabulary lacks (a draft model
    with a padded vocabulary, V' > V) have target probability 0: they are rejected, and the
    residual is exact; draft_probs narrower than V (V' < V) are 0 past their width. Refused
    after the one read (the checks ride along with it, no extra sync): a counted draft id
    outside 0..V'-1 (`TokenError`), draft_probs of a counted draft that are not a
    distribution or give the draft probability 0 (`DrafterError`: it cannot have been drawn
    from them), and a target distribution holding NaN (`StateError`).
    """
    counts = _checked_args(target, drafts, draft_probs, counts, sampler, key)
    if sampler.greedy:
        return accept_greedy(target, drafts, counts)
    return sampled_verdict(target, drafts, draft_probs, counts, sampler, key)


def sampled_verdict(
    target: mx.array,
    drafts: mx.array,
    draft_probs: mx.array | None,
    counts: list[int],
    sampler: Sampler,
    key: mx.array | None,
    made: bool = False,
) -> Verdict:
    """`accept`'s sampled rule on arguments already checked on the host (the generator's
    `checked_proposal`), in one read, raising for what its marks found. `made`: the drafts
    and `draft_probs` are a kvstate drafter's (`Drafted`): ids in range and a sampler's
    distributions, so the distributions' marks are not computed."""
    columns = accept_columns(target, drafts, draft_probs, counts, sampler, key, made)
    rows = cast(list[list[int]], columns.tolist())
    raise_marked([r[2] for r in rows], _refusals(target, drafts, draft_probs, counts))
    return Verdict([r[0] for r in rows], [r[1] for r in rows])


def accept_columns(
    target: mx.array,
    drafts: mx.array,
    draft_probs: mx.array | None,
    counts: list[int],
    sampler: Sampler,
    key: mx.array | None,
    made: bool = False,
) -> mx.array:
    """`accept`'s rule on the device, unread: (B, 3) int32 [accepted, next token, marks],
    marks the bits of `_values` (DRAFT_ID, DRAFT_PROBS, DRAFT_UNLIKELY, TARGET_NAN) of what
    was wrong with row b's input (0: nothing; `made`: DRAFT_PROBS and DRAFT_UNLIKELY are not
    computed, see `sampled_verdict`)."""
    span = drafts.shape[1]
    vocab = target.shape[-1]
    width = vocab if draft_probs is None else draft_probs.shape[-1]
    counted = mx.arange(span)[None] < mx.array(counts)[:, None]
    positional = key is not None and is_position_keys(key)
    if positional and draft_probs is None:
        return _coupled_columns(target, drafts, counted, vocab, cast(mx.array, key))
    keys = split_pair(key) if key is not None and not positional else (None, None)
    # Ids are compared in their own dtype (an int64 id past int32 must not wrap into range)
    # and gathered only once clamped: MLX's gathers do not check bounds.
    invalid = (drafts < 0) | (drafts >= width)
    beyond = drafts >= vocab  # covered by draft_probs only: the target gives them 0
    ids = mx.where(invalid | beyond, 0, drafts).astype(mx.int32)
    p_draft = mx.take_along_axis(target[:, :span], ids[..., None], axis=-1)[..., 0]
    p_draft = mx.where(beyond, 0, p_draft)
    marks = DRAFT_ID * (invalid & counted).any(1).astype(mx.int32)
    if draft_probs is None:
        q_draft = mx.ones_like(p_draft)
    else:
        draft_probs = draft_probs[:, :span].astype(mx.float32)
        q_ids = mx.where(invalid, 0, drafts).astype(mx.int32)
        q_draft = mx.take_along_axis(draft_probs, q_ids[..., None], axis=-1)[..., 0]
        if not made:
            marks = marks + _distribution_marks(draft_probs, q_draft, counted & ~invalid)
    u = uniform_at(cast(mx.array, key)[:, :span]) if positional else uniform(p_draft.shape, keys[0])
    ok = (u * q_draft < p_draft) & counted  # u < p / q, without dividing by a zero q
    accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(1)
    rejected = accepted < mx.array(counts)
    at = accepted[:, None, None]
    p = mx.take_along_axis(target, at, axis=1)[:, 0]
    if draft_probs is None:
        at_draft = mx.take_along_axis(drafts, mx.minimum(accepted, span - 1)[:, None], axis=1)
        q = (mx.arange(p.shape[-1])[None] == at_draft).astype(p.dtype)
    else:
        fitted = _fit_vocabulary(draft_probs, vocab)
        padded = mx.concatenate([fitted, mx.zeros_like(fitted[:, :1])], axis=1)
        q = mx.take_along_axis(padded, at, axis=1)[:, 0]
    residual = mx.maximum(p - q, 0)
    mass = residual.sum(-1, keepdims=True)
    # At a rejection draw from the residual; after the last draft, or if rounding left the
    # residual empty, from p itself.
    use_residual = rejected[:, None] & (mass > 0)
    final = mx.where(use_residual, residual / mx.where(mass > 0, mass, 1), p)
    marks = marks + TARGET_NAN * mx.isnan(final).any(-1).astype(mx.int32)
    if positional:  # the position of each row's next token
        at_key = mx.take_along_axis(cast(mx.array, key), accepted[:, None, None], axis=1)[:, 0]
        next_tokens = draw_from(sampler, final, token_keys(at_key))
    else:
        next_tokens = draw_from(sampler, final, keys[1])
    return _columns(accepted, next_tokens, marks)


def _coupled_columns(
    target: mx.array, drafts: mx.array, counted: mx.array, vocab: int, keys: mx.array
) -> mx.array:
    """`accept_columns` for point-mass drafts and position keys (B, span + 1, 2): the coupled
    rule (`_position_keys`). x_j is the target's own draw at position j with its key; row b
    accepts its drafts while they equal x_j and then emits x at its first disagreement (or
    after its last draft): P(accept draft j) = p_j(draft), the exact rule's, and the emitted
    tokens are the plain decode's draws."""
    span = drafts.shape[1]
    invalid = (drafts < 0) | (drafts >= vocab)
    marks = DRAFT_ID * (invalid & counted).any(1).astype(mx.int32)
    x = categorical_at(mx.log(target[:, : span + 1]), keys[:, : span + 1])
    ok = (x[:, :span] == drafts) & counted
    accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(1)
    p = mx.take_along_axis(target, accepted[:, None, None], axis=1)[:, 0]
    marks = marks + TARGET_NAN * mx.isnan(p).any(-1).astype(mx.int32)
    next_tokens = mx.take_along_axis(x, accepted[:, None], axis=1)[:, 0]
    return _columns(accepted, next_tokens, marks)


def _columns(accepted: mx.array, next_tokens: mx.array, marks: mx.array) -> mx.array:
    return mx.stack([accepted, next_tokens, marks], axis=1).astype(mx.int32)


def _distribution_marks(probs: mx.array, q_draft: mx.array, counted: mx.array) -> mx.array:
    """(B,) DRAFT_PROBS where a counted draft's probs (B, span, V') are not a distribution
    (NaN or inf fail the comparisons), DRAFT_UNLIKELY where they give the draft 0."""
    whole = (mx.abs(probs.sum(-1) - 1) <= SUM_TOLERANCE) & (probs.min(-1) >= 0)
    not_distribution = (~whole & counted).any(1).astype(mx.int32)
    unlikely = ((q_draft <= 0) & counted).any(1).astype(mx.int32)
    return DRAFT_PROBS * not_distribution + DRAFT_UNLIKELY * unlikely


def _fit_vocabulary(probs: mx.array, vocab: int) -> mx.array:
    """Draft distributions (B, span, V') over the target's V ids: the mass past V dropped
    (those ids have target probability 0, so they add nothing to the residual), zeros past
    V' (the drafter never draws them)."""
    width = probs.shape[-1]
    if width == vocab:
        return probs
    if width > vocab:
        return probs[..., :vocab]
    return mx.pad(probs, [(0, 0), (0, 0), (0, vocab - width)])


def accept_greedy(scores: mx.array, drafts: mx.array, drafted: list[int]) -> Verdict:
    """Greedy acceptance straight from `scores` (B, span+1, V): logits, or any distribution
    whose argmax is the target's pick. A draft is accepted while it is the target's argmax.
    One host sync for the whole batch; a counted draft outside 0..V-1 raises `TokenError`
    after it."""
    rows, marks = greedy_picks(
        scores, drafts, drafted, outside_ids(drafts, drafted, scores.shape[-1])
    )
    raise_marked(marks, _refusals(scores, drafts, None, drafted))
    return Verdict([r[0] for r in rows], [r[1 + r[0]] for r in rows])


def outside_ids(drafts: mx.array, drafted: list[int], vocab: int) -> mx.array:
    """(B,) int32 DRAFT_ID where a counted draft of `drafts` (B, span) is outside 0..vocab-1
    (compared in the drafts' own dtype), else 0; unevaluated."""
    counted = mx.arange(drafts.shape[1])[None] < mx.array(drafted)[:, None]
    outside = ((drafts < 0) | (drafts >= vocab)) & counted
    return DRAFT_ID * outside.any(1).astype(mx.int32)


def greedy_picks(
    scores: mx.array, drafts: mx.array, drafted: list[int], marks: mx.array | None = None
) -> tuple[list[list[int]], list[int]]:
    """Per row `[accepted, pick_0 .. pick_span]`: the drafts accepted (while each is the
    target's argmax `pick`) and the target's picks after the last token and each draft, in
    one host read, with `marks` (B,) (a check's bits computed on the device; zeros when
    None) read along. The row's emitted tokens are picks 0..accepted (the accepted drafts
    are picks). `drafted[b]`: the drafts that count in row b."""
    span = drafts.shape[1]
    picks = scores.argmax(-1).astype(mx.int32)  # (B, span+1)
    ok = picks[:, :span] == drafts  # an id outside the vocabulary is never a pick
    if min(drafted) < span:  # filler past a row's drafts is never accepted
        ok = ok & (mx.arange(span)[None] < mx.array(drafted)[:, None])
    accepted = mx.cumprod(ok, axis=1).sum(1, keepdims=True).astype(mx.int32)  # (B, 1)
    columns = [accepted, picks] if marks is None else [accepted, picks, marks[:, None]]
    rows = cast(list[list[int]], mx.concatenate(columns, axis=1).tolist())
    if marks is None:
        return rows, [0] * len(rows)
    return [r[:-1] for r in rows], [r[-1] for r in rows]


# ---------------------------------------------------------------------------- refusals


def _checked_args(
    target: Any, drafts: Any, draft_probs: Any, counts: Any, sampler: Any, key: Any
) -> list[int]:
    """`accept`'s arguments checked on the host (types and shapes: no read); its counts."""
    if not isinstance(sampler, Sampler):
        raise StateError(
            f"accept: sampler must be a kvstate.speculative.Sampler; got {type(sampler).__name__}"
        )
    if not (isinstance(target, mx.array) and target.ndim == 3):
        raise ShapeError(
            f"accept: target must be an mx.array (B, span + 1, vocab) of the target's "
            f"distributions; got {_described(target)}"
        )
    if not (isinstance(drafts, mx.array) and drafts.ndim == 2):
        raise TokenError(
            f"accept: drafts must be an mx.array (B, span) of ids; got {_described(drafts)}"
        )
    if not mx.issubdtype(drafts.dtype, mx.integer):
        raise TokenError(f"accept: drafts must be integer ids; got dtype {drafts.dtype}")
    rows, span = drafts.shape
    if target.shape[0] != rows or target.shape[1] < span + 1:
        raise ShapeError(
            f"accept: target {tuple(target.shape)} must be (B, span + 1, vocab) for drafts "
            f"{tuple(drafts.shape)}: {rows} rows and at least {span + 1} positions"
        )
    if draft_probs is not None:
        if not (isinstance(draft_probs, mx.array) and draft_probs.ndim == 3):
            raise DrafterError(
                f"accept: draft_probs must be None or an mx.array (B, span, vocab); got "
                f"{_described(draft_probs)}"
            )
        if draft_probs.shape[0] != rows or draft_probs.shape[1] < span:
            raise DrafterError(
                f"accept: draft_probs {tuple(draft_probs.shape)} must be (B, span, vocab) for "
                f"drafts {tuple(drafts.shape)}: one distribution per draft"
            )
        if not mx.issubdtype(draft_probs.dtype, mx.floating):
            raise DrafterError(f"accept: draft_probs must be floats; got dtype {draft_probs.dtype}")
    if key is not None:
        checked_key(key, "accept: key", rows)
    return counts_of(counts, "accept: counts", rows, span)


def _described(x: Any) -> str:
    if isinstance(x, mx.array):
        return f"an mx.array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r:.60}"


def _refusals(
    target: mx.array, drafts: mx.array, draft_probs: mx.array | None, counts: list[int]
) -> dict[int, tuple[type[StateError], Callable[[list[int]], str]]]:
    """What each mark means, as (error class, message of the rows marked): the messages read
    the arrays (the error path only)."""
    width = target.shape[-1] if draft_probs is None else draft_probs.shape[-1]

    def counted(rows: list[int]) -> str:
        ids = cast(list[list[int]], drafts.tolist())
        return "; ".join(f"row {b}: {ids[b][: counts[b]]}" for b in rows[:4])

    def ids(rows: list[int]) -> str:
        return (
            f"accept: drafts (a proposal's tokens) hold ids outside 0..{width - 1} "
            f"({counted(rows)}); a draft must "
            + ("be a token id of the target's vocabulary" if draft_probs is None else
               "be an id its draft_probs cover")
        )  # fmt: skip

    def distribution(rows: list[int]) -> str:
        assert draft_probs is not None
        sums = draft_probs[mx.array(rows[:4]), :].sum(-1).tolist()
        return (
            f"accept: draft_probs (a proposal's probs) of rows {rows[:8]} are not "
            f"distributions (sums per draft "
            f"{sums}, or negative or NaN entries): give each draft's probabilities (B, span, "
            "vocab), non-negative and summing to 1, or None for drafts chosen deterministically"
        )

    def unlikely(rows: list[int]) -> str:
        return (
            f"accept: draft_probs (a proposal's probs) give probability 0 to drafts they "
            f"were drawn from "
            f"({counted(rows)}): a draft must be drawn from its own distribution"
        )

    def nan(rows: list[int]) -> str:
        return (
            f"accept: the target distributions of rows {rows[:8]} hold NaN (the target's logits "
            "are NaN: an input id outside its vocabulary, or an overflow)"
        )

    return {
        DRAFT_ID: (TokenError, ids),
        DRAFT_PROBS: (DrafterError, distribution),
        DRAFT_UNLIKELY: (DrafterError, unlikely),
        TARGET_NAN: (StateError, nan),
    }
