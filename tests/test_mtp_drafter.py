"""MTPDrafter: drafts from the target's last hidden state through a draft head.

Oracles: mlx-lm's greedy `generate_step` (the generator's output, whatever the head drafts);
a head run from scratch over the kept positions with the target's teacher-forced hidden
states (the drafter's state after ragged commits); the target's own sampling distribution;
and the target itself as a "head" (it ignores the hidden states), which must draft exactly
what the target decodes, so every draft is accepted.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import kvstate as ks
from kvstate.adapters import MTPHead, wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import MTPDrafter, Sampler, generate
from kvstate.speculative import _linear_round as round_module
from kvstate.speculative._sampling import sampled_verdict as verdict
from tests.test_speculative import NEW, PROMPTS, chi_square, greedy


class TargetHead:
    """A whole model as a draft head: it ignores the hidden states it is given and keeps
    its own state of every position, so with the target's weights it drafts exactly what
    the target decodes (and with perturbed weights, what a close draft model would)."""

    def __init__(self, model) -> None:
        self.model = wrap(model)

    def init_state(self, batch_size: int = 1):
        return self.model.init_state(batch_size)

    def __call__(self, hidden, tokens, state, *, capture=False):
        out = self.model(tokens, state, capture=capture, hidden=True)
        return (out[0], out[-1], *out[1:-1])  # (logits, hidden, state[, checkpoints])


def decode(target, prompts, drafter, k=3, max_tokens=NEW, eos=()):
    """Fixed k (adaptive=False): these tests are of the drafter's mechanics, which the
    default policy's timed choices (drafts or plain steps) would make vary run to run."""
    out: list[list[int]] = [[] for _ in prompts]
    drafted = 0
    rounds = generate(target, prompts, drafter, k=k, max_tokens=max_tokens, eos=eos, adaptive=False)
    for tokens in rounds:
        for t in tokens:
            out[t.row].append(t.token)
            drafted += t.from_draft
    return out, drafted


def up_to(tokens: list[int], eos: list[int]) -> list[int]:
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[: j + 1]
    return tokens


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "nemotron_h"])
def test_greedy_output_is_mlx_lms_with_an_mtp_head(name):
    """A random-init MTP head (its drafts mostly rejected), batch 1."""
    model = tiny_model(name)
    out, _ = decode(wrap(model), PROMPTS[:1], MTPDrafter(MTPHead(model)))
    assert out == [greedy(model, PROMPTS[0], NEW)]


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "nemotron_h"])
def test_greedy_output_is_mlx_lms_with_ragged_acceptance(name):
    """A head close to the target (its weights scaled slightly differently), a ragged
    batch of 3: rows accept different numbers of drafts, and the drafter's state follows
    each row's own commit; one row stops early at an eos (the drafter drops its row)."""
    model = tiny_model(name)
    truth = [greedy(model, p, NEW) for p in PROMPTS]
    eos = [truth[1][20]]
    drafter = MTPDrafter(TargetHead(tiny_model(name, scale=3.9)))
    accepted: list[list[int]] = []
    real_accept = drafter.accept

    def spying(fed, kept, hidden=None):
        accepted.append(kept)
        real_accept(fed, kept, hidden=hidden)

    drafter.accept = spying  # type: ignore[method-assign]
    out, drafted = decode(wrap(model), PROMPTS, drafter, k=4, eos=eos)
    assert out == [up_to(t, eos) for t in truth]
    assert len(out[1]) <= 21 < NEW
    assert drafted > NEW  # the close head is often right...
    assert any(len(set(kept)) > 1 for kept in accepted)  # ...and rows differ


