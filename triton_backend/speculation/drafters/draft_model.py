"""Drafting with a smaller causal LM that shares the target's tokenizer."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from triton_backend.speculation.drafters.base import DraftProposal
from triton_backend.engines.base import CausalLMEngine, EngineSession
from triton_backend.core.errors import VocabMismatchError
from triton_backend.core.sampling import LogitsProcessor


def check_vocab_compatible(target_tokenizer: Any, draft_tokenizer: Any, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft whose tokenizer or output vocabulary differs from the target's."""
    if target_vocab != draft_vocab:
        raise VocabMismatchError(
            f"draft model vocabulary ({draft_vocab} logits) differs from the target's ({target_vocab}); "
            "a draft must share the target's tokenizer"
        )
    if target_tokenizer is None or draft_tokenizer is None:
        return
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        differing = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise VocabMismatchError(
            f"draft tokenizer differs from the target's ({len(dv)} vs {len(tv)} entries; e.g. {differing}); "
            "a draft must share the target's tokenizer"
        )


class _DraftModelSession:
    def __init__(self, session: EngineSession) -> None:
        self._session = session

    def propose(self, tokens: Sequence[int], k: int, processor: LogitsProcessor,
                generator: torch.Generator | None) -> DraftProposal:
        seq = list(tokens)
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self._session.logits(seq, 1)  # [1, vocab]
            history = processor.rows(tokens, [drafted])  # the target's history at this position
            token, q = processor.draw(logits, None if history is None else history[0], generator)
            if q is not None:
                rows.append(q)
            drafted.append(token)
            seq.append(token)
        probs = torch.stack(rows) if rows else None
        return DraftProposal(tokens=drafted, probs=probs)

    def release(self) -> None:
        self._session.release()


class DraftModelDrafter:
    """Autoregressive drafting with its own KV session, rolled back like the target's."""

    def __init__(self, engine: CausalLMEngine, *, target: CausalLMEngine, relative_cost: float | None = None,
                 target_tokenizer: Any = None, draft_tokenizer: Any = None,
                 prior_acceptance: tuple[float, float] | None = None) -> None:
        check_vocab_compatible(target_tokenizer, draft_tokenizer, target.vocab_size, engine.vocab_size)
        self.engine = engine
        self.name = f"draft:{engine.name}"
        if relative_cost is None:
            relative_cost = engine.num_parameters() / max(1, target.num_parameters())
        self.relative_cost = float(relative_cost)
        # the gain rule's starting acceptance (first position, later ones) for this drafter; None:
        # the draft-model type's (policy.PRIOR_ACCEPTANCE). A draft known to agree closely (the
        # target quantized) starts higher, or at its low cost it would never draft, so never learn.
        self.prior_acceptance = prior_acceptance

    def new_session(self) -> _DraftModelSession:
        return _DraftModelSession(self.engine.new_session())
