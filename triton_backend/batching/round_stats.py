"""What the batch's rounds report: the observers told about every round and every admitted
request's prompt (metrics count there), and where the rounds' time went (logged every
:data:`TIMING_LOG_ROUNDS` rounds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

TIMING_LOG_ROUNDS = 256  # rounds between two timing lines in the log


@runtime_checkable
class RoundObserver(Protocol):
    """Told about every round. ``round_done`` runs on the scheduler thread every round: it
    must only count (no blocking I/O); ``flush`` publishes the counts (called elsewhere,
    every so often and before a request's last response)."""

    def round_done(self, batch_size: int, speculating_rows: int, draft_tokens: int, queued: int) -> None: ...
    def flush(self) -> None: ...


@runtime_checkable
class PrefixCacheObserver(Protocol):
    """Told, on the scheduler thread, where every admitted request's prompt came from: it must
    only count (published with the rounds' counts)."""

    def prefix_lookup(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None: ...


@dataclass
class RoundTiming:
    """Where the rounds' time went: the target pass against the whole round (planning,
    drafting, verification, commits and handing chunks to the clients)."""

    rounds: int = 0
    rows: int = 0
    speculating_rows: int = 0
    pass_s: float = 0.0
    round_s: float = 0.0

    def add(self, rows: int, speculating_rows: int, pass_s: float, round_s: float) -> None:
        self.rounds += 1
        self.rows += rows
        self.speculating_rows += speculating_rows
        self.pass_s += pass_s
        self.round_s += round_s

    def summary(self) -> str:
        n = max(1, self.rounds)
        return (f"{self.rounds} rounds of {self.rows / n:.1f} rows ({self.speculating_rows / n:.1f} speculating): "
                f"target pass {1e3 * self.pass_s / n:.1f} ms, round {1e3 * self.round_s / n:.1f} ms "
                f"({1e3 * (self.round_s - self.pass_s) / n:.1f} ms outside the pass)")


__all__ = ["PrefixCacheObserver", "RoundObserver", "RoundTiming", "TIMING_LOG_ROUNDS"]
