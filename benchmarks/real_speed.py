"""Tokens/s of kvstate's generator on the packaged real models, over mlx-lm's, on code, prose
and chat prompts: one table, rows printed as measured.

Models: `load_model("smollm2-135m")` and `load_model("gemma3-270m")` (Gemma 3: 15 of its 18
layers are 512-token sliding windows). Prompts: benchmarks/speed_prompts.json (references into
benchmarks/texts/ and policy_prompts.json; chat prompts through the model's chat template).
Rows of each (model, kind), greedy, every run `--tokens` tokens (no stop at EOS, as
`generate_step`):

- kvstate n-gram: `kvstate.speculative.generate(target, [prompt], NGramDrafter())`, the
  default policy (CostAwarePolicy, k <= 8). mlx-lm has no prompt lookup, so this row has
  only the ratio over `generate_step`.
- kvstate 4-bit draft: the same with `ModelDrafter(wrap(quantized_draft(model, bits=4)))`
  (self-speculation: the target's own `nn.quantize` copy), the default policy; over
  `generate_step` and over mlx-lm's `speculative_generate_step` with the SAME draft model
  (`--draft-tokens` drafts a round, mlx-lm's CLI default 3; mlx-lm has no adaptive k).
- kvstate plain: `generate(target, [prompt])`, no drafter.
- mlx-lm speculative: `speculative_generate_step` itself, over `generate_step`.

SmolLM2 is stored 4-bit (Q4_1, groups of 32): its 4-bit copy would be itself, so its target
here is the stored model dequantized to `--dtype` (the same function up to rounding) and the
draft is that target's `nn.quantize` copy (groups of 64). Gemma is stored float32.

mlx-lm speculates on Gemma only while its rotating caches can still be trimmed: prompt +
tokens + drafts under the 512-token window (its `trim_prompt_cache` silently trims nothing
past it). The prompts are short enough at 128 tokens; a longer run marks that cell n/a.

Agreement first: every contender's tokens are compared with `generate_step`'s greedy tokens
on every prompt (those runs are the warm-up); a row says how many prompts agree and where
the first difference is (in bf16 a verify forward of k + 1 tokens may round differently from
one-token steps: a near tie may then flip; fp32 should agree everywhere). Timing: each
repetition runs every contender once, back to back, in a rotating order (benchmarks/_harness);
tok/s counts the tokens after the first round over the time after it (the first round: the
prefill's token, as mlx-lm's "generation tok/s"; speculative_generate_step yields nothing
before its first verify, so there the first round is the prefill and that verify), from the
median of each prompt's repetitions, averaged over prompts (seconds a token); a ratio is the median over the (prompt, repetition) pairs of the per-pair speed ratio, with its
[p25, p75]. "prefill in": the same ratio of whole runs (prefill included: on a slow CPU with
few tokens the prefill dominates it). "from drafts": the share of the generated tokens that
were accepted drafts.

    .venv/bin/python benchmarks/real_speed.py --quick --tokens 24      # a shared 2-core CPU
    .venv/bin/python benchmarks/real_speed.py --models smollm2-135m --kinds code
    PYTHONPATH=/tmp/site:/tmp/src python3 benchmarks/real_speed.py     # H200: ~4 minutes

Defaults: on a GPU bfloat16, 128 tokens, 3 repetitions, 2 prompts of each kind; on the CPU
float32, 32 tokens, 3 repetitions, 3 prompts. `--quick`: 1 repetition, 1 prompt of each kind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from _harness import Contender, Samples, environment, fmt_ratio, interleave
from mlx_lm.generate import generate_step, speculative_generate_step

from kvstate.adapters import load_model, quantized_draft, wrap
from kvstate.speculative import ModelDrafter, NGramDrafter, generate

HERE = Path(__file__).parent
MODELS = ("smollm2-135m", "gemma3-270m")
KINDS = ("code", "prose", "chat")
START = time.perf_counter()

# (tokens, from-draft count) of one run
Run = Callable[[], tuple[list[int], int]]
Pairs = Iterable[tuple[int, bool]]  # (token, whether it was an accepted draft)


def say(text: str) -> None:
    print(text, flush=True)


def progress(text: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {text}", file=sys.stderr, flush=True)


def prompt_texts(kind: str, count: int) -> list[str]:
    """The first `count` prompts of `kind` from speed_prompts.json, resolved to text."""
    specs = json.loads((HERE / "speed_prompts.json").read_text())[kind][:count]
    held = json.loads((HERE / "policy_prompts.json").read_text())[kind]
    texts = []
    for spec in specs:
        if "policy_prompts" in spec:
            texts.append(held[spec["policy_prompts"]])
        else:
            first, last = spec["lines"]
            lines = (HERE / spec["file"]).read_text().splitlines(keepends=True)
            texts.append("".join(lines[first - 1 : last]))
    return texts


def encoded(tokenizer: Any, kind: str, text: str) -> list[int]:
    if kind == "chat":
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(text))


def target_model(name: str, dtype: str) -> tuple[nn.Module, Any]:
    """The target at `dtype`, a float model (SmolLM2's stored 4-bit matrices dequantized)."""
    from mlx_lm.utils import dequantize_model

    model, tokenizer = load_model(name, dtype=dtype)
    if any(
        isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in model.named_modules()
    ):
        model = dequantize_model(model)
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
    return model, tokenizer


def window(model: nn.Module) -> int | None:
    return getattr(model.args, "sliding_window", None)


def runs_for(
    model: nn.Module, draft: nn.Module, targets: tuple[Any, Any], prompt: list[int], n: int,
    draft_tokens: int, decode: dict[str, list[float]],
) -> dict[str, Run]:  # fmt: skip
    """The contenders of one prompt, each returning (tokens, tokens that came from drafts) and
    appending its seconds per token after its first round to `decode[name]` (the first round:
    the prefill's token; mlx-lm's speculative_generate_step yields its first token only after
    the prefill and its first verify: that round's tokens)."""
    target, wrapped_draft = targets

    def mlx_plain() -> Pairs:
        return ((int(t), False) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n))

    def mlx_spec() -> Pairs:
        steps = speculative_generate_step(
            mx.array(prompt), model, draft, num_draft_tokens=draft_tokens, max_tokens=n
        )
        return ((int(t), bool(d)) for t, _, d in steps)

    def ours(drafter: Any) -> Pairs:
        rounds = generate(target, [prompt], drafter, max_tokens=n)
        return ((t.token, t.from_draft) for r in rounds for t in r)

    def timed(name: str, pairs: Callable[[], Pairs]) -> Run:
        def run() -> tuple[list[int], int]:
            tokens: list[int] = []
            drafted = 0
            first, counted = 0.0, 0
            for token, from_draft in pairs():
                tokens.append(token)
                drafted += from_draft
                if not first and not from_draft:  # the end of the first round
                    first, counted = time.perf_counter(), len(tokens)
            seconds = time.perf_counter() - first
            decode.setdefault(name, []).append(seconds / max(len(tokens) - counted, 1))
            return tokens, drafted

        return run

    makers: dict[str, Callable[[], Pairs]] = {
        "generate_step": mlx_plain,
        "kvstate n-gram": lambda: ours(NGramDrafter()),
        "kvstate 4-bit draft": lambda: ours(ModelDrafter(wrapped_draft)),
        "kvstate plain": lambda: ours(None),
    }
    limit = window(model)
    if limit is None or len(prompt) + n + draft_tokens + 1 < limit:
        makers["speculative_generate_step"] = mlx_spec
    return {name: timed(name, make) for name, make in makers.items()}


