"""Which op of the 300-row sampled generation fails on MLX CUDA (diagnostic, H200).

tests/test_speculative.py's 300-row sampled test raised `cudaGraphAddKernelNode ... invalid
argument` at its first sample on the H200, with and without kvstate's buckets. This evaluates
each piece of that first step on its own, for growing row counts, and prints what fails.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/cuda_rows_probe.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, Sampler, generate


def attempt(label: str, fn: Callable[[], Any]) -> None:
    try:
        mx.eval(fn())
        print(f"ok      {label}", flush=True)
    except Exception as e:  # a probe: print and go on
        print(f"FAILED  {label}: {e!r:.160}", flush=True)


def probe(model: Any, sampler: Sampler, rows: int) -> None:
    ids = mx.array([[5, 9, 13]] * rows)
    m = wrap(model)
    logits = mx.random.normal((rows, 256))
    probs = sampler.probs(logits)
    key = mx.random.key(11)
    attempt(f"{rows} rows: raw mlx-lm forward", lambda: model(ids, cache=make_prompt_cache(model)))
    attempt(f"{rows} rows: wrapped forward", lambda: m(ids, m.init_state(rows))[0])
    attempt(f"{rows} rows: sort", lambda: mx.sort(logits, axis=-1))
    attempt(f"{rows} rows: sampler.probs", lambda: sampler.probs(logits))
    attempt(f"{rows} rows: categorical", lambda: mx.random.categorical(mx.log(probs)))
    attempt(f"{rows} rows: categorical, key", lambda: mx.random.categorical(mx.log(probs), key=key))


def generation(model: Any, sampler: Sampler, rows: int) -> None:
    """The test's own path: generate without a drafter, then with the test's draft model."""
    target = wrap(model)
    prompts = [[5, 9, 13]] * rows

    def run(drafter: Any) -> Any:
        return [t for r in generate(target, prompts, drafter, k=3, max_tokens=2, sampler=sampler,
                                    seed=11) for t in r]  # fmt: skip

    attempt(f"{rows} rows: generate, no drafter", lambda: mx.array(0) if run(None) else None)
    draft = wrap(tiny_model("llama", num_hidden_layers=2, seed=4))
    attempt(
        f"{rows} rows: generate, ModelDrafter",
        lambda: mx.array(0) if run(ModelDrafter(draft, seed=1)) else None,
    )


def main() -> None:
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    sampler = Sampler(temperature=1.0, top_k=6)
    for n in (64, 128, 200, 256, 257, 300, 1000):
        parts = [mx.ones((1, 4)) * i for i in range(n)]
        attempt(f"concatenate of {n} arrays", lambda parts=parts: mx.concatenate(parts))
        attempt(f"stack of {n} arrays", lambda parts=parts: mx.stack(parts))
    for rows in (128, 200, 256, 257, 300):
        generation(model, sampler, rows)
    for rows in (64, 128, 256, 300, 512):
        probe(model, sampler, rows)


if __name__ == "__main__":
    main()
