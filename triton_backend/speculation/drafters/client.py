"""Drafts a client sends with its request (TensorRT-LLM's draft-target API on ``tensorrt_llm``:
``draft_input_ids``, optionally ``draft_logits``), for client-side draft-target orchestration
(one server drafts, another verifies).

The target verifies them in the request's first round, exactly as it verifies its own drafter's
(:mod:`triton_backend.speculation.verify`): greedy, the longest prefix equal to its argmax;
sampling, the rejection rule. Without ``draft_logits`` a draft counts as one-hot, which keeps
the target's distribution whatever produced the drafts; with them, ``q`` is the draft logits
processed with the request's own sampling settings, so the output is the target's distribution
when the drafts were drawn from that ``q`` (a draft token ``q`` gives no probability to falls
back to one-hot). Later rounds decode plainly, up to the request's ``max_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from triton_backend.core.errors import InvalidRequestError
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.speculation.drafters.protocol import EMPTY_PROPOSAL, DraftProposal

METHOD = "client"  # GenerationStats.method of a request verifying client drafts


@dataclass(frozen=True)
class ClientDraft:
    """``tokens``: the draft token ids; ``logits``: the draft model's raw logits for them,
    ``[len(tokens), vocab]`` float32, or ``None`` (verified one-hot)."""

    tokens: tuple[int, ...]
    logits: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.tokens or any(t < 0 for t in self.tokens):
            raise InvalidRequestError("draft_input_ids must be token ids >= 0 (at least one)")
        if self.logits is not None:
            if self.logits.ndim != 2 or self.logits.shape[0] != len(self.tokens):
                raise InvalidRequestError(f"draft_logits must be [{len(self.tokens)}, vocab] (one row per draft "
                                          f"token), got {list(self.logits.shape)}")
            if not np.isfinite(self.logits).all():
                raise InvalidRequestError("draft_logits must be finite")

    def check_vocab(self, vocab_size: int) -> None:
        if any(t >= vocab_size for t in self.tokens):
            raise InvalidRequestError(f"draft_input_ids must be < the vocabulary size ({vocab_size})")
        if self.logits is not None and self.logits.shape[1] != vocab_size:
            raise InvalidRequestError(f"draft_logits rows must have {vocab_size} entries (the target's vocabulary), "
                                      f"got {self.logits.shape[1]}")


class ClientDraftSession:
    """Proposes the client's drafts once, right after the prompt (``prompt_len`` tokens
    committed); nothing afterwards."""

    def __init__(self, draft: ClientDraft, prompt_len: int) -> None:
        self.draft = draft
        self.prompt_len = prompt_len
        self.used = False

    @property
    def pending(self) -> int:
        """Draft tokens still to verify (all of them until the first round, then none)."""
        return 0 if self.used else len(self.draft.tokens)

    def propose(self, tokens: Sequence[int], k: int, processor: LogitsProcessor,
                generator: torch.Generator | None) -> DraftProposal:
        if self.used or k <= 0 or len(tokens) != self.prompt_len:
            return EMPTY_PROPOSAL
        self.used = True
        drafts = list(self.draft.tokens[:k])
        if self.draft.logits is None or processor.greedy:
            return DraftProposal(drafts)
        histories = processor.chain_rows(tokens, drafts)
        q = processor.probs(torch.from_numpy(np.ascontiguousarray(self.draft.logits[:len(drafts)], np.float32)),
                            None if histories is None else histories[:len(drafts)])
        if bool((q[torch.arange(len(drafts)), torch.tensor(drafts)] <= 0).any()):
            return DraftProposal(drafts)  # not drawn from this q: verified one-hot, which is exact for any draft
        return DraftProposal(drafts, q)

    def release(self) -> None:
        pass


__all__ = ["METHOD", "ClientDraft", "ClientDraftSession"]
