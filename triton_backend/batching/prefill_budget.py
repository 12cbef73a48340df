"""How many prompt tokens a round may prefill, from the target's pass costs and the decode load.

A prompt alone in the batch prefills in large chunks (``prefill_chunk_tokens`` a round): nothing
waits for it. Beside running decode rows, every prompt token in the pass slows those streams
down; so the prompt tokens added to the pass are sized from the target's pass-cost model
(:class:`~triton_backend.speculation.cost_model.PassCostModel`, measured at load where the
deployment measured it) so that the pass costs at most ``slowdown`` times the decode-only pass:
the running streams keep about ``1 / slowdown`` of their rate while a long prompt arrives, and
the prompt still moves on by at least one token a round. The split of the prompt over passes
does not change any output (the engine's rows are exact however a prompt is chunked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from triton_backend.core.errors import InvalidRequestError
from triton_backend.speculation.cost_model import PassCostModel


@dataclass(frozen=True)
class PrefillBudget:
    """``chunk_tokens``: the most prompt tokens a round prefills (all of them when no decode row
    runs); ``slowdown``: the most a pass carrying prompt tokens may cost over the decode-only pass
    of the same decode rows (a factor > 1; None: no load-adaptive sizing, ``chunk_tokens`` always)."""

    chunk_tokens: int
    slowdown: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_tokens, int) or isinstance(self.chunk_tokens, bool) or self.chunk_tokens < 1:
            raise InvalidRequestError(f"prefill_chunk_tokens must be a positive integer, got {self.chunk_tokens!r}")
        check_slowdown(self.slowdown)

    def tokens(self, decode_rows: int, cost_model: PassCostModel) -> int:
        """Prompt tokens the next round may prefill beside ``decode_rows`` running rows: the most
        (up to ``chunk_tokens``, at least 1) for which the pass of those rows at one token each
        plus one row of the prompt tokens costs at most ``slowdown`` times the pass without it."""
        if self.slowdown is None or decode_rows <= 0:
            return self.chunk_tokens
        decode = [1] * decode_rows
        limit = self.slowdown * cost_model.pass_cost(decode)
        lo, hi = 1, self.chunk_tokens  # a pass's cost never falls as its tokens grow: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost_model.pass_cost(decode + [mid]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo


def check_slowdown(value: object) -> None:
    """A ``prefill_slowdown`` setting: None (off) or a finite number above 1."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 1.0:
        raise InvalidRequestError(f"prefill_slowdown must be a number above 1 (or null: off), got {value!r}")


__all__ = ["PrefillBudget", "check_slowdown"]