class Row:
    """What one contender got over the prompts of one (model, kind)."""

    def __init__(self) -> None:
        self.agree = 0
        self.prompts = 0
        self.first_difference: list[str] = []
        self.tokens = 0
        self.from_drafts = 0
        self.per_token: list[float] = []  # each prompt's median seconds a token after round 1

    def check(self, index: int, got: list[int], want: list[int], from_drafts: int) -> None:
        self.prompts += 1
        self.tokens += len(got)
        self.from_drafts += from_drafts
        diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if diff is None and len(got) != len(want):
            diff = min(len(got), len(want))
        if diff is None:
            self.agree += 1
        else:
            self.first_difference.append(f"prompt {index}: token {diff}")

    def agreement(self) -> str:
        text = f"{self.agree}/{self.prompts}"
        return text + (f" ({'; '.join(self.first_difference)})" if self.first_difference else "")

    def rate(self) -> float:
        """Tokens/s after the first round (the prompts' mean seconds a token)."""
        return len(self.per_token) / sum(self.per_token)


def measure_kind(
    model: nn.Module, draft: nn.Module, targets: tuple[Any, Any], prompts: list[list[int]],
    args: argparse.Namespace, label: str,
) -> tuple[dict[str, Row], Samples, Samples, bool]:  # fmt: skip
    """Check and time every contender on every prompt: (rows, decode samples, whole-run
    samples, whether mlx-lm speculated on every prompt); the samples of all prompts pooled
    (each prompt's per-repetition pairs, in order)."""
    rows: dict[str, Row] = {}
    decode_pooled, whole_pooled = Samples(), Samples()
    spec_everywhere = True
    for i, prompt in enumerate(prompts):
        decode: dict[str, list[float]] = {}
        runs = runs_for(model, draft, targets, prompt, args.tokens, args.draft_tokens, decode)
        spec_everywhere &= "speculative_generate_step" in runs
        want, _ = runs["generate_step"]()
        for name, run in runs.items():
            got, drafted = run()
            rows.setdefault(name, Row()).check(i, got, want, drafted)
        progress(f"{label} prompt {i} ({len(prompt)} tokens): checked, timing {args.reps} reps")
        decode.clear()
        samples = interleave(
            [Contender(name, lambda _, f=f: f()) for name, f in runs.items()], args.reps, warmup=0
        )
        for name in runs:
            whole_pooled.times.setdefault(name, []).extend(samples.times[name])
            decode_pooled.times.setdefault(name, []).extend(decode[name])
            rows[name].per_token.append(statistics.median(decode[name]))
    if not spec_everywhere:  # pool only over prompts where every contender ran
        for pooled in (decode_pooled, whole_pooled):
            pooled.times.pop("speculative_generate_step", None)
        rows.pop("speculative_generate_step", None)
    return rows, decode_pooled, whole_pooled, spec_everywhere


