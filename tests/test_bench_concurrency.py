"""``specbuild bench concurrency``: the figures from measured levels (speedup, identity with
plain, headline ratios), the report files, config errors; and one tiny real run through
Triton (one mode pair, two stream counts, a few tokens) that must produce every figure."""

from __future__ import annotations

import json

import pytest

from builder.bench.concurrency import (ConcurrencyConfig, LevelResult, merge_levels, run_concurrency_bench, summarize,
                                      write_concurrency_report)
from builder.bench.writer import ReportTarget
from triton_backend.core.errors import ConfigError


def _level(mode: str, c: int, tokens: int, wall: float, text: str = "same") -> LevelResult:
    return LevelResult(mode, c, requests=c, tokens=tokens, wall_s=wall, latencies_s=[wall] * c, ttft_s=[0.1] * c,
                       texts={0: text})


def test_summary_figures_from_levels(tmp_path) -> None:
    levels = [_level("off", 1, 100, 10.0), _level("off", 8, 400, 10.0), _level("always", 1, 150, 10.0),
              _level("always", 8, 300, 10.0, text="different"), _level("load_aware", 1, 140, 10.0),
              _level("load_aware", 8, 400, 10.0)]
    config = ConcurrencyConfig(concurrency=(1, 8), modes=("off", "always", "load_aware"))
    summary = summarize(levels, config)
    rows = {(r["mode"], r["concurrency"]): r for r in summary["rows"]}
    assert rows[("off", 8)]["tokens_per_s"] == pytest.approx(40.0)
    assert rows[("always", 1)]["speedup_over_plain"] == pytest.approx(1.5)
    assert rows[("always", 8)]["identical_to_plain"] is False and rows[("load_aware", 8)]["identical_to_plain"]
    assert summary["headline"]["serving_throughput_8_over_1"] == pytest.approx(4.0)
    # load-aware / best of (off, always): 140/150 at 1 stream, 400/400 at 8 -> the minimum
    assert summary["headline"]["policy_worst_ratio_to_best"] == pytest.approx(140 / 150)
    paths = write_concurrency_report(summary, ReportTarget(tmp_path, "cpu"))
    assert json.loads(paths["json"].read_text())["headline"] == summary["headline"]
    assert "| load_aware | 8 |" in paths["markdown"].read_text()


def test_repeats_pool_tokens_and_time_and_flag_a_text_that_changes() -> None:
    merged = merge_levels([_level("off", 8, 400, 10.0), _level("off", 8, 200, 10.0)])
    assert merged.tokens == 600 and merged.wall_s == 20.0 and merged.requests == 16
    assert merged.summary()["tokens_per_s"] == pytest.approx(30.0)  # all tokens over all time, not a mean of rates
    assert merged.summary()["tokens_per_s_by_repeat"] == [40.0, 20.0]
    assert len(merged.latencies_s) == 16 and not merged.errors
    changed = merge_levels([_level("off", 8, 400, 10.0), _level("off", 8, 400, 10.0, text="other")])
    assert changed.errors == ["prompt 0: the text differs between repeats"]


def test_every_level_can_send_the_same_requests() -> None:
    same = ConcurrencyConfig(concurrency=(1, 2, 8), requests_per_level=8)
    for c in (1, 2, 8):
        sent = sorted(n for s in range(c) for n in same.stream_requests(s, c))
        assert sent == list(range(8))  # the same work at every level
    assert same.stream_requests(0, 1) == list(range(8)) and same.stream_requests(1, 2) == [1, 3, 5, 7]
    own = ConcurrencyConfig(requests_per_stream=2)
    assert own.stream_requests(3, 8) == [6, 7]
    with pytest.raises(ConfigError, match="requests_per_level"):
        ConcurrencyConfig(concurrency=(1, 16), requests_per_level=8)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="modes"):
        ConcurrencyConfig(modes=("fast",))
    with pytest.raises(ConfigError, match="positive"):
        ConcurrencyConfig(concurrency=(0, 2))
    with pytest.raises(ConfigError, match="repeats"):
        ConcurrencyConfig(repeats=0)


@pytest.mark.slow
def test_tiny_run_through_triton(tmp_path) -> None:
    config = ConcurrencyConfig(concurrency=(1, 2), modes=("off", "load_aware"), max_tokens=4, requests_per_stream=1,
                               workloads=("copy",), prompts_per_workload=2,
                               repeats=2, requests_per_level=2)
    summary = run_concurrency_bench(config)
    assert len(summary["rows"]) == 4
    for row in summary["rows"]:
        assert row["errors"] == 0 and row["tokens"] == 2 * 4 * 2 and row["tokens_per_s"] > 0  # 2 requests a level
        assert len(row["tokens_per_s_by_repeat"]) == 2
        assert row["identical_to_plain"] is True
