"""A drafter with no model: prompt lookup (n-gram matching over each row's own context)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx

from .. import StateError, TokenError
from . import _values as values
from ._checks import (
    checked_depth,
    checked_kept,
    checked_last,
    checked_prompts,
    checked_rows,
    started_rows,
)
from ._drafter import Drafted, DraftTree, Proposal
from ._sampling import Sampler
from ._trees import tree_of_paths


class NGramDrafter:
    """Proposes the tokens that followed the most recent earlier occurrence of a row's last
    `n` tokens (n from `max_n` down to `min_n`) in that row's prompt and output. Code, quotes
    and lists repeat, so this is free and often right; when nothing matches it proposes
    nothing, and the generator takes a plain step.

    For tree verification (`propose_tree`) it proposes up to `branches` distinct
    continuations: those of the latest `branches` occurrences of each n-gram, longest n first.

    Each row keeps an index from every n-gram to where its latest `branches` occurrences
    ended, updated as tokens are kept: a lookup is O(max_n * branches), whatever the
    context's length.
    """

    uses_hidden = False

    def __init__(self, max_n: int = 3, min_n: int = 1, *, branches: int = 3) -> None:
        max_n = values.integer(max_n, "NGramDrafter: max_n")
        min_n = values.integer(min_n, "NGramDrafter: min_n")
        branches = values.integer(branches, "NGramDrafter: branches")
        if not 1 <= min_n <= max_n:
            raise StateError(f"NGramDrafter: need 1 <= min_n <= max_n; got {min_n}, {max_n}")
        if branches < 1:
            raise StateError(f"NGramDrafter: branches must be >= 1; got {branches}")
        self.max_n, self.min_n, self.branches = max_n, min_n, branches
        self.history: list[list[int]] = []
        self.index: list[dict[tuple[int, ...], list[int]]] = []
        self._started = False
        self._top = 0  # the largest id any row's history holds
        self.confidence: list[tuple[int, int] | None] = []
        """After `propose`, per row: (n, occurrences) of the n-gram its drafts follow (its
        length, and how many of its latest `branches` occurrences are indexed), None where
        nothing matched: what a drafting policy learns acceptance by."""
        self.proposed: list[list[int]] = []
        """After `propose`, per row: its drafts (host ints): a drafting policy learns their
        acceptance from the tokens that follow, verified or not."""

    def start(self, prompts: list[list[int]], *, key: mx.array | None = None) -> None:
        """Index `prompts` (one per row). `key` is taken and unused: the lookup draws
        nothing at random (its drafts are point masses)."""
        prompts = checked_prompts(prompts, None, "NGramDrafter.start")
        self._started = True
        self.history, self.index, self._top = [], [], 0
        for prompt in prompts:
            self.history.append([])
            self.index.append({})
            self._extend(len(self.history) - 1, list(prompt))

    def add_rows(self, prompts: list[list[int]]) -> None:
        """New rows after the current ones, whose `prompts` the target prefilled (a batch
        that admits rows between rounds; `start` when none were started)."""
        if not self._started:
            self.start(prompts)
            return
        prompts = checked_prompts(prompts, None, "NGramDrafter.add_rows")
        for prompt in prompts:
            self.history.append([])
            self.index.append({})
            self._extend(len(self.history) - 1, list(prompt))

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        proposed, confidence = self._found(last, k, "NGramDrafter.propose")
        counts = [len(found) for found in proposed]
        drafts = [found + [0] * (k - len(found)) for found in proposed]
        self.confidence, self.proposed = confidence, proposed
        # Every draft is an id of some row's history (or the filler 0): below `_top + 1`.
        return Drafted(mx.array(drafts, mx.int32), counts, None, self._top + 1)

    def peek(self, last: list[int], k: int) -> tuple[list[list[int]], list[Any]]:
        """What `propose` would draft after each row's `last` token, on the host, and its
        confidence labels, changing nothing (a drafting policy peeks past the last token read
        in rounds built ahead)."""
        return self._found(last, k, "NGramDrafter.peek")

    def _found(self, last: Any, k: Any, where: str) -> tuple[list[list[int]], list[Any]]:
        last = self._checked(where, last, k)
        found = [self._lookup(row, token, k) for row, token in enumerate(last)]
        return [drafts for drafts, _ in found], [label for _, label in found]

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        if not values.is_integer(last):
            raise TokenError(
                f"NGramDrafter.propose_tree: last must be an int token id; got {last!r}"
            )
        last = self._checked("NGramDrafter.propose_tree", [last], k)[0]
        paths: list[list[int]] = []
        for found in self._matches(0, last, k):
            if found not in paths:
                paths.append(found)
            if len(paths) == self.branches:
                break
        return DraftTree(*tree_of_paths(paths))

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        where = "NGramDrafter.accept"
        kept = checked_kept(fed, kept, self._rows(where), values.INT32_LIMIT, where)
        rows = cast(list[list[int]], fed.tolist())
        for row, (tokens, n) in enumerate(zip(rows, kept, strict=True)):
            self._extend(row, tokens[:n])

    def keep_rows(self, rows: list[int]) -> None:
        rows = checked_rows(rows, self._rows("NGramDrafter.keep_rows"), "NGramDrafter.keep_rows")
        self.history = [self.history[i] for i in rows]
        self.index = [self.index[i] for i in rows]

    def _rows(self, where: str) -> int:
        return started_rows(len(self.history) if self._started else None, where)

    def _checked(self, where: str, last: Any, k: Any) -> list[int]:
        rows = self._rows(where)
        checked_depth(k, where, low=0)
        return checked_last(last, rows, None, where)

    def _lookup(self, row: int, token: int, k: int) -> tuple[list[int], tuple[int, int] | None]:
        """The drafts after the longest latest match, and its (n, occurrences)."""
        history, index = self.history[row], self.index[row]
        for n in range(self.max_n, self.min_n - 1, -1):
            if n - 1 > len(history):
                continue
            gram = (*history[len(history) - (n - 1) :], token)
            ends = index.get(gram)
            if ends:
                return [*history[ends[-1] : ends[-1] + k], token][:k], (n, len(ends))
        return [], None

    def _matches(self, row: int, token: int, k: int) -> Iterator[list[int]]:
        """What followed each indexed occurrence of the row's last n tokens, longest n first,
        latest occurrence first."""
        history, index = self.history[row], self.index[row]
        for n in range(self.max_n, self.min_n - 1, -1):
            if n - 1 > len(history):
                continue
            gram = (*history[len(history) - (n - 1) :], token)
            for end in reversed(index.get(gram, ())):
                # What followed that occurrence, up to the present (the last token included:
                # a match that ends just before it continues a repeating pattern).
                yield [*history[end : end + k], token][:k]

    def _extend(self, row: int, tokens: list[int]) -> None:
        history, index = self.history[row], self.index[row]
        if tokens:
            self._top = max(self._top, max(tokens))
        for token in tokens:
            history.append(token)
            end = len(history)
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    ends = index.setdefault(tuple(history[end - n : end]), [])
                    ends.append(end)
                    if len(ends) > self.branches:
                        del ends[0]
