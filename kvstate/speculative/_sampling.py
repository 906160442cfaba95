"""Sampling, the same for the target and its drafter, and the speculative acceptance rule.

Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023): row b accepts its draft
i, drawn from q_i, with probability min(1, p_i(x) / q_i(x)), stops at its first rejection, and
then draws the next token from norm(max(0, p - q)) at that position, or from p after the last
draft if all were accepted. Every emitted token is then distributed exactly as if the target
had sampled it alone. Greedy decoding (temperature 0) is the limit where p is a point mass:
a draft is accepted iff it is the target's argmax.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import attrs
import mlx.core as mx

from .. import StateError


@attrs.frozen
class Sampler:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 leave the distribution whole.
    Applied identically to the target's and the drafter's logits."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __attrs_post_init__(self) -> None:
        bad = []
        if not self.temperature >= 0:
            bad.append(f"temperature={self.temperature!r} (must be >= 0)")
        if not 0 < self.top_p <= 1:
            bad.append(f"top_p={self.top_p!r} (must be in (0, 1])")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            bad.append(f"top_k={self.top_k!r} (must be an int >= 0)")
        if bad:
            raise StateError(f"Sampler: {', '.join(bad)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: mx.array) -> mx.array:
        """The sampling distribution (..., vocab) float32 of `logits` (..., vocab)."""
        logits = logits.astype(mx.float32)
        if self.greedy:
            return (mx.arange(logits.shape[-1]) == logits.argmax(-1, keepdims=True)).astype(
                mx.float32
            )
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
        """One token per distribution of `probs` (..., vocab) (argmax when greedy)."""
        if self.greedy:
            return probs.argmax(-1).astype(mx.int32)
        return mx.random.categorical(mx.log(probs), key=key).astype(mx.int32)


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
    return sampler.sample(sampler.probs(logits), key)


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
    after each of the span drafts; drafts: (B, span) int; draft_probs: (B, span, V) or None
    (point masses); counts: drafted[b], the drafts that count in row b (<= span). One host
    sync for the whole batch.
    """
    span = drafts.shape[1]
    if sampler.greedy:
        return accept_greedy(target, drafts, counts)
    valid = mx.arange(span)[None] < mx.array(counts)[:, None]
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    p_draft = mx.take_along_axis(target[:, :span], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = mx.ones_like(p_draft)
    else:
        q_draft = mx.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    u = mx.random.uniform(shape=p_draft.shape, key=keys[0])
    ok = (u * q_draft < p_draft) & valid  # u < p / q, without dividing by a zero q
    accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(1)
    rejected = accepted < mx.array(counts)
    at = accepted[:, None, None]
    p = mx.take_along_axis(target, at, axis=1)[:, 0]
    if draft_probs is None:
        at_draft = mx.take_along_axis(drafts, mx.minimum(accepted, span - 1)[:, None], axis=1)
        q = (mx.arange(p.shape[-1])[None] == at_draft).astype(p.dtype)
    else:
        padded = mx.concatenate([draft_probs, mx.zeros_like(draft_probs[:, :1])], axis=1)
        q = mx.take_along_axis(padded, at, axis=1)[:, 0]
    residual = mx.maximum(p - q, 0)
    mass = residual.sum(-1, keepdims=True)
    # At a rejection draw from the residual; after the last draft, or if rounding left the
    # residual empty, from p itself.
    use_residual = rejected[:, None] & (mass > 0)
    final = mx.where(use_residual, residual / mx.where(mass > 0, mass, 1), p)
    next_tokens = sampler.sample(final, key=keys[1])
    return _verdict(mx.concatenate([accepted[:, None], next_tokens[:, None]], axis=1))


def accept_greedy(scores: mx.array, drafts: mx.array, drafted: list[int]) -> Verdict:
    """Greedy acceptance straight from `scores` (B, span+1, V): logits, or any distribution
    whose argmax is the target's pick. A draft is accepted while it is the target's argmax.
    One host sync for the whole batch."""
    rows = greedy_picks(scores, drafts, drafted)
    return Verdict([r[0] for r in rows], [r[1 + r[0]] for r in rows])


def greedy_picks(scores: mx.array, drafts: mx.array, drafted: list[int]) -> list[list[int]]:
    """Per row `[accepted, pick_0 .. pick_span]`: the drafts accepted (while each is the
    target's argmax `pick`) and the target's picks after the last token and each draft, in
    one host read. The row's emitted tokens are picks 0..accepted (the accepted drafts are
    picks). `drafted[b]`: the drafts that count in row b."""
    span = drafts.shape[1]
    picks = scores.argmax(-1).astype(mx.int32)  # (B, span+1)
    ok = picks[:, :span] == drafts
    if min(drafted) < span:  # filler past a row's drafts is never accepted
        ok = ok & (mx.arange(span)[None] < mx.array(drafted)[:, None])
    accepted = mx.cumprod(ok, axis=1).sum(1, keepdims=True)  # (B, 1) int32
    return cast(list[list[int]], mx.concatenate([accepted, picks], axis=1).tolist())


def _verdict(columns: mx.array) -> Verdict:
    """(B, 2) [accepted, next token] -> a Verdict, in one host read."""
    rows = cast(list[list[int]], columns.tolist())
    return Verdict([r[0] for r in rows], [r[1] for r in rows])
