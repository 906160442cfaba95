"""The small random-init qwen3_next hybrid the policy probes run (`policy.HYBRID["small"]`),
a 32-token prompt and its greedy continuation, the oracle drafter's truth."""

from __future__ import annotations

from typing import Any, NamedTuple

import _on_path  # noqa: F401  (benchmarks/ on the path, for policy)
import numpy as np
from policy import HYBRID

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import generate


class HybridRun(NamedTuple):
    target: Any
    vocab: int
    prompt: list[int]
    truth: list[int]  # the plain greedy decode of `prompt`: 9 tokens past `tokens`


def hybrid_run(tokens: int) -> HybridRun:
    model = tiny_model("qwen3_next", **HYBRID["small"])
    vocab = int(model.args.vocab_size)
    target = wrap(model)
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, vocab, 32)]
    truth = [t.token for r in generate(target, [prompt], None, max_tokens=tokens + 9) for t in r]
    return HybridRun(target, vocab, prompt, truth)
