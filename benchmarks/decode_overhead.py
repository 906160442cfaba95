"""Where a decode step through `wrap` loses time against raw mlx-lm on a GPU: contenders that
add wrap's pieces to a raw loop, or take them out of wrap, one at a time.

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python3 benchmarks/decode_overhead.py   # H200
    .venv/bin/python benchmarks/decode_overhead.py --small                          # CPU smoke

Every contender decodes its own greedy sequence from the same prompt in 16-token blocks
(pipelined like generate_step); one block of each contender per repetition, in rotating
order, so the host's drift hits all alike. Each row: the median over repetitions of raw's
block time / the contender's (tokens/s relative to raw), with its inter-quartile range.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import mlx.core as mx
from verify import BIG, RawDecoder, WrapDecoder, build, decode_block, random_ids, say

from kvstate import ModelState
from kvstate.adapters import _wrap, wrap
from kvstate.adapters._convert import from_cache


class GuardedRawDecoder(RawDecoder):
    """Raw mlx-lm plus wrap's id guard and NaN poisoning (its two extra kernels)."""

    def step(self, y: mx.array) -> mx.array:
        ids, bad = _wrap._guarded(y[:, None], self.vocab)
        logits = _wrap._nan_where(bad, self.model(ids, cache=self.caches))
        return logits[:, -1].argmax(-1)


class ReadBackRawDecoder(RawDecoder):
    """Raw mlx-lm plus wrap's read-back: a new state from the caches after every step."""

    def step(self, y: mx.array) -> mx.array:
        logits = self.model(y[:, None], cache=self.caches)
        self.state = ModelState(tuple(from_cache(c, 1) for c in self.caches))
        return logits[:, -1].argmax(-1)


class UnguardedWrapDecoder(WrapDecoder):
    """wrap with ids trusted (no guard kernel, no poisoning): the rest of wrap's step."""

    def __init__(self, m: Any, prompt: mx.array) -> None:
        m._tokens = lambda tokens, state: (tokens, None)
        super().__init__(m, prompt)


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
        guarded = GuardedRawDecoder(model, prompt)
        guarded.vocab = mx.array(model.args.vocab_size, mx.int32)
        decoders: dict[str, Any] = {
            "raw mlx-lm": RawDecoder(model, prompt),
            "raw + id guard + NaN poisoning": guarded,
            "raw + read-back into a state": ReadBackRawDecoder(model, prompt),
            "wrap": WrapDecoder(wrap(model), prompt),
            "wrap, ids trusted (no guard)": UnguardedWrapDecoder(wrap(model), prompt),
        }
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


if __name__ == "__main__":
    main()
