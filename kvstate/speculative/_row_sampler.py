"""A sampler per row: a batch whose rows sample with different temperatures, top-p and top-k
(greedy rows among them), as a serving engine's batch of requests does.

`RowSampler` is a `Sampler`, so every round function, drafter and the acceptance rule take
it as they take one: its `probs` applies row b's own sampler to row b of the logits (the
leading axis of every array it is given is the batch), and gives a greedy row its argmax as
a point mass. Exactness carries over row by row: speculative sampling draws each token from
the distribution `probs` gives, and row b's is what `rows[b].probs` gives for that row
alone (the same operations, value for value), so a sampled row is distributed as the target
alone samples it and a greedy row's tokens are the argmax (a point-mass target accepts a
draft iff it is the argmax, and its residual is the argmax again).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx

from .. import ShapeError, StateError
from ._sampling import Sampler


@attrs.frozen
class RowSampler(Sampler):
    """`rows[b]` samples row b. Build it with `RowSampler.of(samplers)`; the inherited fields
    summarise the rows (temperature: the largest, so `greedy` is True iff every row is)."""

    rows: tuple[Sampler, ...] = attrs.field(default=(), kw_only=True)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not self.rows or not all(type(s) is Sampler for s in self.rows):
            raise StateError(
                "RowSampler: rows must be a non-empty tuple of kvstate.speculative.Sampler, "
                f"one per row; got {self.rows!r:.80}"
            )
        if self.temperature != max(s.temperature for s in self.rows):
            raise StateError("RowSampler: build it with RowSampler.of(samplers)")

    @classmethod
    def of(cls, samplers: Sequence[Sampler]) -> RowSampler:
        """The sampler of a batch whose row b samples with `samplers[b]`."""
        rows = tuple(samplers)
        if not rows or not all(type(s) is Sampler for s in rows):
            raise StateError(
                f"RowSampler.of: give one kvstate.speculative.Sampler per row; got {rows!r:.80}"
            )
        return cls(temperature=max(s.temperature for s in rows), rows=rows)

    def probs(self, logits: mx.array) -> mx.array:
        """Row b's sampling distribution (b, ..., vocab) float32 under `rows[b]`, for
        `logits` (B, ..., vocab) with B = len(rows)."""
        if not isinstance(logits, mx.array) or logits.ndim < 2:
            raise StateError(
                "RowSampler.probs: logits must be an mx.array (B, ..., vocab), one row per "
                f"sampler; got {getattr(logits, 'shape', type(logits).__name__)}"
            )
        if logits.shape[0] != len(self.rows):
            raise ShapeError(
                f"RowSampler.probs: logits {tuple(logits.shape)} have {logits.shape[0]} rows "
                f"for {len(self.rows)} samplers; give one row per sampler"
            )
        logits = logits.astype(mx.float32)
        vocab = logits.shape[-1]
        per_row = (len(self.rows),) + (1,) * (logits.ndim - 1)

        def column(values: Sequence[float], dtype: mx.Dtype) -> mx.array:
            return mx.array(list(values), dtype).reshape(per_row)

        temperatures = [s.temperature for s in self.rows]
        greedy = column([t == 0 for t in temperatures], mx.bool_)
        argmax = (mx.arange(vocab) == logits.argmax(-1, keepdims=True)).astype(mx.float32)
        if all(t == 0 for t in temperatures):
            return argmax
        scaled = logits / column([t or 1.0 for t in temperatures], mx.float32)
        top_k = [s.top_k if 0 < s.top_k < vocab else 0 for s in self.rows]
        if any(top_k):
            # Sampler's rule row by row: keep the k largest (ties at the k-th kept too); a
            # row without top_k compares against -inf and keeps everything.
            at = column([vocab - k if k else 0 for k in top_k], mx.int32)
            kth = mx.take_along_axis(mx.sort(scaled, axis=-1), at, axis=-1)
            kth = mx.where(column([k > 0 for k in top_k], mx.bool_), kth, -mx.inf)
            scaled = mx.where(scaled < kth, -mx.inf, scaled)
        probs = mx.softmax(scaled, axis=-1)
        top_p = [s.top_p for s in self.rows]
        if any(p < 1 for p in top_p):
            p = column(top_p, mx.float32)
            order = mx.argsort(-probs, axis=-1)
            sorted_probs = mx.take_along_axis(probs, order, axis=-1)
            before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
            kept_sorted = before < p
            kept = mx.put_along_axis(mx.zeros_like(kept_sorted), order, kept_sorted, axis=-1)
            cut = mx.where(kept, probs, 0)
            cut = cut / cut.sum(-1, keepdims=True)
            # A row with top_p 1 is left whole, not renormalised: Sampler skips it too.
            probs = mx.where(p < 1, cut, probs)
        return mx.where(greedy, argmax, probs)
