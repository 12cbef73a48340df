"""The speculation controller: how many tokens to draft next, and when to stop speculating.

- Draft length: fixed ``k``, or adaptive: from an exponential moving average of the
  per-token acceptance rate ``a``, pick the ``k`` that maximises expected tokens per
  round ``E(a, k) = (1 - a^(k+1)) / (1 - a)`` over the round's cost
  ``1 + k * draft_cost + k * verify_cost`` (in target decoding steps); when even the best
  ``k`` is below break-even, fall back at once (a poor draft is dropped within a few rounds).
- Fallback: a sliding window of the last ``fallback_window`` drafted tokens' outcomes;
  once ``fallback_min_drafted`` are in it and speculation no longer pays, the request
  continues as plain decoding. "Pays" is, by default, break-even under the same cost model:
  the window's rounds committed at least as many tokens as plain decoding would have in
  the same time (tokens per round / round cost >= 1), so a free drafter (n-gram lookup)
  keeps speculating at acceptance rates that would sink an expensive draft model. An
  explicit ``fallback_threshold`` replaces that with a fixed acceptance rate. The decision
  is logged and reported in the generation statistics.
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
        self._rounds: deque[tuple[int, int]] = deque()  # (drafted, accepted) of the rounds in the window
        self.fallen_back = False

    def round_cost(self, k: int) -> float:
        """A round drafting ``k`` tokens, in target decoding steps."""
        return 1.0 + k * (self.draft_cost + self.config.verify_cost_per_token)

    def next_draft_length(self) -> int:
        """0 means: decode this step plainly."""
        cfg = self.config
        if self.fallen_back or cfg.num_draft_tokens == 0:
            return 0
        if not cfg.adaptive:
            return cfg.num_draft_tokens
        best_k, best_rate = cfg.min_draft_tokens, -1.0
        for k in range(cfg.min_draft_tokens, cfg.num_draft_tokens + 1):
            rate = expected_tokens_per_round(self.acceptance_ema, k) / self.round_cost(k)
            if rate > best_rate + 1e-9:
                best_k, best_rate = k, rate
        if cfg.fallback and cfg.fallback_threshold is None and best_rate < 1.0:
            # no draft length pays at the running acceptance: plain decoding is faster (break-even)
            self.fallen_back = True
            logger.info("speculation fallback: at running acceptance %.3f the best draft length (%d) commits "
                        "%.2fx the tokens of plain decoding per unit of time; continuing with plain decoding",
                        self.acceptance_ema, best_k, best_rate)
            return 0
        return best_k

    def window_acceptance(self) -> float | None:
        return sum(self._window) / len(self._window) if self._window else None

    def window_gain(self) -> float | None:
        """Tokens committed per unit of cost over the window's rounds (1.0: break-even with plain)."""
        if not self._rounds:
            return None
        tokens = sum(accepted + 1 for _, accepted in self._rounds)
        return tokens / sum(self.round_cost(drafted) for drafted, _ in self._rounds)

    def record(self, num_drafted: int, num_accepted: int) -> bool:
        """Record one verification round; returns True when this round triggered fallback."""
        if num_drafted <= 0:
            return False
        outcomes = [i < num_accepted for i in range(num_drafted)]
        self._window.extend(outcomes)
        self._rounds.append((num_drafted, num_accepted))
        while sum(d for d, _ in self._rounds) > self.config.fallback_window and len(self._rounds) > 1:
            self._rounds.popleft()
        rate = num_accepted / num_drafted
        self.acceptance_ema = self._ema_decay * self.acceptance_ema + (1 - self._ema_decay) * rate
        cfg = self.config
        if not cfg.fallback or self.fallen_back or len(self._window) < cfg.fallback_min_drafted:
            return False
        window_rate = self.window_acceptance()
        if cfg.fallback_threshold is not None:
            if window_rate is None or window_rate >= cfg.fallback_threshold:
                return False
            reason = f"acceptance {window_rate:.3f} is below {cfg.fallback_threshold:.3f}"
        else:
            gain = self.window_gain()
            if gain is None or gain >= 1.0:
                return False
            reason = (f"acceptance {window_rate:.3f} commits {gain:.2f}x the tokens of plain decoding per unit "
                      f"of time (break-even 1.0)")
        self.fallen_back = True
        logger.info("speculation fallback: over the last %d drafted tokens, %s; continuing with plain decoding",
                    len(self._window), reason)
        return True
