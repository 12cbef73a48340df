"""Flags and helpers every ``specbuild bench`` subcommand shares (builder/cli/bench.py registers
them): the results flags (``--target``, ``--out``, ``--label``, ``--headline`` / ``--no-headline``,
``--threads``), the prompt flags, and :func:`report`, which hands a result to its writer
(:class:`builder.bench.writer.ReportWriter`) and prints the table and the files."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from builder.bench.config import DEFAULT_OUT, DEFAULT_PROMPTS, BenchConfig, headline_file
from builder.bench.writer import ReportTarget, ReportWriter


def ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


class _HeadlineAction(argparse.Action):
    """``--headline FILE`` (the file this run's figures merge into) and ``--no-headline`` (none):
    one setting, two spellings. Unset: ``OUT/headline.json``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string == "--no-headline":
            if values is not None:
                raise argparse.ArgumentError(self, f"takes no value (got {values!r}; put positional arguments first)")
            setattr(namespace, self.dest, False)
        elif values is None:
            raise argparse.ArgumentError(self, "expected FILE")
        else:
            setattr(namespace, self.dest, Path(values))


def results_arguments(p: argparse.ArgumentParser, *, headline: bool = True) -> None:
    """The flags every measuring subcommand shares: what it measures, where its files go."""
    p.add_argument("--target", default=BenchConfig.target, help="reference model name or HF directory")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default benchmarks/results/)")
    p.add_argument("--label", default="cpu", help="results file name suffix")
    if headline:
        p.add_argument("--headline", "--no-headline", dest="headline", action=_HeadlineAction, nargs="?", default=None,
                       metavar="FILE", help="--headline FILE: the headline file this run's figures merge into "
                       "(default OUT/headline.json, so only a run with the default --out updates "
                       "benchmarks/results/headline.json); --no-headline: write no headline figures")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def prompt_arguments(p: argparse.ArgumentParser, *, prompts: bool = True) -> None:
    """Which bench prompts, and how long each answer is."""
    if prompts:
        p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompt file (default benchmarks/prompts.json)")
        p.add_argument("--workloads", type=words, default=("chat", "code", "copy"))
    p.add_argument("--prompts-per-workload", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=BenchConfig.max_tokens)


def headline(args: argparse.Namespace) -> Path | None:
    """The one rule for every figure of every bench run: --headline FILE, else OUT/headline.json
    (--no-headline: None)."""
    return None if args.headline is False else headline_file(args.out, args.headline)


def report_target(args: argparse.Namespace, *, plot: bool = True) -> ReportTarget:
    return ReportTarget(out_dir=args.out, label=args.label,
                        headline=headline(args) if hasattr(args, "headline") else None, plot=plot)


def report(result: Any, writer: ReportWriter[Any], target: ReportTarget, markdown: str) -> int:
    """Write a bench's result with its writer, then print its table and where its files went."""
    paths = writer(result, target)
    print(markdown)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


__all__ = ["headline", "ints", "prompt_arguments", "report", "report_target", "results_arguments", "words"]
