"""The speculative entry points' argument checks, in one place: what `generate`,
`speculative_generate_step` and `verify_paths` take, and what a drafter's proposal must be
when the generator receives it (`checked_proposal`, `checked_tree`).

Everything on the host (arguments, prompts, a proposal's counts, shapes and dtypes) is
checked on the host before it is used. A proposal's ids in an mx.array are checked on the
device without a sync: they are clamped where a forward or a gather could not take them,
and the mark of a row with a counted id outside the vocabulary is read with the round's
verdict (`_values`). Every refusal is a StateError subclass naming the argument, its value
and the fix; NotSupportedError is for well-formed requests the package cannot serve.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx
import numpy as np

from .. import DenseKV, RowError, State, StateError, TokenError, batch_size, quantize
from . import _values as values
from ._drafter import Drafted, DraftTree, Proposal
from ._sampling import Sampler
from ._target import Abilities
from ._values import DrafterError


class Call(NamedTuple):
    """A `generate` call's arguments, checked and normalised."""

    prompts: list[list[int]]
    sampler: Sampler
    eos: tuple[int, ...]
    abilities: Abilities


def checked_call(
    target: Any,
    prompts: Any,
    drafter: Any,
    *,
    k: Any,
    max_tokens: Any,
    sampler: Any,
    eos: Any,
    adaptive: Any,
    seed: Any,
    tree: Any,
    where: str = "generate",
) -> Call:
    """`generate`'s arguments checked (StateError subclasses naming each), the prompts as
    lists of ints, the sampler (greedy for None), eos as a tuple and the target's
    abilities (probed once). `k` means nothing without a drafter (any int >= 0 is taken);
    `max_tokens` 0 is an empty generation."""
    abilities = checked_target(target, where)
    values.integer(k, f"{where}: k", 1 if drafter is not None else 0)
    values.integer(max_tokens, f"{where}: max_tokens", 0)
    values.flag(adaptive, f"{where}: adaptive")
    values.seed(seed, f"{where}: seed")
    vocab = abilities.vocab_size
    rows = checked_prompts(prompts, vocab, where)
    checked_drafter(drafter, tree, where)
    return Call(
        rows, sampler_of(sampler, f"{where}: sampler"), eos_of(eos, vocab, where), abilities
    )


def checked_target(target: Any, where: str) -> Abilities:
    """A `Target`: callable, with `init_state` (a wrapped model); its abilities."""
    if isinstance(target, type) or not (
        callable(target) and callable(getattr(target, "init_state", None))
    ):
        raise StateError(
            f"{where}: target must be a wrapped model (a Target: `logits, state = "
            f"target(tokens, state)` and `target.init_state(batch)`); got a "
            f"{type(target).__name__}. Wrap an mlx-lm model with kvstate.adapters.wrap(model)"
        )
    abilities = Abilities.of(target)
    vocab = abilities.vocab_size
    if vocab is not None and not (values.is_integer(vocab) and vocab >= 1):
        raise StateError(f"{where}: the target's vocab_size must be an int >= 1; got {vocab!r}")
    return abilities


