#!/usr/bin/env python3
"""The long load test, run by hand: N concurrent gRPC streams for D seconds against a real
Triton server on loopback (free ports), every answer checked against its in-process
reference, server memory and Prometheus counters checked, then SIGTERM mid-load.

    SPECBUILD_CACHE_DIR=... python scripts/load_test.py --streams 32 --duration 120 \\
        --out benchmarks/results/load_32x120.json
    python scripts/load_test.py --streams 8 --duration 30 --openai-streams 8 --no-sigterm  # + the OpenAI API

Exit status 0 when everything passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from builder.loadtest.openai_streams import OpenAILoadConfig
from builder.loadtest.streams import LoadConfig
from builder.loadtest.session import SessionConfig, markdown, run_session, write
from triton_backend.serving.interface import ServingConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds before memory is judged")
    p.add_argument("--templates", type=int, default=24)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8, help="requests the model generates at once")
    p.add_argument("--exit-timeout", type=int, default=120, help="Triton's exit timeout for the SIGTERM phase")
    p.add_argument("--no-sigterm", action="store_true", help="skip the SIGTERM-mid-load phase")
    p.add_argument("--openai-streams", type=int, default=0,
                   help="then this many concurrent streams through the OpenAI front's /v1/chat/completions")
    p.add_argument("--openai-rounds", type=int, default=4, help="requests per OpenAI stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/load.json"))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = SessionConfig(
        load=LoadConfig(streams=a.streams, duration_s=a.duration, warmup_s=a.warmup, templates=a.templates,
                        min_tokens=a.min_tokens, max_tokens=a.max_tokens, seed=a.seed),
        serving=ServingConfig(max_concurrency=a.max_concurrency, default_max_tokens=16),
        sigterm=not a.no_sigterm, exit_timeout_s=a.exit_timeout,
        openai=OpenAILoadConfig(streams=a.openai_streams, rounds=a.openai_rounds, max_tokens=a.max_tokens)
        if a.openai_streams > 0 else None)
    results = run_session(config)
    write(results, a.out)
    print(markdown(results))
    print(f"results: {a.out}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
