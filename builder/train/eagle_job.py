"""The jobs behind ``specbuild train-eagle`` and ``specbuild eval-eagle``: target data
(generated or resumed, with hidden states) -> training -> held-out acceptance in the real
loop -> a JSON report next to the drafter (and, when asked, the headline figures
``eagle_acceptance_pos1`` / ``eagle_tokens_per_pass`` from that measuring run). The drafter is
EAGLE-1 (a ``train-eagle`` file or folder) or EAGLE-3 (a ``train-eagle3`` or published folder), as
its files say (:mod:`triton_backend.core.drafter_format`); the report names which, and its path."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from builder.train.acceptance import AcceptanceReport, measure_acceptance
from builder.train.eagle import EagleTrainConfig, train_eagle
from builder.train.target_data import TargetDataConfig, generate_target_data
from builder.train.jobs import EvalConfig, _with_threads, _write  # the training jobs' helpers, shared

logger = logging.getLogger(__name__)

REPORT_NAME = "training_report.json"


@dataclass(frozen=True)
class EagleJob:
    data: TargetDataConfig
    heldout: TargetDataConfig
    train: EagleTrainConfig
    evaluation: EvalConfig | None = EvalConfig()
    headline: Path | None = None  # the headline file the held-out figures go to (None: not written)
    generate: bool = True  # False: train on the shards already there (a partial run's)
    threads: int = 1
    progress: bool = True


@dataclass(frozen=True)
class EagleEvalJob:
    eagle: str
    target: str
    evaluation: EvalConfig = EvalConfig()
    headline: Path | None = None  # the headline file the figures go to (None: not written)
    threads: int = 1


def drafter_identity(eagle: str | Path) -> dict[str, str]:
    """Which drafter a report measured: its path relative to the repository and its format."""
    from builder.report_paths import repo_path
    from triton_backend.core.drafter_format import detect_eagle_format

    return {"drafter": repo_path(Path(eagle).absolute()), "format": detect_eagle_format(eagle).value}


def drafter_folder(eagle: str | Path) -> Path:
    """The folder a drafter's reports go to: the drafter folder itself, or an EAGLE-1 file's folder."""
    return Path(eagle) if Path(eagle).is_dir() else Path(eagle).parent


def evaluate_eagle(target: str, eagle: str, evaluation: EvalConfig, *, headline: Path | None) -> AcceptanceReport:
    """Held-out greedy acceptance of the drafter (EAGLE-1 or EAGLE-3) in the real loop (fixed draft
    length, no fallback)."""
    from triton_backend.core.config import SpeculationMode
    from triton_backend.deployment.deployment_config import DeploymentConfig

    identity = drafter_identity(eagle)
    logger.info("measuring drafter %s (%s) on %d held-out prompts", identity["drafter"], identity["format"],
                evaluation.count)
    report = measure_acceptance(DeploymentConfig(target=target, eagle=eagle, ngram=False), evaluation.prompts(),
                                SpeculationMode.EAGLE, max_tokens=evaluation.max_tokens,
                                num_draft_tokens=evaluation.num_draft_tokens)
    if headline is not None and report.per_position:
        from builder.headline import update_headline

        # only the figures the issue names; the settings they were measured with go to acceptance.json
        update_headline({"eagle_acceptance_pos1": report.per_position[0], "eagle_tokens_per_pass": report.tokens_per_pass},
                        headline)
    return report


def run_train_eagle(job: EagleJob) -> dict[str, Any]:
    """Generate/resume training and held-out data, train the drafter, measure acceptance."""
    previous = _with_threads(job.threads)
    try:
        if job.generate:
            generate_target_data(job.data, progress=job.progress)
            generate_target_data(job.heldout, progress=job.progress)
        trained = train_eagle(job.train, progress=job.progress)
        acceptance = None
        if job.evaluation is not None:
            acceptance = evaluate_eagle(job.train.target, job.train.out, job.evaluation, headline=job.headline)
    finally:
        torch.set_num_threads(previous)
    report = {"training": asdict(trained), "settings": asdict(job.train), "summary": trained.summary(),
              "data": {"prompts_file": job.data.prompts_file or "packaged", "max_prompts": job.data.max_prompts,
                       "max_new_tokens": job.data.max_new_tokens},
              "acceptance": acceptance.to_dict() if acceptance else None}
    _write(Path(job.train.out).parent / REPORT_NAME, report)
    return report


def run_eval_eagle(job: EagleEvalJob) -> AcceptanceReport:
    """Measure, and write ``acceptance.json`` (naming the drafter and its format) next to the drafter."""
    previous = _with_threads(job.threads)
    try:
        report = evaluate_eagle(job.target, job.eagle, job.evaluation, headline=job.headline)
    finally:
        torch.set_num_threads(previous)
    _write(drafter_folder(job.eagle) / "acceptance.json",
           {**drafter_identity(job.eagle), "evaluation": asdict(job.evaluation), **report.to_dict()})
    return report


def eagle_bench_headline(summary: dict[str, Any], headline: Path) -> dict[str, float]:
    """``eagle_chat_x_plain`` from a ``specbuild bench --eagle`` run, merged into ``headline``
    (the run's own headline file, as every other key): the best EAGLE row's median chat
    throughput over plain decoding's, outputs identical."""
    rows = [e for e in summary["rows"] if e.get("method") == "eagle" and e["workload"] == "chat"
            and e.get("speedup_vs_plain") is not None and e.get("identical_to_plain")]
    if not rows:
        logger.warning("no EAGLE chat row with output identical to plain: headline not written")
        return {}
    best = max(rows, key=lambda e: e["speedup_vs_plain"])
    logger.info("eagle_chat_x_plain from the k=%d row of drafter %s (%s)", int(best["k"]), best.get("drafter", "?"),
                best.get("eagle_format", "?"))
    from builder.headline import device_keys
    from builder.headline import update_headline

    figures = device_keys({"eagle_chat_x_plain": float(best["speedup_vs_plain"])},
                          summary.get("environment", {}).get("device", "cpu"))
    update_headline(figures, headline)
    return figures