def speed(samples: Samples, a: str, b: str) -> str:
    """tokens/s of `a` over `b`: time(b) / time(a), pooled per-pair medians and quartiles."""
    if a not in samples.times or b not in samples.times:
        return "n/a"
    med, lo, hi = samples.paired_ratio(b, a)
    return fmt_ratio((med, lo, hi))


def command(name: str, kind: str, args: argparse.Namespace) -> str:
    """The command that measures one (model, kind) group of rows again."""
    return (
        f"`real_speed.py --models {name} --kinds {kind} --tokens {args.tokens} --reps {args.reps}"
        f" --prompts {args.prompts} --dtype {args.dtype} --draft-tokens {args.draft_tokens}`"
    )


def report(
    name: str, kind: str, rows: dict[str, Row], decode: Samples, whole: Samples,
    args: argparse.Namespace,
) -> None:  # fmt: skip
    base = rows["generate_step"].rate()
    for contender in (
        "kvstate n-gram", "kvstate 4-bit draft", "kvstate plain", "speculative_generate_step",
    ):  # fmt: skip
        row = rows.get(contender)
        if row is None:
            continue
        if contender == "speculative_generate_step":
            over_spec = "—"
            label = "mlx-lm speculative_generate_step (4-bit draft)"
        elif contender == "kvstate 4-bit draft":
            over_spec = speed(decode, contender, "speculative_generate_step")
            label = contender
        else:
            over_spec = "— (mlx-lm has no prompt lookup)" if "n-gram" in contender else "—"
            label = contender
        share = f"{row.from_drafts / max(row.tokens, 1):.0%}" if "plain" not in contender else "—"
        say(
            f"| {name} | {kind} | {label} | {row.rate():.1f} | {base:.1f} | "
            f"{speed(decode, contender, 'generate_step')} | "
            f"{speed(whole, contender, 'generate_step')} | {over_spec} | {share} | "
            f"{row.agreement()} | {command(name, kind, args)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    gpu = mx.default_device() == mx.gpu
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--tokens", type=int, default=128 if gpu else 32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2 if gpu else 3, help="of each kind")
    parser.add_argument("--draft-tokens", type=int, default=3, help="mlx-lm's drafts a round")
    parser.add_argument("--dtype", default="bfloat16" if gpu else "float32",
                        choices=["float32", "bfloat16", "float16"])  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1 repetition, 1 prompt of a kind")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.prompts = 1, 1
    say("# kvstate vs mlx-lm on the packaged real models, tokens/s\n")
    say(environment(args.quick))
    say(
        f"- greedy, {args.tokens} tokens a run, {args.dtype}, {args.reps} repetitions, "
        f"{args.prompts} prompt(s) of each kind; kvstate: the default policy (k <= 8); "
        f"mlx-lm speculative_generate_step: {args.draft_tokens} drafts a round\n"
    )
    say(
        "| model | kind | generator | tok/s | generate_step tok/s | / generate_step "
        "| / generate_step, prefill in | / speculative_generate_step | from drafts "
        "| agrees with generate_step | command |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model, tokenizer = target_model(name, args.dtype)
        draft = quantized_draft(model, bits=4)
        mx.eval(draft.parameters())
        targets = (wrap(model), wrap(draft))
        progress(f"{name} loaded ({args.dtype}; draft: its 4-bit copy)")
        for kind in args.kinds:
            prompts = [encoded(tokenizer, kind, t) for t in prompt_texts(kind, args.prompts)]
            rows, decode, whole, spec_everywhere = measure_kind(
                model, draft, targets, prompts, args, f"{name} {kind}"
            )
            if not spec_everywhere:
                say(
                    f"<!-- {name} {kind}: prompt + tokens reach the {window(model)}-token "
                    "window on some prompt: mlx-lm cannot trim its caches there (n/a) -->"
                )
            report(name, kind, rows, decode, whole, args)
    progress("done")


if __name__ == "__main__":
    main()
