"""The ``specbuild`` command line. Each command parses its flags into one typed config
and calls one library function."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from triton_backend.core.errors import SpecbuildError

logger = logging.getLogger("specbuild")


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from triton_backend.core.reference_model import ensure_reference_model

    path = ensure_reference_model(args.name)
    print(path)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from builder.ops.local_run import LocalRunConfig, run_local

    config = LocalRunConfig.from_args(args)
    result = run_local(config)
    print(result.text)
    print()
    print(result.stats.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specbuild", description="Speculative decoding built and served the NVIDIA way.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch-model", help="fetch, verify and convert the reference model into the cache")
    fetch.add_argument("--name", default="smollm2-135m-instruct")
    fetch.set_defaults(func=_cmd_fetch_model)

    run = sub.add_parser("run", help="generate in-process (no server) and print the acceptance statistics")
    from builder.ops.local_run import add_run_arguments

    add_run_arguments(run)
    run.set_defaults(func=_cmd_run)

    from builder.cli.serve import register as register_serving

    register_serving(sub)

    from builder.cli.build import register_build_commands

    register_build_commands(sub)

    from builder.cli.train import register_training_commands

    register_training_commands(sub)

    from builder.cli.eagle import register_eagle_commands

    register_eagle_commands(sub)

    from builder.cli.bench import register as register_bench

    register_bench(sub)

    from builder.cli.deploy import register as register_deploy

    register_deploy(sub)

    from builder.cli.k8s import register as register_k8s

    register_k8s(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except SpecbuildError as exc:
        print(f"specbuild: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
