#!/usr/bin/env python3
"""Prefix caching and chunked prefill on the reference model, in process through the batch
scheduler (builder/bench/prefix_cache.py): a follow-up turn's time to first token with the
prefix cache over cold, and the rate running streams keep while a long prompt prefills, per
prefill chunk size. Writes benchmarks/results/prefix-cache-LABEL.{json,md} and the headline
keys prefix_cache_ttft_x_cold, chunked_prefill_stream_rate_kept, chunked_prefill_chunk_tokens.

    .venv/bin/python scripts/prefix_cache_bench.py                 # the CPU figures
    .venv/bin/python scripts/prefix_cache_bench.py --repeats 1 --chunk-sizes 16,512 --no-headline
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from builder.bench.prefix_cache import PrefixBenchConfig, run_prefix_bench


def main(argv: list[str] | None = None) -> int:
    defaults = PrefixBenchConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=defaults.target)
    p.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len, help="the bench engine's context")
    p.add_argument("--shared-tokens", type=int, default=defaults.shared_tokens, help="the system prompt's tokens")
    p.add_argument("--repeats", type=int, default=defaults.repeats)
    p.add_argument("--streams", type=int, default=defaults.streams)
    p.add_argument("--long-prompt-tokens", type=int, default=defaults.long_prompt_tokens)
    p.add_argument("--chunk-sizes", default=",".join(map(str, defaults.chunk_sizes)))
    p.add_argument("--baseline-s", type=float, default=defaults.baseline_s, help="the streams' rate before: seconds")
    p.add_argument("--window-s", type=float, default=defaults.window_s,
                   help="the streams' rate while the long prompt prefills: at most these seconds of it")
    p.add_argument("--kernel-threads", type=int, default=defaults.kernel_threads)
    p.add_argument("--label", default=defaults.label, help="results file suffix; not 'cpu': headline keys get it as a prefix")
    p.add_argument("--out", type=Path, default=defaults.out)
    p.add_argument("--no-headline", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = PrefixBenchConfig(target=a.target, max_seq_len=a.max_seq_len, shared_tokens=a.shared_tokens,
                               repeats=a.repeats, streams=a.streams, long_prompt_tokens=a.long_prompt_tokens,
                               chunk_sizes=tuple(int(x) for x in a.chunk_sizes.split(",") if x.strip()),
                               baseline_s=a.baseline_s, window_s=a.window_s, kernel_threads=a.kernel_threads,
                               label=a.label, out=a.out,
                               headline=None if a.no_headline else PrefixBenchConfig.headline)
    result = run_prefix_bench(config)
    print(f"{result['figures']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
