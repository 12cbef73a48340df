"""``specbuild bench``: one subcommand per kind of measurement, each with its own few flags.

``specbuild bench [speed] ...`` (the default: every decoding method side by side on the bench
prompts, :mod:`builder.cli.bench_speed`), ``heldout`` / ``mtbench`` (the same on a held-out
prompt set), and :mod:`builder.cli.bench_modes`: ``pass-cost``, ``concurrency``, ``openai``,
``perf-analyzer``, ``json``, ``precision``, ``ngram-replay``, ``render-readme``. Each parses
its flags into the bench's typed config, runs it, and hands the result to the bench's writer
(:class:`builder.bench.writer.ReportWriter`) with one :class:`~builder.bench.writer.ReportTarget`
built from the shared flags (``--out``, ``--label``, ``--headline`` / ``--no-headline``;
:mod:`builder.cli.bench_args`).
The flags of the one-command era (``bench --pass-cost``, ``--concurrency 1,2``, ``--ngram-k
4``, ...) fail with the subcommand or option that replaced them."""

from __future__ import annotations

import argparse
from typing import Any

MAX_FLAGS = 15  # per subcommand (tests/test_bench_cli.py)


# the one-command era's flags -> what replaced them
_MODES = {"--pass-cost": "bench pass-cost", "--pass-sizes": "bench pass-cost --sizes",
          "--pass-batch": "bench pass-cost --batch", "--pass-context": "bench pass-cost --context",
          "--concurrency": "bench concurrency LEVELS", "--concurrency-modes": "bench concurrency --modes",
          "--concurrency-method": "bench concurrency --method", "--concurrency-repeats": "bench concurrency --repeats",
          "--requests-per-stream": "bench concurrency --requests N/stream",
          "--requests-per-level": "bench concurrency --requests N", "--api": "bench openai LEVELS",
          "--perf-analyzer": "bench perf-analyzer", "--pa-model": "bench perf-analyzer --model",
          "--ngram-replay": "bench ngram-replay RECORDS", "--ngram-record": "bench ngram-replay --record",
          "--replay-set": "bench ngram-replay --set", "--replay-costs": "bench ngram-replay --costs",
          "--replay-ngram-max": "bench ngram-replay --ngram-max", "--replay-trace": "bench ngram-replay --trace",
          "--json": "bench json", "--json-prompts": "bench json --prompts", "--precisions": "bench precision LIST",
          "--agreement-prompts": "bench precision --agreement-prompts", "--render-readme": "bench render-readme",
          "--check": "bench render-readme --check", "--heldout-split": "bench heldout", "--mtbench": "bench mtbench"}


class _MovedAction(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from builder.cli.bench_speed import ROW_OPTIONS

        flag = option_string or "?"
        if flag in _MODES:
            raise argparse.ArgumentError(self, f"is now a subcommand: `specbuild {_MODES[flag]}` "
                                               "(`specbuild bench -h` lists them)")
        if flag == "--no-plot":
            raise argparse.ArgumentError(self, "is gone: `specbuild bench [speed]` always drew its plot "
                                               "(it ignored --no-plot); drop the flag")
        item = flag[2:] if values is None else f"{flag[2:]}={values}"
        raise argparse.ArgumentError(self, f"is now a row option of `specbuild bench speed`: `--rows {item}` "
                                           f"(row options: {', '.join(ROW_OPTIONS)})")


def register(sub: argparse._SubParsersAction) -> None:
    from builder.cli import bench_modes, bench_speed

    p = sub.add_parser("bench", help="benchmarks: speed (default), heldout, mtbench, pass-cost, concurrency, openai, "
                       "perf-analyzer, json, precision, ngram-replay, render-readme",
                       description="Without a subcommand: `bench speed` (its flags below). "
                       "`specbuild bench SUBCOMMAND -h` for each subcommand's own flags.",
                       allow_abbrev=False)  # a subcommand's flag must not read as a prefix of one here
    bench_speed.speed_arguments(p)
    from builder.cli.bench_speed import ROW_OPTIONS

    for flag in sorted({*_MODES, "--no-plot", *(f"--{key}" for key in ROW_OPTIONS)}):  # hidden: each says what replaced it
        p.add_argument(flag, action=_MovedAction, nargs="?", dest=f"moved_{flag[2:]}", help=argparse.SUPPRESS)
    p.set_defaults(func=bench_speed.cmd_speed)
    modes = p.add_subparsers(dest="bench", metavar="SUBCOMMAND", required=False)
    bench_speed.register(modes)
    bench_modes.register(modes)


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``bench``'s subcommand parsers by name (for tests and docs)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flag_count(parser: argparse.ArgumentParser) -> int:
    """The options and positionals a user can give a parser (help, subcommands and the hidden
    catcher of moved flags aside)."""
    return sum(1 for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and a.help != argparse.SUPPRESS)


__all__ = ["MAX_FLAGS", "flag_count", "register", "subcommand_parsers"]
