#!/usr/bin/env python3
"""The long abrupt-client run, by hand: N client sessions, each several requests (valid and
invalid) on one decoupled gRPC stream, vanishing without closing it, against a real Triton
server under the specbuild supervisor; counts server aborts per 1,000 sessions.

    python scripts/abrupt_clients.py --sessions 2000 --out benchmarks/results/abrupt_clients.json

Writes ``abrupt_client_aborts_per_1000`` (``..._grpc_error_mode`` with --grpc-error-mode) to
benchmarks/results/headline.json for runs of >= 1,000 sessions (unless --no-headline).
Exit status 0 when there was no abort and the server still answered.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from builder.loadtest.abrupt_clients import AbruptConfig, markdown, run_abrupt_clients
from builder.headline import HEADLINE_PATH, update_headline
from builder.report_paths import portable
from builder.stages.model_repository import render_model_repository
from triton_backend.serving.launch.triton_server import ServerConfig
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=2000)
    p.add_argument("--parallel", type=int, default=8, help="sessions at once")
    p.add_argument("--max-requests", type=int, default=8, help="requests per session (stream), at most")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-concurrency", type=int, default=4, help="requests the model generates at once")
    p.add_argument("--grpc-error-mode", action="store_true",
                   help="every session sends the triton_grpc_error header (the stream closes on the first error)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: print only)")
    p.add_argument("--no-headline", action="store_true", help="do not write headline.json")
    p.add_argument("--headline", type=Path, default=HEADLINE_PATH, help="the headline file to update")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work = Path(tempfile.mkdtemp(prefix="specbuild-abrupt-"))
    repository = render_model_repository(DeploymentConfig(), work / "model_repo",
                                         ServingConfig(max_concurrency=a.max_concurrency, default_max_tokens=8))
    server = ServerConfig(repository, exit_timeout_s=5, log_file=work / "tritonserver.log")
    config = AbruptConfig(sessions=a.sessions, parallel=a.parallel, max_requests=a.max_requests,
                          max_tokens=a.max_tokens, seed=a.seed, grpc_error_mode_fraction=1.0 if a.grpc_error_mode else 0.0)
    result = run_abrupt_clients(server, config)
    print(markdown(result))
    print(f"server log: {server.log_file}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(portable(result.to_json()), indent=2) + "\n")
        print(f"results: {a.out}")
    if not a.no_headline and result.sessions >= 1000:
        key = "abrupt_client_aborts_per_1000" + ("_grpc_error_mode" if a.grpc_error_mode else "")
        update_headline({key: round(result.aborts_per_1000, 2)}, a.headline)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
