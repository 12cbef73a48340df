"""``specbuild bench perf-analyzer``: NVIDIA's perf_analyzer against a real Triton server
serving the deployment, through the tensorrtllm_backend model name (``ensemble``, gRPC
streaming, by default): one row per concurrency level (requests/s, p50 / p99 latency) from
perf_analyzer's own CSV, written as JSON and Markdown beside the other bench results.
perf_analyzer comes from ``scripts/get_perf_analyzer.sh``; without it the command fails
with that hint (:class:`builder.ops.perf_analyzer.PerfAnalyzerError`)."""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from builder.bench.config import DEFAULT_OUT, DEFAULT_PROMPTS, BenchConfig
from builder.bench.writer import ReportTarget
from builder.ops.perf_analyzer import PerfAnalyzerRun, PerfRow, run_perf_analyzer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PerfAnalyzerBenchConfig:
    target: str = BenchConfig.target
    model: str = "ensemble"  # a tensorrtllm_backend front model (ensemble / tensorrt_llm_bls)
    streaming: bool = True  # gRPC streaming (decoupled_mode true); false: infer (decoupled_mode false)
    concurrency: tuple[int, ...] = (1, 2, 4)
    prompts_file: Path = DEFAULT_PROMPTS
    workloads: tuple[str, ...] = ("chat", "code", "copy")
    prompts_per_workload: int = 5
    max_tokens: int = 64
    requests_per_window: int = 8
    max_trials: int = 5
    num_threads: int = 1
    out_dir: Path = DEFAULT_OUT
    label: str = "cpu"
    max_batch_size: int = 16  # the serving model's scheduler slots


def _prompts(config: PerfAnalyzerBenchConfig) -> list[str]:
    bench = BenchConfig(prompts_file=config.prompts_file, workloads=config.workloads,
                        prompts_per_workload=config.prompts_per_workload)
    return [p for w in config.workloads for p in bench.load_prompts().get(w, [])]


@dataclass(frozen=True)
class PerfAnalyzerResult:
    config: PerfAnalyzerBenchConfig
    rows: list[PerfRow]


def run_perf_analyzer_bench(config: PerfAnalyzerBenchConfig) -> PerfAnalyzerResult:
    """Serve the target on loopback (free ports) and run perf_analyzer at each concurrency."""
    from builder.stages.model_repository import render_model_repository
    from triton_backend.serving.launch.triton_server import ServerConfig, TritonServer
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.serving.interface import ServingConfig

    prompts = _prompts(config)
    if not prompts:
        raise ValueError(f"no prompts for workloads {config.workloads} in {config.prompts_file}")
    deployment = DeploymentConfig(target=config.target, runtime=RuntimeConfig(num_threads=config.num_threads))
    with tempfile.TemporaryDirectory(prefix="specbuild-perf-") as work:
        repository = render_model_repository(deployment, Path(work) / "model_repo",
                                             ServingConfig(max_batch_size=config.max_batch_size,
                                                           decoupled_mode=config.streaming))
        with TritonServer(ServerConfig(repository, exit_timeout_s=10, log_file=Path(work) / "triton.log")) as server:
            assert server.endpoints is not None
            run = PerfAnalyzerRun(server.endpoints.grpc_url, config.model, prompts, max_tokens=config.max_tokens,
                                  concurrency=config.concurrency, streaming=config.streaming,
                                  requests_per_window=config.requests_per_window, max_trials=config.max_trials)
            return PerfAnalyzerResult(config, [
                row for level in config.concurrency
                for row in run_perf_analyzer(PerfAnalyzerRun(**{**asdict(run), "concurrency": (level,)}))])


def to_markdown(rows: list[PerfRow], config: PerfAnalyzerBenchConfig) -> str:
    lines = [f"perf_analyzer -> `{config.model}` ({'gRPC streaming' if config.streaming else 'gRPC'}), "
             f"max_tokens {config.max_tokens}, target {config.target}", "",
             "| concurrency | requests/s | p50 latency (ms) | p99 latency (ms) |", "|---:|---:|---:|---:|"]
    lines += [f"| {r.concurrency} | {r.requests_per_s:.3f} | {r.p50_latency_ms:.1f} | {r.p99_latency_ms:.1f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def write_perf_analyzer_report(result: PerfAnalyzerResult, target: ReportTarget) -> dict[str, Path]:
    """``perf_analyzer_<label>.json`` / ``.md`` in ``target.out_dir`` (no headline figures)."""
    rows, config = result.rows, result.config
    target.out_dir.mkdir(parents=True, exist_ok=True)
    stem = target.out_dir / f"perf_analyzer_{target.label}"
    from builder.report_paths import portable

    settings = portable(asdict(config))
    stem.with_suffix(".json").write_text(json.dumps({"config": settings, "rows": [asdict(r) for r in rows]}, indent=2))
    stem.with_suffix(".md").write_text(to_markdown(rows, config))
    return {"json": stem.with_suffix(".json"), "markdown": stem.with_suffix(".md")}


__all__ = ["PerfAnalyzerBenchConfig", "PerfAnalyzerResult", "run_perf_analyzer_bench", "to_markdown", "write_perf_analyzer_report"]
