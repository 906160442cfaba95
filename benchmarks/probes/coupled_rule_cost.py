"""What the coupled acceptance rule (position keys, point-mass drafts) costs against the split
rule (one key a round): `accept_columns` alone on distributions (B, span + 1, V), evaluated,
medians of interleaved calls. The coupled rule draws Gumbel noise over the vocabulary at every
verified position; the split rule draws uniforms for the drafts and one residual per row.

    .venv/bin/python benchmarks/probes/coupled_rule_cost.py [--vocab 49152] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from kvstate.speculative import Sampler
from kvstate.speculative._position_keys import position_keys, rows_of
from kvstate.speculative._sampling import accept_columns

HOT = Sampler(temperature=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    for rows, span in [(1, 4), (1, 8), (8, 4)]:
        probs = HOT.probs(mx.random.normal((rows, span + 1, args.vocab)))
        drafts = mx.random.randint(0, args.vocab, (rows, span)).astype(mx.int32)
        one = mx.random.key(0)
        positional = position_keys(rows_of(one, rows), [5] * rows, span + 1)
        mx.eval(probs, drafts, positional)
        keys = {"split rule (one key)": one, "coupled rule (position keys)": positional}
        times: dict[str, list[float]] = {name: [] for name in keys}
        for _ in range(args.reps):
            for name, key in keys.items():
                start = time.perf_counter()
                mx.eval(accept_columns(probs, drafts, None, [span] * rows, HOT, key))
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"B={rows} span={span} V={args.vocab}: " + ", ".join(
            f"{name} {v:.2f} ms" for name, v in ms.items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
