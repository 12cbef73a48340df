"""The engine protocol the speculative loop talks to.

An engine holds the weights; a session holds one sequence's KV cache. A session is
asked for logits of the last ``num_last`` positions of a token sequence; it keeps
whatever prefix of its cache still matches and runs only the rest, so rolling back
rejected draft tokens is bookkeeping (a committed length), never a recomputation of
the accepted prefix. The torch runtime's sessions also verify draft trees in one pass
(Medusa; EAGLE passes its chain as a one-branch tree): every session offers those calls.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class EngineSession(Protocol):
    pass_time_s: float  # seconds this session spent in the engine's passes and LM-head products

    def logits(self, tokens: Sequence[int], num_last: int) -> torch.Tensor:
        """Logits (float32, ``[num_last, vocab]``) predicting the token after each of the
        last ``num_last`` positions of ``tokens``. Afterwards the cache holds ``tokens``."""

    @property
    def cached_length(self) -> int:
        """How many tokens the KV cache holds now."""

    def release(self) -> None:
        """Free the KV cache."""

    def tree_hidden(self, tokens: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """One pass over the committed ``tokens`` and a draft tree (``parents``: see
        :mod:`triton_backend.core.tree`): last hidden states ``[1 + n, hidden]`` for the last
        committed token then each node. The nodes stay cached until :meth:`keep_tree_path`."""

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: float32 ``[r, vocab]`` logits for last hidden states ``[r, hidden]``."""

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """After :meth:`tree_hidden`: keep the committed tokens plus the nodes ``path``
        (root to leaf); drop the other nodes."""


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


@runtime_checkable
class FeatureSession(Protocol):
    """A session whose tree pass also returns target layers' outputs (an EAGLE-3 drafter's
    features): the slot engine's :class:`~triton_backend.engines.torch.llama_engine.SlotSession`."""

    def tree_features(self, tokens: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int],
                      capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`EngineSession.tree_hidden` ``[1 + n, hidden]`` and, from the same pass, the
        ``capture`` layers' outputs at those rows, concatenated ``[1 + n, len(capture) * hidden]``."""
