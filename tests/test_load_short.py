"""Sustained concurrent load, short version (the long one: ``scripts/load_test.py``): 8 gRPC
streams for ~20 s against the real server with mixed parameters. Every answer identical to
its in-process reference (no lost or duplicated tokens), expected refusals refused, memory
flat after the warm-up, and the Prometheus counters' deltas equal to what the clients got.
Then concurrent streams through the OpenAI front (``/v1/chat/completions``) in front of the
same server: no errors, every answer identical to the same request alone (greedy)."""

from __future__ import annotations

import json
import os

import pytest
from reliability_fixtures import SERVING, reliable_decoder, reliable_triton  # noqa: F401 (fixtures)

from builder.loadtest.openai_streams import OpenAILoadConfig, run_openai_load
from builder.loadtest.streams import LoadConfig, make_templates, run_load
from triton_backend.serving.front.openai.app import OpenAIConfig
from builder.ops.serve import start_openai_front

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


OPENAI = OpenAILoadConfig(streams=int(os.environ.get("SPECBUILD_LOAD_OPENAI_STREAMS", "4")), rounds=2, max_tokens=12,
                          api_key="load-key")


def test_openai_chat_streams_equal_each_request_alone(reliable_triton) -> None:
    front = start_openai_front(OpenAIConfig(api_key=OPENAI.api_key), reliable_triton.endpoints,
                               reliable_triton.repository)  # a thread in this process, before the same server
    try:
        report = run_openai_load(front.url, front.config.model_id(front.backend), OPENAI)
    finally:
        front.stop()
    print("\nOpenAI load summary:", json.dumps(report.summary(), indent=1))
    assert not report.errors, report.errors[:5]
    assert not report.mismatches, report.mismatches[:3]
    assert report.succeeded == report.requests == OPENAI.streams * OPENAI.rounds and report.tokens > 0
    assert reliable_triton.server.running
