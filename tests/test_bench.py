"""`specbuild bench` end to end on a tiny budget: rows, ratios, identity checks, files."""

from __future__ import annotations

import json

import pytest

from builder.bench.config import BenchConfig
from builder.bench.report import summarize, to_markdown, write_report
from builder.bench.writer import ReportTarget
from builder.bench.runner import run_bench
from triton_backend.core.errors import ConfigError

pytestmark = pytest.mark.slow


def test_bench_tiny_budget(tmp_path):
    config = BenchConfig(prompts_per_workload=1, max_tokens=6, repeats=2, ngram_k=(3,), out_dir=tmp_path, label="t")
    run = run_bench(config)
    assert run.rows == ["plain", "ngram k=3", "hf plain", "hf prompt-lookup"]
    assert len(run.samples) == 4 * 3 * 2  # rows x workloads x repeats
    summary = summarize(run)
    rows = {(e["workload"], e["row"]): e for e in summary["rows"]}
    assert rows[("all", "plain")]["speedup_vs_plain"] == pytest.approx(1.0)
    assert rows[("all", "ngram k=3")]["identical_to_plain"] is True  # greedy speculation is exact
    assert rows[("all", "plain")]["tokens_per_target_pass"] == pytest.approx(1.0)
    assert rows[("all", "hf plain")]["identical_to_plain"] is True  # the peer on the same weights, EOS not masked
    assert all(1 <= len(s.tokens) == s.num_tokens <= 6 for s in run.samples)  # stops at EOS or 6 tokens
    for name in ("plain", "ngram k=3"):  # the round time beyond the target's passes, and its share
        entry = rows[("all", name)]
        assert entry["target_pass_ms"] > 0 and entry["outside_target_ms_per_pass"] >= 0
        assert 0 <= entry["outside_target_share"] < 1
    assert "outside_target_share" not in rows[("all", "hf plain")]  # the peer's passes are not timed apart
    paths = write_report(summary, ReportTarget(tmp_path, "t"))
    assert json.loads(paths["json"].read_text())["rows"]
    assert "| all | ngram k=3 |" in to_markdown(summary) and "outside target ms/pass (share)" in to_markdown(summary)
    assert paths["plot"].stat().st_size > 1000


def test_bench_shows_chain_tree_and_auto_side_by_side(tmp_path):
    """With an EAGLE drafter the bench runs its chain row, its tree row, the auto row (n-gram,
    EAGLE or both merged per round) and auto without merged trees, all exact, and writes the drafting-strategy headline keys, the EAGLE
    tokens per pass from the best EAGLE row (tiny budget)."""
    from pathlib import Path

    eagle = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m-eagle"
    config = BenchConfig(eagle=str(eagle), workloads=("chat", "copy"), prompts_per_workload=1, max_tokens=8, repeats=1,
                         ngram_k=(4,), auto_unmerged=True, peer=False, plot=False, out_dir=tmp_path, label="t")
    run = run_bench(config)
    assert run.rows == ["plain", "ngram k=4", "eagle k=3", "eagle tree k=3", "eagle tree 4x11 always", "auto", "auto unmerged"]
    assert [run.row_info[r].get("strategy") for r in run.rows] == [None, "chain", "chain", "tree", "tree-always", "auto",
                                                                    "auto"]
    assert [run.row_info[r]["merge_lookup"] for r in ("auto", "auto unmerged")] == [True, False]
    summary = summarize(run)
    rows = {(e["workload"], e["row"]): e for e in summary["rows"]}
    eagle_rows = ("eagle k=3", "eagle tree k=3", "eagle tree 4x11 always")
    assert all(rows[("all", r)]["identical_to_plain"] for r in ("auto", "auto unmerged", *eagle_rows))
    headline = json.loads(write_report(summary, ReportTarget(tmp_path, "t", tmp_path / "headline.json"))["headline"].read_text())
    assert {"auto_all_x_plain", "worst_speculative_row_x_plain", "eagle_tokens_per_pass"} <= set(headline)
    assert headline["auto_all_x_plain"] == pytest.approx(rows[("all", "auto")]["speedup_vs_plain"], abs=1e-4)
    best = max(rows[("all", r)]["tokens_per_target_pass"] for r in eagle_rows)
    assert headline["eagle_tokens_per_pass"] == pytest.approx(best, abs=1e-4)


