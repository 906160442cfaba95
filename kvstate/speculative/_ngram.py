"""A drafter with no model: prompt lookup (n-gram matching over each row's own context)."""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from ._drafter import Proposal
from ._sampling import Sampler


class NGramDrafter:
    """Proposes the tokens that followed the most recent earlier occurrence of a row's last
    `n` tokens (n from `max_n` down to `min_n`) in that row's prompt and output. Code, quotes
    and lists repeat, so this is free and often right; when nothing matches it proposes
    nothing, and the generator takes a plain step.

    Each row keeps an index from every n-gram to where its latest occurrence ended, updated
    as tokens are kept: a lookup is O(max_n), whatever the context's length.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NGramDrafter: need 1 <= min_n <= max_n; got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.history: list[list[int]] = []
        self.index: list[dict[tuple[int, ...], int]] = []

    def start(self, prompts: list[list[int]]) -> None:
        self.history, self.index = [], []
        for prompt in prompts:
            self.history.append([])
            self.index.append({})
            self._extend(len(self.history) - 1, list(prompt))

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        drafts, counts = [], []
        for row, token in enumerate(last):
            found = self._lookup(row, token, k)
            counts.append(len(found))
            drafts.append(found + [0] * (k - len(found)))
        return Proposal(mx.array(drafts, mx.int32), counts, None)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        rows = cast(list[list[int]], fed.tolist())
        for row, (tokens, n) in enumerate(zip(rows, kept, strict=True)):
            self._extend(row, tokens[:n])

    def keep_rows(self, rows: list[int]) -> None:
        self.history = [self.history[i] for i in rows]
        self.index = [self.index[i] for i in rows]

    def _lookup(self, row: int, token: int, k: int) -> list[int]:
        history, index = self.history[row], self.index[row]
        for n in range(self.max_n, self.min_n - 1, -1):
            if n - 1 > len(history):
                continue
            gram = (*history[len(history) - (n - 1) :], token)
            end = index.get(gram)
            if end is not None:
                # What followed that occurrence, up to the present (the last token included:
                # a match that ends just before it continues a repeating pattern).
                return [*history[end : end + k], token][:k]
        return []

    def _extend(self, row: int, tokens: list[int]) -> None:
        history, index = self.history[row], self.index[row]
        for token in tokens:
            history.append(token)
            end = len(history)
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    index[tuple(history[end - n : end])] = end
