"""`kvstate` / `python -m kvstate`: generate text, or chat, from the command line.

    kvstate generate --model tiny:llama --prompt "Hello" --max-tokens 32
    kvstate generate --model /path/to/mlx-model --draft ngram --temp 0.7 --seed 1 < prompt.txt
    kvstate generate --draft /path/to/draft-model --num-draft-tokens 4 --kv-bits 8 --prompt hi
    printf 'Hi!\\nAnd then?\\n' | kvstate chat --system "Be brief."

`--model` is a packaged model's name (default smollm2-135m), a local mlx-lm model directory,
or tiny:<architecture> (a random-init test model with a byte tokenizer), resolved as the
server resolves it (`kvstate.text.load_text_model`). The text goes to stdout as it comes;
mlx-lm's `verbose=True` summary (prompt and generation tokens per second, drafts accepted,
peak memory) to stderr. `kvstate chat` reads one user message per line of stdin and
continues one state across the turns (`kvstate.text.Chat`). A bad argument exits with
status 2 and a message saying what is wrong. `kvstate <command> --help` lists the options.

The top floor: argument parsing over kvstate.text and kvstate.speculative; nothing imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._commands import chat, generate
from ._options import add_model_options, add_sampling_options

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstate",
        description="Generate text or chat with kvstate's speculative generator.",
    )
    commands = p.add_subparsers(dest="command", metavar="{generate,chat}", required=True)
    g = commands.add_parser(
        "generate",
        help="generate from one prompt (--prompt, or stdin)",
        description="Generate from one prompt and print the text as it comes.",
    )
    add_model_options(g)
    g.add_argument("--prompt", "-p", help="the prompt ('-' or left out: read it from stdin)")
    g.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="encode the prompt as text, without the tokenizer's chat template",
    )
    add_sampling_options(g)
    g.set_defaults(run=generate)
    c = commands.add_parser(
        "chat",
        help="chat: one user message per line of stdin, one state across the turns",
        description="Chat: each line of stdin is a user message; the reply continues the "
        "conversation's state (only the new tokens of each turn run through the model).",
    )
    add_model_options(c)
    add_sampling_options(c)
    c.set_defaults(run=chat)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    raise SystemExit(args.run(args, sys.stdin, sys.stdout, sys.stderr))
