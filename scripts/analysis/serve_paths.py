"""In-process serving against real Triton: the same tree, the same workload, interleaved.

Does the Triton path (the Python backend stub's IPC, the gRPC server, the bench's gRPC
client) cost throughput at ``c`` streams? Builds the bench's deployment in this process and
starts ``specbuild serve`` from this tree, then, ``repeats`` times (which path goes first
alternates), runs the concurrency bench's levels on both: ``c`` streams sending
``requests_per_stream`` requests back to back with the bench's prompt choice (stream ``s``'s
``r``-th request: prompt ``s * requests_per_stream + r``; ``scripts/analysis/serve_rounds.py`` in
process, :func:`builder.bench.concurrency.run_level` through Triton). A control level sends,
through Triton at the top concurrency, only the prompts of the one-stream level, so the
8-over-1 ratio is taken over one prompt mix. Prints tok/s per path and level, the ratios, and
the scheduler thread's CPU time per output token (on that thread's own clock: other
processes on a busy machine slow the wall clock, not this one)::

    .venv/bin/python scripts/analysis/serve_paths.py --concurrency 1,8 --max-tokens 64 --repeats 4
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from dataclasses import replace
from pathlib import Path

import serve_rounds
from serve_ab import start_server, stop_server

from builder.bench.concurrency import ConcurrencyConfig, _prompts, run_level
from builder.loadtest.streams import process_tree
from triton_backend.core.config import DraftLengthConfig, RuntimeConfig, SpeculationConfig
from triton_backend.deployment.config import DeploymentConfig
from triton_backend.deployment.torch_deployment import build_decoder

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SERVING_MODEL = "/specdec/1/model.py"  # in the stub's command line: the model that holds the scheduler


def serving_stub(server_pid: int) -> int:
    """The Python backend stub that runs the serving model (its scheduler thread)."""
    for pid in process_tree(server_pid):
        try:
            if SERVING_MODEL in Path(f"/proc/{pid}/cmdline").read_text():
                return pid
        except OSError:
            continue
    raise RuntimeError(f"no Python backend stub serving {SERVING_MODEL} under process {server_pid}")


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def triton_level(url: str, stub: int, prompts: list[str], c: int, config: ConcurrencyConfig) -> tuple[float, float]:
    """(tok/s, the busiest stub thread's CPU seconds per output token: the scheduler's)."""
    before = thread_cpu_s(stub)
    level = run_level(url, prompts, "off", "off", c, config)
    after = thread_cpu_s(stub)
    if level.errors:
        raise RuntimeError(f"x{c} through Triton: {level.errors[:3]}")
    busiest = max(after[t] - before.get(t, 0.0) for t in after)
    return level.tokens / level.wall_s, busiest / max(1, level.tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--log", type=Path, default=Path("/tmp/serve_paths.log"), help="the server's log")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    levels = sorted(int(c) for c in args.concurrency.split(","))
    low, high = levels[0], levels[-1]
    config = ConcurrencyConfig(concurrency=tuple(levels), max_tokens=args.max_tokens,
                               requests_per_stream=args.requests_per_stream)
    prompts = _prompts(config)
    low_prompts = prompts[: low * args.requests_per_stream]  # what the lowest level sends
    decoder = build_decoder(DeploymentConfig(runtime=RuntimeConfig(num_threads=1, max_batch_size=max(16, high)),
                                             speculation=SpeculationConfig(draft_length=DraftLengthConfig())))
    serve_rounds.run_level(decoder, prompts[:1], "off", 1, 4, 8)  # warm-up
    proc, url = start_server(Path.cwd(), args.log, "load_aware", max(16, high))
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        stub = serving_stub(proc.pid)
        run_level(url, prompts[:1], "off", "off", 1, replace(config, max_tokens=8, requests_per_stream=1))  # warm-up
        for repeat in range(args.repeats):
            for c in levels:
                runs = ["in-process", "triton"] + (["triton, low level's prompts"] if c == high and c != low else [])
                for path in runs if repeat % 2 == 0 else reversed(runs):
                    if path == "in-process":
                        rate, log = serve_rounds.run_level(decoder, prompts, "off", c, 4, args.max_tokens,
                                                           requests_per_stream=args.requests_per_stream)
                        cpu = log.cpu_s / max(1, log.tokens)
                    else:
                        rate, cpu = triton_level(url, stub, low_prompts if "low" in path else prompts, c, config)
                    results.setdefault((path, c), []).append((rate, cpu))
                    print(f"{path:>29} x{c:<3} {rate:7.1f} tok/s  scheduler CPU {1e3 * cpu:5.1f} ms/token", flush=True)
    finally:
        stop_server(proc)
    print("\nmedians:")
    for (path, c), runs in results.items():
        print(f"  {path:>29} x{c:<3} {statistics.median(r for r, _ in runs):7.1f} tok/s  "
              f"{1e3 * statistics.median(u for _, u in runs):5.1f} ms CPU/token")
    if low != high:
        results[("triton, low level's prompts", low)] = results[("triton", low)]
        for path in ("in-process", "triton", "triton, low level's prompts"):
            rate = {c: statistics.median(r for r, _ in results[(path, c)]) for c in (low, high)}
            cpu = {c: statistics.median(u for _, u in results[(path, c)]) for c in (low, high)}
            print(f"  {path}: {high}-over-{low} {rate[high] / rate[low]:.2f} (scheduler CPU per token, "
                  f"x{low} over x{high}: {cpu[low] / cpu[high]:.2f})")


if __name__ == "__main__":
    main()
