"""Teacher-forced greedy agreement of an engine with a float32 baseline engine.

For each held-out prompt (chat template where the tokenizer has one) the baseline's greedy
continuation of ``max_tokens`` tokens; an engine then reads prompt + continuation in one pass
(teacher-forced) and its agreement is the share of those positions whose argmax is the
baseline's token. Every engine is a :class:`~triton_backend.engines.batch.BatchedEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from triton_backend.engines.batch import BatchRow

HELDOUT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "heldout_prompts.txt"


@dataclass(frozen=True)
class GreedyReference:
    """A prompt's token ids and the baseline's greedy continuation of it."""

    prompt: list[int]
    continuation: list[int]


def heldout_prompts(path: Path, count: int) -> list[str]:
    """The first ``count`` non-empty lines of ``path``."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip()][:count]


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a user turn through the chat template (plain text where there is none)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def greedy_references(base: Any, tokenizer: Any, prompts: Sequence[str], max_tokens: int) -> list[GreedyReference]:
    """``base``'s greedy continuation of each prompt (no stop at EOS: every position counts)."""
    out = []
    for text in prompts:
        ids = prompt_ids(tokenizer, text)
        slot = base.allocate()
        try:
            logits = base.forward([BatchRow(slot, 0, ids)])[0].logits
            continuation: list[int] = []
            for i in range(max_tokens):
                continuation.append(int(logits[-1].argmax()))
                if i + 1 < max_tokens:
                    logits = base.forward([BatchRow(slot, len(ids) + i, [continuation[-1]])])[0].logits
        finally:
            base.release(slot)
        out.append(GreedyReference(ids, continuation))
    return out


def teacher_forced_matches(engine: Any, reference: GreedyReference) -> int:
    """How many of ``reference.continuation``'s tokens are ``engine``'s argmax, teacher-forced."""
    sequence = reference.prompt + reference.continuation
    slot = engine.allocate()
    try:
        logits = engine.forward([BatchRow(slot, 0, sequence[:-1], num_logits=len(reference.continuation))])[0].logits
    finally:
        engine.release(slot)
    return sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), reference.continuation))


def greedy_agreement(engine: Any, references: Sequence[GreedyReference]) -> float:
    """Share of the references' positions where ``engine``'s argmax is the baseline's token."""
    total = sum(len(r.continuation) for r in references)
    if total == 0:
        raise ValueError("greedy agreement needs at least one reference token")
    return sum(teacher_forced_matches(engine, r) for r in references) / total


__all__ = ["GreedyReference", "HELDOUT_PROMPTS", "greedy_agreement", "greedy_references", "heldout_prompts",
           "prompt_ids", "teacher_forced_matches"]
