"""End-of-sequence ids: the one place they are read and the one place a request's settings
apply to them.

A model names its EOS ids in its config and its generation config (an id or a list); a
tokenizer names one. :func:`eos_token_ids` reads them from any of these (loaded objects or
the JSON files' dicts). A request that ignores EOS stops at none of them
(:func:`stopping_eos`); ``min_tokens`` holds back EOS and the one-token stop sequences
(:func:`min_tokens_end_ids`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from triton_backend.core.config import SamplingParams


def eos_token_ids(*sources: object, tokenizer: Any = None) -> frozenset[int]:
    """The EOS ids named by ``sources`` (model configs, generation configs, or their JSON
    dicts; ``None`` entries are skipped); the tokenizer's when none names any."""
    ids: set[int] = set()
    for source in sources:
        value = source.get("eos_token_id") if isinstance(source, Mapping) else getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(t) for t in value)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def stopping_eos(params: SamplingParams, eos: Iterable[int]) -> frozenset[int]:
    """The EOS ids a request stops at: none when it ignores EOS."""
    return frozenset() if params.ignore_eos else frozenset(int(t) for t in eos)


def min_tokens_end_ids(params: SamplingParams, eos: Iterable[int]) -> list[int]:
    """What ``min_tokens`` holds back: EOS (unless ignored) and one-token stop sequences (end_id)."""
    return sorted(stopping_eos(params, eos)) + [seq[0] for seq in params.stop_token_ids if len(seq) == 1]


__all__ = ["eos_token_ids", "min_tokens_end_ids", "stopping_eos"]