def checked_prompts(prompts: Any, vocab: int | None, where: str) -> list[list[int]]:
    """One list of ids per row, each non-empty and inside the vocabulary, from what mlx-lm
    takes as prompts: one flat list of ids or a 1-d array (one prompt), a 2-d array (rows),
    or a list / tuple of rows, each a sequence or 1-d array of ints."""
    if isinstance(prompts, (str, bytes)) or not isinstance(
        prompts, (list, tuple, np.ndarray, mx.array)
    ):
        raise TokenError(
            f"{where}: prompts must be token ids: a list of ids or a 1-d array (one prompt), "
            f"a list of such rows or a 2-d array (rows, ids); got {prompts!r:.80}"
            + (" (encode text with the tokenizer first, or use kvstate.text)" if
               isinstance(prompts, str) else "")
        )  # fmt: skip
    if isinstance(prompts, (np.ndarray, mx.array)):
        integer = (
            mx.issubdtype(prompts.dtype, mx.integer)
            if isinstance(prompts, mx.array)
            else prompts.dtype.kind in "iu"
        )
        if prompts.ndim == 2 and integer:
            prompts = prompts.tolist()  # one read for every row
        elif prompts.ndim in (1, 2):
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        else:
            raise TokenError(
                f"{where}: prompts as an array must be 1-d (one prompt) or 2-d (rows, ids); "
                f"got shape {tuple(prompts.shape)}"
            )
    if len(prompts) == 0:
        raise TokenError(
            f"{where}: prompts is empty; give at least one prompt, each with at least one token"
        )
    if isinstance(prompts, (list, tuple)) and all(values.is_integer(p) for p in prompts):
        prompts = [prompts]  # one flat list of ids: one prompt, as mlx-lm's generate_step
    rows = [values.ids(p, f"{where}: prompts[{i}]", vocab) for i, p in enumerate(prompts)]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise TokenError(
            f"{where}: prompts {empty[:8]} are empty; give at least one prompt, each with at "
            "least one token"
        )
    return rows


class Extras(NamedTuple):
    """`generate`'s continuation and decoding options, checked."""

    states: list[Any] | None  # per row: a batch-1 state to continue, or None (fresh)
    history: list[list[int]]  # per row: the ids its state holds ([] where not given)
    keep_states: bool
    processors: list[Callable[..., Any]] | None
    max_kv_size: int | None
    kv: tuple[int, int, int] | None  # (bits, group size, start)


def checked_extras(
    rows: int,
    vocab: int | None,
    *,
    states: Any,
    history: Any,
    keep_states: Any,
    logits_processors: Any,
    max_kv_size: Any,
    kv_bits: Any,
    kv_group_size: Any,
    quantized_kv_start: Any,
    where: str = "generate",
) -> Extras:
    """The continuation (`states`, `history`, `keep_states`) and mlx-lm's decoding options
    (`logits_processors`, `max_kv_size`, `kv_bits` / `kv_group_size` /
    `quantized_kv_start`), checked: a StateError subclass naming the argument."""
    starts = _checked_states(states, rows, where)
    ids = _checked_history(history, starts, rows, vocab, where)
    keep = values.flag(keep_states, f"{where}: keep_states")
    processors = None
    if logits_processors is not None:
        if callable(logits_processors) or not isinstance(logits_processors, (list, tuple)):
            raise StateError(
                f"{where}: logits_processors must be a list of callables (tokens, logits) -> "
                f"logits (mlx_lm.sample_utils.make_logits_processors gives one) or None; got "
                f"{logits_processors!r:.60}" + (": pass [it]" if callable(logits_processors)
                                               else "")
            )  # fmt: skip
        bad = [i for i, p in enumerate(logits_processors) if not callable(p)]
        if bad:
            raise StateError(
                f"{where}: logits_processors[{bad[0]}] is not callable; each takes (tokens, "
                f"logits) and returns logits; got {logits_processors[bad[0]]!r:.60}"
            )
        processors = list(logits_processors) or None
    size = None
    if max_kv_size is not None:
        # mlx-lm's rotating cache keeps the first 4 tokens: a window must hold more.
        size = values.integer(max_kv_size, f"{where}: max_kv_size (None: unbounded)", 5)
    kv = None
    if kv_bits is not None:
        bits = values.integer(kv_bits, f"{where}: kv_bits (None: no quantization)")
        group = values.integer(kv_group_size, f"{where}: kv_group_size")
        start = values.integer(quantized_kv_start, f"{where}: quantized_kv_start", 0)
        try:  # what kvstate.quantize takes, asked of an empty layer
            quantize(DenseKV(), bits, group)
        except StateError as e:
            raise StateError(
                f"{where}: kv_bits={bits}, kv_group_size={group} are not supported: {e}"
            ) from None
        kv = (bits, group, start)
    return Extras(starts, ids, keep, processors, size, kv)


