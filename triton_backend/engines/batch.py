"""The batched, slot-based engine contract: many sequences in one ragged forward pass.

An engine owns a KV cache of ``num_slots`` slots x ``max_context`` positions, preallocated
once. A sequence owns a slot (:meth:`BatchedEngine.allocate`) and writes its tokens into it
by position. Every row of a :meth:`BatchedEngine.forward` call names its slot, the position
of its first new token (``start``) and its new tokens; the row attends to the slot's
positions ``[0, start)`` plus its own new tokens (causally, or by a tree mask). ``start`` is
the sequence's committed length: rolling back rejected draft tokens is simply asking the
next row to start earlier -- nothing is copied, cropped or diffed. Positions at or after
``start`` that a previous call wrote are overwritten.

Row kinds in one call (ragged): decode (1 token), verify (k + 1 tokens: the last committed
token's successor slot plus k drafts), prefill (a prompt or a chunk of it, ``start`` = what
is cached), tree (the last committed token plus draft nodes; ``tree_parents`` gives the
nodes' parents, see :mod:`triton_backend.core.tree`). After a tree row, :meth:`keep_tree_path`
moves the accepted nodes' KV entries into place (the one compaction).

Implementations: :mod:`triton_backend.engines.torch.llama_engine` (a compact Llama-family forward
with a static cache; the default) and :mod:`triton_backend.engines.torch.hf_batched` (any Hugging
Face causal LM, one row at a time; the fallback for architectures the compact forward does
not cover).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from triton_backend.core.errors import SpecbuildError


class SlotsExhaustedError(SpecbuildError):
    """Every KV-cache slot of an engine is taken."""

    code = "overloaded"


@dataclass(frozen=True)
class BatchRow:
    """One sequence's share of a batched pass.

    ``tokens`` are written at positions ``start .. start + len(tokens) - 1`` of ``slot``.
    ``num_logits``: return logits (and hidden states, when asked) for the last
    ``num_logits`` new tokens (tree rows: usually ``1 + number of nodes``).
    ``tree_parents``: for a tree row, the parents of the LAST ``len(tree_parents)`` tokens
    (node indices, ``-1`` = child of the token just before the nodes); those nodes sit at
    position ``root + depth`` and see only their ancestors. ``None``: causal chain.
    ``return_logits=False`` (with ``return_hidden``): skip the LM head for this row (its
    output's ``logits`` is None); a tree verifier then pays the head only for the rows it
    visits, through :meth:`BatchedEngine.head_logits`.
    ``capture``: target layers whose outputs (layer ``i``'s output: Hugging Face's
    ``hidden_states[i + 1]``) the row's output returns, concatenated in this order, for the
    same last ``num_logits`` tokens (an EAGLE-3 drafter's fused features); ``()``: none, and
    the pass costs nothing more. Logits and hidden states do not depend on it.
    """

    slot: int
    start: int
    tokens: Sequence[int]
    num_logits: int = 1
    tree_parents: Sequence[int] | None = None
    return_hidden: bool = False
    return_logits: bool = True
    capture: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a batch row needs at least one token")
        if self.start < 0:
            raise ValueError(f"row start must be >= 0, got {self.start}")
        if not 1 <= self.num_logits <= len(self.tokens):
            raise ValueError(f"num_logits must be in [1, {len(self.tokens)}], got {self.num_logits}")
        if self.tree_parents is not None and len(self.tree_parents) >= len(self.tokens):
            raise ValueError("a tree row needs the root token before its nodes")
        if not (self.return_logits or self.return_hidden):
            raise ValueError("a row must return logits, hidden states or both")


@dataclass
class RowOutput:
    logits: torch.Tensor | None  # [num_logits, vocab] float32; None only when the row asked for none
    hidden: torch.Tensor | None = None  # [num_logits, hidden] last hidden states, when asked
    features: torch.Tensor | None = None  # [num_logits, len(capture) * hidden] the capture layers' outputs, when asked


@runtime_checkable
class BatchedEngine(Protocol):
    name: str
    vocab_size: int
    hidden_size: int
    max_context: int
    num_slots: int
    eos_token_ids: frozenset[int]

    def allocate(self) -> int:
        """A free slot (its committed length 0); :class:`SlotsExhaustedError` when none is left."""

    def release(self, slot: int) -> None:
        """Give the slot back (idempotent)."""

    def forward(self, rows: Sequence[BatchRow]) -> list[RowOutput]:
        """One pass over every row (each slot at most once); outputs in the rows' order."""

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: float32 ``[r, vocab]`` logits for last hidden states ``[r, hidden]``."""

    def keep_tree_path(self, slot: int, root_length: int, path: Sequence[int]) -> None:
        """After a tree row whose nodes started at position ``root_length``: keep the nodes
        ``path`` (root-to-leaf node indices) at ``root_length ..``; the rest is garbage."""

    def num_parameters(self) -> int:
        """Parameter count (relative cost estimates)."""

    def kv_cache_bytes(self) -> int:
        """Bytes the preallocated KV cache holds."""


@runtime_checkable
class PrefixSharing(Protocol):
    """A batched engine whose slots can share a prompt prefix: a new sequence whose prompt
    starts with another's committed tokens takes their keys and values instead of computing
    them again (a chat template's system prompt, shared by every request)."""

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        """Positions ``0 .. length - 1`` of slot ``source`` into slot ``destination`` (both allocated)."""


__all__ = ["BatchRow", "BatchedEngine", "PrefixSharing", "RowOutput", "SlotsExhaustedError"]
