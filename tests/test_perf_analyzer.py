"""NVIDIA's perf_analyzer (tritonclient 2.51.0's binary) drives the served models for real:
gRPC streaming against the decoupled ``ensemble`` (the test server runs decoupled_mode true) and
plain gRPC infer against ``specdec_unary``. Skipped with a reason where perf_analyzer is not installed
(``scripts/get_perf_analyzer.sh``)."""

from __future__ import annotations

import pytest
from triton_fixtures import triton  # noqa: F401 (fixture)

from builder.ops.perf_analyzer import PerfAnalyzerRun, find_perf_analyzer, run_perf_analyzer

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_perf_analyzer() is None,
                                 reason="perf_analyzer not installed: run scripts/get_perf_analyzer.sh")]

PROMPTS = ("The capital of France is", "Write a haiku about the sea.")


@pytest.mark.parametrize("model,streaming", [("ensemble", True), ("specdec_unary", False)])
def test_perf_analyzer_drives_the_served_model(triton, model: str, streaming: bool) -> None:
    before = triton.metrics().get('nv_inference_request_success{model="specdec",version="1"}', 0.0)
    rows = run_perf_analyzer(PerfAnalyzerRun(triton.endpoints.grpc_url, model, PROMPTS, max_tokens=4,
                                             streaming=streaming, requests_per_window=4, max_trials=5))
    assert len(rows) == 1 and rows[0].concurrency == 1
    assert rows[0].requests_per_s > 0 and 0 < rows[0].p50_latency_ms <= rows[0].p99_latency_ms
    served = triton.metrics()['nv_inference_request_success{model="specdec",version="1"}'] - before
    assert served >= 4  # the requests reached the serving model


def test_bench_perf_analyzer_row(tmp_path) -> None:
    """``specbuild bench perf-analyzer``: its own server, one row per level, JSON + Markdown."""
    import json

    from builder.bench.perf_analyzer_bench import (PerfAnalyzerBenchConfig, run_perf_analyzer_bench,
                                                   write_perf_analyzer_report)
    from builder.bench.writer import ReportTarget

    config = PerfAnalyzerBenchConfig(concurrency=(1,), workloads=("chat",), prompts_per_workload=2, max_tokens=3,
                                     requests_per_window=3, max_trials=3, out_dir=tmp_path, label="t")
    result = run_perf_analyzer_bench(config)
    rows = result.rows
    assert [r.concurrency for r in rows] == [1] and rows[0].requests_per_s > 0
    paths = write_perf_analyzer_report(result, ReportTarget(tmp_path, "t"))
    assert json.loads(paths["json"].read_text())["rows"][0]["p50_latency_ms"] == rows[0].p50_latency_ms
    assert "| 1 |" in paths["markdown"].read_text()
