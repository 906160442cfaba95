"""Where a decode step through `wrap` loses time against raw mlx-lm on a GPU: contenders that
add wrap's pieces to a raw loop, or take them out of wrap, one at a time.

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python3 benchmarks/probes/decode_overhead.py   # H200
    .venv/bin/python benchmarks/probes/decode_overhead.py --small                          # CPU smoke

Every contender decodes its own greedy sequence from the same prompt in 16-token blocks
(pipelined like generate_step); one block of each contender per repetition, in rotating
order, so the host's drift hits all alike. Each row: the median over repetitions of raw's
block time / the contender's (tokens/s relative to raw), with its inter-quartile range.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for verify)
import mlx.core as mx
from verify import BIG, RawDecoder, WrapDecoder, build, decode_block, random_ids, say

from kvstate import ModelState
from kvstate.adapters import wrap
from kvstate.adapters.caches.registry import from_cache
from kvstate.adapters.wrapped import model as wrapped_model
from kvstate.adapters.wrapped import tokens as id_checks


def guard_by_ops(ids: mx.array, vocab: int) -> tuple[mx.array, mx.array]:
    """The id guard as plain ops (prebuilt kernels) instead of one compiled kernel."""
    wide = ids.view(mx.uint32) if ids.dtype == mx.int32 else ids.astype(mx.uint32)
    bad = wide >= vocab
    return mx.where(bad, 0, ids), bad


_NAN = mx.array(float("nan"), mx.bfloat16)


def poison_by_ops(bad: mx.array, logits: mx.array) -> mx.array:
    return mx.where(bad[..., None], _NAN.astype(logits.dtype), logits)


class GuardedRawDecoder(RawDecoder):
    """Raw mlx-lm plus wrap's id guard and NaN poisoning (its two extra kernels)."""

    guard, poison = staticmethod(id_checks.guarded), staticmethod(id_checks.nan_where)

    def step(self, y: mx.array) -> mx.array:
        ids, bad = self.guard(y[:, None], self.vocab)
        logits = self.poison(bad, self.model(ids, cache=self.caches))
        return logits[:, -1].argmax(-1)


class OpsGuardedRawDecoder(GuardedRawDecoder):
    """The same guard and poisoning as plain ops."""

    guard, poison = staticmethod(guard_by_ops), staticmethod(poison_by_ops)


class ReadBackRawDecoder(RawDecoder):
    """Raw mlx-lm plus wrap's read-back: a new state from the caches after every step."""

    def step(self, y: mx.array) -> mx.array:
        logits = self.model(y[:, None], cache=self.caches)
        self.state = ModelState(tuple(from_cache(c, 1) for c in self.caches))
        return logits[:, -1].argmax(-1)


class UnguardedWrapDecoder(WrapDecoder):
    """wrap with ids trusted (no guard kernel, no poisoning): the rest of wrap's step."""

    def __init__(self, m: Any, prompt: mx.array) -> None:
        m.checked_tokens = lambda tokens, state: (tokens, None)
        super().__init__(m, prompt)


class OpsGuardWrapDecoder(WrapDecoder):
    """wrap with the guard and poisoning as plain ops (patched into this wrapped model only
    for its own steps)."""

    def step(self, y: mx.array) -> mx.array:
        # WrappedModel guards a decode step's ids with its module's `guarded` and poisons
        # through `tokens.poisoned`, which reads `tokens.nan_where`.
        saved = wrapped_model.guarded, id_checks.nan_where
        wrapped_model.guarded, id_checks.nan_where = guard_by_ops, poison_by_ops
        try:
            return super().step(y)
        finally:
            wrapped_model.guarded, id_checks.nan_where = saved


def build_us(decoder: Any, y: mx.array, n: int = 30) -> float:
    """Median host microseconds to build one step's graph (nothing evaluated; the steps'
    cache writes are undone by evaluating and dropping them, so the context stays put)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        out = decoder.step(y)
        times.append(time.perf_counter() - start)
        mx.eval(out)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--models", nargs="*", default=["llama"], choices=list(BIG))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    context = 64 if args.small else 1024
    for name in args.models:
        model = build(name, args.small)
        prompt = random_ids(model, (1, context), 1)
        vocab = int(model.args.vocab_size)
        decoders: dict[str, Any] = {
            "raw mlx-lm": RawDecoder(model, prompt),
            "raw + id guard + NaN poisoning (compiled)": GuardedRawDecoder(model, prompt),
            "raw + id guard + NaN poisoning (plain ops)": OpsGuardedRawDecoder(model, prompt),
            "raw + read-back into a state": ReadBackRawDecoder(model, prompt),
            "wrap": WrapDecoder(wrap(model), prompt),
            "wrap, guard as plain ops": OpsGuardWrapDecoder(wrap(model), prompt),
            "wrap, ids trusted (no guard)": UnguardedWrapDecoder(wrap(model), prompt),
        }
        for d in decoders.values():
            d.vocab = vocab
        for d in decoders.values():
            decode_block(d, 4)  # warm-up
        names = list(decoders)
        ratios: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            took = {n: decode_block(decoders[n], 16) for n in order}
            for n in names:
                ratios[n].append(took["raw mlx-lm"] / took[n])
        say(f"\n## {name}, {mx.default_device()}, context {context}, {args.reps} reps of "
            "16-token blocks\n")  # fmt: skip
        say("| contender | tokens/s / raw: median [IQR] |")
        say("|---|---|")
        for n in names[1:]:
            q1, med, q3 = statistics.quantiles(ratios[n], n=4)
            say(f"| {n} | {med:.3f} [{q1:.3f}, {q3:.3f}] |")
        say("\n| contender | host us to build one step (median of 30) |")
        say("|---|---|")
        for n in names:
            say(f"| {n} | {build_us(decoders[n], decoders[n].y):.0f} |")


if __name__ == "__main__":
    main()
