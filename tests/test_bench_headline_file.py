"""Where a bench run writes its headline figures: one rule for every key, --out or --headline.

The bug this guards: ``specbuild bench --prompts OTHER.json --eagle ... --out /tmp/x`` wrote its
EAGLE chat figure into the repository's ``benchmarks/results/headline.json`` while its other keys
went to ``/tmp/x/headline.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.bench.concurrency import write_concurrency_report
from builder.bench.config import DEFAULT_OUT, headline_file
from builder.bench.pass_cost import write_pass_cost
from builder.bench.writer import ReportTarget
from builder.cli.main import main as cli_main
from builder.headline import HEADLINE_PATH

REPO = Path(__file__).resolve().parents[1]
EAGLE = REPO / "artifacts" / "smollm2-135m-eagle"


def test_headline_file_follows_out_unless_chosen(tmp_path: Path) -> None:
    assert headline_file(DEFAULT_OUT) == HEADLINE_PATH  # the default run updates the committed file
    assert headline_file(tmp_path) == tmp_path / "headline.json"
    assert headline_file(tmp_path, tmp_path / "mine.json") == tmp_path / "mine.json"


def test_pass_cost_and_concurrency_writers_take_the_given_file(tmp_path: Path) -> None:
    before = HEADLINE_PATH.read_bytes()
    result = {"config": {"context": 1, "target": "t", "threads": 1, "repeats": 1}, "rows": [],
              "headline": {"engine_plain_decode_x_hf": 2.0}}
    paths = write_pass_cost(result, ReportTarget(tmp_path, "t", tmp_path / "h.json"))
    assert paths["headline"] == tmp_path / "h.json"
    assert json.loads((tmp_path / "h.json").read_text()) == {"engine_plain_decode_x_hf": 2.0}
    assert "headline" not in write_pass_cost(result, ReportTarget(tmp_path / "none", "t"))  # None: nothing written
    assert not (tmp_path / "none" / "headline.json").exists()
    summary = {"config": {}, "rows": [], "headline": {"serving_throughput_8_over_1": 4.0}}
    write_concurrency_report(summary, ReportTarget(tmp_path / "c", "cpu", headline_file(tmp_path / "c"), plot=False))
    assert json.loads((tmp_path / "c" / "headline.json").read_text()) == {"serving_throughput_8_over_1": 4.0}
    assert HEADLINE_PATH.read_bytes() == before


@pytest.mark.slow
def test_bench_with_eagle_and_out_elsewhere_leaves_the_committed_headline(tmp_path: Path) -> None:
    prompts = tmp_path / "other.json"
    prompts.write_text(json.dumps({"workloads": {"chat": ["Name three colours."]}}))
    before = HEADLINE_PATH.read_bytes()
    common = ["bench", "--prompts", str(prompts), "--workloads", "chat", "--prompts-per-workload", "1",
              "--max-tokens", "4", "--repeats", "1", "--eagle", str(EAGLE), "--rows", "ngram-k=2", "eagle-k=1",
              "no-peer"]
    assert cli_main([*common, "--out", str(tmp_path / "x")]) == 0
    written = json.loads((tmp_path / "x" / "headline.json").read_text())
    assert "eagle_chat_x_plain" in written and "worst_speculative_row_x_plain" in written
    assert HEADLINE_PATH.read_bytes() == before  # no key of this run reached the repository's file
    assert cli_main([*common, "--out", str(tmp_path / "y"), "--headline", str(tmp_path / "h.json")]) == 0
    assert set(json.loads((tmp_path / "h.json").read_text())) == set(written)
    assert not (tmp_path / "y" / "headline.json").exists()
    assert HEADLINE_PATH.read_bytes() == before
