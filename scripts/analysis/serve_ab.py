"""Two code trees served side by side through real Triton: serving throughput, A against B.

Starts ``specbuild serve`` (each tree's default deployment) once from each tree
(``PYTHONPATH`` and working folder set to the tree, free loopback ports), then runs the
concurrency bench's levels (:func:`builder.bench.concurrency.run_level`: ``c`` gRPC streams,
the bench prompts, ``ignore_eos``) on A and B in turn (which goes first alternates), ``repeats``
times, so a busy machine's noise falls on both alike. Prints tok/s per tree, mode and concurrency, and B/A per level.
A baseline tree is a plain export of a commit::

    mkdir -p /tmp/base && git archive HEAD~1 | tar -x -C /tmp/base
    .venv/bin/python scripts/analysis/serve_ab.py --tree-a /tmp/base --tree-b . --concurrency 1,8 --modes off

Both servers are stopped at the end (their process groups), whatever happens.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from builder.bench.concurrency import ConcurrencyConfig, _prompts, run_level
from triton_backend.serving.launch.triton_server import free_port


def start_server(tree: Path, log: Path, batch_policy: str, max_batch_size: int) -> tuple[subprocess.Popen, str]:
    """``specbuild serve`` from ``tree``; returns the process and its gRPC address once ready."""
    http, grpc, metrics = free_port(), free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    cli = "builder.cli.main" if (tree / "builder" / "cli" / "main.py").is_file() else "builder.cli"  # trees before #19's packages
    cmd = [sys.executable, "-m", cli, "serve", "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), "--max-batch-size", str(max_batch_size), "--batch-policy", batch_policy,
           "--restart-limit", "0"]
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server from {tree} exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as reply:
                if reply.status == 200:
                    return proc, f"127.0.0.1:{grpc}"
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server from {tree} was not ready in time; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree-a", type=Path, required=True)
    parser.add_argument("--tree-b", type=Path, default=Path("."))
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--modes", default="off", help="off (plain), ngram or load_aware, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/serve_ab"))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    config = ConcurrencyConfig(concurrency=tuple(levels), max_tokens=args.max_tokens,
                               requests_per_stream=args.requests_per_stream)
    prompts = _prompts(config)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    trees = {"A": args.tree_a.resolve(), "B": args.tree_b.resolve()}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    rates: dict[tuple[str, str, int], list[float]] = {}
    try:
        for name, tree in trees.items():
            servers[name] = start_server(tree, args.log_dir / f"{name}.log", "load_aware", max(16, *levels))
            print(f"{name}: {tree} at {servers[name][1]}", flush=True)
        for name, (_, url) in servers.items():  # warm-up
            run_level(url, prompts[:1], "off", "off", 1, ConcurrencyConfig(max_tokens=8, requests_per_stream=1))
        for repeat in range(args.repeats):
            order = list(servers.items()) if repeat % 2 == 0 else list(reversed(servers.items()))  # A first, then B first
            for c in levels:
                for mode in modes:
                    speculation = "off" if mode == "off" else "ngram"
                    for name, (_, url) in order:
                        level = run_level(url, prompts, speculation, mode, c, config)
                        if level.errors:
                            raise RuntimeError(f"{name} {mode} x{c}: {level.errors[:3]}")
                        rate = level.tokens / level.wall_s
                        rates.setdefault((name, mode, c), []).append(rate)
                        print(f"{name} {mode:>10} x{c:<3} {rate:7.1f} tok/s", flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print("\nmedian tok/s (A / B, B over A):")
    for c in levels:
        for mode in modes:
            a, b = (statistics.median(rates[(n, mode, c)]) for n in ("A", "B"))
            print(f"  {mode:>10} x{c:<3} {a:7.1f} / {b:7.1f}  B/A {b / a:.3f}")
    for mode in modes:
        if 1 in levels and 8 in levels:
            for n in ("A", "B"):
                one, eight = (statistics.median(rates[(n, mode, c)]) for c in (1, 8))
                print(f"  {n} {mode} 8-over-1: {eight / one:.2f}")


if __name__ == "__main__":
    main()
