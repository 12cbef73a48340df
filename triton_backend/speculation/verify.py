"""Verification of drafted tokens against the target: short pure functions over tensors.

Vocabulary, per verification round over draft tokens ``d_1..d_k``:

- **accepted** tokens: the leading drafts the target keeps. Greedy: ``d_i`` equals the
  target's argmax at that position. Sampling (Leviathan et al. 2023; Chen et al. 2023):
  ``d_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``.
- **recovered** token: at the first rejected position ``i``, a token drawn from the
  residual ``norm(max(0, p_i - q_i))`` (greedy: the target's argmax there).
- **bonus** token: when all ``k`` drafts are accepted, one more token drawn from the
  target's distribution after ``d_k`` (greedy: its argmax).

Each round therefore commits ``num_accepted + 1`` tokens and the output distribution is
exactly the target's. ``p`` and ``q`` must be computed with the same temperature /
top-k / top-p (see :mod:`triton_backend.core.sampling`). A deterministic drafter (n-gram
lookup) passes ``q = None``, meaning one-hot on its proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_backend.core.sampling import sample


@dataclass(frozen=True)
class VerifyResult:
    num_drafted: int  # k
    num_accepted: int
    next_token: int  # the recovered token (num_accepted < k) or the bonus token (num_accepted == k)

    @property
    def bonus(self) -> bool:
        return self.num_accepted == self.num_drafted


def _check(target: torch.Tensor, draft_tokens: torch.Tensor) -> int:
    if target.ndim != 2 or draft_tokens.ndim != 1:
        raise ValueError(f"expected target [k+1, vocab] and draft_tokens [k], got {tuple(target.shape)} and {tuple(draft_tokens.shape)}")
    k = draft_tokens.shape[0]
    if target.shape[0] != k + 1:
        raise ValueError(f"target has {target.shape[0]} rows for {k} draft tokens; expected {k + 1}")
    return k


def _first_false(flags: torch.Tensor) -> int:
    """Index of the first False in a bool vector, or its length when all are True."""
    return int(torch.cumprod(flags.to(torch.int64), 0).sum().item()) if flags.numel() else 0


def verify_greedy(
    target_logits: torch.Tensor,  # [k+1, vocab]
    draft_tokens: torch.Tensor,  # [k] int64
) -> VerifyResult:
    """Accept the longest draft prefix equal to the target's argmax; then one target token."""
    k = _check(target_logits, draft_tokens)
    argmax = target_logits.argmax(dim=-1)  # [k+1]
    m = _first_false(argmax[:k] == draft_tokens)
    return VerifyResult(k, m, int(argmax[m].item()))


def verify_rejection(
    target_probs: torch.Tensor,  # [k+1, vocab] p, processed
    draft_tokens: torch.Tensor,  # [k] int64, drawn from q
    draft_probs: torch.Tensor | None,  # [k, vocab] q, processed; None = one-hot on draft_tokens
    generator: torch.Generator | None,
) -> VerifyResult:
    """Exact rejection sampling: output tokens are distributed as the target's ``p``."""
    k = _check(target_probs, draft_tokens)
    rows = torch.arange(k)
    p_d = target_probs[rows, draft_tokens]  # [k]
    if draft_probs is None:
        q_d = torch.ones(k, dtype=target_probs.dtype)
    else:
        if draft_probs.shape != (k, target_probs.shape[1]):
            raise ValueError(f"draft_probs must be [{k}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}")
        q_d = draft_probs[rows, draft_tokens]
    u = torch.rand(k, generator=generator, dtype=torch.float32)
    m = _first_false(u * q_d < p_d)  # accept d_i with probability min(1, p/q)
    if m == k:
        return VerifyResult(k, k, sample(target_probs[k], generator))
    p = target_probs[m]
    if draft_probs is None:
        residual = p.clone()
        residual[draft_tokens[m]] = 0.0
    else:
        residual = torch.clamp(p - draft_probs[m], min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q here (up to rounding): the residual is undefined, p itself is exact
        residual = p
    return VerifyResult(k, m, sample(residual, generator))
