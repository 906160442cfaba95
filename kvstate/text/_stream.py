"""Text out of `kvstate.speculative.generate`, shaped like mlx-lm's `stream_generate`: one
`Response` per round (text, tokens and figures), prompts as a string or chat messages, the
text through the tokenizer's streaming detokenizer (`text_tokenizer`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx

from .. import StateError
from ..speculative import Drafter, Generation, Target, TreeDrafter, generate
from ._tokenizer import text_tokenizer

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]] | mx.array
"""A string (encoded as mlx-lm's stream_generate encodes it), token ids, or chat messages
(`[{"role": "user", "content": ...}, ...]`, rendered with the tokenizer's chat template and
a generation prompt)."""


class Response(NamedTuple):
    """One round of `stream_text` (mlx-lm's `GenerationResponse`, per round instead of per
    token: a speculative round emits several).

    text: the round's new text (possibly empty: a multi-byte character or a word held back
        until it is whole; end tokens are not part of the text).
    tokens / from_draft: the round's token ids, and which were accepted drafts.
    prompt_tokens: the prompt's length (the new tokens, after a state); prompt_tps: prompt
        tokens per second (the time to the first round); generation_tokens: the tokens
        emitted so far; generation_tps: their rate since the first round.
    drafts_proposed / drafts_accepted: the drafts verified and accepted so far.
    peak_memory: MLX's peak memory so far, in GB.
    finish_reason: None, then "stop" (an end token) or "length" (max_tokens) on the last.
    """

    text: str
    tokens: list[int]
    from_draft: list[bool]
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    drafts_proposed: int
    drafts_accepted: int
    peak_memory: float
    finish_reason: str | None


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """`prompt` (see `Prompt`) as token ids, with `tokenizer` (a `TokenizerWrapper`)."""
    if isinstance(prompt, str):
        # As mlx-lm's stream_generate: the special tokens unless the text starts with BOS.
        bos = tokenizer.bos_token
        return list(tokenizer.encode(prompt, add_special_tokens=bos is None or
                                     not prompt.startswith(bos)))  # fmt: skip
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return list(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True))
    if isinstance(prompt, mx.array):
        return cast(list[int], prompt.reshape(-1).tolist())
    if isinstance(prompt, (list, tuple)):
        return list(prompt)  # ids: generate checks them
    raise StateError(
        f"stream_text: prompt must be a string, token ids or chat messages ([{{'role': "
        f"'user', 'content': ...}}]); got {prompt!r:.60}"
    )


class TextStream(Iterator[Response]):
    """The responses of `stream_text`, one per round; after them (or after a `break`):
    `text` (all of it), `tokens` (the ids emitted), `history` (the ids the final state holds:
    the history given, the prompt, the tokens) and, with `keep_state=True`, `state`."""

    def __init__(
        self,
        generation: Generation,
        tokenizer: Any,
        prompt: list[int],
        history: list[int],
        max_tokens: int,
        eos: set[int],
    ) -> None:
        self._generation = generation
        self._detokenizer = tokenizer.detokenizer
        self.prompt: list[int] = prompt
        self.tokens: list[int] = []
        self._history = history
        self._max_tokens, self._eos = max_tokens, eos
        self._pieces: list[str] = []
        self._tic = time.perf_counter()
        self._prompt_tps = 0.0
        self._started: float | None = None
        self._ended = False

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> Response:
        if self._ended:
            raise StopIteration
        try:
            tokens = next(self._generation)
        except StopIteration:  # max_tokens 0: nothing was generated
            self._ended = True
            raise
        now = time.perf_counter()
        if self._started is None:
            self._prompt_tps = len(self.prompt) / max(now - self._tic, 1e-9)
            self._started = now
        ids = [t.token for t in tokens]
        self.tokens += ids
        for t in ids:
            if t not in self._eos:  # as mlx-lm: an end token is not text
                self._detokenizer.add_token(t)
        reason = None
        if ids and ids[-1] in self._eos:
            reason = "stop"
        elif len(self.tokens) >= self._max_tokens:
            reason = "length"
        if reason is not None:
            self._detokenizer.finalize()
            self._ended = True
        text = self._detokenizer.last_segment
        self._pieces.append(text)
        elapsed = max(now - self._started, 1e-9)
        return Response(
            text=text,
            tokens=ids,
            from_draft=[t.from_draft for t in tokens],
            prompt_tokens=len(self.prompt),
            prompt_tps=self._prompt_tps,
            generation_tokens=len(self.tokens),
            generation_tps=len(self.tokens) / elapsed if len(self.tokens) > 1 else 0.0,
            drafts_proposed=self._generation.drafted,
            drafts_accepted=self._generation.accepted,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=reason,
        )

    @property
    def text(self) -> str:
        """The text so far (with what the detokenizer still holds back, once it ended)."""
        return "".join(self._pieces)

    @property
    def history(self) -> list[int]:
        return [*self._history, *self.prompt, *self.tokens]

    @property
    def state(self) -> Any:
        """The final state (batch 1): the history, ready to continue from
        (`stream_text(..., state=stream.state, history=stream.history)`)."""
        return self._generation.states[0]


def stream_text(
    target: Target,
    tokenizer: Any,
    prompt: Prompt,
    drafter: Drafter | TreeDrafter | None = None,
    *,
    max_tokens: int = 256,
    state: Any = None,
    history: Sequence[int] | None = None,
    keep_state: bool = False,
    eos: Sequence[int] | None = None,
    **options: Any,
) -> TextStream:
    """Generate from `prompt` and stream the text: mlx-lm's `stream_generate` over kvstate's
    generator, one `Response` per round.

    `tokenizer`: any tokenizer `text_tokenizer` takes (a transformers tokenizer, mlx-lm's
    `TokenizerWrapper`, a `tokenizers.Tokenizer`, the GGUF tokenizer of
    `kvstate.adapters.real_models`). `prompt`: a string, token ids or chat messages (see
    `Prompt`). `drafter`: speculative decoding (`ModelDrafter`, `NGramDrafter`, ...), or
    None. `state` / `history`: continue from a state and the ids it holds (a chat's earlier
    turns: `prompt` is then the new tokens only; `Chat` works them out); `keep_state`: the
    stream's `state` after it. `eos`: the end tokens (default: the tokenizer's). Every other
    keyword goes to `generate` (`k`, `sampler`, `seed`, `tree`, `prefill_step_size`,
    `prompt_progress`, `logits_processors`, `max_kv_size`, `kv_bits`, ...).
    """
    wrapper = text_tokenizer(tokenizer)
    ids = prompt_ids(wrapper, prompt)
    ends = set(wrapper.eos_token_ids) if eos is None else set(eos)
    before = list(history) if history is not None else []
    generation = generate(
        target,
        [ids],
        drafter,
        max_tokens=max_tokens,
        eos=sorted(ends),
        states=None if state is None else [state],
        history=None if state is None else [before],
        keep_states=keep_state,
        **options,
    )
    return TextStream(generation, wrapper, ids, before, max_tokens, ends)
