"""One choice's reply text as its tokens arrive: detokenized, cut at stop strings.

The tokenizer's streaming detokenizer (mlx-lm's `TokenizerWrapper.detokenizer`) releases
text only once it is whole: a multi-byte character split over tokens waits for its last
byte, so no delta ever ends inside a character. Stop strings: text that could be the start
of one is held back until the next token decides; when one appears, the reply ends just
before it (the stop string itself is not part of the reply, as in OpenAI's API) and the
tokens after the one that completed it are not counted.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Delta:
    """What one batch of tokens adds: `text` (possibly empty), the `tokens` consumed
    (counted in the reply) with their `logprobs` (None when not asked), and each token's
    offset in the reply text when it was consumed (`offsets`)."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    offsets: tuple[int, ...]


class TextStream:
    """The reply of one choice: `feed` each engine output's tokens, `finish` at the end.
    `hidden` ids (eos, stop token ids) are counted but have no text. After a stop string
    matched, `stopped` is True and further tokens are ignored."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], hidden: frozenset[int]) -> None:
        self._detokenizer = tokenizer.detokenizer
        self._stops = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._hidden = hidden
        self._pending = ""  # detokenized, not yet released: it may begin a stop string
        self.text = ""  # the reply so far, as released
        self.tokens: list[int] = []  # the reply's tokens (those after a stop string excluded)
        self.logprobs: list[float] = []  # theirs, when asked
        self.offsets: list[int] = []  # where each one's text begins in `text`, about
        self.stopped = False

    def feed(self, tokens: tuple[int, ...], logprobs: tuple[float, ...] | None) -> Delta:
        start = len(self.text)
        used: list[int] = []
        offsets: list[int] = []
        out: list[str] = []
        for t in tokens:
            if self.stopped:
                break
            used.append(t)
            offsets.append(start + sum(len(s) for s in out) + len(self._pending))
            if t in self._hidden:
                continue
            self._detokenizer.add_token(t)
            out.append(self._released(self._detokenizer.last_segment))
        return self._delta("".join(out), used, logprobs, offsets)

    def finish(self) -> Delta:
        """The text the detokenizer and the stop-string check still hold."""
        if self.stopped:
            return Delta("", (), None, ())
        self._detokenizer.finalize()
        text = self._released(self._detokenizer.last_segment, final=True)
        return self._delta(text, [], None, [])

    def _released(self, segment: str, final: bool = False) -> str:
        """The text that can go out now, `segment` being the detokenizer's new text."""
        if not self._stops:
            return segment
        pending = self._pending + segment
        hits = [i for i in (pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return pending[: min(hits)]
        keep = 0 if final else self._stop_prefix(pending)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of `text` that begins some stop string."""
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _delta(
        self, text: str, used: list[int], logprobs: tuple[float, ...] | None, offsets: list[int]
    ) -> Delta:
        self.text += text
        self.tokens.extend(used)
        self.offsets.extend(offsets)
        kept = None if logprobs is None else tuple(logprobs[: len(used)])
        self.logprobs.extend(kept or ())
        return Delta(text, tuple(used), kept, tuple(offsets))
