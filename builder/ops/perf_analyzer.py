"""NVIDIA's perf_analyzer against a served model: find it, run it, read its CSV report.

perf_analyzer ships in the tritonclient 2.51.0 x86_64 wheel (``scripts/get_perf_analyzer.sh``
installs it with ``libb64.so.0d`` and ``libcudart.so.12`` into
``~/.cache/specbuild/perf_analyzer``; ``SPECBUILD_PERF_ANALYZER_DIR`` overrides the folder).
:func:`run_perf_analyzer` drives one model at one or more concurrencies with prompts from a
JSON input file (perf_analyzer's ``--input-data`` format) and returns one row per concurrency.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from triton_backend.core.errors import SpecbuildError

logger = logging.getLogger(__name__)


class PerfAnalyzerError(SpecbuildError, RuntimeError):
    code = "perf_analyzer"


def perf_analyzer_dir() -> Path:
    return Path(os.environ.get("SPECBUILD_PERF_ANALYZER_DIR", Path.home() / ".cache" / "specbuild" / "perf_analyzer"))


def find_perf_analyzer() -> Path | None:
    """The installed perf_analyzer with its libraries, or ``None``."""
    folder = perf_analyzer_dir()
    binary = folder / "bin" / "perf_analyzer"
    libs = [folder / "lib" / "libb64.so.0d", folder / "lib" / "libcudart.so.12"]
    return binary if binary.is_file() and all(lib.exists() for lib in libs) else None


@dataclass(frozen=True)
class PerfAnalyzerRun:
    """One perf_analyzer invocation. ``streaming``: gRPC streaming (decoupled models)."""

    url: str  # host:port of the gRPC endpoint (or the HTTP one with protocol "http")
    model: str
    prompts: Sequence[str]
    max_tokens: int = 16
    concurrency: Sequence[int] = (1,)
    streaming: bool = True
    protocol: str = "grpc"
    requests_per_window: int = 8
    max_trials: int = 5  # stability needs 3 windows in a row
    timeout_s: float = 600.0


@dataclass(frozen=True)
class PerfRow:
    concurrency: int
    requests_per_s: float
    p50_latency_ms: float
    p99_latency_ms: float


def input_data(prompts: Sequence[str], max_tokens: int, stream: bool) -> dict:
    """perf_analyzer's ``--input-data`` JSON: one entry per prompt, tensorrtllm_backend's text tensors."""
    return {"data": [{"text_input": [p], "max_tokens": [max_tokens], "stream": [stream]} for p in prompts]}


def command(run: PerfAnalyzerRun, binary: Path, inputs: Path, report: Path) -> list[str]:
    levels = ",".join(str(c) for c in run.concurrency)
    args = [str(binary), "-m", run.model, "-u", run.url, "-i", run.protocol, "--input-data", str(inputs),
            "--concurrency-range", f"{levels}:{levels}" if len(run.concurrency) == 1 else
            f"{min(run.concurrency)}:{max(run.concurrency)}",
            "--measurement-mode", "count_windows", "--measurement-request-count", str(run.requests_per_window),
            "--max-trials", str(run.max_trials), "--stability-percentage", "999", "-f", str(report)]
    return args + (["--streaming"] if run.streaming else [])


def _ms(row: dict[str, str], key: str) -> float:
    return float(row[key]) / 1000.0  # perf_analyzer reports microseconds


def parse_report(path: Path) -> list[PerfRow]:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise PerfAnalyzerError(f"perf_analyzer wrote no rows to {path}")
    return [PerfRow(int(r["Concurrency"]), float(r["Inferences/Second"]), _ms(r, "p50 latency"),
                    _ms(r, "p99 latency")) for r in rows]


def run_perf_analyzer(run: PerfAnalyzerRun) -> list[PerfRow]:
    """Run perf_analyzer; a clear error when it is not installed or fails."""
    binary = find_perf_analyzer()
    if binary is None:
        raise PerfAnalyzerError(f"perf_analyzer is not installed in {perf_analyzer_dir()}: "
                                "run scripts/get_perf_analyzer.sh")
    env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent.parent / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    with tempfile.TemporaryDirectory(prefix="perf_analyzer_") as work:
        inputs, report = Path(work) / "inputs.json", Path(work) / "report.csv"
        inputs.write_text(json.dumps(input_data(run.prompts, run.max_tokens, run.streaming)))
        args = command(run, binary, inputs, report)
        logger.info("running %s", " ".join(args))
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=run.timeout_s, check=False)
        if done.returncode != 0 or not report.is_file():
            tail = (done.stdout + done.stderr).strip().splitlines()[-8:]
            raise PerfAnalyzerError(f"perf_analyzer failed (exit {done.returncode}): " + " | ".join(tail))
        return parse_report(report)


__all__ = ["PerfAnalyzerError", "PerfAnalyzerRun", "PerfRow", "find_perf_analyzer", "input_data", "parse_report",
           "run_perf_analyzer"]