def _checked_states(states: Any, rows: int, where: str) -> list[Any] | None:
    """None, or one batch-1 kvstate state (or None) per prompt."""
    if states is None:
        return None
    if not isinstance(states, (list, tuple)):
        raise StateError(
            f"{where}: states must be a list with one state (or None) per prompt; got a "
            f"{type(states).__name__}" + (": pass [state]" if isinstance(states, State) else "")
        )
    if len(states) != rows:
        raise StateError(
            f"{where}: states has {len(states)} entries for {rows} prompts; give one state "
            "(or None, to start fresh) per prompt"
        )
    for i, s in enumerate(states):
        if s is not None and not isinstance(s, State):
            raise StateError(
                f"{where}: states[{i}] must be a kvstate state (a generation's "
                f"`states`, kvstate.load(path), kvstate.adapters.from_mlx_lm(caches)) or "
                f"None; got a {type(s).__name__}"
            )
        if s is not None and batch_size(s) != 1:
            raise RowError(
                f"{where}: states[{i}] holds {batch_size(s)} rows; each prompt continues "
                "one row: pass kvstate.extract(state, row) for each"
            )
    return None if all(s is None for s in states) else list(states)


def _checked_history(
    history: Any, states: list[Any] | None, rows: int, vocab: int | None, where: str
) -> list[list[int]]:
    """Per row the ids its state holds (`[]` for none), inside the vocabulary."""
    if history is None:
        return [[] for _ in range(rows)]
    if not isinstance(history, (list, tuple)) or len(history) != rows:
        raise TokenError(
            f"{where}: history must be a list with, per prompt, the ids its state holds (or "
            f"None); got {history!r:.60}"
        )
    ids = [[] if h is None else values.ids(h, f"{where}: history[{i}]", vocab)
           for i, h in enumerate(history)]  # fmt: skip
    orphans = [i for i, h in enumerate(ids) if h and (states is None or states[i] is None)]
    if orphans:
        raise StateError(
            f"{where}: history[{orphans[0]}] is given but states[{orphans[0]}] is None: the "
            "history is what a state holds; give the state too, or prepend the ids to the "
            "prompt"
        )
    return ids


def sampler_of(sampler: Any, name: str) -> Sampler:
    """`sampler`, or greedy for None."""
    if sampler is None:
        return Sampler()
    if isinstance(sampler, Sampler):
        return sampler
    fix = (
        "pass an instance: Sampler(temperature=...)"
        if sampler is Sampler
        else "pass kvstate.speculative.Sampler(temperature=..., top_p=..., top_k=...) or None"
    )
    raise StateError(f"{name} must be a Sampler or None (greedy); got {sampler!r:.60}: {fix}")


def eos_of(eos: Any, vocab: int | None, where: str) -> tuple[int, ...]:
    """The end ids as a tuple of ints inside the vocabulary."""
    if values.is_integer(eos):
        raise StateError(f"{where}: eos must be a list of token ids; got {eos!r}: pass [{eos}]")
    if not isinstance(eos, (list, tuple, set, frozenset, range, np.ndarray, mx.array)):
        raise StateError(f"{where}: eos must be a list of token ids (() for none); got {eos!r:.60}")
    items = sorted(eos) if isinstance(eos, (set, frozenset)) else eos
    return tuple(values.ids(items, f"{where}: eos", vocab))


def checked_drafter(drafter: Any, tree: Any, where: str) -> None:
    """None, or an instance with the methods the generator calls."""
    if drafter is None:
        return
    if isinstance(drafter, type):
        raise StateError(
            f"{where}: drafter must be a drafter instance; got the class {drafter.__name__}: "
            f"pass {drafter.__name__}(...)"
        )
    needed = ["start", "accept", "keep_rows", "propose_tree" if tree is not None else "propose"]
    missing = [m for m in needed if not callable(getattr(drafter, m, None))]
    if tree is not None and missing == ["propose_tree"]:
        return  # generate refuses it as a drafter without tree drafting (NotSupportedError)
    if missing:
        raise StateError(
            f"{where}: drafter must implement the Drafter protocol (start, propose, accept, "
            f"keep_rows; a TreeDrafter propose_tree); a {type(drafter).__name__} lacks "
            f"{missing}: pass ModelDrafter(wrap(draft_model)), NGramDrafter(), MTPDrafter(head) "
            "or None"
        )


