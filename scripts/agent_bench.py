#!/usr/bin/env python3
"""The agent benchmark (builder/loadtest/agent_bench.py): concurrent multi-turn tool-using conversations
(benchmarks/agent/conversations.json) through the OpenAI API of a real Triton server, with and without
the prefix cache and chunked prefill, speculation auto and off. Writes
benchmarks/results/agent-bench-LABEL.{json,md} and the headline keys agent_bench_x_plain (output tokens
per second, all three on over all three off) and agent_bench_ttft_x_plain.

    .venv/bin/python scripts/agent_bench.py                                   # 2 conversations x 3 turns
    .venv/bin/python scripts/agent_bench.py --conversations 4 --turns 4 --arms plain,full
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from builder.loadtest.agent_bench import ARMS, AgentBenchConfig, run_agent_bench
from triton_backend.core.errors import ConfigError


def parse(argv: list[str] | None = None) -> AgentBenchConfig:
    d = AgentBenchConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations-file", type=Path, default=d.conversations_file)
    p.add_argument("--conversations", type=int, default=d.conversations, help="run the file's first N at once")
    p.add_argument("--turns", type=int, default=d.turns, help="the first N turns of each")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="per answer")
    p.add_argument("--arms", default=",".join(d.arms), help=f"comma-separated, among {', '.join(ARMS)}")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens, help="prefill chunk of the chunked arms")
    p.add_argument("--kernel-threads", type=int, default=d.kernel_threads)
    p.add_argument("--label", default=d.label, help="results file suffix; not 'cpu': headline keys get it as a prefix")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--no-headline", action="store_true")
    a = p.parse_args(argv)
    return AgentBenchConfig(conversations_file=a.conversations_file, conversations=a.conversations, turns=a.turns,
                            max_tokens=a.max_tokens, arms=tuple(x.strip() for x in a.arms.split(",") if x.strip()),
                            max_seq_len=a.max_seq_len, chunk_tokens=a.chunk_tokens, kernel_threads=a.kernel_threads,
                            label=a.label, out=a.out, headline=None if a.no_headline else d.headline)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse(argv)
    except ConfigError as exc:
        print(f"agent_bench: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run_agent_bench(config)
    print(json.dumps({"headline": summary["headline"], "identical": summary["identical"], "paths": summary["paths"]}))
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
