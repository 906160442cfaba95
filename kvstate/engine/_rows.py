"""The running batch: the target's state over its rows and, per row, what the host keeps of
it (its request, its last token, its key, the tokens its state holds). Rows join with
`extend` (ragged lengths: left padding) and leave with `filter`; nothing else touches the
state between rounds but a plain step launched ahead (`launched`), whose forward the state
is the output of."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import extend, filter
from ..speculative import Launched
from ._params import Request


class Row:
    """One running request. `last`: its last emitted token, in no state yet (the next round
    feeds it); `history`: the tokens its state holds (prompt, then every token a round kept,
    which past a stop or `max_tokens` can run beyond what it emitted)."""

    __slots__ = ("history", "last", "request")

    def __init__(self, request: Request, last: int, history: list[int]) -> None:
        self.request, self.last, self.history = request, last, history

    @property
    def remaining(self) -> int:
        """Tokens it may still emit."""
        return self.request.params.max_tokens - len(self.request.tokens)


class Batch:
    """The running rows (`rows`, in batch order), the target's `state` over them (None when
    there are none) and their keys (B, 2), row b's the key its request draws with.

    `launched`: a plain step over the rows built before the last round's tokens were read
    (from them, unread), its tokens not read yet; `state` is then its forward's output and
    holds each row's `last` token too (`held`). None: the state holds each row's `history`."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.state: Any = None
        self.keys: mx.array | None = None
        self.launched: Launched | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rows: list[Row], added: Any, keys: list[mx.array]) -> None:
        """Append `rows`, with their batched state `added` and keys (2,), after the current
        ones."""
        new_keys = mx.stack(keys)
        if self.state is None:
            self.state, self.keys = added, new_keys
        else:
            assert self.keys is not None
            self.state = extend(self._take(), added)
            self.keys = mx.concatenate([self.keys, new_keys])
        self.rows += rows

    def keep(self, alive: list[int]) -> None:
        """Only the rows at positions `alive` stay, in this order (none: the batch empties)."""
        if not alive:
            self.rows, self.state, self.keys, self.launched = [], None, None, None
            return
        self.state = filter(self._take(), alive)
        if self.launched is not None:
            self.launched.keep(alive)
        assert self.keys is not None
        self.keys = self.keys[mx.array(alive)]
        self.rows = [self.rows[i] for i in alive]

    def held(self, b: int) -> list[int]:
        """The tokens row `b`'s state holds."""
        row = self.rows[b]
        return [*row.history, row.last] if self.launched is not None else list(row.history)

    def take(self) -> Any:
        """The state, handed over to a round (no reference kept here while it runs)."""
        return self._take()

    def _take(self) -> Any:
        state, self.state = self.state, None
        return state