def start_keywords(drafter: Any, key: mx.array) -> dict[str, Any]:
    """{"key": key} for a drafter whose `start` takes a key (the protocol's), else {}: a
    drafter written before keys existed is started as before (it draws from its own seed)."""
    try:
        parameters = inspect.signature(drafter.start).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return {}
    takes = any(p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return {"key": key} if takes else {}


def checked_step_prompt(prompt: Any) -> list[int]:
    """`speculative_generate_step`'s one prompt: a flat sequence or 1-d array of ids."""
    where = "speculative_generate_step: prompt"
    if isinstance(prompt, (str, bytes)):
        raise TokenError(f"{where} must be a list or 1-d array of token ids; got {prompt!r:.60}")
    if isinstance(prompt, (list, tuple)) and prompt and not values.is_integer(prompt[0]):
        raise TokenError(
            f"{where} must be one prompt, a flat list of token ids; got {prompt!r:.60} "
            "(for several prompts use generate)"
        )
    return values.ids(prompt, where, None)  # generate checks them against the vocabulary


# ---------------------------------------------------------------------------- proposals


class Drafts(NamedTuple):
    """A proposal as the round verifies it.

    tokens: (B, span) the drafts as proposed (their own integer dtype: an id past int32
        must not wrap into range), for the acceptance rule.
    fed: (B, span) int32, what the verify forward takes: ids no forward can take (outside
        the vocabulary) as 0 (such a draft is refused, or rejected, never accepted).
    counts: drafted[b], 0 .. span.
    probs: (B, span, V') float or None.
    marks: (B,) int32 device marks (`_values.DRAFT_ID`) of rows with a counted id outside
        the vocabulary the drafts may use, read with the verdict; None when nothing is
        left to read (ids checked on the host, made in range, or nothing drafted).
    made: a kvstate drafter's proposal (`Drafted`) whose ids fit: its ids and
        distributions need no device check (the acceptance rule skips the probs' marks).
    """

    tokens: mx.array
    fed: mx.array
    counts: list[int]
    probs: mx.array | None
    marks: mx.array | None
    made: bool = False


def checked_proposal(proposal: Any, rows: int, asked: int, k: int, vocab: int) -> Drafts:
    """A drafter's `Proposal` for `rows` rows after `propose(last, asked, ...)` in a
    generation of `k`, checked on the host (type, counts, shapes, dtypes; ids given as lists
    or NumPy) and, for ids in an mx.array, on the device (the marks). Counts up to `k` are
    taken, cut to the `asked` the round verifies (a drafter may ignore the round's depth:
    the drafts past it would only be cut from the output); past `k` they are refused.
    `vocab`: the target's vocabulary size."""
    where = "generate: the drafter's proposal"
    if not isinstance(proposal, Proposal):
        raise DrafterError(
            f"{where} must be a kvstate.speculative.Proposal(tokens, counts, probs); got a "
            f"{type(proposal).__name__}: return Proposal(...) from propose"
        )
    tokens, counts, probs = proposal
    proposed = values.counts_of(counts, f"{where}: counts (drafts per row, at most k)", rows, k)
    span = max(proposed) if proposed else 0
    drafted = proposed if span <= asked else [min(c, asked) for c in proposed]
    limit = vocab
    if probs is not None:
        probs = _checked_probs(probs, rows, span, where)
        limit = probs.shape[-1]  # a padded draft vocabulary: ids the target lacks are rejected
    if isinstance(tokens, mx.array):
        tokens = _checked_shape(tokens, rows, span, where)
        span = min(span, asked)
        if probs is not None and probs.shape[1] != span:
            probs = probs[:, :span]
        if span == 0:
            return Drafts(tokens, tokens, drafted, probs, None)
        tokens = tokens[:, :span]
        if isinstance(proposal, Drafted) and proposal.bound <= limit:
            # Made in range by a kvstate drafter: nothing to mark; ids the target lacks (a
            # wider draft vocabulary, covered by probs) are fed as 0 and rejected.
            fed = tokens if proposal.bound <= vocab else mx.where(tokens >= vocab, 0, tokens)
            fed = fed if fed.dtype == mx.int32 else fed.astype(mx.int32)
            return Drafts(tokens, fed, drafted, probs, None, True)
        fed, marks = _guarded(tokens, mx.array(drafted), vocab, limit)
        return Drafts(tokens, fed, drafted, probs, marks)
    host = _host_tokens(tokens, rows, span, where)
    span = min(span, asked)
    if probs is not None and probs.shape[1] != span:
        probs = probs[:, :span]
    for b, (row, n) in enumerate(zip(host, drafted, strict=True)):
        outside = [t for t in row[:n] if not 0 <= t < limit]
        if outside:
            raise TokenError(
                f"{where}: tokens of row {b} hold ids {outside[:8]} outside 0..{limit - 1} "
                "(the target's vocabulary, or the width of the proposal's probs)"
            )
    ids = mx.array([r[:span] for r in host], mx.int32)
    fed = ids if limit <= vocab else mx.where(ids >= vocab, 0, ids)
    return Drafts(ids, fed, drafted, probs, None)


@mx.compile
def _guarded(ids: mx.array, counts: mx.array, vocab: int, limit: int) -> tuple[mx.array, mx.array]:
    """`ids` (B, span) as the verify feeds them, int32 with ids outside 0..vocab-1 as 0,
    and (B,) int32 `DRAFT_ID` marks of rows with a counted id (position < counts[b])
    outside 0..limit-1 (compared in the ids' own dtype). Compiled (`vocab` and `limit`
    constants of it, one per model): one fused kernel on every round, no read."""
    outside = (ids < 0) | (ids >= limit)
    fed = mx.where(outside | (ids >= vocab), 0, ids).astype(mx.int32)
    counted = mx.arange(ids.shape[1])[None] < counts[:, None]
    return fed, values.DRAFT_ID * (outside & counted).any(1).astype(mx.int32)


def _checked_shape(tokens: mx.array, rows: int, span: int, where: str) -> mx.array:
    if tokens.ndim != 2 or tokens.shape[0] != rows or tokens.shape[1] < span:
        raise DrafterError(
            f"{where}: tokens must be (B, depth) = ({rows}, >= {span}) ids (one row per row "
            f"of the batch, at least max(counts) wide); got shape {tuple(tokens.shape)}"
        )
    if not mx.issubdtype(tokens.dtype, mx.integer):
        raise TokenError(f"{where}: tokens must be integer ids; got dtype {tokens.dtype}")
    return tokens


def _host_tokens(tokens: Any, rows: int, span: int, where: str) -> list[list[int]]:
    """Drafts given as nested lists or a NumPy array, as lists of Python ints."""
    try:
        host = np.asarray(tokens)
    except ValueError:  # ragged nested lists
        host = np.asarray([], dtype=object)
    if host.dtype.kind not in "iu" or host.ndim != 2:
        raise DrafterError(
            f"{where}: tokens must be an mx.array (or nested lists) of integer ids, shape "
            f"(B, depth); got {tokens!r:.80}"
        )
    if host.shape[0] != rows or host.shape[1] < span:
        raise DrafterError(
            f"{where}: tokens must be (B, depth) = ({rows}, >= {span}); got shape {host.shape}"
        )
    return cast(list[list[int]], host.tolist())


def _checked_probs(probs: Any, rows: int, span: int, where: str) -> mx.array:
    if not isinstance(probs, mx.array) or probs.ndim != 3:
        shown = f"shape {tuple(probs.shape)}" if isinstance(probs, mx.array) else repr(probs)[:60]
        raise DrafterError(
            f"{where}: probs must be None or an mx.array (B, depth, vocab) of the distributions "
            f"the drafts were drawn from; got {shown}"
        )
    if probs.shape[0] != rows or probs.shape[1] < span:
        raise DrafterError(
            f"{where}: probs must be (B, depth, vocab) with B = {rows} rows and depth >= "
            f"{span} (max(counts)); got shape {tuple(probs.shape)}"
        )
    if not mx.issubdtype(probs.dtype, mx.floating):
        raise DrafterError(f"{where}: probs must be floats; got dtype {probs.dtype}")
    return probs


def is_linked(tree: DraftTree) -> bool:
    """Whether a DraftTree's parents make a tree: sequences of one length, each parent -1 or
    an earlier node (so walks from the root end)."""
    tokens, parents = tree
    return (
        isinstance(parents, Sequence)
        and isinstance(tokens, Sequence)
        and len(tokens) == len(parents)
        and all(values.is_integer(p) and -1 <= p < i for i, p in enumerate(parents))
    )


def checked_tree(tree: Any, asked: int, k: int) -> DraftTree:
    """A tree drafter's `DraftTree` after `propose_tree(last, asked, ...)` in a generation
    of `k`: its type and depth (the tree round checks its ids and links). A tree up to `k`
    deep is taken, its nodes past `asked` dropped (as a linear proposal's are cut); a deeper
    one is refused."""
    where = "generate: the drafter's tree"
    if not isinstance(tree, DraftTree):
        raise DrafterError(
            f"{where} must be a kvstate.speculative.DraftTree(tokens, parents); got a "
            f"{type(tree).__name__}: build one with DraftTree(*tree_of_paths(paths))"
        )
    if not is_linked(tree):
        return tree  # the tree round refuses it, naming what is wrong
    tokens, parents = tree
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p == -1 else depth[p] + 1)
    deepest = max(depth, default=0)
    if deepest > k:
        raise DrafterError(f"{where} is {deepest} drafts deep; generate's k is {k}")
    if deepest <= asked:
        return tree
    # Parents come first, so a node past `asked` has every descendant past it too.
    kept = [i for i, d in enumerate(depth) if d <= asked]
    new = {old: i for i, old in enumerate(kept)}
    return DraftTree([tokens[i] for i in kept], [new.get(parents[i], -1) for i in kept])


