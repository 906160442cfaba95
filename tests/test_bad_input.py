"""Bad input to the speculative package, save / load and kvstate.distributed: every call of
the reliability review's table raises the StateError subclass it should (never a bare
TypeError / IndexError / MLX error, never NotSupportedError, which is for well-formed
requests), with a message naming the argument; none runs silently, none crashes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from kvstate import distributed as dist
from kvstate.adapters import MTPHead, wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import (
    DrafterError,
    DraftTree,
    ModelDrafter,
    MTPDrafter,
    NGramDrafter,
    Proposal,
    Sampler,
    accept,
    generate,
    speculative_generate_step,
    tree_of_paths,
    verify_paths,
)

P = [[1, 2, 3, 4]]
HOT = Sampler(temperature=1.0)


class Ctx:
    """Models and states of a tiny llama (vocabulary 256), built once."""

    def __init__(self) -> None:
        self.raw = tiny_model("llama", num_hidden_layers=2)
        self.T, self.D = wrap(self.raw), wrap(self.raw)
        self.s1 = self.T(mx.array(P), self.T.init_state())[1]
        self.tmp = ""


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Ctx:
    ctx = Ctx()
    ctx.tmp = str(tmp_path_factory.mktemp("bad-input"))
    return ctx


def drain(target: Any, prompts: Any, drafter: Any = None, **kw: Any) -> list[list[int]]:
    """Run `generate` to the end (at most 12 rounds); what each row emitted."""
    kw.setdefault("max_tokens", 4)
    out: dict[int, list[int]] = {}
    for n, tokens in enumerate(generate(target, prompts, drafter, **kw)):
        assert n < 12
        for t in tokens:
            out.setdefault(t.row, []).append(t.token)
    return list(out.values())


class Scripted:
    """A drafter proposing `make(last, k, sampler)` (a tree drafter: `tree(...)`)."""

    def __init__(self, make: Any = None, tree: Any = None) -> None:
        self.make, self.tree = make, tree

    def start(self, prompts: list[list[int]], *, key: Any = None) -> None:
        pass

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Any:
        return self.make(last, k, sampler)

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> Any:
        return self.tree(last, k, sampler)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        pass


def drafted(tokens: Any, counts: Any = None, probs: Any = None, dtype: Any = None) -> Scripted:
    """A drafter proposing `tokens` (a list per row) every round."""

    def make(last: list[int], k: int, sampler: Sampler) -> Proposal:
        t = mx.array(tokens) if dtype is None else mx.array(tokens, dtype)
        n = counts if counts is not None else [len(tokens[0])] * len(last)
        return Proposal(t, n, probs(t) if callable(probs) else probs)

    return Scripted(make)


def uniform(value: float, width: int = 256) -> Callable[[mx.array], mx.array]:
    return lambda t: mx.full((t.shape[0], t.shape[1], width), value, mx.float32)


Case = tuple[str, Callable[[Ctx], Any], type[ks.StateError], str]
CASES: list[Case] = []


def add(label: str, thunk: Callable[[Ctx], Any], error: type[ks.StateError], names: str) -> None:
    CASES.append((label, thunk, error, names))


T, SE, DE, RE, PE = ks.TokenError, ks.StateError, DrafterError, ks.RowError, ks.PlacementError

# ------------------------------------------------------------------------ generate: prompts
PROMPTS = "prompts"
for label, prompts in [
    ("[[1, 300]] (vocabulary 256)", [[1, 300]]),
    ("[[-1, 2]]", [[-1, 2]]),
    ("[[2**40]]", [[2**40]]),
    ("[[2**31]]", [[2**31]]),
    ("a bad row of a ragged batch", [[1, 2, 3], [4, 999]]),
    ("a bad id of an equal-length batch", [[1, 2, 3], [4, 5, -7]]),
    ("[[1.5, 2]] (float ids)", [[1.5, 2]]),
    ("[[True, 2]] (bool ids)", [[True, 2]]),
    ("[['a', 'b']]", [["a", "b"]]),
    ("[1, 2, 300] (one flat list)", [1, 2, 300]),
    ("mx.array 3-d", mx.zeros((1, 1, 2), mx.int32)),
    ("mx.array 2-d floats", mx.zeros((1, 2))),
    ("[1, [2, 3]] (ids and rows mixed)", [1, [2, 3]]),
    ("[[[1, 2]]] (3 levels)", [[[1, 2]]]),
    ("'abc'", "abc"),
    ("[]", []),
    ("[[]]", [[]]),
    ("[np.array([1, 300])]", [np.array([1, 300])]),
    ("[mx.array([1, 2, 300])]", [mx.array([1, 2, 300])]),
    ("[mx.array([1.0, 2.0])]", [mx.array([1.0, 2.0])]),
    ("np.array([[1, 300]]) (2-d)", np.array([[1, 300]])),
]:
    add(f"generate prompts {label}", lambda c, p=prompts: drain(c.T, p), T, PROMPTS)
for label, make in [
    ("NGramDrafter", lambda c: NGramDrafter()),
    ("ModelDrafter", lambda c: ModelDrafter(c.D)),
    ("MTPDrafter", lambda c: MTPDrafter(MTPHead(c.raw))),
]:
    add(f"generate prompts [[1, 300]], {label}, sampled",
        lambda c, m=make: drain(c.T, [[1, 300]], m(c), sampler=HOT), T, PROMPTS)  # fmt: skip
add("generate prompts [[1, 300]], tree='paths'",
    lambda c: drain(c.T, [[1, 300]], NGramDrafter(), tree="paths"), T, PROMPTS)  # fmt: skip

# ------------------------------------------------------------------------ generate: arguments
for name, bad in [
    ("k", ["4", 2.5, True, 0, None]),
    ("max_tokens", [None, 2.5, True, "8", float("nan"), -1]),
    ("seed", [-1, 2**70, 1.5, True, "3"]),
    ("eos", [5, None, [1.5], [300], "ab"]),
    ("sampler", ["greedy", Sampler, {"temperature": 1.0}, 1]),
    ("adaptive", ["yes", None]),
]:
    for value in bad:
        given = {"sampler": HOT, name: value}  # sampled: the seed is used
        add(f"generate {name}={value!r}", lambda c, g=given: drain(c.T, P, NGramDrafter(), **g),
            SE, name)  # fmt: skip
# the continuation and mlx-lm's decoding options (issue 21)
for label, kw, error, names in [
    ("states=a state (not a list)", lambda c: {"states": c.s1}, SE, "states"),
    ("states=[] for one prompt", lambda c: {"states": []}, SE, "states"),
    ("states=['x']", lambda c: {"states": ["x"]}, SE, r"states\[0\]"),
    ("states=[a 2-row state]", lambda c: {"states": [ks.tile(c.s1, 2)]}, RE, r"states\[0\]"),
    ("history without states", lambda c: {"history": [[1, 2]]}, SE, r"history\[0\]"),
    ("history=[[1, 300]]", lambda c: {"states": [c.s1], "history": [[1, 300]]}, T,
     r"history\[0\]"),
    ("history=5", lambda c: {"states": [c.s1], "history": 5}, T, "history"),
    ("keep_states='yes'", lambda c: {"keep_states": "yes"}, SE, "keep_states"),
    ("logits_processors=a callable", lambda c: {"logits_processors": lambda t, x: x}, SE,
     "logits_processors"),
    ("logits_processors=[5]", lambda c: {"logits_processors": [5]}, SE, "logits_processors"),
    ("max_kv_size=4", lambda c: {"max_kv_size": 4}, SE, "max_kv_size"),
    ("max_kv_size=2.5", lambda c: {"max_kv_size": 2.5}, SE, "max_kv_size"),
    ("kv_bits=7", lambda c: {"kv_bits": 7}, SE, "kv_bits"),
    ("kv_bits=4, kv_group_size=48", lambda c: {"kv_bits": 4, "kv_group_size": 48}, SE,
     "kv_group_size"),
    ("kv_bits=4, quantized_kv_start=-1", lambda c: {"kv_bits": 4, "quantized_kv_start": -1},
     SE, "quantized_kv_start"),
]:  # fmt: skip
    add(f"generate {label}", lambda c, kw=kw: drain(c.T, P, **kw(c)), error, names)
add("generate states=[s] with a ModelDrafter and no history",
    lambda c: drain(c.T, P, ModelDrafter(c.D), states=[c.s1]), SE, "history")  # fmt: skip
add("Sampler(min_p=2)", lambda c: Sampler(temperature=1.0, min_p=2), SE, "min_p")
add("Sampler(min_p=-0.1)", lambda c: Sampler(min_p=-0.1), SE, "min_p")
add("generate target = a raw mlx-lm model", lambda c: drain(c.raw, P), SE, "target.*wrap")
add("generate target = a state", lambda c: drain(c.s1, P), SE, "target")
add("generate drafter='x'", lambda c: drain(c.T, P, "x"), SE, "drafter")
add("generate drafter=NGramDrafter (the class)", lambda c: drain(c.T, P, NGramDrafter), SE,
    "drafter")  # fmt: skip
add("ModelDrafter(raw mlx-lm model)", lambda c: ModelDrafter(c.raw), SE, "draft.*wrap")
add("ModelDrafter(None)", lambda c: ModelDrafter(None), SE, "draft")
add("ModelDrafter(5)", lambda c: ModelDrafter(5), SE, "draft")


def interleaved(c: Ctx) -> None:
    d = ModelDrafter(c.D)
    g1 = generate(c.T, [[1, 2, 3]], d, max_tokens=6)
    g2 = generate(c.T, [[4, 5], [6, 7]], d, max_tokens=6)
    for _ in zip(g1, g2, strict=False):
        pass


add("one ModelDrafter shared by two interleaved generations", interleaved, SE, "drafter")
add("ModelDrafter of a 512-token vocabulary drafting ids the target lacks, greedy",
    lambda c: drain(c.T, [[7, 8, 9]], ModelDrafter(wrap(tiny_model(
        "llama", num_hidden_layers=2, seed=5, vocab_size=512))), max_tokens=8),
    T, "vocabulary")  # fmt: skip
add("Sampler(temperature=inf) in generate",
    lambda c: drain(c.T, P, ModelDrafter(c.D), sampler=Sampler(temperature=float("inf"))),
    SE, "temperature")  # fmt: skip

# ------------------------------------------------------------------------ drafter output
TOK, CNT, PRB = "tokens|ids|vocabulary", "counts", "probs"
for label, drafter, kw, error, names in [
    ("tokens float32", drafted([[5.7, 6.2]], dtype=mx.float32), {}, T, TOK),
    ("tokens 1-d", drafted([5, 6], counts=[2]), {}, DE, "tokens"),
    ("tokens nested lists of floats", Scripted(lambda *a: Proposal([[5.5, 6.0]], [2], None)),
     {}, DE, "tokens"),
    ("tokens a row too many", drafted([[5, 6], [7, 8]], counts=[2]), {}, DE, "counts|tokens"),
    ("tokens [[-1, -1]], sampled (point masses)", drafted([[-1, -1]]), {"sampler": HOT}, T, TOK),
    ("tokens [[-1, -1]], sampled, probs 1e-6", drafted([[-1, -1]], probs=uniform(1e-6)),
     {"sampler": HOT}, T, TOK),
    ("tokens [[-1, -1]], greedy", drafted([[-1, -1]]), {}, T, TOK),
    ("tokens [[300, 300]], greedy", drafted([[300, 300]]), {}, T, TOK),
    ("tokens [[300, 300]], sampled", drafted([[300, 300]]), {"sampler": HOT}, T, TOK),
    ("tokens [[10**8, 5]], sampled", drafted([[10**8, 5]]), {"sampler": HOT}, T, TOK),
    ("tokens int64 [[2**32 + 5, 5]]", drafted([[2**32 + 5, 5]], dtype=mx.int64), {}, T, TOK),
    ("tokens [[300]] as a list", Scripted(lambda *a: Proposal([[300, 5]], [2], None)), {}, T,
     TOK),
    ("counts [5] for k=2", drafted([[5, 6, 7, 8, 9]], counts=[5]), {}, DE, CNT),
    ("counts [-1]", drafted([[5, 6]], counts=[-1]), {}, DE, CNT),
    ("counts [1.5]", drafted([[5, 6]], counts=[1.5]), {}, DE, CNT),
    ("counts None", Scripted(lambda *a: Proposal(mx.array([[5, 6]]), None, None)), {}, DE,
     CNT),
    ("probs all zero", drafted([[5, 6]], probs=uniform(0.0)), {"sampler": HOT}, DE, PRB),
    ("probs NaN", drafted([[5, 6]], probs=uniform(float("nan"))), {"sampler": HOT}, DE, PRB),
    ("probs -1 everywhere", drafted([[5, 6]], probs=uniform(-1.0)), {"sampler": HOT}, DE, PRB),
    ("probs all ones (not normalised)", drafted([[5, 6]], probs=uniform(1.0)),
     {"sampler": HOT}, DE, PRB),
    ("probs 0 at the draft", drafted([[5, 6]], probs=lambda t: mx.where(
        mx.arange(256) == 5, 0.0, 1 / 255)[None, None] * mx.ones((1, 2, 1))),
     {"sampler": HOT}, DE, PRB),
    ("probs 2-d", drafted([[5, 6]], probs=lambda t: mx.full((1, 2), 0.5)), {"sampler": HOT},
     DE, PRB),
    ("probs a row too many", drafted([[5, 6]], probs=lambda t: mx.full((2, 2, 256), 1 / 256)),
     {"sampler": HOT}, DE, PRB),
    ("probs narrower than the drafts", drafted(
        [[5, 6]], probs=lambda t: mx.full((1, 1, 256), 1 / 256)), {"sampler": HOT}, DE, PRB),
    ("a plain tuple", Scripted(lambda *a: (mx.array([[5, 6]]), [2], None)), {}, DE, "Proposal"),
]:  # fmt: skip
    add(f"drafter output: {label}",
        lambda c, d=drafter, kw=kw: drain(c.T, P, d, k=2, **kw), error, names)  # fmt: skip
add("drafter output: one count for a batch of 2",
    lambda c: drain(c.T, [[1, 2], [3, 4]], drafted([[5, 6], [5, 6]], counts=[2]), k=2),
    DE, CNT)  # fmt: skip
add(
    "drafter output: a row too few",
    lambda c: drain(c.T, [[1, 2], [3, 4]], drafted([[5, 6]], counts=[2, 2]), k=2),
    DE,
    "tokens",
)
for mode in ("tree", "paths"):
    add(f"tree drafter ({mode}): a list of paths",
        lambda c, m=mode: drain(c.T, P, Scripted(tree=lambda *a: [[5, 6], [7]]), k=2, tree=m),
        DE, "DraftTree")  # fmt: skip
    add(f"tree drafter ({mode}): depth 6 for k=2",
        lambda c, m=mode: drain(c.T, P, Scripted(tree=lambda *a: DraftTree(
            [5, 6, 7, 8, 9, 10], [-1, 0, 1, 2, 3, 4])), k=2, tree=m), DE, "deep|k")  # fmt: skip
    add(f"tree drafter ({mode}): tokens [300]",
        lambda c, m=mode: drain(c.T, P, Scripted(tree=lambda *a: DraftTree([300], [-1])), k=2,
                                tree=m), T, "vocabulary")  # fmt: skip

# ------------------------------------------------------------------------ speculative_generate_step


def step(c: Ctx, prompt: Any, drafter: Any = None, **kw: Any) -> list[int]:
    kw.setdefault("max_tokens", 4)
    target = kw.pop("target", c.T)
    return [t for t, _, _ in speculative_generate_step(prompt, target, drafter, **kw)]


for label, thunk, error, names in [
    ("prompt [[1, 2, 3]] (nested)", lambda c: step(c, [[1, 2, 3]], NGramDrafter()), T, "prompt"),
    ("prompt [300]", lambda c: step(c, [300], NGramDrafter()), T, "prompt"),
    ("prompt 'abc'", lambda c: step(c, "abc", NGramDrafter()), T, "prompt"),
    ("prompt mx.array([1, 2, 300])", lambda c: step(c, mx.array([1, 2, 300]), ModelDrafter(c.D)),
     T, "prompt"),
    ("num_draft_tokens=0", lambda c: step(c, [1, 2], NGramDrafter(), num_draft_tokens=0), SE,
     "num_draft_tokens"),
    ("num_draft_tokens='2'", lambda c: step(c, [1, 2], NGramDrafter(), num_draft_tokens="2"),
     SE, "num_draft_tokens"),
    ("max_tokens='3'", lambda c: step(c, [1, 2], NGramDrafter(), max_tokens="3"), SE,
     "max_tokens"),
    ("max_tokens=1.5", lambda c: step(c, [1, 2], ModelDrafter(c.D), max_tokens=1.5), SE,
     "max_tokens"),
    ("sampler=1", lambda c: step(c, [1, 2], NGramDrafter(), sampler=1), SE, "sampler"),
    ("eos=3", lambda c: step(c, [1, 2], NGramDrafter(), eos=3), SE, "eos"),
    ("target = a raw mlx-lm model", lambda c: step(c, [1, 2], NGramDrafter(), target=c.raw), SE,
     "target"),
    ("drafter='x'", lambda c: step(c, [1, 2], "x"), SE, "drafter"),
]:  # fmt: skip
    add(f"speculative_generate_step {label}", thunk, error, names)

# ------------------------------------------------------------------------ verify_paths


def vp(c: Ctx, last: Any = 5, paths: Any = ((6, 7),), **kw: Any) -> Any:
    if isinstance(paths, tuple):
        paths = [list(p) for p in paths]
    target = kw.pop("target", c.T)
    return verify_paths(target, c.s1, last, paths, **kw)


for label, kw, error, names in [
    ("last=300", {"last": 300, "paths": [[1]]}, T, "last"),
    ("last=-1", {"last": -1}, T, "last"),
    ("last=1.5", {"last": 1.5}, T, "last"),
    ("last=None", {"last": None}, T, "last"),
    ("last=True", {"last": True}, T, "last"),
    ("last=2**40", {"last": 2**40}, T, "last"),
    ("last=300, sampled", {"last": 300, "sampler": HOT, "key": mx.random.key(0)}, T, "last"),
    ("paths=5", {"paths": 5}, T, "paths"),
    ("paths=[[300]]", {"paths": [[300]]}, T, "paths"),
    ("paths=[[-1]]", {"paths": [[-1]]}, T, "paths"),
    ("paths=[[1.5]]", {"paths": [[1.5]]}, T, "paths"),
    ("paths=[1, 2]", {"paths": [1, 2]}, T, "paths"),
    ("paths=[]", {"paths": []}, T, "path"),
    ("paths=[[10**8]], sampled", {"paths": [[10**8]], "sampler": HOT, "key": mx.random.key(0)},
     T, "paths"),
    ("sampler='x'", {"sampler": "x"}, SE, "sampler"),
    ("key=5", {"sampler": HOT, "key": 5}, SE, "key"),
]:  # fmt: skip
    add(f"verify_paths {label}", lambda c, kw=kw: vp(c, **kw), error, names)
add("verify_paths target = a raw mlx-lm model", lambda c: vp(c, target=c.raw), SE, "target")

# ------------------------------------------------------------------------ accept, tree_of_paths


def acc(B: int = 2, w: int = 2, V: int = 8, **kw: Any) -> Any:
    target = kw.pop("target", mx.full((B, w + 1, V), 1 / V))
    drafts = kw.pop("drafts", mx.zeros((B, w), mx.int32))
    counts = kw.pop("counts", [w] * B)
    sampler = kw.pop("sampler", HOT)
    key = kw.pop("key", mx.random.key(0))
    return accept(target, drafts, kw.pop("draft_probs", None), counts, sampler, key)


for label, kw, error, names in [
    ("counts of the wrong length", {"counts": [2]}, DE, "counts"),
    ("counts above the drafts' width", {"counts": [5, 5]}, DE, "counts"),
    ("counts negative", {"counts": [-1, -1]}, DE, "counts"),
    ("drafts 9 (vocabulary 8)", {"drafts": mx.full((2, 2), 9, mx.int32)}, T, "drafts"),
    ("drafts 10**8", {"drafts": mx.full((2, 2), 10**8, mx.int32)}, T, "drafts"),
    ("drafts -1, greedy", {"drafts": mx.full((2, 2), -1, mx.int32), "sampler": Sampler()}, T,
     "drafts"),
    ("drafts float", {"drafts": mx.zeros((2, 2))}, T, "drafts"),
    ("target 2-d", {"target": mx.full((2, 8), 1 / 8)}, ks.ShapeError, "target"),
    ("target NaN", {"target": mx.full((2, 3, 8), float("nan"))}, SE, "target"),
    ("draft_probs 2-d", {"draft_probs": mx.full((2, 2), 0.5)}, DE, "draft_probs"),
    ("draft_probs not distributions", {"draft_probs": mx.full((2, 2, 8), 1.0)}, DE,
     "draft_probs"),
    ("key=5", {"key": 5}, SE, "key"),
    ("sampler='x'", {"sampler": "x"}, SE, "sampler"),
]:  # fmt: skip
    add(f"accept {label}", lambda c, kw=kw: acc(**kw), error, names)
for label, paths in [("5", 5), ("[['a']]", [["a"]]), ("[[1.5]]", [[1.5]])]:
    add(f"tree_of_paths({label})", lambda c, p=paths: tree_of_paths(p), T, "paths")

# ------------------------------------------------------------------------ Sampler
for label, kw, names in [
    ("temperature=-1", {"temperature": -1}, "temperature"),
    ("temperature='1'", {"temperature": "1"}, "temperature"),
    ("temperature=True", {"temperature": True}, "temperature"),
    ("temperature=inf", {"temperature": float("inf")}, "temperature"),
    ("temperature=nan", {"temperature": float("nan")}, "temperature"),
    ("top_p=0", {"top_p": 0}, "top_p"),
    ("top_p='0.9'", {"top_p": "0.9"}, "top_p"),
    ("top_p=nan", {"top_p": float("nan")}, "top_p"),
    ("top_p=True", {"top_p": True}, "top_p"),
    ("top_k=-1", {"top_k": -1}, "top_k"),
    ("top_k=2.5", {"top_k": 2.5}, "top_k"),
    ("top_k=True", {"top_k": True}, "top_k"),
]:
    add(f"Sampler({label})", lambda c, kw=kw: Sampler(**kw), SE, names)
add("Sampler().probs('x')", lambda c: Sampler().probs("x"), SE, "logits")  # type: ignore[arg-type]
add("Sampler.sample(key=5)", lambda c: HOT.sample(mx.array([[0.5, 0.5]]), key=5), SE, "key")

# ------------------------------------------------------------------------ drafters


def ngram(prompts: list[list[int]] | None = None) -> NGramDrafter:
    d = NGramDrafter()
    d.start(prompts or [[1, 2, 1, 2]])
    return d


def model_drafter(c: Ctx, proposed: bool = False) -> ModelDrafter:
    d = ModelDrafter(c.D)
    d.start([[1, 2, 3]])
    if proposed:
        d.propose([1], 2, Sampler())
    return d


for label, kw, names in [
    ("max_n=0", {"max_n": 0}, "max_n"),
    ("min_n=3, max_n=2", {"min_n": 3, "max_n": 2}, "min_n"),
    ("branches=0", {"branches": 0}, "branches"),
    ("max_n='3'", {"max_n": "3"}, "max_n"),
    ("max_n=2.5", {"max_n": 2.5}, "max_n"),
    ("min_n=1.5", {"min_n": 1.5}, "min_n"),
    ("branches=1.5", {"branches": 1.5}, "branches"),
    ("branches=True", {"branches": True}, "branches"),
]:
    add(f"NGramDrafter({label})", lambda c, kw=kw: NGramDrafter(**kw), SE, names)
for label, thunk, error, names in [
    ("propose before start", lambda c: NGramDrafter().propose([1], 2, Sampler()), SE, "start"),
    ("propose: more rows than started", lambda c: ngram().propose([1, 2], 2, Sampler()), T,
     "last"),
    ("propose k=-1", lambda c: ngram().propose([1], -1, Sampler()), SE, "k"),
    ("accept: fed of 2 rows for 1", lambda c: ngram().accept(mx.array([[1, 2], [3, 4]]), [1, 1]),
     SE, "fed|rows"),
    ("accept: kept 5 of 2 fed", lambda c: ngram().accept(mx.array([[1, 2]]), [5]), DE, "kept"),
    ("keep_rows([5])", lambda c: ngram().keep_rows([5]), RE, "rows"),
]:  # fmt: skip
    add(f"NGramDrafter {label}", thunk, error, names)
for label, thunk, error, names in [
    ("seed=-1", lambda c: ModelDrafter(c.D, seed=-1), SE, "seed"),
    ("seed=1.5", lambda c: ModelDrafter(c.D, seed=1.5), SE, "seed"),
    ("seed=2**70", lambda c: ModelDrafter(c.D, seed=2**70), SE, "seed"),
    ("branches=0", lambda c: ModelDrafter(c.D, branches=0), SE, "branches"),
    ("propose before start", lambda c: ModelDrafter(c.D).propose([1], 2, Sampler()), SE, "start"),
    ("propose k=0", lambda c: model_drafter(c).propose([1], 0, Sampler()), SE, "k"),
    ("propose k='2'", lambda c: model_drafter(c).propose([1], "2", Sampler()), SE, "k"),
    ("propose sampler=None", lambda c: model_drafter(c).propose([1], 2, None), SE, "sampler"),
    ("propose last of 3 ids for 1 row", lambda c: model_drafter(c).propose([1, 2, 3], 2, Sampler()),
     T, "last"),
    ("propose last=[300]", lambda c: model_drafter(c).propose([300], 2, Sampler()), T, "last"),
    ("propose last=[1.5]", lambda c: model_drafter(c).propose([1.5], 2, Sampler()), T, "last"),
    ("accept kept [4] after 2 drafts",
     lambda c: model_drafter(c, True).accept(mx.array([[1, 5, 6]]), [4]), DE, "kept"),
    ("accept kept [0]", lambda c: model_drafter(c, True).accept(mx.array([[1, 5, 6]]), [0]), SE,
     "kept"),
    ("accept kept [-1]", lambda c: model_drafter(c, True).accept(mx.array([[1, 5, 6]]), [-1]), DE,
     "kept"),
    ("accept kept [1, 1] for 1 row",
     lambda c: model_drafter(c, True).accept(mx.array([[1, 5, 6]]), [1, 1]), SE, "kept|fed"),
    ("accept fed of 2 rows",
     lambda c: model_drafter(c, True).accept(mx.array([[1, 5, 6]] * 2), [2, 2]), SE, "fed"),
    ("accept kept [1.5]", lambda c: model_drafter(c, True).accept(mx.array([[1, 5, 6]]), [1.5]),
     DE, "kept"),
    ("propose_tree k=0", lambda c: model_drafter(c).propose_tree(1, 0, Sampler()), SE, "k"),
    ("propose_tree last=300", lambda c: model_drafter(c).propose_tree(300, 2, Sampler()), T,
     "last"),
    ("propose twice without accept",
     lambda c: model_drafter(c, True).propose([1], 2, Sampler()), SE, "accept"),
]:  # fmt: skip
    add(f"ModelDrafter {label}", thunk, error, names)
for label, thunk, names in [
    ("MTPDrafter(None)", lambda c: MTPDrafter(None), "head"),  # type: ignore[arg-type]
    ("MTPDrafter(head, seed=-1)", lambda c: MTPDrafter(MTPHead(c.raw), seed=-1), "seed"),
    ("MTPDrafter start without hidden states",
     lambda c: MTPDrafter(MTPHead(c.raw)).start([[1, 2]]), "hidden"),
    ("MTPDrafter start: one hidden state for two prompts",
     lambda c: MTPDrafter(MTPHead(c.raw)).start([[1, 2], [3, 4]], hidden=[mx.zeros((1, 2, 64))]),
     "hidden"),
]:  # fmt: skip
    add(label, thunk, SE, names)

# ------------------------------------------------------------------------ save / load


def dense(c: Ctx, **kw: Any) -> ks.DenseKV:
    """A hand-built DenseKV (batch 1, 2 heads, capacity 4, dim 8), built unchecked (as a
    state put together field by field can be)."""
    args: dict[str, Any] = {"keys": mx.zeros((1, 2, 4, 8)), "values": mx.zeros((1, 2, 4, 8))}
    args |= {"length": 2, **kw}
    return ks.kinds.trusted(ks.DenseKV)(**args)


def saved(c: Ctx, state: Any, name: str) -> None:
    path = os.path.join(c.tmp, name)
    try:
        ks.save(path, state)
    finally:
        assert not os.path.exists(path), "save wrote a file load refuses"


for label, fields, names in [
    ("length 9 past capacity 4", {"length": 9}, "length"),
    ("appended 3 > length 2", {"appended": 3}, "appended"),
    ("keys batch 2 / values batch 3",
     {"keys": mx.zeros((2, 2, 4, 8)), "values": mx.zeros((3, 2, 4, 8))}, "keys|values"),
    ("left_padding of 3 rows", {"left_padding": mx.zeros((3,), mx.int32)}, "left_padding"),
    ("left_padding 7 past length", {"left_padding": mx.array([7], mx.int32)}, "left_padding"),
    ("length a float", {"length": 2.0}, "length"),
]:  # fmt: skip
    add(f"save a hand-built DenseKV, {label}",
        lambda c, f=fields, n=label: saved(c, dense(c, **f), f"{len(n)}.safetensors"),
        ks.ShapeError, names)  # fmt: skip
add("save ModelState(placement='garbage')",
    lambda c: saved(c, ks.kinds.trusted(ks.ModelState)(c.s1.layers, "garbage"), "pl.safetensors"),
    SE, "placement")  # fmt: skip
add("save(None, state)", lambda c: ks.save(None, c.s1), SE, "path")  # type: ignore[arg-type]
add(
    "save into a missing directory",
    lambda c: ks.save(os.path.join(c.tmp, "missing", "x.safetensors"), c.s1),
    SE,
    "directory",
)
add("save onto a directory", lambda c: ks.save(c.tmp, c.s1), SE, "directory")
add("load(None)", lambda c: ks.load(None), SE, "path")  # type: ignore[arg-type]


def load_with(c: Ctx, group: Any) -> Any:
    path = os.path.join(c.tmp, "good.safetensors")
    ks.save(path, c.s1)
    return ks.load(path, group=group)


add("load(path, group='x')", lambda c: load_with(c, "x"), SE, "group")
add("load(path, group=5)", lambda c: load_with(c, 5), SE, "group")

# ------------------------------------------------------------------------ distributed


def two(scheme: str = "tensor") -> list[dist.Placement]:
    return [dist.Placement(scheme, r, 2) for r in range(2)]


for label, thunk, error, names in [
    ("scatter(state, a placement string)", lambda c: dist.scatter(c.s1, "tensor rank 0 of 2"),
     PE, "placements"),
    ("scatter(state, [placement strings])",
     lambda c: dist.scatter(c.s1, ["tensor rank 0 of 2", "tensor rank 1 of 2"]), PE, "placements"),
    ("scatter(state, [])", lambda c: dist.scatter(c.s1, []), PE, "placements"),
    ("scatter(state, None)", lambda c: dist.scatter(c.s1, None), PE, "placements"),
    ("Placement('tensor', True, 2)", lambda c: dist.Placement("tensor", True, 2), PE, "rank"),
    ("Placement('tensor', 0, 2.0)", lambda c: dist.Placement("tensor", 0, 2.0), PE, "size"),
    ("Placement('pipeline', 0, 2, (0, 'a'))",
     lambda c: dist.Placement("pipeline", 0, 2, (0, "a")), PE, "layers"),
    ("Placement('pipeline', 0, 2, 5)", lambda c: dist.Placement("pipeline", 0, 2, 5), PE, "layers"),
    ("Placement('pipeline', 0, 2, (0, 2), '4')",
     lambda c: dist.Placement("pipeline", 0, 2, (0, 2), "4"), PE, "total_layers"),
    ("with_placement(state, a string)",
     lambda c: dist.with_placement(c.s1, "tensor rank 0 of 2"), PE, "placement"),
    ("with_placement(None, placement)", lambda c: dist.with_placement(None, two()[0]), PE, "state"),
    ("agree([1, 'a'])", lambda c: dist.agree([1, "a"]), SE, "values"),
    ("agree(None)", lambda c: dist.agree(None), SE, "values"),
    ("agree([1.5])", lambda c: dist.agree([1.5]), SE, "values"),
    ("agree([1], group=5)", lambda c: dist.agree([1], group=5), SE, "group"),
]:  # fmt: skip
    add(f"distributed {label}", thunk, error, names)
add("quantize(rotation='so4', seed=-1)",
    lambda c: ks.quantize(c.s1, rotation="so4", seed=-1), SE, "seed")  # fmt: skip


# ------------------------------------------------------------------------ the review's leftovers
# (benchmarks/results/reliability-after-issue20.md: what still escaped or ran silently)


def head_of(c: Ctx) -> MTPHead:
    return MTPHead(c.raw)


def tiled(state: Any, n: int) -> Any:
    return ks.tile(state, n)


def mlx_lm_caches(c: Ctx) -> Any:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(c.raw)


SH = ks.ShapeError
for label, thunk, error, names in [
    ("MTPHead call: hidden 32 wide for a 64-wide model",
     lambda c: head_of(c)(mx.zeros((1, 1, 32)), mx.array([[1]]), head_of(c).init_state()), SH,
     "hidden"),
    ("MTPDrafter start: hidden of the wrong width",
     lambda c: MTPDrafter(head_of(c)).start([[1, 2]], hidden=[mx.zeros((1, 2, 32))]), SH,
     "hidden"),
    ("generate with the head of another model (hidden 32)",
     lambda c: drain(c.T, P, MTPDrafter(MTPHead(tiny_model("llama", num_hidden_layers=2,
                                                           hidden_size=32, head_dim=8))), k=2),
     SH, "hidden"),
    ("MTPHead call: tokens a list",
     lambda c: head_of(c)(mx.zeros((1, 1, 64)), [[3]], head_of(c).init_state()), T, "tokens"),
    ("MTPHead call: tokens of floats",
     lambda c: head_of(c)(mx.zeros((1, 1, 64)), mx.array([[3.0]]), head_of(c).init_state()), T,
     "tokens"),
    ("MTPHead(layers=100) for a 2-layer model", lambda c: MTPHead(c.raw, layers=100), SE, "layers"),
    ("MTPHead(layers=True)", lambda c: MTPHead(c.raw, layers=True), SE, "layers"),
    ("Sampler.sample of negative probs",
     lambda c: HOT.sample(mx.array([[-0.5, 1.5]]), key=mx.random.key(0)), SE, "probs"),
    ("Sampler.sample of NaN probs", lambda c: HOT.sample(mx.array([[float("nan"), 1.0]])), SE,
     "probs"),
    ("Sampler.sample of probs summing to 2 (greedy too)",
     lambda c: Sampler().sample(mx.array([[1.0, 1.0]])), SE, "probs"),
    ("Sampler.sample of int probs", lambda c: HOT.sample(mx.array([[0, 1]])), SE, "probs"),
    ("quantize(bits=7)", lambda c: ks.quantize(c.s1, bits=7), ks.ConfigMismatchError, "bits="),
    ("quantize(bits=4.0)", lambda c: ks.quantize(c.s1, bits=4.0), ks.ConfigMismatchError,
     "bits="),
    ("quantize(group_size=48)", lambda c: ks.quantize(c.s1, group_size=48),
     ks.ConfigMismatchError, "group_size="),
    ("quantize(bits=4, value_bits=7)", lambda c: ks.quantize(c.s1, bits=4, value_bits=7),
     ks.ConfigMismatchError, "value_bits="),
    ("tile(state, 10**9) (cannot fit)", lambda c: tiled(c.s1, 10**9), RE, "n="),
    ("tile(None, 2)", lambda c: tiled(None, 2), SE, "state"),
    ("nbytes(None)", lambda c: ks.nbytes(None), SE, "from_mlx_lm"),
    ("nbytes([mlx-lm caches])", lambda c: ks.nbytes(mlx_lm_caches(c)), SE,
     "from_mlx_lm"),
    ("wrapped m(tokens, state, lengths=5)", lambda c: c.T([[1, 2]], c.s1, lengths=5), SH,
     "lengths"),
    ("wrap(None)", lambda c: wrap(None), SE, "model"),
    ("wrap(a string)", lambda c: wrap("llama"), SE, "model"),
]:  # fmt: skip
    add(label, thunk, error, names)


@pytest.mark.parametrize(("label", "thunk", "error", "names"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_state_error_naming_it(c, label, thunk, error, names):
    with pytest.raises(ks.StateError) as raised:
        thunk(c)
    assert isinstance(raised.value, error), f"{type(raised.value).__name__}: {raised.value}"
    assert not isinstance(raised.value, ks.NotSupportedError)
    assert _names(str(raised.value), names), str(raised.value)


def _names(message: str, names: str) -> bool:
    import re

    return re.search(rf"(?<![a-z0-9_])({names})", message) is not None
