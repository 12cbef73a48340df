"""One report-writer protocol for every ``specbuild bench`` subcommand.

A bench measures into a result (a summary dict, or a small record) and hands it to its writer
with a :class:`ReportTarget`: where the files go (``out_dir``, file names suffixed ``label``),
the headline file its figures merge into (None: none written) and whether a plot is drawn. The
writer returns what it wrote, by kind (``json``, ``markdown``, ``plot``, ``headline``), which the
CLI prints under the bench's table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from builder.bench.config import DEFAULT_OUT

R_contra = TypeVar("R_contra", contravariant=True)


@dataclass(frozen=True)
class ReportTarget:
    out_dir: Path = DEFAULT_OUT
    label: str = "cpu"  # the result files' name suffix
    headline: Path | None = None  # the headline file the figures merge into (builder.bench.config.headline_file)
    plot: bool = True  # draw the bench's plot where it has one (and matplotlib is installed)


class ReportWriter(Protocol[R_contra]):
    def __call__(self, result: R_contra, target: ReportTarget, /) -> dict[str, Path]: ...


__all__ = ["ReportTarget", "ReportWriter"]
