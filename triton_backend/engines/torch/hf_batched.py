"""The batched engine contract over any Hugging Face causal LM: one DynamicCache per slot.

The fallback implementation of :class:`triton_backend.engines.batch.BatchedEngine` for
architectures the compact forward does not cover. :meth:`HFBatchedEngine.forward` runs its
rows one at a time (a ragged batch of per-slot passes); each row first crops its slot's
cache to ``start`` (rollback is bookkeeping: nothing before ``start`` is recomputed). Chain
rows run the causal LM as :meth:`TorchSession.logits` does; tree rows run the base model
with the tree attention inputs of :mod:`triton_backend.core.tree` as
:meth:`TorchSession.tree_hidden` does, so one request gives the same numbers through either.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from transformers import DynamicCache

from triton_backend.engines.batch import BatchRow, RowOutput, SlotsExhaustedError
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.core.errors import ContextLengthError
from triton_backend.engines.torch.tree_attention import compact_cache, tree_attention_inputs

logger = logging.getLogger(__name__)


class _Slot:
    """One sequence's cache; ``length`` = positions the cache holds."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.length = 0


class HFBatchedEngine:
    """``num_slots`` sequences of a :class:`TorchEngine`'s model (weights shared, not copied)."""

    def __init__(self, engine: TorchEngine, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.engine = engine
        self.model = engine.model
        self.name = engine.name
        self.vocab_size = engine.vocab_size
        self.hidden_size = int(self.model.config.hidden_size)
        self.max_context = engine.max_context
        self.num_slots = num_slots
        self.eos_token_ids = engine.eos_token_ids
        self._slots: dict[int, _Slot] = {}

    # -- slots --------------------------------------------------------------------------------
    def allocate(self) -> int:
        for slot in range(self.num_slots):
            if slot not in self._slots:
                self._slots[slot] = _Slot()
                return slot
        raise SlotsExhaustedError(f"all {self.num_slots} KV-cache slots of {self.name} are taken")

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def cached_length(self, slot: int) -> int:
        return self._state(slot).length

    def _state(self, slot: int) -> _Slot:
        state = self._slots.get(slot)
        if state is None:
            raise ValueError(f"slot {slot} of {self.name} is not allocated")
        return state

    # -- passes -------------------------------------------------------------------------------
    def forward(self, rows: Sequence[BatchRow]) -> list[RowOutput]:
        slots = [row.slot for row in rows]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one pass: {slots}")
        return [self._row(row) for row in rows]

    def _row(self, row: BatchRow) -> RowOutput:
        state = self._state(row.slot)
        end = row.start + len(row.tokens)
        if end > self.max_context:
            raise ContextLengthError(f"sequence of {end} tokens exceeds the model context of {self.max_context}")
        if row.start > state.length:
            raise ValueError(f"row starts at {row.start} but slot {row.slot} holds only {state.length} positions")
        if row.capture:
            raise ValueError("the Hugging Face-wrapped engine returns no capture-layer outputs (the slot engine does)")
        self._crop(state, row.start)
        input_ids = torch.tensor([list(row.tokens)], dtype=torch.long, device=self.engine.device)
        with torch.inference_mode():
            if row.tree_parents is None and not row.return_hidden:
                out = self.model(input_ids=input_ids, past_key_values=state.cache, use_cache=True,
                                 logits_to_keep=row.num_logits)
                state.length = end
                return RowOutput(out.logits[0, -row.num_logits:].float())
            hidden = self._hidden(state, row, input_ids)[-row.num_logits:]
            state.length = end
            logits = self.head_logits(hidden) if row.return_logits else None
            return RowOutput(logits, hidden if row.return_hidden else None)

    def _hidden(self, state: _Slot, row: BatchRow, input_ids: torch.Tensor) -> torch.Tensor:
        """Last hidden states ``[len(tokens), hidden]`` (tree attention for a tree row)."""
        parents = list(row.tree_parents or [])
        mask, positions = tree_attention_inputs(parents, row.start, len(row.tokens) - len(parents),
                                                self.model.dtype, self.engine.device)
        out = self.model.base_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                    past_key_values=state.cache, use_cache=True)
        return out.last_hidden_state[0]

    def _crop(self, state: _Slot, length: int) -> None:
        if state.cache is None or length == 0:
            state.cache = DynamicCache(config=self.model.config)  # DynamicCache.crop(0) keeps everything
        elif length < state.length:
            state.cache.crop(length)
        state.length = length

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.get_output_embeddings()(hidden).float()

    def keep_tree_path(self, slot: int, root_length: int, path: Sequence[int]) -> None:
        state = self._state(slot)
        if root_length > state.length:
            raise ValueError(f"tree root {root_length} is past slot {slot}'s {state.length} positions")
        if state.cache is not None and root_length > 0:
            compact_cache(state.cache, root_length, path)
        state.length = root_length + len(path)

    # -- sizes --------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return self.engine.num_parameters()

    def kv_cache_bytes(self) -> int:
        """Bytes the slots' caches hold now (they grow with the sequences; nothing is preallocated)."""
        layers = [layer for state in self._slots.values() if state.cache is not None for layer in state.cache.layers]
        tensors = [t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __repr__(self) -> str:
        return f"HFBatchedEngine({self.name!r}, slots={self.num_slots}, context={self.max_context})"


__all__ = ["HFBatchedEngine"]
