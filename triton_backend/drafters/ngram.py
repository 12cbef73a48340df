"""N-gram / prompt lookup drafting: propose what followed the latest earlier occurrence
of the sequence's last n tokens (n from ``max_n`` down to ``min_n``). No model, no cost."""

from __future__ import annotations

from typing import Sequence

import torch

from triton_backend.drafters.base import EMPTY_PROPOSAL, DraftProposal
from triton_backend.sampling import LogitsProcessor


def find_ngram_continuation(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The up-to-``k`` tokens after the most recent earlier match of the longest suffix
    n-gram (``max_n`` >= n >= ``min_n``); empty when nothing matches."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n:])
        last = suffix[-1]
        # a match ends at position j (exclusive) < length; newest first
        for end in range(length - 1, n - 1, -1):
            if tokens[end - 1] == last and list(tokens[end - n:end]) == suffix:
                continuation = list(tokens[end:end + k])
                if continuation:
                    return continuation
    return []


class _NgramSession:
    def __init__(self, drafter: "NgramDrafter") -> None:
        self._drafter = drafter

    def propose(self, tokens: Sequence[int], k: int, processor: LogitsProcessor,
                generator: torch.Generator | None) -> DraftProposal:
        found = find_ngram_continuation(tokens, k, self._drafter.min_n, self._drafter.max_n)
        return DraftProposal(tokens=found) if found else EMPTY_PROPOSAL

    def release(self) -> None:
        pass


class NgramDrafter:
    name = "ngram"
    relative_cost = 0.0

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def new_session(self) -> _NgramSession:
        return _NgramSession(self)
