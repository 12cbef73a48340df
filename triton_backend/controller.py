"""The speculation controller: how many tokens to draft next, and when to stop speculating.

- Draft length: fixed ``k``, or adaptive: from an exponential moving average of the
  per-token acceptance rate ``a``, pick the ``k`` that maximises expected tokens per
  round ``E(a, k) = (1 - a^(k+1)) / (1 - a)`` over the round's cost
  ``1 + k * draft_cost + k * verify_cost`` (in target decoding steps).
- Fallback: a sliding window of the last ``fallback_window`` drafted tokens' outcomes;
  once ``fallback_min_drafted`` are in it and the window's acceptance rate is below
  ``fallback_threshold``, the request continues as plain decoding. The decision is
  logged and reported in the generation statistics.
"""

from __future__ import annotations

import logging
from collections import deque

from triton_backend.config import SpeculationConfig

logger = logging.getLogger(__name__)


def expected_tokens_per_round(acceptance: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): expected tokens committed per target pass."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class SpeculationController:
    def __init__(self, config: SpeculationConfig, draft_cost: float, *, ema_decay: float = 0.8,
                 initial_acceptance: float = 0.7) -> None:
        self.config = config
        self.draft_cost = max(0.0, float(draft_cost))
        self._ema_decay = ema_decay
        self.acceptance_ema = initial_acceptance
        self._window: deque[bool] = deque(maxlen=config.fallback_window)
        self.fallen_back = False

    def next_draft_length(self) -> int:
        """0 means: decode this step plainly."""
        cfg = self.config
        if self.fallen_back or cfg.num_draft_tokens == 0:
            return 0
        if not cfg.adaptive:
            return cfg.num_draft_tokens
        best_k, best_rate = cfg.min_draft_tokens, -1.0
        for k in range(cfg.min_draft_tokens, cfg.num_draft_tokens + 1):
            cost = 1.0 + k * (self.draft_cost + cfg.verify_cost_per_token)
            rate = expected_tokens_per_round(self.acceptance_ema, k) / cost
            if rate > best_rate + 1e-9:
                best_k, best_rate = k, rate
        return best_k

    def window_acceptance(self) -> float | None:
        return sum(self._window) / len(self._window) if self._window else None

    def record(self, num_drafted: int, num_accepted: int) -> bool:
        """Record one verification round; returns True when this round triggered fallback."""
        if num_drafted <= 0:
            return False
        outcomes = [i < num_accepted for i in range(num_drafted)]
        self._window.extend(outcomes)
        rate = num_accepted / num_drafted
        self.acceptance_ema = self._ema_decay * self.acceptance_ema + (1 - self._ema_decay) * rate
        cfg = self.config
        if cfg.fallback and not self.fallen_back and len(self._window) >= cfg.fallback_min_drafted:
            window_rate = self.window_acceptance()
            if window_rate is not None and window_rate < cfg.fallback_threshold:
                self.fallen_back = True
                logger.info(
                    "speculation fallback: acceptance %.3f over the last %d drafted tokens is below %.3f; "
                    "continuing with plain decoding", window_rate, len(self._window), cfg.fallback_threshold,
                )
                return True
        return False