def refused(error: StateError) -> StateError:
    """`accept`'s refusal of a proposal, as the generator reports it."""
    return type(error)(f"generate: the drafter's proposal is refused: {error}")


def marked_message(drafts: Drafts, vocab: int) -> Any:
    """The refusal of the rows a greedy round marked (DRAFT_ID), reading the drafts."""
    limit = vocab if drafts.probs is None else drafts.probs.shape[-1]

    def message(rows: list[int]) -> str:
        ids = cast(list[list[int]], drafts.tokens.tolist())
        shown = "; ".join(f"row {b}: {ids[b][: drafts.counts[b]]}" for b in rows[:4])
        return (
            f"generate: the drafter proposed ids outside 0..{limit - 1} (the target's "
            f"vocabulary) ({shown}); a drafter must draft ids of the target's vocabulary"
        )

    return {values.DRAFT_ID: (TokenError, message)}


# ---------------------------------------------------------------------------- drafters


def checked_model(model: Any, name: str) -> Abilities:
    """A draft model (a `Target`): callable, with `init_state`; its abilities."""
    if isinstance(model, type) or not (
        callable(model) and callable(getattr(model, "init_state", None))
    ):
        raise StateError(
            f"{name} must be a wrapped model (a Target: `logits, state = model(tokens, "
            f"state)` and `init_state(batch)`); got a {type(model).__name__}. Wrap an mlx-lm "
            "model with kvstate.adapters.wrap(model)"
        )
    return Abilities.of(model)


