"""``specbuild bench openai 1,8``: the OpenAI front's cost over Triton gRPC.

One real Triton server (the reference target, load-aware in-flight batching) and the OpenAI
front in front of it (:mod:`triton_backend.serving.front.openai`). At each concurrency ``c``, ``c`` client
threads send the same chat requests (the bench prompts, fixed length, greedy) back to back,
once straight to Triton over gRPC streaming (``apply_chat_template``: the model renders the
template) and once through ``POST /v1/chat/completions`` with ``stream: true`` (the front
renders the same template); the two APIs alternate at each level and the sweep repeats, so a
busy machine's drift falls on both alike. Per API and ``c``: p50/p95 end-to-end latency, time
to first text, tokens/s; the texts must be identical between the APIs.

Headline: ``openai_latency_x_grpc``, the p50 latency through the OpenAI API over the p50
through gRPC, the worse over the levels.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from builder.bench.concurrency import (ConcurrencyConfig, LevelResult, Reply, _percentile, _prompts, _serving,
                                      drive_level, grpc_sender, merge_levels)
from builder.bench.writer import ReportTarget

logger = logging.getLogger(__name__)

APIS = ("grpc", "openai")


def openai_sender(url: str, model: str, config: ConcurrencyConfig, speculation: str) -> Callable[[str], Reply]:
    def send(prompt: str) -> Reply:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": config.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "speculation": speculation, "num_draft_tokens": config.num_draft_tokens}
        request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        started = time.perf_counter()
        pieces: list[str] = []
        ttft, tokens = None, 0
        with urllib.request.urlopen(request, timeout=600) as reply:
            for raw in reply:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data:"):])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text and ttft is None:
                        ttft = time.perf_counter() - started
                    pieces.append(text)
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
        latency = time.perf_counter() - started
        return Reply("".join(pieces), tokens, latency, latency if ttft is None else ttft)

    return send


def run_api_bench(config: ConcurrencyConfig) -> dict[str, Any]:
    from triton_backend.serving.front.openai.app import OpenAIConfig
    from builder.ops.serve import start_openai_front
    from triton_backend.serving.launch.triton_server import ServerConfig, TritonServer
    from builder.stages.model_repository import render_model_repository

    prompts = _prompts(config)
    deployment, serving, speculation = _serving(config, "load_aware")
    runs: dict[tuple[str, int], list[LevelResult]] = {(a, c): [] for a in APIS for c in config.concurrency}
    with tempfile.TemporaryDirectory(prefix="specbuild-openai-bench-") as tmp:
        repository = render_model_repository(deployment, Path(tmp) / "model_repo", serving)
        with TritonServer(ServerConfig(repository, exit_timeout_s=10, log_file=Path(tmp) / "triton.log")) as server:
            front = start_openai_front(OpenAIConfig(), server.endpoints, repository)
            try:
                model = OpenAIConfig().model_id(front.backend)
                senders = {"grpc": grpc_sender(server.endpoints.grpc_url, config, speculation, temperature=0.0),
                           "openai": openai_sender(front.url, model, config, speculation)}
                for api in APIS:  # warm-up
                    senders[api](prompts[0])
                turn = 0
                for repeat in range(config.repeats):
                    for c in config.concurrency:
                        order = list(APIS) if turn % 2 == 0 else list(reversed(APIS))
                        turn += 1
                        for api in order:
                            level = drive_level(senders[api], prompts, api, c, config)
                            logger.info("repeat %d, %s x%d: p50 %.3fs", repeat + 1, api, c,
                                        _percentile(level.latencies_s, 50))
                            runs[(api, c)].append(level)
            finally:
                front.stop()
    return summarize([merge_levels(runs[(a, c)]) for a in APIS for c in config.concurrency], config)


def summarize(levels: list[LevelResult], config: ConcurrencyConfig) -> dict[str, Any]:
    grpc = {(lv.concurrency, i): t for lv in levels if lv.mode == "grpc" for i, t in lv.texts.items()}
    rows = []
    for lv in levels:
        row = {"api": lv.mode, **{k: v for k, v in lv.summary().items() if k != "mode"}}
        same = [t == grpc[(lv.concurrency, i)] for i, t in lv.texts.items() if (lv.concurrency, i) in grpc]
        row["identical_to_grpc"] = all(same) if same else None
        rows.append(row)
    p50 = {(r["api"], r["concurrency"]): r["latency_p50_s"] for r in rows}
    ratios = {c: p50[("openai", c)] / p50[("grpc", c)] for c in config.concurrency if p50.get(("grpc", c))}
    for r in rows:
        r["p50_x_grpc"] = ratios.get(r["concurrency"]) if r["api"] == "openai" else 1.0
    clean = all(r["errors"] == 0 and r["identical_to_grpc"] is not False for r in rows)
    headline = {"openai_latency_x_grpc": max(ratios.values())} if ratios and clean else {}
    return {"config": {"target": config.target, "method": config.method, "k": config.num_draft_tokens,
                       "max_tokens": config.max_tokens, "requests_per_level": config.requests_per_level,
                       "repeats": config.repeats, "concurrency": list(config.concurrency)},
            "rows": rows, "headline": headline}


def to_markdown(summary: dict[str, Any]) -> str:
    lines = ["| API | streams | p50 s | p95 s | x gRPC p50 | TTFT p50 s | tok/s | same text | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {r['api']} | {r['concurrency']} | {r['latency_p50_s']:.3f} | {r['latency_p95_s']:.3f} | "
                     f"{r['p50_x_grpc']:.3f} | {r['ttft_p50_s']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['identical_to_grpc']} | {r['errors']} |")
    for key, value in summary["headline"].items():
        lines.append(f"\n{key}: {value:.3f}")
    return "\n".join(lines)


def write_api_report(summary: dict[str, Any], target: ReportTarget) -> dict[str, Path]:
    target.out_dir.mkdir(parents=True, exist_ok=True)
    stem = target.out_dir / f"openai-api-{target.label}"
    paths = {"json": stem.with_suffix(".json"), "markdown": stem.with_suffix(".md")}
    from builder.report_paths import portable

    paths["json"].write_text(json.dumps(portable(summary), indent=2))
    paths["markdown"].write_text(to_markdown(summary) + "\n")
    if target.headline is not None and summary["headline"]:
        from builder.headline import update_headline

        update_headline(summary["headline"], target.headline)
        paths["headline"] = target.headline
    return paths


__all__ = ["APIS", "run_api_bench", "summarize", "to_markdown", "write_api_report"]
