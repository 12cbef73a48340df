"""Perplexity of an engine on a held-out text: ``exp`` of the mean next-token negative
log-likelihood over the text's tokens, read in windows of at most ``window`` tokens (each window
starts a fresh context; its first token is context only)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from triton_backend.engines.batch import BatchRow

HELDOUT_TEXT = Path(__file__).resolve().parents[1] / "data" / "heldout_text.txt"


def text_windows(tokenizer: Any, text: str, max_tokens: int, window: int) -> list[list[int]]:
    """The first ``max_tokens`` tokens of ``text`` in consecutive windows of ``window`` tokens
    (a last window shorter than two tokens is dropped: it predicts nothing)."""
    if window < 2 or max_tokens < 2:
        raise ValueError("perplexity needs windows and a text of at least 2 tokens")
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) >= 2]


def perplexity(engine: Any, windows: Sequence[list[int]]) -> tuple[float, int]:
    """``(perplexity, predicted tokens)`` of ``engine`` over ``windows``."""
    nll, count = 0.0, 0
    for ids in windows:
        slot = engine.allocate()
        try:
            logits = engine.forward([BatchRow(slot, 0, ids[:-1], num_logits=len(ids) - 1)])[0].logits
        finally:
            engine.release(slot)
        logp = torch.log_softmax(logits.double(), dim=-1)  # [len - 1, vocab]
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
    if count == 0:
        raise ValueError("perplexity needs at least one predicted token")
    return math.exp(nll / count), count


__all__ = ["HELDOUT_TEXT", "perplexity", "text_windows"]
