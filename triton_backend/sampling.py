"""Logits -> probabilities under temperature / top-k / top-p, applied identically to
the target (p) and the draft (q) so the rejection rule compares like with like."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_backend.config import SamplingParams


@dataclass(frozen=True)
class LogitsProcessor:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def from_params(cls, params: SamplingParams) -> "LogitsProcessor":
        return cls(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [n, vocab] -> probabilities [n, vocab] (float32).

        Greedy parameters give the one-hot distribution of the argmax."""
        if logits.ndim != 2:
            raise ValueError(f"expected logits of shape [n, vocab], got {tuple(logits.shape)}")
        logits = logits.float()
        if self.greedy:
            out = torch.zeros_like(logits)
            out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
            return out
        # shifted by the row's maximum first (softmax is shift-invariant): a tiny temperature then
        # sends the others to -inf instead of turning every logit into +-inf and the softmax into NaN
        temperature = max(self.temperature, torch.finfo(logits.dtype).tiny)  # 5e-324 is 0.0 in float32
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
        vocab = logits.shape[-1]
        if 0 < self.top_k < vocab:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token when the mass strictly before it already reaches top_p (the top-1 always stays)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop_sorted = mass_before >= self.top_p
            drop_sorted[..., 0] = False  # even when top_p rounds to 0 in float32
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a probability vector [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed % (2**63))
    return gen
