"""The drafter protocol.

A drafter proposes up to ``k`` tokens after the committed sequence. A chain proposal
is a list of tokens, with the draft's processed distributions ``q`` when it sampled
them (``None`` for deterministic proposals such as n-gram lookup, meaning one-hot).
``parents`` is reserved for tree proposals (Medusa): ``parents[i]`` is the index of
token ``i``'s parent in the proposal, ``-1`` for children of the last committed token;
``None`` means a chain. A tree's ``probs`` row ``i``, when given, is the distribution node
``i`` was drawn from (its parent's ``q``, shared by its siblings; an EAGLE tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from triton_backend.core.sampling import LogitsProcessor


@dataclass
class DraftProposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] processed q, or None (one-hot)
    parents: list[int] | None = None  # tree proposals only
    ranks: list[int] | None = None  # a drafted tree's nodes: place among their siblings (0: the drafter's first choice;
    # -1: not drawn by the drafter, a merged tree's n-gram node)
    lookup: list[bool] | None = None  # a merged tree: the nodes of the n-gram match's branch (merged_tree.py)
    scores: list[float] | None = None  # an EAGLE tree's node scores (greedy: each path's drafter log probability)

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"draft probs have {self.probs.shape[0]} rows for {len(self.tokens)} tokens")

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_PROPOSAL = DraftProposal(tokens=[])


@runtime_checkable
class DrafterSession(Protocol):
    def propose(self, tokens: Sequence[int], k: int, processor: LogitsProcessor,
                generator: torch.Generator | None) -> DraftProposal:
        """Up to ``k`` tokens to follow ``tokens`` (the committed sequence)."""

    def release(self) -> None: ...


class DraftCost(Protocol):
    """What the speculation controller needs of a drafter: its name and cost (the TensorRT-LLM
    runtime's draft engines are this, without sessions of their own)."""

    @property
    def name(self) -> str: ...

    @property
    def relative_cost(self) -> float:
        """Cost of drafting one token, relative to one target decoding step (for adaptive k)."""


@runtime_checkable
class Drafter(Protocol):
    name: str
    # cost of drafting one token, relative to one target decoding step (for adaptive k)
    relative_cost: float

    def new_session(self) -> DrafterSession: ...