def test_bench_compares_unpacked_rows_side_by_side(tmp_path):
    config = BenchConfig(workloads=("copy",), prompts_per_workload=1, max_tokens=6, repeats=1, ngram_k=(3,),
                         peer=False, compare_unpacked=True, out_dir=tmp_path, label="t")
    run = run_bench(config)
    assert run.rows == ["plain", "ngram k=3", "plain unpacked", "ngram k=3 unpacked"]
    rows = {e["row"]: e for e in summarize(run)["rows"] if e["workload"] == "all"}
    assert all(rows[name]["identical_to_plain"] is True for name in rows)


def test_bench_rows_on_a_quantized_target(tmp_path):
    """``target-weights``: every row of ours on the int4 target, each speculative row checked against
    the int4 plain row; no HF rows (they would run float32); the CLI labels the files with the
    precision and writes no headline figure (headline keys name float32 targets)."""
    from builder.cli.bench_speed import bench_config
    from builder.cli.main import build_parser
    from triton_backend.core.runtime_config import WeightPrecision

    config = BenchConfig(workloads=("copy",), prompts_per_workload=1, max_tokens=6, repeats=1, ngram_k=(3,),
                         target_weights="int4", out_dir=tmp_path, label="t")
    assert config.target_weights is WeightPrecision.INT4
    run = run_bench(config)
    assert run.rows == ["plain", "ngram k=3"]
    summary = summarize(run)
    assert summary["config"]["target_weights"] == "int4"
    assert all(e["identical_to_plain"] is True for e in summary["rows"] if e["row"] != "plain")
    assert json.loads(json.dumps(summary))["config"]["target_weights"] == "int4"
    args = build_parser().parse_args(["bench", "speed", "--rows", "target-weights=int8", "--out", str(tmp_path)])
    cli = bench_config(args)
    assert cli.target_weights is WeightPrecision.INT8 and args.label == "cpu-int8" and args.headline is False
    with pytest.raises(ConfigError, match="target weights"):
        BenchConfig(target_weights="int3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "speed", "--rows", "target-weights=int3"])


def test_bench_through_triton(tmp_path):
    """The same requests through a real Triton server: identical text, overhead reported."""
    config = BenchConfig(workloads=("copy",), prompts_per_workload=1, max_tokens=6, repeats=1, ngram_k=(3,),
                         peer=False, triton=True, out_dir=tmp_path, label="t")
    summary = summarize(run_bench(config))
    rows = {e["row"]: e for e in summary["rows"] if e["workload"] == "all"}
    for name in ("plain via triton", "ngram k=3 via triton"):
        assert rows[name]["identical_to_plain"] is True
        assert rows[name]["serving_overhead"] is not None and rows[name]["tokens_per_s"] > 0
    assert "Serving overhead through Triton" in to_markdown(summary)


def test_bench_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        BenchConfig(prompts_file=tmp_path / "none.json")
    with pytest.raises(ConfigError, match="positive"):
        BenchConfig(max_tokens=0)
    with pytest.raises(ConfigError, match="workloads"):
        BenchConfig(workloads=("poetry",)).load_prompts()


def test_pass_cost_profile_tiny_budget(tmp_path):
    from builder.bench.pass_cost import PassCostConfig, measure_pass_cost, pass_cost_markdown, write_pass_cost

    result = measure_pass_cost(PassCostConfig(target=BenchConfig.target, sizes=(4,), batch=(2,), context=16, repeats=1))
    cells = {(r["rows"], r["tokens"]): r for r in result["rows"]}
    assert sorted(cells) == [(1, 1), (1, 4), (2, 1), (2, 4)]  # one row x one token is always measured: the unit
    assert cells[(1, 1)]["ours_x_step"] == pytest.approx(1.0) and cells[(1, 1)]["hf_x_step"] == pytest.approx(1.0)
    assert all(r["ours_ms"] > 0 and r["hf_ms"] > 0 for r in cells.values())
    paths = write_pass_cost(result, ReportTarget(tmp_path, "t"))  # headline None: a test never touches the headline figures
    assert "| 2 | 4 |" in pass_cost_markdown(result) and json.loads(paths["json"].read_text())["rows"]
    with pytest.raises(ConfigError):
        PassCostConfig(target="x", sizes=(0,))


def test_bench_self_draft_rows(tmp_path):
    """Self-draft rows over the bench's own float32 target, and auto with the self draft beside
    n-gram lookup: outputs identical to plain, the chat figure taken from the self-draft row, the
    auto figure from the auto row."""
    from builder.bench.report import headline_figures

    config = BenchConfig(workloads=("chat",), prompts_per_workload=1, max_tokens=8, repeats=1, ngram_k=(3,),
                         peer=False, self_draft=("int8",), self_draft_k=(3,), out_dir=tmp_path, label="t")
    run = run_bench(config)
    assert run.rows == ["plain", "ngram k=3", "self-int8 k=3", "auto self-int8 k=3"]
    rows = {(e["workload"], e["row"]): e for e in summarize(run)["rows"]}
    entry = rows[("chat", "self-int8 k=3")]
    assert entry["identical_to_plain"] is True and entry["precision"] == "int8" and 0 < entry["draft_cost"] < 1
    assert entry["context"] == "committed"  # the default: the draft takes its context from the target
    auto = rows[("all", "auto self-int8 k=3")]
    assert auto["identical_to_plain"] is True and auto["method"] == "auto" and auto["model_drafter"] == "draft"
    assert {s.stats["method"] for s in run.samples if s.row == "auto self-int8 k=3"} == {"draft"}
    headline = headline_figures(summarize(run))
    assert headline["selfdraft_chat_x_plain"] == entry["speedup_vs_plain"]
    assert headline["auto_all_x_plain"] == auto["speedup_vs_plain"]
    with pytest.raises(ConfigError, match="self-draft precisions"):
        BenchConfig(self_draft=("int3",))


def test_peer_rows_run_on_the_threads_they_are_given():
    """A Hugging Face peer row generates on as many torch threads as our engine's row kernel uses
    (a fair comparison), and leaves the process's setting as it found it."""
    import torch

    from builder.bench.config import BenchPrompt
    from builder.bench.rows import PeerRow, torch_threads

    class Recorder:  # stands in for transformers' generate: records the threads it ran on
        device = torch.device("cpu")
        generation_config = None
        seen: list[int] = []

        def generate(self, ids, **kwargs):
            self.seen.append(torch.get_num_threads())
            return torch.cat([ids, torch.tensor([[5, 6]])], dim=1)

    before = torch.get_num_threads()
    model = Recorder()
    result = PeerRow("hf plain", model, {}, {}, threads=2).run(BenchPrompt("chat", 0, "hi", [1, 2]), 2, True)
    assert result.tokens == [5, 6] and model.seen == [2] and torch.get_num_threads() == before
    with torch_threads(3):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == before


def test_the_always_tree_flag_parses_depth_by_nodes():
    import argparse

    from builder.cli.bench_speed import _depth_nodes

    assert _depth_nodes("4x11") == (4, 11) and _depth_nodes("3X8") == (3, 8) and _depth_nodes("none") is None
    for bad in ("4", "x11", "4x0", "fourx11"):
        with pytest.raises(argparse.ArgumentTypeError, match="DEPTHxNODES"):
            _depth_nodes(bad)
