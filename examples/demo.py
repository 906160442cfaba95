"""kvstate demo: batched speculative decoding on a random-init hybrid model, no downloads.

A qwen3_next-style model (gated-delta linear attention + full attention, built in code) is
wrapped as a pure function. Three prompts are prefilled separately and merged into one
batch; the batch then decodes with prompt-lookup speculation: each row drafts K tokens from
its own history, one forward verifies all rows, and every row keeps its own accepted prefix
(ragged `commit_prefix`, with the recurrent layers rolled back from checkpoints). The result
is checked against plain greedy decoding, token for token.

Run: python examples/demo.py
"""

from __future__ import annotations

import time

import mlx.core as mx

import kvstate as ks
from adapters import wrap
from adapters.tiny_models import tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 101, 102], [7, 7, 40, 41, 42, 43]]
NEW_TOKENS = 32
K = 4  # draft length


def draft_from_history(history: list[int], k: int) -> list[int]:
    """Prompt-lookup drafting: continue the latest earlier occurrence of the last token."""
    last = history[-1]
    for start in range(len(history) - 2, -1, -1):
        if history[start] == last:
            follow = history[start + 1 : start + 1 + k]
            return follow + [last] * (k - len(follow))
    return [last] * k


def plain_greedy(m, prompt: list[int]) -> list[int]:
    logits, state = m(mx.array([prompt]), m.init_state())
    out: list[int] = []
    while len(out) < NEW_TOKENS:
        y = logits[:, -1].argmax(-1)
        out.append(int(y.item()))
        logits, state = m(y[:, None], state)
    return out


def speculative_batch(m) -> tuple[list[list[int]], list[int]]:
    # Prefill each prompt alone, then batch them: merge aligns rows with left padding.
    starts = [m(mx.array([p]), m.init_state()) for p in PROMPTS]
    state = ks.merge([s for _, s in starts])
    last = [int(logits[0, -1].argmax().item()) for logits, _ in starts]
    histories = [list(p) + [t] for p, t in zip(PROMPTS, last, strict=True)]
    outputs = [[t] for t in last]
    accepted_total, forwards = [0, 0, 0], 0

    while min(len(o) for o in outputs) < NEW_TOKENS:
        drafts = [draft_from_history(h, K) for h in histories]
        tokens = mx.array([[h[-1], *d] for h, d in zip(histories, drafts, strict=True)])
        before = ks.snapshot(state)  # O(1): the state can never change under us
        logits, state, checkpoints = m(tokens, state, capture=True)
        forwards += 1
        verified = logits.argmax(-1).tolist()  # target's greedy choice after each position
        keep = []
        for row, (draft, target) in enumerate(zip(drafts, verified, strict=True)):
            n = 0
            while n < K and draft[n] == target[n]:
                n += 1
            new = draft[:n] + [target[n]]  # accepted drafts plus the target's own next token
            outputs[row] += new
            histories[row] += new
            accepted_total[row] += n
            keep.append(n + 1)  # the last token plus n accepted drafts stay in the state
        state = ks.commit_prefix(state, keep, checkpoints)
        assert ks.batch_size(before) == ks.batch_size(state)
    print(f"  verify forwards: {forwards} for {NEW_TOKENS} tokens per row")
    print(f"  drafts accepted per row: {accepted_total}")
    return [o[:NEW_TOKENS] for o in outputs], state


def describe(state) -> None:
    kinds: dict[str, int] = {}
    for layer in state.layers:
        kinds[type(layer).__name__] = kinds.get(type(layer).__name__, 0) + ks.nbytes(layer)
    for kind, size in kinds.items():
        print(f"  {kind:15s} {size / 1024:8.1f} KiB")
    print(f"  {'total':15s} {ks.nbytes(state) / 1024:8.1f} KiB, batch {ks.batch_size(state)}")


def main() -> None:
    model = tiny_model("qwen3_next")
    m = wrap(model)
    print("kvstate demo: random-init qwen3_next (gated delta + attention), batch of 3 prompts")

    print("speculative batched decode (prompt lookup, ragged commit):")
    t0 = time.perf_counter()
    speculative, state = speculative_batch(m)
    print(f"  {time.perf_counter() - t0:.2f} s")

    print("plain greedy decode of each prompt alone (the oracle):")
    t0 = time.perf_counter()
    reference = [plain_greedy(m, p) for p in PROMPTS]
    print(f"  {time.perf_counter() - t0:.2f} s")

    for row, (got, want) in enumerate(zip(speculative, reference, strict=True)):
        status = "identical" if got == want else "DIFFERENT"
        print(f"  row {row}: {status}: {got[:12]}...")
        assert got == want, f"row {row}: speculative {got} != greedy {want}"

    print("state bytes after decoding:")
    describe(ks.eval(state))

    t0 = time.perf_counter()
    for _ in range(1000):
        ks.snapshot(state)
    print(f"snapshot: {(time.perf_counter() - t0) * 1e3:.3f} us each, 0 bytes (states are immutable)")
    row = ks.extract(state, 1)
    print(f"extract(row 1): batch {ks.batch_size(row)}, {ks.nbytes(ks.eval(row)) / 1024:.1f} KiB")
    print("ok")


if __name__ == "__main__":
    main()
