"""Speculative decoding built from kvstate's transforms: a generator, drafters, sampling.

    from kvstate.adapters import wrap
    from kvstate.speculative import ModelDrafter, Sampler, generate

    target, draft = wrap(big_model), wrap(small_model)
    for tokens in generate(target, [[1, 2, 3]], ModelDrafter(draft), k=4, max_tokens=64):
        for t in tokens:
            print(t.row, t.token, t.from_draft)

Works on every model kvstate wraps (hybrid and recurrent ones roll back from the verify's
checkpoints), batched with ragged acceptance, greedy or with exact speculative sampling.
"""

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from ._drafter import Drafter, DraftTree, Proposal, TreeDrafter
from ._generate import Token, generate
from ._model_drafter import ModelDrafter
from ._mtp import DraftHead, MTPDrafter
from ._ngram import NGramDrafter
from ._paths import PathVerdict, verify_paths
from ._sampling import Sampler, Verdict, accept
from ._tree_verify import TreeVerdict, tree_of_paths, verify_tree

__all__ = [
    "DraftHead",
    "DraftTree",
    "Drafter",
    "MTPDrafter",
    "ModelDrafter",
    "NGramDrafter",
    "PathVerdict",
    "Proposal",
    "Sampler",
    "Token",
    "TreeDrafter",
    "TreeVerdict",
    "Verdict",
    "accept",
    "generate",
    "speculative_generate_step",
    "tree_of_paths",
    "verify_paths",
    "verify_tree",
]


def speculative_generate_step(
    prompt: Sequence[int],
    target: Any,
    drafter: Drafter | None = None,
    *,
    num_draft_tokens: int = 4,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    eos: Sequence[int] = (),
) -> Iterator[tuple[int, mx.array, bool]]:
    """mlx-lm's `speculative_generate_step` shape for one prompt: yields (token, logprobs,
    from_draft) per token. `target` is a wrapped model; `drafter` any Drafter (a
    `ModelDrafter(wrap(draft_model))` for mlx-lm's draft-model behaviour)."""
    rounds = generate(
        target,
        [prompt],
        drafter,
        k=num_draft_tokens,
        max_tokens=max_tokens,
        sampler=sampler,
        eos=eos,
    )
    for tokens in rounds:
        for t in tokens:
            yield t.token, t.logprobs, t.from_draft
