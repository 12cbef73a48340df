"""Sustained concurrent load, short version (the long one: ``scripts/load_test.py``): 8 gRPC
streams for ~20 s against the real server with mixed parameters. Every answer identical to
its in-process reference (no lost or duplicated tokens), expected refusals refused, memory
flat after the warm-up, and the Prometheus counters' deltas equal to what the clients got."""

from __future__ import annotations

import json
import os

import pytest
from reliability_fixtures import SERVING, reliable_decoder, reliable_triton  # noqa: F401 (fixtures)

from builder.loadtest.streams import LoadConfig, make_templates, run_load

pytestmark = pytest.mark.slow

CONFIG = LoadConfig(streams=int(os.environ.get("SPECBUILD_LOAD_STREAMS", "8")),
                    duration_s=float(os.environ.get("SPECBUILD_LOAD_SECONDS", "20")), warmup_s=5.0, templates=10,
                    min_tokens=4, max_tokens=12, invalid_every=5, sample_every_s=1.0)


def test_concurrent_streams_lose_nothing_and_metrics_match(reliable_triton, reliable_decoder) -> None:
    templates = make_templates(reliable_decoder, CONFIG, SERVING)
    report = run_load(reliable_triton.endpoints, reliable_triton.server.pid, templates, CONFIG)
    summary = report.summary()
    summary.pop("rss_timeline_mib")
    print("\nload summary:", json.dumps(summary, indent=1, default=str))
    assert not report.mismatches, report.mismatches[:5]
    assert not report.unexpected_errors, report.unexpected_errors[:5]
    # each stream's first request is template i (template 4 is invalid), whatever the machine's speed
    assert report.succeeded >= CONFIG.streams - 1 and report.refused_as_expected >= 1
    for name, (server, clients) in report.metric_checks.items():
        assert server == clients, f"{name}: the server counted {server}, the clients got {clients}"
    assert report.in_flight_after == 0
    memory = report.memory()
    assert memory["flat"], memory
    assert reliable_triton.server.running
