"""Verification as batched tensor ops on the target's device: one small result per round.

The rule is :mod:`~triton_backend.speculation.verify`'s, for every row of a batch at once, with no
host sync: each row ``r`` drafted ``num_drafts[r] <= K`` tokens (a padded ``[R, K]``), the target
scored ``K + 1`` positions, and the round returns ``[R, 2]`` int64: the **accepted** count and the
**next** token (the **recovered** token after a rejection, the **bonus** token after ``k``
accepts). The host copies that one tensor per round.

- :func:`greedy_accept`: the longest draft prefix equal to the target's argmax, then its argmax
  (identical to :func:`~triton_backend.speculation.verify.verify_greedy` row by row).
- :func:`rejection_accept`: exact rejection sampling (accept ``d_i`` with probability
  ``min(1, p_i(d_i) / q_i(d_i))``, recover from ``norm(max(0, p - q))``, bonus from ``p``);
  ``draft_probs=None`` is a deterministic drafter (one-hot ``q``).

Randomness is counter-based: a uniform is a hash of (the request's seed, a salt for what it
decides, the sequence position, the vocabulary lane), computed on the device (:func:`uniforms`).
A seeded request therefore draws the same numbers in any batch, bucket or graph replay, and no
generator state has to be carried through a CUDA graph. Sampling a token from a distribution
uses the exponential race (``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)`` independent), which is
exact for unnormalised ``p`` and needs no cumulative sum.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd, < 2^27: a 32-bit value times it stays within int64
ACCEPT_SALT = 0x1B873593
SAMPLE_SALT = 0x5BD1E995


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mix (values held in int64, always in ``[0, 2^32)``)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def uniforms(seeds: torch.Tensor, salt: int, *counters: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in ``(0, 1)``, one per element of the broadcast of ``seeds`` and
    ``counters`` (int64 tensors): a function of their values only, on their device."""
    h = _mix(((seeds ^ (seeds >> 32)) & _M32) ^ (salt & _M32))
    for c in counters:
        h = _mix(h ^ (c & _M32))
    return ((h >> 8).to(torch.float32) + 0.5) * (2.0 ** -24)


def sample_tokens(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[R, V]`` (non-negative, not necessarily normalised) for
    the row's ``seeds`` ``[R]`` at sequence ``positions`` ``[R]``: ``[R]`` int64."""
    lanes = torch.arange(probs.shape[1], device=probs.device)
    e = -torch.log(uniforms(seeds[:, None], SAMPLE_SALT, positions[:, None], lanes[None, :]))
    return (probs.float() / e).argmax(dim=1)


def _check(target: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor) -> tuple[int, int, int]:
    if target.ndim != 3 or draft_tokens.ndim != 2 or num_drafts.ndim != 1:
        raise ValueError(f"expected target [R, K+1, V], draft_tokens [R, K], num_drafts [R], got "
                         f"{tuple(target.shape)}, {tuple(draft_tokens.shape)}, {tuple(num_drafts.shape)}")
    R, K = draft_tokens.shape
    if target.shape[:2] != (R, K + 1) or num_drafts.shape[0] != R:
        raise ValueError(f"target {tuple(target.shape)} does not match draft_tokens {tuple(draft_tokens.shape)} "
                         f"and num_drafts {tuple(num_drafts.shape)}")
    if draft_tokens.dtype != torch.long or num_drafts.dtype != torch.long:
        raise ValueError("draft_tokens and num_drafts must be int64")
    return R, K, target.shape[2]


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """``[R]`` count of leading True per row of ``[R, K]``."""
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_accept(
    target_logits: torch.Tensor,  # [R, K+1, V]
    draft_tokens: torch.Tensor,  # [R, K] int64 (beyond num_drafts: anything)
    num_drafts: torch.Tensor,  # [R] int64, <= K
) -> torch.Tensor:
    """``[R, 2]`` int64: accepted count, then the target's argmax after the accepted drafts."""
    R, K, _ = _check(target_logits, draft_tokens, num_drafts)
    argmax = target_logits.argmax(dim=-1)  # [R, K+1]
    drafted = torch.arange(K, device=draft_tokens.device)[None, :] < num_drafts[:, None]
    accepted = _leading_true((argmax[:, :K] == draft_tokens) & drafted)
    return torch.stack([accepted, argmax.gather(1, accepted[:, None])[:, 0]], dim=1)


def rejection_accept(
    target_probs: torch.Tensor,  # [R, K+1, V] p, processed
    draft_tokens: torch.Tensor,  # [R, K] int64, drawn from q
    draft_probs: torch.Tensor | None,  # [R, K, V] q, processed; None: one-hot on draft_tokens
    num_drafts: torch.Tensor,  # [R] int64, <= K
    seeds: torch.Tensor,  # [R] int64: each request's seed
    positions: torch.Tensor,  # [R] int64: sequence position of each row's first draft token
) -> torch.Tensor:
    """``[R, 2]`` int64: accepted count and the next token, exactly as the rejection rule draws them."""
    R, K, V = _check(target_probs, draft_tokens, num_drafts)
    if draft_probs is not None and draft_probs.shape != (R, K, V):
        raise ValueError(f"draft_probs must be [{R}, {K}, {V}], got {tuple(draft_probs.shape)}")
    steps = torch.arange(K, device=draft_tokens.device)
    p_d = target_probs[:, :K].gather(2, draft_tokens[..., None])[..., 0]  # [R, K]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    u = uniforms(seeds[:, None], ACCEPT_SALT, positions[:, None] + steps[None, :])  # [R, K]
    accepted = _leading_true((u * q_d < p_d) & (steps[None, :] < num_drafts[:, None]))
    p_m = target_probs.gather(1, accepted[:, None, None].expand(R, 1, V))[:, 0]  # [R, V]
    dist = p_m
    if K:
        at = accepted.clamp(max=K - 1)
        if draft_probs is None:
            residual = p_m.scatter(1, draft_tokens.gather(1, at[:, None]), 0.0)
        else:
            residual = (p_m - draft_probs.gather(1, at[:, None, None].expand(R, 1, V))[:, 0]).clamp(min=0.0)
        # recovered from the residual after a rejection; where it is empty (p == q up to rounding) p itself is exact
        recover = (accepted < num_drafts) & (residual.sum(dim=1) > 0)
        dist = torch.where(recover[:, None], residual, p_m)
    return torch.stack([accepted, sample_tokens(dist, seeds, positions + accepted)], dim=1)


__all__ = ["ACCEPT_SALT", "SAMPLE_SALT", "greedy_accept", "rejection_accept", "sample_tokens", "uniforms"]
