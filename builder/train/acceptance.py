"""Held-out acceptance: the real speculative loop on prompts the drafter never trained on."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationMode
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.deployment.deployment_config import DeploymentConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcceptanceReport:
    mode: str
    prompts: int
    generated_tokens: int
    target_passes: int
    drafted_tokens: int
    accepted_tokens: int
    draft_ms_per_round: float
    per_position: tuple[float, ...]  # [i]: share of rounds whose first i + 1 drafted tokens were all accepted
    verify_ms_per_pass: float
    seconds: float

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "acceptance_rate": self.acceptance_rate, "tokens_per_pass": self.tokens_per_pass}

    def summary(self) -> str:
        return (f"{self.mode}: held-out acceptance {self.acceptance_rate:.3f} ({self.accepted_tokens}/{self.drafted_tokens}) "
                f"over {self.prompts} prompts (per position {', '.join(f'{a:.2f}' for a in self.per_position)}), "
                f"{self.tokens_per_pass:.2f} tokens per target pass, "
                f"draft {self.draft_ms_per_round:.1f} ms/round, verify {self.verify_ms_per_pass:.1f} ms/pass")


def measure_acceptance(deployment: DeploymentConfig, prompts: list[str], mode: SpeculationMode, *,
                       max_tokens: int = 64, num_draft_tokens: int = 4, chat: bool = True,
                       sampling: SamplingParams | None = None, decoder: Any = None) -> AcceptanceReport:
    """Generate for each prompt with ``mode`` (no fallback) and add up the loop's statistics."""
    decoder = decoder or build_decoder(deployment)
    spec = replace(deployment.speculation, method=mode, fallback=FallbackConfig(enabled=False),
                   draft_length=DraftLengthConfig(num_draft_tokens=num_draft_tokens))
    params = sampling or SamplingParams(max_tokens=max_tokens)
    totals = dict(generated=0, passes=0, drafted=0, accepted=0, rounds=0, draft_s=0.0, verify_s=0.0, total_s=0.0)
    drafted_at: list[int] = []
    accepted_at: list[int] = []
    for prompt in prompts:
        text = prompt
        if chat and getattr(decoder.tokenizer, "chat_template", None):
            text = decoder.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True, tokenize=False)
        stats = decoder.generate(text, params, spec).stats
        totals["generated"] += stats.generated_tokens
        totals["passes"] += stats.target_passes
        totals["drafted"] += stats.drafted_tokens
        totals["accepted"] += stats.accepted_tokens
        totals["rounds"] += stats.speculative_rounds
        totals["draft_s"] += stats.draft_time_s
        totals["verify_s"] += stats.verify_time_s
        totals["total_s"] += stats.total_time_s
        for i, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
            if i == len(drafted_at):
                drafted_at.append(0)
                accepted_at.append(0)
            drafted_at[i] += d
            accepted_at[i] += a
    report = AcceptanceReport(
        mode=mode.value, prompts=len(prompts), generated_tokens=totals["generated"], target_passes=totals["passes"],
        drafted_tokens=totals["drafted"], accepted_tokens=totals["accepted"],
        draft_ms_per_round=1000 * totals["draft_s"] / max(1, totals["rounds"]),
        per_position=tuple(a / d for a, d in zip(accepted_at, drafted_at) if d),
        verify_ms_per_pass=1000 * totals["verify_s"] / max(1, totals["passes"]), seconds=totals["total_s"])
    logger.info("%s", report.summary())
    return report