def test_the_target_as_its_own_head_has_every_draft_accepted():
    """The head's positions line up with the target's (position i takes token i): a head
    that is the target drafts the target's own greedy tokens, all accepted."""
    model = tiny_model("qwen3_next")
    truth = [greedy(model, p, NEW) for p in PROMPTS]
    k = 4
    out, drafted = decode(wrap(model), PROMPTS, MTPDrafter(TargetHead(model)), k=k)
    assert out == truth
    # Every round gives k drafts and the target's token; the last round drafts only the
    # tokens still wanted (rest - 1 drafts, then the target's token).
    full, rest = divmod(NEW - 1, k + 1)
    assert drafted == len(PROMPTS) * (full * k + max(rest - 1, 0))


# ---------------------------------------------------------------------------------------
# The drafter's own state against a head run from scratch
# ---------------------------------------------------------------------------------------


def from_scratch(head, target, tokens: list[int]):
    """The head's state over `tokens`, built directly: position i gets the target's
    teacher-forced hidden state at i - 1 (zeros at 0); and the target's last hidden."""
    _, _, hidden = target(mx.array([tokens]), target.init_state(), hidden=True)
    before = mx.concatenate([mx.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    return head(before, mx.array([tokens]), head.init_state())[2], hidden[:, -1:]


def assert_next_step_equal(head, state, pending, reference, reference_pending, token):
    np.testing.assert_allclose(np.array(pending), np.array(reference_pending), atol=2e-4)
    probe = mx.array([[token]])
    got = head(reference_pending, probe, state)
    want = head(reference_pending, probe, reference)
    for a, b in zip(got[:2], want[:2], strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "nemotron_h"])
def test_after_ragged_accepts_the_head_state_is_the_kept_positions_only(name):
    """Two rounds by hand: propose, verify the true continuation, keep a different number
    of tokens per row (one row a plain-step round), catch up. Each row's head state and
    pending hidden state equal a from-scratch head run over that row's kept tokens."""
    model = tiny_model(name)
    target = wrap(model)
    head = MTPHead(model)
    drafter = MTPDrafter(head)
    truth = [greedy(model, p, 12) for p in PROMPTS]
    starts = [target(mx.array([p]), target.init_state(), hidden=True) for p in PROMPTS]
    state = ks.merge([s[1] for s in starts])
    drafter.start([list(p) for p in PROMPTS], hidden=[s[2] for s in starts])
    emitted = [1, 1, 1]  # tokens of truth already decoded (the first, from the prefill)
    for kept in ([1, 3, 4], [2, 2, 2], [4, 1, 2]):
        last = [t[e - 1] for t, e in zip(truth, emitted, strict=True)]
        drafter.propose(last, 3, Sampler())
        fed = mx.array([t[e - 1 : e + 3] for t, e in zip(truth, emitted, strict=True)])
        _, verified, checkpoints, hidden = target(fed, state, capture=True, hidden=True)
        state = ks.commit_prefix(verified, kept, checkpoints)
        drafter.accept(fed, kept, hidden=hidden)
        emitted = [e + n for e, n in zip(emitted, kept, strict=True)]
        for b, prompt in enumerate(PROMPTS):
            tokens = [*prompt, *truth[b][: emitted[b] - 1]]
            reference, pending = from_scratch(head, target, tokens)
            row = ks.row_select(drafter.state, b)
            assert_next_step_equal(
                head, row, drafter.pending[b : b + 1], reference, pending, truth[b][emitted[b] - 1]
            )


def test_a_round_without_a_proposal_feeds_the_plain_steps_token():
    model = tiny_model("qwen3_next")
    target = wrap(model)
    head = MTPHead(model)
    drafter = MTPDrafter(head)
    prompt = PROMPTS[0]
    truth = greedy(model, prompt, 4)
    _, state, hidden = target(mx.array([prompt]), target.init_state(), hidden=True)
    drafter.start([prompt], hidden=[hidden])
    _, state, hidden = target(mx.array([[truth[0]]]), state, hidden=True)
    drafter.accept(mx.array([[truth[0]]]), [1], hidden=hidden)
    reference, pending = from_scratch(head, target, [*prompt, truth[0]])
    assert_next_step_equal(head, drafter.state, drafter.pending, reference, pending, truth[1])


def test_proposals_chain_the_heads_own_hidden_states():
    model = tiny_model("llama")
    target, head = wrap(model), MTPHead(model)
    drafter = MTPDrafter(head)
    _, _, hidden = target(mx.array([PROMPTS[0]]), target.init_state(), hidden=True)
    drafter.start([PROMPTS[0]], hidden=[hidden])
    before = drafter.state
    proposal = drafter.propose([5], 3, Sampler())
    h, y, state, want = hidden[:, -1:], mx.array([[5]]), before, []
    for _ in range(3):
        logits, h, state = head(h, y, state)
        y = logits[:, -1].argmax(-1)[:, None]
        want.append(int(y.item()))
    assert proposal.tokens.tolist() == [want] and proposal.counts == [3]
    assert proposal.probs is None


# ---------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------


def test_sampled_tokens_follow_the_targets_distribution(monkeypatch):
    """600 rows (6 generations of 100: MLX CUDA fails a step of >= 128 rows, README) sample
    the same prompt at temperature 1 (top_k 3) with a close head that disagrees with the
    target; the second token (the first a draft can give) of the rows whose first token was
    the most common one follows the target's distribution after it, by a chi-square test at
    the 0.1% level (df = 2: 13.82)."""
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    target = wrap(model)
    sampler = Sampler(temperature=1.0, top_k=3)
    prompt = [5, 9, 13]
    verdicts = []  # the acceptance rule's, one per verify round: it must have been tried
    monkeypatch.setattr(
        round_module,
        "sampled_verdict",
        lambda *a, **k: verdicts.append(verdict(*a, **k)) or verdicts[-1],
    )
    emitted: list[list[int]] = []
    for seed in range(5, 11):
        head = TargetHead(tiny_model("llama", num_hidden_layers=2, seed=4))
        drafter = MTPDrafter(head, seed=seed)
        # max_tokens 3: the round after the first token drafts (drafts are capped at the
        # tokens still wanted: with 2 it would be a plain step).
        rounds = generate(target, [prompt] * 100, drafter, k=2, max_tokens=3, sampler=sampler,
                          seed=seed)  # fmt: skip
        rows: list[list[int]] = [[] for _ in range(100)]
        for tokens in rounds:
            for t in tokens:
                rows[t.row].append(t.token)
        emitted += rows
    assert len(verdicts) == 6 and all(len(v.accepted) == 100 for v in verdicts)
    firsts = np.array([e[0] for e in emitted])
    first = int(np.bincount(firsts).argmax())
    seconds = np.array([e[1] for e in emitted])[firsts == first]
    assert len(seconds) >= 200
    logits, _ = target(mx.array([[*prompt, first]]), target.init_state())
    want = np.array(sampler.probs(logits[0, -1]))
    assert chi_square(np.bincount(seconds, minlength=want.size), want) < 13.82


def test_sampling_with_the_target_as_head_accepts_nearly_every_draft():
    """The head's draft distribution is the target's (same sampler transforms), so the
    acceptance ratio p/q is 1: drafts are rejected only by rounding."""
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    sampler = Sampler(temperature=1.0, top_p=0.9)
    drafter = MTPDrafter(TargetHead(model), seed=2)
    total = drafted = 0
    for tokens in generate(
        wrap(model),
        [PROMPTS[0]] * 4,
        drafter,
        k=3,
        max_tokens=24,
        sampler=sampler,
        adaptive=False,
    ):
        total += len(tokens)
        drafted += sum(t.from_draft for t in tokens)
    assert drafted >= 0.7 * total  # all accepted: 3 of every 4 tokens (less at the end)


def test_drafts_follow_the_distribution_the_proposal_reports():
    """The acceptance rule is exact only if Proposal.probs is what the drafts were drawn
    from: 500 identical rows, one proposal; each draft position's tokens against its
    reported distribution (the second draft among rows whose first draft was the most
    common), chi-square at the 0.1% level (df = 3: 16.27)."""
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    target = wrap(model)
    _, _, hidden = target(mx.array([[5, 9, 13]]), target.init_state(), hidden=True)
    drafter = MTPDrafter(TargetHead(tiny_model("llama", num_hidden_layers=2, seed=4)), seed=3)
    rows = 500
    drafter.start([[5, 9, 13]] * rows, hidden=[hidden] * rows)
    proposal = drafter.propose([7] * rows, 2, Sampler(temperature=1.0, top_k=4))
    assert proposal.probs is not None
    drafts, probs = np.array(proposal.tokens), np.array(proposal.probs)
    vocab = probs.shape[-1]
    assert chi_square(np.bincount(drafts[:, 0], minlength=vocab), probs[0, 0]) < 16.27
    common = drafts[:, 0] == np.bincount(drafts[:, 0]).argmax()
    row = int(np.flatnonzero(common)[0])
    np.testing.assert_allclose(
        probs[common, 1], np.broadcast_to(probs[row, 1], probs[common, 1].shape), atol=1e-5
    )
    assert chi_square(np.bincount(drafts[common, 1], minlength=vocab), probs[row, 1]) < 16.27


@pytest.mark.parametrize(
    ("name", "tied"), [("llama", False), ("llama", True), ("qwen3_next", False)]
)
def test_the_mtp_head_shares_the_targets_embedding_norm_and_projection(name, tied):
    """The head's logits are the target's output projection of the head's hidden states,
    its input the target's embedding; only its fusion and layers are its own parameters."""
    model = tiny_model(name, tie_word_embeddings=tied)
    head = MTPHead(model)
    hidden = mx.random.normal((2, 3, 64), key=mx.random.key(0))
    tokens = mx.array([[1, 2, 3], [4, 5, 6]])
    logits, out, _ = head(hidden, tokens, head.init_state(2))
    project = model.model.embed_tokens.as_linear if tied else model.lm_head
    np.testing.assert_allclose(np.array(project(out)), np.array(logits), rtol=1e-5, atol=1e-5)
    fused = head.inner.model.embed_tokens
    np.testing.assert_array_equal(
        np.array(fused.embedding(tokens)), np.array(model.model.embed_tokens(tokens))
    )
    assert head.inner.model.norm is model.model.norm
    own = {k for k, _ in tree_flatten(head.trainable_parameters())}
    assert own and all(
        ".layers." in k or ".enorm." in k or ".hnorm." in k or ".eh_proj." in k for k in own
    )
    assert any(".eh_proj." in k for k in own)
    # Teacher forcing without a state (for training) computes the same.
    taught, taught_hidden = head.forward(hidden, tokens)
    np.testing.assert_allclose(np.array(taught), np.array(logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(taught_hidden), np.array(out), rtol=1e-5, atol=1e-5)
    # The hidden states matter: other ones give other logits.
    other = head(hidden + 1, tokens, head.init_state(2))[0]
    assert not np.allclose(np.array(other), np.array(logits))


def test_without_the_targets_hidden_states_the_drafter_says_so():
    model = tiny_model("llama")
    drafter = MTPDrafter(MTPHead(model))
    with pytest.raises(ks.StateError, match="hidden states"):
        drafter.start([[1, 2, 3]])
    with pytest.raises(ks.StateError, match="start first"):
        drafter.propose([1], 2, Sampler())
    with pytest.raises(ks.StateError, match="layers must be"):
        MTPHead(model, layers=0)
    with pytest.raises(ks.StateError, match="with 1 layers runs"):
        MTPHead(tiny_model("qwen3_next"), layers=1)  # needs a linear and a full-attention layer
    with pytest.raises(ks.StateError, match="no mlx-lm `args`"):
        MTPHead(mx)  # type: ignore[arg-type]
    with pytest.raises(ks.StateError, match=r"\(B, K, D\)"):
        MTPHead(model)(mx.zeros((1, 2, 64)), mx.array([[1]]), MTPHead(model).init_state())
