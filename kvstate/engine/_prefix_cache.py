"""The exact prefix cache: batch-1 states kept by the tokens they hold, LRU within a byte
bound, shared through `kvstate.save` / `kvstate.load`.

A state is a value (`snapshot`): the state after a prompt's first n tokens stays exactly
that, whatever runs from it later, so a new prompt that starts with those n tokens can
start from it and prefill only the rest. Which prefixes a kept state serves depends on its
kinds:

- cut (every layer a dense KV cache: `Capabilities.joinable_forwards`): a prefill's
  entries for positions 0..n-1 are what a prefill of any shorter prefix leaves, so a state
  kept at a prompt's end serves every prompt that shares its first m <= n tokens, cut to m
  with one `commit_prefix` (the state stamped as one forward of its n tokens, as a draft
  model's rollback does). Not a turn end's: a ragged commit moves a row's oldest tokens
  into the slots its rejected drafts left (keys carry their RoPE, so attention does not
  mind), so its buffer is no longer in position order and only the whole state serves;
- exact (windows, recurrent and hybrid states, quantized ones): a recurrent state after n
  tokens cannot be taken back to m < n, so a kept state serves exactly its n tokens; the
  engine keeps them where they are free: at fixed block boundaries inside a prompt (its
  chunked prefill's chunk ends), at the prompt's last-but-one position and at turn ends
  (a finished request's prompt and output).

Lookup scans the entries' token arrays (NumPy, vectorised): the cache is bounded by bytes,
so by the tokens it holds, and a scan of them costs microseconds against a prefill.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import FileFormatError, StateError, commit_prefix, load, nbytes, save
from ..kinds import Composite, inherit, replace, with_parts

_META_KEY = "kvstate.engine.prefix_cache"
_VERSION = 1


class _Entry:
    __slots__ = ("cuttable", "nbytes", "state", "tokens")

    def __init__(self, tokens: np.ndarray, state: Any, size: int, cuttable: bool) -> None:
        self.tokens, self.state, self.nbytes, self.cuttable = tokens, state, size, cuttable


class PrefixCache:
    """States by token prefix (see the module docstring). `max_bytes`: the bound on
    `nbytes` of the entries together (0: keep nothing); `cuts`: whether any prefix of an
    entry can be cut from it (attention-only states) or only its whole length serves.

    `lookup(prompt, limit)` -> (state, n) for the longest prefix of at most `limit` tokens
    it serves, or None; `insert(tokens, state, cuttable=)` keeps a batch-1 state over
    `tokens`.
    Counters: hits, misses, hit_tokens (prompt tokens served), evictions."""

    def __init__(self, max_bytes: int, *, cuts: bool) -> None:
        self.max_bytes = max_bytes
        self.cuts = cuts
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.hits = self.misses = self.hit_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def prefixes(self) -> list[tuple[int, ...]]:
        """The token prefixes held, least recently used first."""
        return list(self._entries)

    def lookup(self, prompt: tuple[int, ...], limit: int) -> tuple[Any, int] | None:
        """The state after the longest prefix of `prompt` of at most `limit` tokens that the
        cache serves, and that prefix's length; None (a miss) when none does. A hit makes
        its entry the most recently used."""
        best: tuple[int, tuple[int, ...]] | None = None
        if limit >= 1 and self._entries:
            ids = np.asarray(prompt[:limit], np.int64)
            for key, entry in self._entries.items():  # oldest first: ties go to the newest
                common = _common(ids, entry.tokens)
                if not (entry.cuttable or common == len(key)):
                    continue  # a whole entry serves only prompts that start with all of it
                if common >= 1 and (best is None or common >= best[0]):
                    best = (common, key)
        if best is None:
            self.misses += 1
            return None
        served, key = best
        entry = self._entries[key]
        self._entries.move_to_end(key)
        self.hits += 1
        self.hit_tokens += served
        if served == len(key):
            return entry.state, served
        return cut(entry.state, len(key), served), served

    def insert(self, tokens: tuple[int, ...], state: Any, *, cuttable: bool = True) -> bool:
        """Keep `state`, a batch-1 state over exactly `tokens`, evicting the least recently
        used entries past the byte bound; False when it is not kept (larger than the bound,
        or served already by a longer entry that can be cut). `cuttable`: whether a prefix
        of it can be cut from it (with `cuts`: a prefill's state, not a turn end's); one
        that can drops the entries it serves (prefixes of `tokens`)."""
        if not tokens:
            return False
        cuttable = cuttable and self.cuts
        if tokens in self._entries:
            self._entries.move_to_end(tokens)
            return True
        size = nbytes(state)
        if size > self.max_bytes:
            return False
        if self.cuts:
            ids = np.asarray(tokens, np.int64)
            for key in list(self._entries):
                entry = self._entries[key]
                common = _common(ids, entry.tokens)
                if common == len(tokens) and entry.cuttable:  # a longer entry serves it
                    self._entries.move_to_end(key)
                    return False
                if common == len(key) and cuttable:
                    self._drop(key)
        self._entries[tokens] = _Entry(np.asarray(tokens, np.int64), state, size, cuttable)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        return tokens in self._entries

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    # -- files -------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every entry to one file (`kvstate.save`: safetensors, atomic), least
        recently used first, with their tokens in its metadata."""
        entries = list(self._entries.items())
        meta = {
            "version": _VERSION,
            "tokens": [list(k) for k, _ in entries],
            "cuttable": [e.cuttable for _, e in entries],
        }
        save(path, [e.state for _, e in entries], {_META_KEY: json.dumps(meta)})

    def load(self, path: str | os.PathLike[str], check: Callable[[Any], None]) -> int:
        """Add the entries of a file `save` wrote (each state checked by `check` first, which
        raises for a state that does not fit the engine's model), as the most recently used;
        the number of entries kept."""
        states, metadata = load(path, return_metadata=True)
        raw = metadata.get(_META_KEY)
        if raw is None:
            raise FileFormatError(
                f"load_prefix_cache: {os.fspath(path)!r} is a kvstate file but no prefix "
                "cache (write one with Engine.save_prefix_cache)"
            )
        meta = json.loads(raw)
        if meta.get("version") != _VERSION:
            raise FileFormatError(
                f"load_prefix_cache: {os.fspath(path)!r} is prefix cache version "
                f"{meta.get('version')!r}; this kvstate reads version {_VERSION}"
            )
        tokens, cuttable = meta.get("tokens"), meta.get("cuttable")
        if not (
            isinstance(states, (list, tuple))
            and isinstance(tokens, list)
            and isinstance(cuttable, list)
            and len(cuttable) == len(tokens)
        ):
            raise FileFormatError(f"load_prefix_cache: {os.fspath(path)!r} is malformed")
        if len(tokens) != len(states):
            raise FileFormatError(
                f"load_prefix_cache: {os.fspath(path)!r} has {len(states)} states for "
                f"{len(tokens)} token lists"
            )
        kept = 0
        for ids, state, whole in zip(tokens, states, cuttable, strict=True):
            if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
                raise FileFormatError(
                    f"load_prefix_cache: {os.fspath(path)!r} holds token lists that are not "
                    "lists of ints"
                )
            check(state)
            kept += self.insert(tuple(ids), state, cuttable=bool(whole))
        return kept


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two 1-d id arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _stamped(state: Any, n: int) -> Any:
    """`state` as if its last `n` tokens came from one forward (`appended=n`, every part)."""
    if isinstance(state, Composite):
        return with_parts(state, tuple(_stamped(p, n) for p in state.parts))
    return replace(state, appended=n)


def cut(state: Any, length: int, n: int) -> Any:
    """A batch-1 attention-only state over `length` tokens cut to its first `n`: stamped as
    one forward of all of them, then one `commit_prefix` keeping `n`."""
    if not 0 < n <= length:
        raise StateError(f"prefix cache: cannot cut a state of {length} tokens to {n}")
    return commit_prefix(inherit(_stamped(state, length), state), n)
