"""Layered verifier tests: hand-built greedy cases, seeded determinism, the statistical
exactness of rejection sampling, and parity with a slow per-token reference."""

from __future__ import annotations

import pytest
import torch

from triton_backend.speculation.verify import verify_greedy, verify_rejection


def _logits_with_argmax(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    for row, tok in enumerate(argmaxes):
        logits[row, tok] = 5.0
    return logits


@pytest.mark.parametrize(
    "target,draft,accepted,next_token",
    [
        ([1, 2, 3, 4], [1, 2, 3], 3, 4),  # all accepted -> bonus
        ([1, 2, 3, 4], [1, 5, 3], 1, 2),  # rejected at position 1 -> recovered = target argmax
        ([1, 2, 3, 4], [0, 2, 3], 0, 1),  # rejected first
        ([5], [], 0, 5),  # plain decoding step
    ],
)
def test_greedy_hand_built(target, draft, accepted, next_token):
    result = verify_greedy(_logits_with_argmax(target), torch.tensor(draft, dtype=torch.long))
    assert (result.num_accepted, result.next_token) == (accepted, next_token)
    assert result.bonus == (accepted == len(draft))


def test_shape_checks():
    with pytest.raises(ValueError, match="rows"):
        verify_greedy(torch.zeros(2, 4), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="expected"):
        verify_greedy(torch.zeros(4), torch.tensor([1]))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_rejection(torch.full((2, 4), 0.25), torch.tensor([1]), torch.full((1, 3), 1 / 3), None)


def _random_probs(rows: int, vocab: int, seed: int, temperature: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g) * 2 / temperature, dim=-1)


def test_seeded_determinism():
    p, q = _random_probs(4, 8, 0), _random_probs(3, 8, 1)
    draft = torch.tensor([1, 2, 3])
    runs = [verify_rejection(p, draft, q, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(runs)) == 1


def _first_token_histogram(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int, deterministic: int | None = None) -> torch.Tensor:
    """Empirical distribution of the first committed token over n rounds of k=1 verification."""
    g = torch.Generator().manual_seed(seed)
    vocab = p.shape[1]
    counts = torch.zeros(vocab)
    for _ in range(n):
        if q is None:
            draft = torch.tensor([deterministic])
            result = verify_rejection(p, draft, None, g)
        else:
            draft = torch.multinomial(q[0], 1, generator=g)
            result = verify_rejection(p, draft, q, g)
        first = int(draft[0]) if result.num_accepted >= 1 else result.next_token
        counts[first] += 1
    return counts / n


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("case", ["close_draft", "bad_draft", "deterministic_draft"])
def test_rejection_preserves_target_distribution(case):
    vocab, n = 8, 20000
    p = _random_probs(2, vocab, 11)
    if case == "close_draft":
        q = torch.softmax(torch.log(p[:1]) + 0.3 * torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)), -1)
        emp = _first_token_histogram(p, q, n, seed=5)
    elif case == "bad_draft":
        q = torch.zeros(1, vocab)
        q[0, int(p[0].argmin())] = 0.9  # most mass where the target puts the least
        q[0, :] += 0.1 / vocab
        emp = _first_token_histogram(p, q, n, seed=6)
    else:
        emp = _first_token_histogram(p, None, n, seed=7, deterministic=int(p[0].argmin()))
    # with n=20000 and 8 categories, sampling noise in TV is ~0.01; a biased rule is off by far more
    assert _tv(emp, p[0]) < 0.02, (emp, p[0])


def test_rejection_detects_a_biased_rule():
    """The statistical check has teeth: always accepting the draft gives q, not p."""
    vocab, n = 8, 20000
    p = _random_probs(2, vocab, 11)
    q = torch.zeros(1, vocab)
    q[0, int(p[0].argmin())] = 1.0
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    for _ in range(n):
        counts[int(torch.multinomial(q[0], 1, generator=g))] += 1  # the biased "always accept" rule
    assert _tv(counts / n, p[0]) > 0.2


def _slow_rejection(p, draft, q, g):
    """Per-token reference of the same rule, consuming randomness in the same order."""
    k = len(draft)
    u = torch.rand(k, generator=g, dtype=torch.float32)
    for i in range(k):
        x = int(draft[i])
        qx = 1.0 if q is None else float(q[i, x])
        if not float(u[i]) * qx < float(p[i, x]):
            if q is None:
                residual = p[i].clone()
                residual[x] = 0
            else:
                residual = torch.clamp(p[i] - q[i], min=0)
            if float(residual.sum()) <= 0:
                residual = p[i]
            return i, int(torch.multinomial(residual, 1, generator=g))
    return k, int(torch.multinomial(p[k], 1, generator=g))


@pytest.mark.parametrize("seed", range(20))
def test_fast_matches_slow_reference(seed):
    k, vocab = 4, 10
    p, q = _random_probs(k + 1, vocab, seed), _random_probs(k, vocab, seed + 100)
    draft = torch.stack([torch.multinomial(q[i], 1, generator=torch.Generator().manual_seed(seed + i))[0] for i in range(k)])
    for probs in (q, None):
        fast = verify_rejection(p, draft, probs, torch.Generator().manual_seed(seed))
        slow = _slow_rejection(p, draft, probs, torch.Generator().manual_seed(seed))
        assert (fast.num_accepted, fast.next_token) == slow


def test_draft_equal_to_target_accepts_everything():
    k, vocab = 6, 12
    p = _random_probs(k + 1, vocab, 4)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        draft = torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i in range(k)])
        assert verify_rejection(p, draft, p[:k], g).num_accepted == k
