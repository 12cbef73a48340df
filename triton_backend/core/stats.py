"""Per-generation statistics, filled in by the loop as it runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    method: str = "off"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0  # target forward passes (prefill included in the first)
    speculative_rounds: int = 0  # passes that verified at least one drafted token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    fallback: bool = False
    fallback_at_token: int | None = None  # generated-token index at which fallback happened
    draft_lengths: list[int] = field(default_factory=list)  # k used per speculative round
    time_to_first_token_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    # the target's passes alone (forward and LM head; the single-request loop's, 0 where rows share
    # a batched pass): total_time_s - target_pass_time_s is what a round costs beyond them
    target_pass_time_s: float = 0.0
    total_time_s: float = 0.0

    def record_fallback(self, at_token: int) -> None:
        """The request switched to plain decoding at generated-token index ``at_token`` (the first call counts)."""
        if not self.fallback:
            self.fallback = True
            self.fallback_at_token = at_token

    def record_round(self, num_drafted: int, num_accepted: int) -> None:
        self.target_passes += 1
        if num_drafted == 0:
            return
        self.speculative_rounds += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.draft_lengths.append(num_drafted)
        while len(self.drafted_per_position) < num_drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean accepted draft tokens per speculative round."""
        return self.accepted_tokens / self.speculative_rounds if self.speculative_rounds else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_target_pass=self.tokens_per_target_pass,
            per_position_acceptance=self.per_position_acceptance,
            tokens_per_second=self.tokens_per_second,
        )
        return out

    def summary(self) -> str:
        line = (
            f"{self.generated_tokens} tokens in {self.total_time_s:.2f}s ({self.tokens_per_second:.1f} tok/s), "
            f"method={self.method}, target passes={self.target_passes} "
            f"({self.tokens_per_target_pass:.2f} tokens/pass)"
        )
        if self.drafted_tokens:
            line += (
                f", acceptance={self.acceptance_rate:.3f} ({self.accepted_tokens}/{self.drafted_tokens}), "
                f"mean accepted length={self.mean_accepted_length:.2f}"
            )
        if self.fallback:
            line += f", fell back to plain decoding at token {self.fallback_at_token}"
        return line
