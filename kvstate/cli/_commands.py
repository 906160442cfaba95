"""The two commands: `generate` (one prompt) and `chat` (a line of stdin per turn)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import IO, Any

from .. import StateError
from ..text import Chat, Response, detokenizer_class, stream_text
from ._options import drafter_of, generate_options, loaded_model


def generate(args: argparse.Namespace, stdin: IO[str], out: IO[str], err: IO[str]) -> int:
    """Generate from `--prompt` (or stdin), streaming the text to `out`; the summary to
    `err`. The exit status: 0, or 2 for a bad argument (the message on `err`)."""
    return _guarded("generate", err, lambda: _generate(args, stdin, out, err))


def chat(args: argparse.Namespace, stdin: IO[str], out: IO[str], err: IO[str]) -> int:
    """One turn per non-empty line of `stdin` (until its end, or a line `/quit`): the reply
    streamed to `out`, then a newline; a summary per turn to `err`."""
    return _guarded("chat", err, lambda: _chat(args, stdin, out, err))


def _guarded(command: str, err: IO[str], run: Callable[[], None]) -> int:
    try:
        run()
    except StateError as error:
        print(f"kvstate {command}: {error}", file=err)
        return 2
    except KeyboardInterrupt:
        print(file=err)
        return 130
    return 0


def _generate(args: argparse.Namespace, stdin: IO[str], out: IO[str], err: IO[str]) -> None:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = stdin.read()
    if not prompt:
        raise StateError("no prompt: give --prompt TEXT, or the prompt on stdin")
    options = generate_options(args)
    drafter = drafter_of(args.draft)
    target, tokenizer = loaded_model(args.model)
    messages: Any = prompt
    if tokenizer.has_chat_template and not args.ignore_chat_template:
        system = [] if args.system is None else [{"role": "system", "content": args.system}]
        messages = [*system, {"role": "user", "content": prompt}]
    elif args.system is not None:
        raise StateError(
            "--system needs a chat template, and this model's tokenizer has none (or "
            "--ignore-chat-template is given); put the instructions in the prompt"
        )
    if not args.quiet:
        print("=" * 10, file=err, flush=True)
    last = _streamed(stream_text(target, tokenizer, messages, drafter, **options), out)
    out.write("\n")
    out.flush()
    if not args.quiet:
        print("=" * 10, file=err)
        _summary(last, err)


def _chat(args: argparse.Namespace, stdin: IO[str], out: IO[str], err: IO[str]) -> None:
    options = generate_options(args)
    drafter = drafter_of(args.draft)
    target, tokenizer = loaded_model(args.model)
    if not tokenizer.has_chat_template:
        tokenizer = with_fallback_template(tokenizer)
    conversation = Chat(target, tokenizer, drafter, system=args.system, **options)
    interactive = stdin.isatty()
    for line in _lines(stdin, err if interactive else None):
        if line.strip() in ("/quit", "/exit"):
            break
        if not line.strip():
            continue
        last = _streamed(conversation.send(line), out)
        out.write("\n")
        out.flush()
        if not args.quiet:
            _summary(last, err)


def _lines(stdin: IO[str], prompt_to: IO[str] | None) -> Iterable[str]:
    """The lines of `stdin` without their newline (a `>> ` prompt on `prompt_to` before
    each, when it is a terminal)."""
    while True:
        if prompt_to is not None:
            print(">> ", end="", file=prompt_to, flush=True)
        line = stdin.readline()
        if not line:
            return
        yield line.rstrip("\r\n")


def _streamed(responses: Iterable[Response], out: IO[str]) -> Response | None:
    """Write each response's text to `out` as it comes; the last response."""
    last = None
    for last in responses:
        if last.text:
            out.write(last.text)
            out.flush()
    return last


def _summary(last: Response | None, err: IO[str]) -> None:
    """mlx-lm's `verbose=True` figures, and the drafts accepted."""
    if last is None or last.generation_tokens == 0:
        print("No text generated for this prompt", file=err)
        return
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec", file=err)
    print(
        f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
        file=err,
    )
    if last.drafts_proposed:
        rate = last.drafts_accepted / last.drafts_proposed
        print(
            f"Drafts: {last.drafts_accepted} of {last.drafts_proposed} accepted ({rate:.1%})",
            file=err,
        )
    print(f"Peak memory: {last.peak_memory:.3f} GB", file=err, flush=True)


def fallback_template(messages: list[dict[str, Any]], **options: Any) -> str:
    """The plain template of a tokenizer without one (the server's fallback, `kvstate.serve`'s
    FALLBACK_TEMPLATE): each message as `<role>: <content>` on its own line, then
    `assistant:` for the reply."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if options.get("add_generation_prompt") else "")


def with_fallback_template(tokenizer: Any) -> Any:
    """`tokenizer` (a `TokenizerWrapper` without a chat template) with `fallback_template`."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = tokenizer._tokenizer  # the wrapper's Hugging Face tokenizer
    return TokenizerWrapper(
        hf,
        detokenizer_class(hf),
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        chat_template=fallback_template,
    )