def started_rows(rows: int | None, where: str) -> int:
    """The rows a drafter was started on, or a StateError if `start` was never called."""
    if rows is None:
        raise StateError(f"{where}: the drafter was never started; call start(prompts) first")
    return rows


def checked_last(last: Any, rows: int, vocab: int | None, where: str) -> list[int]:
    """`propose`'s `last`: one id per row of the drafter's batch, inside the vocabulary
    (the generator's own, `values.Made`, is checked against the vocabulary only)."""
    made = type(last) is values.Made and len(last) == rows
    if made and (vocab is None or not last or max(last) < vocab):
        return cast(list[int], last)
    ids = values.ids(last, f"{where}: last", vocab)
    if len(ids) != rows:
        raise TokenError(
            f"{where}: last has {len(ids)} ids but the drafter was started on {rows} rows; "
            "give one last token per row (a drafter serves one generation at a time: start "
            "it again, or use one drafter per generation)"
        )
    return ids


def checked_depth(k: Any, where: str, low: int = 1) -> int:
    """`propose`'s `k`, the drafts wanted per row."""
    return values.integer(k, f"{where}: k", low)


def checked_sampler(sampler: Any, where: str) -> Sampler:
    if not isinstance(sampler, Sampler):
        raise StateError(
            f"{where}: sampler must be a kvstate.speculative.Sampler; got {sampler!r:.60}"
        )
    return sampler


