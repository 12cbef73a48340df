"""A learning-rate schedule that finishes on time: linear warm-up, then cosine decay to zero,
driven by whichever is further along, the step count or the wall-clock budget. A run cut
short by its time limit therefore still ends with a small learning rate."""

from __future__ import annotations

import math
import time

import torch


class TimedCosine:
    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, time_limit_s: float,
                 warmup: float = 0.05) -> None:
        self.optimizer = optimizer
        self.total_steps = max(1, total_steps)
        self.time_limit_s = time_limit_s
        self.warmup = warmup
        self.start = time.monotonic()
        self.steps = 0
        self.base = [group["lr"] for group in optimizer.param_groups]
        self._apply()

    def progress(self) -> float:
        return min(1.0, max(self.steps / self.total_steps, (time.monotonic() - self.start) / self.time_limit_s))

    def factor(self) -> float:
        p = self.progress()
        if p < self.warmup:
            return max(0.05, p / self.warmup)
        return 0.5 * (1 + math.cos(math.pi * (p - self.warmup) / (1 - self.warmup)))

    @property
    def done(self) -> bool:
        return self.progress() >= 1.0

    def step(self) -> None:
        self.steps += 1
        self._apply()

    def _apply(self) -> None:
        f = self.factor()
        for group, base in zip(self.optimizer.param_groups, self.base):
            group["lr"] = base * f
