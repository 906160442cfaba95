"""Serve many concurrent requests through kvstate's engine on a tiny random-init model.

Requests arrive at random steps, each with its own prompt (half behind a shared system
prompt, which the prefix cache serves after the first), its own max_tokens and its own
sampler (greedy, or sampled with its own seed); a few are cancelled midway. The engine runs
them in one batch that changes every step, drafting with prompt lookup (the n-gram
drafter), and the script prints each finished request and the throughput. Every greedy
request is checked against mlx-lm's `generate_step` of its prompt alone.

Run: python examples/engine.py [--requests 48] [--model qwen3_next]
"""

from __future__ import annotations

import argparse
import random
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import CONFIGS, VOCAB, tiny_model
from kvstate.engine import Engine, Request, RequestParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--model", default="llama", choices=sorted(CONFIGS))
    parser.add_argument("--max-batch", type=int, default=16)
    args = parser.parse_args()

    model = tiny_model(args.model)
    engine = Engine(
        wrap(model), "ngram", max_batch=args.max_batch, prefill_chunk=64, prefix_cache_bytes=2**26
    )
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(48)]
    arrivals: dict[int, list[tuple[list[int], RequestParams]]] = {}
    for i in range(args.requests):
        own = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))]
        prompt = system + own if i % 2 else own
        sampled = i % 3 == 0
        params = RequestParams(
            max_tokens=rng.randint(8, 48),
            temperature=0.8 if sampled else 0.0,
            top_p=0.95 if sampled else 1.0,
            seed=i,
        )
        arrivals.setdefault(rng.randrange(args.requests), []).append((prompt, params))

    requests: list[Request] = []
    step = 0
    started = time.perf_counter()
    while step < args.requests or engine.has_work():
        for prompt, params in arrivals.get(step, []):
            requests.append(engine.submit(prompt, params))
        if step % 17 == 16 and engine.running:
            engine.cancel(engine.running[0])  # a client that went away
        for out in engine.step():
            if out.finished:
                r = out.request
                kind = "greedy" if r.params.temperature == 0 else "sampled"
                print(
                    f"request {r.id:3d} {kind:7s} prompt {len(r.prompt):3d} tokens "
                    f"({r.cached_tokens:3d} from the prefix cache): {len(r.tokens):3d} tokens, "
                    f"{r.finish_reason}"
                )
        step += 1
    elapsed = time.perf_counter() - started

    stats = engine.stats()
    print(
        f"\n{len(requests)} requests, {stats['generated_tokens']} tokens in {elapsed:.2f} s: "
        f"{stats['generated_tokens'] / elapsed:.0f} tokens/s over {stats['steps']} steps; "
        f"prefix cache {stats['prefix_hits']} hits / {stats['prefix_misses']} misses "
        f"({stats['prefix_hit_tokens']} prompt tokens not prefilled, "
        f"{stats['prefix_bytes'] / 2**20:.1f} MiB held); drafts accepted "
        f"{stats['accepted']} of {stats['drafted']}; {stats['cancelled']} cancelled"
    )
    checked = 0
    for r in requests:
        if r.params.temperature == 0 and r.finish_reason != "cancelled":
            alone = [int(t) for t, _ in generate_step(mx.array(r.prompt), model,
                                                      max_tokens=r.params.max_tokens)]  # fmt: skip
            assert r.tokens == alone, f"request {r.id} differs from decoding it alone"
            checked += 1
    print(f"{checked} greedy requests checked against mlx-lm's generate_step alone: identical")


if __name__ == "__main__":
    main()