def checked_kept(fed: Any, kept: Any, rows: int, most: int, where: str) -> list[int]:
    """`accept`'s `fed` (rows, 1 + span) ids and `kept`: one count in 1..min(most, 1 + span)
    per row (`most`: what the drafter's last proposal can keep). The generator's own counts
    (`values.Made`, each in 1..1 + span of its `fed`) are taken as they are when they are
    one per row and within `most`."""
    made = type(kept) is values.Made and isinstance(fed, mx.array)
    if made and fed.shape[0] == len(kept) == rows and (not kept or max(kept) <= most):
        return cast(list[int], kept)
    if not (isinstance(fed, mx.array) and fed.ndim == 2 and fed.shape[0] == rows):
        shown = f"shape {tuple(fed.shape)}" if isinstance(fed, mx.array) else type(fed).__name__
        raise StateError(
            f"{where}: fed must be the verify's input, an mx.array ({rows}, 1 + span) (as many "
            f"rows as the drafter's {rows} rows); got {shown}"
        )
    top = min(most, fed.shape[1])
    counts = values.counts_of(kept, f"{where}: kept", rows, top)
    if counts and min(counts) < 1:
        raise StateError(
            f"{where}: kept must each be in 1..{top} (the last token and the accepted drafts); "
            f"got {counts[:16]}"
        )
    return counts


def checked_rows(rows: Any, count: int, where: str) -> list[int]:
    """`keep_rows`' rows: ints in 0..count-1."""
    if not isinstance(rows, (list, tuple)) or not all(values.is_integer(r) for r in rows):
        raise RowError(f"{where}: rows must be a list of ints; got {rows!r:.60}")
    bad = [r for r in rows if not 0 <= r < count]
    if bad:
        raise RowError(f"{where}: rows {bad[:8]} are outside the drafter's {count} rows")
    return [int(r) for r in rows]


# ---------------------------------------------------------------------------- verifiers


def checked_token(x: Any, name: str, vocab: int | None) -> int:
    """One token id (an int, never a bool or float) inside the vocabulary."""
    if not values.is_integer(x):
        raise TokenError(f"{name} must be an int token id; got {x!r:.60} ({type(x).__name__})")
    return values.ids([x], name, vocab)[0]


def checked_paths(paths: Any, vocab: int | None, where: str) -> list[list[int]]:
    """Candidate continuations: a non-empty list of non-empty lists of ids."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, (list, tuple)):
        raise TokenError(
            f"{where}: paths must be a list of candidate paths, each a list of draft ids; got "
            f"{paths!r:.60}"
        )
    if paths and all(values.is_integer(p) for p in paths):
        raise TokenError(
            f"{where}: paths must be a list of paths (lists of ids); got one flat list "
            f"{list(paths)!r:.60}: pass [[...]] for a single path"
        )
    rows = [values.ids(p, f"{where}: paths[{i}]", vocab) for i, p in enumerate(paths)]
    if not rows or any(not r for r in rows):
        raise TokenError(f"{where}: give at least one path, each with at least one draft")
    return rows
