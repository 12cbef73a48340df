"""The two training jobs behind ``specbuild distill`` and ``specbuild train-medusa``:
target data (generated or resumed) -> training -> held-out acceptance in the real loop ->
a JSON report next to the artifact."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from builder.train.acceptance import AcceptanceReport, measure_acceptance
from triton_backend.core.errors import ConfigError
from builder.train.distill import DistillConfig, distill
from builder.train.medusa import MedusaTrainConfig, train_medusa
from builder.train.target_data import TargetDataConfig, default_prompts_file, generate_target_data, load_prompts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out acceptance: ``count`` prompts from ``prompts_file`` (default: the packaged
    held-out prompts, disjoint from the training prompts), greedy, ``max_tokens`` each."""

    prompts_file: str = ""
    count: int = 16
    max_tokens: int = 64
    num_draft_tokens: int = 4

    def prompts(self) -> list[str]:
        return load_prompts(self.prompts_file or default_prompts_file("heldout_prompts.txt"), self.count)


@dataclass(frozen=True)
class DistillJob:
    data: TargetDataConfig
    train: DistillConfig
    evaluation: EvalConfig | None = EvalConfig()
    threads: int = 1
    progress: bool = True


@dataclass(frozen=True)
class MedusaJob:
    data: TargetDataConfig
    heldout: TargetDataConfig
    train: MedusaTrainConfig
    evaluation: EvalConfig | None = EvalConfig()
    threads: int = 1
    progress: bool = True


MAX_THREADS = 1024


def _with_threads(threads: int) -> int:
    """Set torch's CPU threads; returns the previous count. A count torch cannot take is a
    ConfigError, not a traceback."""
    if not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"threads must be between 1 and {MAX_THREADS}, got {threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    return previous


def _acceptance(deployment: Any, evaluation: EvalConfig | None, mode: Any) -> AcceptanceReport | None:
    if evaluation is None:
        return None
    return measure_acceptance(deployment, evaluation.prompts(), mode, max_tokens=evaluation.max_tokens,
                              num_draft_tokens=evaluation.num_draft_tokens)


def run_distill(job: DistillJob) -> dict[str, Any]:
    """Generate/resume the data, train the draft, measure held-out acceptance; returns the report."""
    from triton_backend.core.config import SpeculationMode
    from triton_backend.deployment.deployment_config import DeploymentConfig

    previous = _with_threads(job.threads)
    try:
        generate_target_data(job.data, progress=job.progress)
        trained = distill(job.train, progress=job.progress)
        acceptance = _acceptance(DeploymentConfig(target=job.train.target, draft=job.train.out_dir, ngram=False),
                                 job.evaluation, SpeculationMode.DRAFT)
    finally:
        torch.set_num_threads(previous)
    report = {"training": trained.__dict__, "summary": trained.summary(),
              "acceptance": acceptance.to_dict() if acceptance else None}
    _write(Path(job.train.out_dir) / "distill_report.json", report)
    return report


def run_train_medusa(job: MedusaJob) -> dict[str, Any]:
    """Generate/resume training and held-out data, train the heads, measure acceptance."""
    from triton_backend.core.config import SpeculationMode
    from triton_backend.deployment.deployment_config import DeploymentConfig

    previous = _with_threads(job.threads)
    try:
        generate_target_data(job.data, progress=job.progress)
        generate_target_data(job.heldout, progress=job.progress)
        trained = train_medusa(job.train, progress=job.progress)
        acceptance = _acceptance(DeploymentConfig(target=job.train.target, medusa=job.train.out, ngram=False),
                                 job.evaluation, SpeculationMode.MEDUSA)
    finally:
        torch.set_num_threads(previous)
    report = {"training": {**trained.__dict__, "medusa_choices": [list(c) for c in trained.medusa_choices]},
              "summary": trained.summary(), "acceptance": acceptance.to_dict() if acceptance else None}
    _write(Path(job.train.out).with_suffix(".report.json"), report)
    return report


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    from builder.report_paths import portable

    path.write_text(json.dumps(portable(report), indent=2, default=str) + "\n")
    logger.info("report written to %s", path)
