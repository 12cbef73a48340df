"""The engine protocol the speculative loop talks to.

An engine holds the weights; a session holds one sequence's KV cache. A session is
asked for logits of the last ``num_last`` positions of a token sequence; it keeps
whatever prefix of its cache still matches and runs only the rest, so rolling back
rejected draft tokens is bookkeeping (a committed length), never a recomputation of
the accepted prefix.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class EngineSession(Protocol):
    def logits(self, tokens: Sequence[int], num_last: int) -> torch.Tensor:
        """Logits (float32, ``[num_last, vocab]``) predicting the token after each of the
        last ``num_last`` positions of ``tokens``. Afterwards the cache holds ``tokens``."""

    @property
    def cached_length(self) -> int:
        """How many tokens the KV cache holds now."""

    def release(self) -> None:
        """Free the KV cache."""


@runtime_checkable
class CausalLMEngine(Protocol):
    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]

    def new_session(self) -> EngineSession:
        """A fresh, empty KV session for one sequence."""

    def num_parameters(self) -> int:
        """Parameter count (for relative cost estimates)."""
