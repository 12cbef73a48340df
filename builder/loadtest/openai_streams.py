"""Concurrent streams through the OpenAI front (``POST /v1/chat/completions``, ``stream: true``):
every chat prompt is first sent alone (its reference), then ``streams`` clients send
``rounds`` requests each at once (prompts rotated, so the same prompt runs beside different
neighbours). Greedy, so every streamed answer must equal its prompt's answer alone, token for
token, and nothing may fail. The short version runs in ``tests/test_load_short.py``; the long
session (``scripts/load_test.py --openai-streams N``) adds it after the gRPC load.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

PROMPTS = ("Count from one to ten:", "The three primary colors are",
           "Rewrite in the past tense: The cat sits on the mat.", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three uses of a paperclip.", "What is the capital of France?",
           "Translate to French: good morning, my friend.")


@dataclass(frozen=True)
class OpenAILoadConfig:
    streams: int = 4
    rounds: int = 2  # requests per stream
    max_tokens: int = 12
    prompts: tuple[str, ...] = PROMPTS
    api_key: str | None = None
    timeout_s: float = 300.0


@dataclass
class OpenAILoadReport:
    requests: int = 0
    succeeded: int = 0
    tokens: int = 0
    duration_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.errors and not self.mismatches and self.succeeded == self.requests > 0

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "succeeded": self.succeeded, "tokens": self.tokens,
                "duration_s": round(self.duration_s, 2),
                "tokens_per_s": round(self.tokens / self.duration_s, 1) if self.duration_s else 0.0,
                "errors": self.errors[:10], "mismatches": self.mismatches[:10], "passed": self.passed}


def stream_chat(base_url: str, model: str, prompt: str, config: OpenAILoadConfig) -> tuple[str, int]:
    """One greedy streamed chat completion: its text and completion tokens (``usage``).
    Raises ``RuntimeError`` on an error status or an ``error`` event."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": config.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
    pieces: list[str] = []
    tokens, done = 0, False
    try:
        with urllib.request.urlopen(request, timeout=config.timeout_s) as reply:
            for raw in reply:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                    break
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[len(b"data:"):])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error'].get('message')}")
                pieces.extend(c.get("delta", {}).get("content") or "" for c in event.get("choices", []))
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:200]!r}") from None
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(pieces), tokens


def run_openai_load(base_url: str, model: str, config: OpenAILoadConfig) -> OpenAILoadReport:
    """References alone, then ``streams`` x ``rounds`` concurrent requests checked against them."""
    alone = {prompt: stream_chat(base_url, model, prompt, config)[0] for prompt in config.prompts}
    report, lock = OpenAILoadReport(), threading.Lock()

    def client(i: int) -> None:
        for r in range(config.rounds):
            prompt = config.prompts[(i + r * config.streams) % len(config.prompts)]
            try:
                text, tokens = stream_chat(base_url, model, prompt, config)
            except Exception as exc:  # noqa: BLE001 - recorded: the test fails on any
                with lock:
                    report.requests += 1
                    report.errors.append(f"stream {i} round {r}: {exc}"[:300])
                continue
            with lock:
                report.requests += 1
                report.succeeded += 1
                report.tokens += tokens
                if text != alone[prompt]:
                    report.mismatches.append({"prompt": prompt, "alone": alone[prompt], "together": text})

    threads = [threading.Thread(target=client, args=(i,), name=f"openai-load-{i}") for i in range(config.streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=config.timeout_s * config.rounds + 30)
    report.duration_s = time.perf_counter() - started
    logger.info("OpenAI load: %s", report.summary())
    return report


__all__ = ["OpenAILoadConfig", "OpenAILoadReport", "PROMPTS", "run_openai_load", "stream_chat"]
