"""Drafting with a smaller causal LM that shares the target's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from triton_backend.speculation.drafters.protocol import DraftProposal
from triton_backend.engines.base import CausalLMEngine, EngineSession
from triton_backend.core.errors import VocabMismatchError
from triton_backend.core.runtime_config import DraftContext
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.engines.torch.llama_engine import SlotSession


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


@dataclass(frozen=True)
class TargetContext:
    """A draft over the target's own model taking the committed tokens' keys and values from the
    target's cache instead of running them itself: ``scope`` which positions (:class:`DraftContext`),
    ``layers`` the target layer of each draft layer (a layer-skip draft; None: the same layers)."""

    scope: DraftContext
    layers: tuple[int, ...] | None = None

    def limit(self, prompt_len: int, length: int) -> int:
        """Positions to take of a sequence of ``length`` committed tokens (the last one, never
        seen by the target, is always the draft's to run)."""
        return min(prompt_len, length - 1) if self.scope is DraftContext.PROMPT else length - 1


def doubtful(logits: torch.Tensor, q: torch.Tensor | None, stop_below: float) -> bool:
    """Whether a draft stops after this token: its own top-1 probability (of ``q`` when it sampled,
    else of the raw ``logits`` ``[1, vocab]``) is below ``stop_below`` (0: never)."""
    if stop_below <= 0.0:
        return False
    top = q.max() if q is not None else torch.softmax(logits[0].float(), -1).max()
    return float(top) < stop_below


class DraftModelSession:
    """One sequence's drafting on its own KV session of the draft engine."""

    def __init__(self, session: EngineSession, drafter: "DraftModelDrafter") -> None:
        self._session = session
        self._drafter = drafter

    @property
    def waits_for_target(self) -> bool:
        """The draft takes the prompt from the target: it cannot draft before the target's prefill."""
        return self._drafter.context is not None

    def take_context(self, target: EngineSession, tokens: Sequence[int], prompt_len: int) -> None:
        """Copy the keys and values of ``tokens`` that the drafter's context scope takes from
        ``target``'s session (nothing without a :class:`TargetContext`)."""
        context = self._drafter.context
        if context is None:
            return
        if not isinstance(self._session, SlotSession) or not isinstance(target, SlotSession):
            raise TypeError("a draft taking the target's context needs slot-engine sessions for both")
        self._session.adopt_prefix(target, tokens, context.limit(prompt_len, len(tokens)), context.layers)

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
            if doubtful(logits, q, self._drafter.stop_below):
                break
        probs = torch.stack(rows) if rows else None
        return DraftProposal(tokens=drafted, probs=probs)

    def release(self) -> None:
        self._session.release()


class DraftModelDrafter:
    """Autoregressive drafting with its own KV session, rolled back like the target's.
    ``context``: take the committed tokens' keys and values from the target's cache (a draft
    over the target's own model); ``stop_below``: end a round's draft after a token the draft
    gave a top-1 probability below this (0: never)."""

    def __init__(self, engine: CausalLMEngine, *, target: CausalLMEngine, relative_cost: float | None = None,
                 target_tokenizer: Any = None, draft_tokenizer: Any = None,
                 prior_acceptance: tuple[float, float] | None = None, context: TargetContext | None = None,
                 stop_below: float = 0.0) -> None:
        check_vocab_compatible(target_tokenizer, draft_tokenizer, target.vocab_size, engine.vocab_size)
        self.engine = engine
        self.name = f"draft:{engine.name}"
        if relative_cost is None:
            relative_cost = engine.num_parameters() / max(1, target.num_parameters())
        self.relative_cost = float(relative_cost)
        self.nominal_cost = self.relative_cost  # not from a load-time measurement (seeded sampling is priced by it)
        # the gain rule's starting acceptance (first position, later ones) for this drafter; None:
        # the draft-model type's (policy.PRIOR_ACCEPTANCE). A draft known to agree closely (the
        # target quantized) starts higher, or at its low cost it would never draft, so never learn.
        self.prior_acceptance = prior_acceptance
        self.context = None if context is None or context.scope is DraftContext.DRAFT else context
        self.stop_below = float(stop_below)

    def new_session(self) -> DraftModelSession:
        return DraftModelSession(self.engine.new_session(), self)
