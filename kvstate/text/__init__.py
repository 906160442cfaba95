"""Text on top of kvstate's generator: mlx-lm's streaming detokenizers for any tokenizer, a
`stream_generate`-shaped `stream_text`, and a `Chat` that continues one state turn after turn.

    from kvstate.adapters import wrap
    from kvstate.speculative import NGramDrafter
    from kvstate.text import Chat, stream_text

    for r in stream_text(wrap(model), tokenizer, "Hello", NGramDrafter(), max_tokens=64):
        print(r.text, end="", flush=True)

`load_text_model(spec)` resolves a `--model` spec (a packaged name, a local mlx-lm directory,
tiny:<architecture>) to a model and its tokenizer, for the CLI and the server alike.

Above the speculative package (it imports transformers and mlx-lm's tokenizer utilities;
only the top floor, kvstate.cli and kvstate.serve, imports it).
"""

from ._chat import Chat
from ._models import DEFAULT_MODEL, TINY, TextModel, load_text_model
from ._stream import Prompt, Response, TextStream, prompt_ids, stream_text
from ._tokenizer import detokenizer_class, text_tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "TINY",
    "Chat",
    "Prompt",
    "Response",
    "TextModel",
    "TextStream",
    "detokenizer_class",
    "load_text_model",
    "prompt_ids",
    "stream_text",
    "text_tokenizer",
]
