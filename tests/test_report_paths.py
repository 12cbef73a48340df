"""Committed reports name paths relative to the repository: the writers make them so, and no
committed report holds a machine's absolute path."""

from __future__ import annotations

import json
import re
from pathlib import Path

from builder.bench.config import DEFAULT_PROMPTS, BenchConfig, BenchRun
from builder.bench.report import summarize
from builder.report_paths import OUTSIDE, REPO, portable, repo_path
from builder.train.jobs import _write

MACHINE_PATH = re.compile(r"""["'`(\s](/(?:root|home|tmp|work|Users|scratch|mnt|var)/[^"'`)\s]*)""")


def test_repo_path_inside_outside_and_relative(tmp_path: Path) -> None:
    assert repo_path(REPO / "benchmarks" / "prompts.json") == "benchmarks/prompts.json"
    assert repo_path(str(REPO / "artifacts")) == "artifacts"
    assert repo_path(REPO) == "."
    assert repo_path(tmp_path / "data") == f"{OUTSIDE}/data"
    assert repo_path("drafts/x") == "drafts/x"


def test_portable_walks_nested_values(tmp_path: Path) -> None:
    value = {"a": [REPO / "x.json", (str(tmp_path / "y"), 3)], "b": {"c": "/v2 is not a path", "d": None},
             "e": "plain text", "f": str(REPO / "z")}
    assert portable(value) == {"a": ["x.json", [f"{OUTSIDE}/y", 3]], "b": {"c": "/v2 is not a path", "d": None},
                               "e": "plain text", "f": "z"}


def test_writers_leave_no_absolute_path(tmp_path: Path) -> None:
    summary = summarize(BenchRun(config=BenchConfig(out_dir=tmp_path / "results")))
    assert summary["config"]["prompts_file"] == repo_path(DEFAULT_PROMPTS) == "benchmarks/prompts.json"
    assert summary["config"]["out_dir"] == f"{OUTSIDE}/results"
    _write(tmp_path / "report.json", {"settings": {"out": tmp_path / "heads.safetensors", "data": str(REPO / "d")}})
    written = json.loads((tmp_path / "report.json").read_text())
    assert written == {"settings": {"out": f"{OUTSIDE}/heads.safetensors", "data": "d"}}


def test_committed_reports_hold_no_machine_path() -> None:
    files = [p for base in ("artifacts", "benchmarks") for p in (REPO / base).rglob("*")
             if p.suffix in (".json", ".md", ".txt", ".csv")]
    assert files
    found = {f"{p.relative_to(REPO)}: {m}" for p in files for m in MACHINE_PATH.findall(p.read_text())}
    assert not found, sorted(found)
