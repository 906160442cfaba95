"""Speculative decoding built from kvstate's transforms: a generator, drafters, sampling.

    from kvstate.adapters import wrap
    from kvstate.speculative import ModelDrafter, Sampler, generate

    target, draft = wrap(big_model), wrap(small_model)
    for tokens in generate(target, [[1, 2, 3]], ModelDrafter(draft), k=4, max_tokens=64):
        for t in tokens:
            print(t.row, t.token, t.from_draft)

Works on every model kvstate wraps (hybrid and recurrent ones roll back from the verify's
checkpoints), batched with ragged acceptance, greedy or with exact speculative sampling:
exact for every seed, since the generator's seed is split into the target's key and the
drafter's (`Drafter.start(prompts, key=...)`) and no two draws share a key (`_sampling`);
the target draws each row's token at position t with that row's key of t (`position_keys`),
so with n-gram drafts a seed gives the tokens of the decode without a drafter.
The target is anything with the `Target` protocol (a wrapped model is one). Every argument,
and what a drafter returns each round, is checked (`_checks`): a `StateError` subclass
naming what is wrong (`DrafterError` for a drafter's output the round cannot verify).

`generate` returns a `Generation` (iterate it for the rounds); it continues rows from states
(`states=`, with `history=` for the drafter and the logits processors) and with
`keep_states=True` hands back each row's final state (`Generation.states`), to continue a
chat or keep a prompt cache; it takes mlx-lm's `generate_step` options (`logits_processors`,
`max_kv_size`, `kv_bits` / `kv_group_size` / `quantized_kv_start`, `Sampler(min_p=)`).
Text on top of it: `kvstate.text`.

A round has four phases: propose (the drafter drafts after each row's last token), verify
(one forward of the target over the last tokens and the drafts), accept (each row's longest
prefix of drafts the target agrees with, or exact speculative sampling), commit (each row
keeps its own prefix: a ragged `commit_prefix` of the target's state, `Drafter.accept` for
the drafter's). A round with nothing drafted is a plain step (one token per row).

Glossary: the words for a round's counts, used the same way everywhere in this package (row
b of a batch of B; public names that predate it are given with their meaning here):

- `k`: the most drafts a round may use (`generate(k=...)`).
- depth: the drafts asked for this round (1 .. k; with `adaptive`, the default, chosen by
  a `CostAwarePolicy` from each row's acceptance and the timed cost of a verify, which
  may also cut each row's drafted[b] or take a plain step); what
  `Drafter.propose(last, k, sampler)` gets as its `k`.
- budget: the drafts the rows can still use: the most tokens any row still wants, minus
  its next token; a round asks for min(depth, budget) drafts, and none when it is 0.
- drafted[b]: the drafts row b proposed (`Proposal.counts[b]`; `accept(counts=...)`).
- span: the drafts verified this round, max(drafted[b]) (a tree: its depth).
- fed: the verify's input, (B, 1 + span) int32: each row's last token, then its drafts (a
  tree round: (1, 1 + n), the winning path's n drafts); what `Drafter.accept(fed, kept)`
  gets.
- accepted[b]: the drafts of row b the target agreed with, 0 .. drafted[b]
  (`Verdict.accepted`, `PathVerdict.accepted`, `TreeVerdict.accepted`).
- kept[b] = accepted[b] + 1: the tokens of `fed` row b keeps in the state (its last token
  and its accepted drafts); what `commit_prefix(state, kept, checkpoints)` and
  `Drafter.accept` take.
- next token (bonus): the target's own token after row b's accepted drafts
  (`Verdict.next_tokens[b]`): emitted, and in no state yet; the next round's last token.
- emitted[b]: the tokens row b has put out so far (accepted drafts and next tokens); a row
  stops at `max_tokens` or after an `eos` token.
"""

from collections.abc import Iterator, Sequence

import mlx.core as mx

from . import _values as values
from ._batch_round import batch_round, round_plan
from ._checks import checked_step_prompt
from ._drafter import Drafter, DraftTree, Proposal, TreeDrafter
from ._generate import Token, generate
from ._generation import Generation
from ._linear_round import Launched, launch_plain
from ._model_drafter import ModelDrafter
from ._mtp import DraftHead, MTPDrafter
from ._ngram import NGramDrafter
from ._paths import PathVerdict, verify_paths
from ._policy import CostAwarePolicy, CostModel, Decision, FixedCost
from ._position_keys import position_keys
from ._round import Round, RoundPlan
from ._row_keys import row_keys, split_row_keys
from ._row_sampler import RowSampler
from ._sampling import Sampler, Verdict, accept, generation_keys
from ._target import ChainTarget, PrefillTarget, Target, TreeTarget
from ._tree_verify import TreeVerdict, verify_tree
from ._trees import tree_of_paths
from ._values import DrafterError

__all__ = [
    "ChainTarget",
    "CostAwarePolicy",
    "CostModel",
    "Decision",
    "DraftHead",
    "DraftTree",
    "Drafter",
    "DrafterError",
    "FixedCost",
    "Generation",
    "Launched",
    "MTPDrafter",
    "ModelDrafter",
    "NGramDrafter",
    "PathVerdict",
    "PrefillTarget",
    "Proposal",
    "Round",
    "RoundPlan",
    "RowSampler",
    "Sampler",
    "Target",
    "Token",
    "TreeDrafter",
    "TreeTarget",
    "TreeVerdict",
    "Verdict",
    "accept",
    "batch_round",
    "generate",
    "generation_keys",
    "launch_plain",
    "round_plan",
    "position_keys",
    "row_keys",
    "speculative_generate_step",
    "split_row_keys",
    "tree_of_paths",
    "verify_paths",
    "verify_tree",
]


def speculative_generate_step(
    prompt: Sequence[int],
    target: Target,
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
    where = "speculative_generate_step"
    values.integer(num_draft_tokens, f"{where}: num_draft_tokens", 1)
    values.integer(max_tokens, f"{where}: max_tokens", 1)
    rounds = generate(
        target,
        [checked_step_prompt(prompt)],
        drafter,
        k=num_draft_tokens,
        max_tokens=max_tokens,
        sampler=sampler,
        eos=eos,
    )
    for tokens in rounds:
        for t in tokens:
            yield t.token, t.logprobs, t.from_draft
