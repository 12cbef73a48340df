"""Which sequences prefill a chunk of their prompt this round and which run a round (draft +
verify): the round's prompt-token budget is shared out in batch order, so a long prompt is split
over rounds instead of stalling every other row for one long pass."""

from __future__ import annotations

from typing import Sequence

from triton_backend.batching.batch_round import BatchSequence, PlannedRow
from triton_backend.engines.batch import BatchRow


def split_rows(active: Sequence[BatchSequence], budget: int) -> tuple[list[BatchRow], list[PlannedRow]]:
    """Prefill chunks for prompts longer than what is left of the round's ``budget`` (prompt
    tokens); a round (draft + verify) for every other sequence. A prompt that fits what is left
    rides whole in its planned row; an EAGLE prompt always does (it feeds the drafter's features
    whole, no chunks)."""
    prefill: list[BatchRow] = []
    planned: list[PlannedRow] = []
    for seq in active:
        pending = seq.pending()
        if pending <= 1 or seq.eagle is not None:
            budget -= pending if pending > 1 else 0
            planned.append(PlannedRow(seq, 0))
        elif pending <= budget:
            budget -= pending
            planned.append(PlannedRow(seq, 0))
        elif budget > 0:
            row = seq.prefill_row(budget)
            budget -= len(row.tokens)
            prefill.append(row)
    return prefill, planned


__all__ = ["split_rows"]
