"""``specbuild bench`` as subcommands (builder/cli/bench*.py): each with at most 15 flags, the
speed bench still the default, the one-command era's flags refused with what replaced them, and
one writer protocol (builder/bench/writer.py) for every bench."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import pytest

from builder.bench.config import DEFAULT_OUT, HEADLINE_NAME
from builder.cli.bench import MAX_FLAGS, flag_count, subcommand_parsers
from builder.cli.main import build_parser

SUBCOMMANDS = {"speed", "heldout", "mtbench", "pass-cost", "concurrency", "openai", "perf-analyzer", "json",
               "precision", "ngram-replay", "render-readme"}


def _bench() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["bench"]


def test_every_subcommand_has_at_most_15_flags() -> None:
    parsers = subcommand_parsers(_bench())
    assert set(parsers) == SUBCOMMANDS
    counts = {name: sum(1 for a in p._actions if not isinstance(a, argparse._HelpAction)) for name, p in parsers.items()}
    assert max(counts.values()) <= MAX_FLAGS, counts
    assert counts == {name: flag_count(p) for name, p in parsers.items()}  # no hidden option in a subcommand
    assert flag_count(_bench()) == counts["speed"]  # plain `bench` takes speed's flags (and hidden moved ones)


def test_bench_without_subcommand_is_speed() -> None:
    from builder.cli.bench_speed import bench_config, cmd_speed

    argv = ["--prompts-per-workload", "2", "--eagle", "e", "--rows", "ngram-k=4,12", "no-peer",
            "eagle-always-tree=none", "--rows", "medusa-tree-size=0", "self-draft=int8", "ignore-eos"]
    old_style, new_style = (build_parser().parse_args(["bench", *argv]), build_parser().parse_args(["bench", "speed", *argv]))
    assert old_style.func is cmd_speed and new_style.func is cmd_speed
    config = bench_config(old_style)
    assert config == bench_config(new_style)
    assert (config.prompts_per_workload, config.eagle, config.ngram_k, config.peer) == (2, "e", (4, 12), False)
    assert (config.eagle_always_tree, config.medusa_tree_size, config.self_draft, config.ignore_eos) == (None, None,
                                                                                                         ("int8",), True)
    assert (config.eagle_k, config.auto, config.triton) == ((3,), True, False)  # untouched row options keep defaults


@pytest.mark.parametrize("old, new", [
    (["--pass-cost"], "bench pass-cost"), (["--concurrency", "1,2,4"], "bench concurrency LEVELS"),
    (["--concurrency", "1,8", "--api", "openai"], "bench concurrency LEVELS"), (["--json"], "bench json"),
    (["--precisions", "int8"], "bench precision LIST"), (["--render-readme", "--check"], "bench render-readme"),
    (["--heldout-split"], "bench heldout"), (["--mtbench"], "bench mtbench"), (["--perf-analyzer"], "bench perf-analyzer"),
    (["--ngram-replay", "r.json"], "bench ngram-replay RECORDS"), (["--ngram-k", "4,12"], "--rows ngram-k=4,12"),
    (["--no-peer"], "--rows no-peer"), (["--eagle-always-tree", "none"], "--rows eagle-always-tree=none"),
])
def test_an_old_flag_fails_naming_what_replaced_it(old: list[str], new: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", "--max-tokens", "8", *old])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("specbuild bench: error: argument ")
    assert f"`specbuild {new}" in last or f"`{new}`" in last


@pytest.mark.parametrize("argv", [["--rows", "bogus=1"], ["--rows", "ngram-k"], ["--rows", "no-peer=1"],
                                  ["--rows", "eagle-always-tree=4"], ["concurrency", "1,2", "--method", "draft"],
                                  ["concurrency", "1,2", "--requests", "2/s"], ["precision", "--no-headline", "int8"]])
def test_bad_values_are_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", *argv])
    assert exit_.value.code == 2


def test_serving_flags_build_the_concurrency_config() -> None:
    from builder.cli.bench_modes import _concurrency_config

    args = build_parser().parse_args(["bench", "concurrency", "1,8", "--method", "draft=d", "--k", "3", "--requests",
                                      "2/stream", "--modes", "off,load_aware", "--repeats", "1"])
    config = _concurrency_config(args)
    assert (config.concurrency, config.method, config.draft, config.medusa) == ((1, 8), "draft", "d", None)
    assert (config.num_draft_tokens, config.requests_per_level, config.requests_per_stream) == (3, None, 2)
    assert (config.modes, config.repeats, config.max_tokens) == (("off", "load_aware"), 1, 96)
    default = _concurrency_config(build_parser().parse_args(["bench", "openai", "1,8"]))
    assert (default.method, default.requests_per_level, default.repeats) == ("ngram", 32, 2)


def test_headline_flags_one_rule(tmp_path: Path) -> None:
    from builder.cli.bench_args import report_target

    def target(*argv: str):
        return report_target(build_parser().parse_args(["bench", "pass-cost", *argv]))

    assert target().headline == DEFAULT_OUT / HEADLINE_NAME
    assert target("--out", str(tmp_path)).headline == tmp_path / HEADLINE_NAME
    assert target("--out", str(tmp_path), "--headline", str(tmp_path / "h.json")).headline == tmp_path / "h.json"
    assert target("--no-headline").headline is None
    assert (target("--label", "x").label, target("--out", str(tmp_path)).out_dir) == ("x", tmp_path)


def test_every_bench_writer_takes_a_result_and_a_report_target() -> None:
    from builder.bench import concurrency, guided_json_report, openai_api, pass_cost, perf_analyzer_bench, precision, report

    writers = [report.write_report, report.write_speed_report, report.heldout_writer("heldout"),
               concurrency.write_concurrency_report, openai_api.write_api_report, pass_cost.write_pass_cost,
               precision.write_precision_bench, guided_json_report.write_json_report,
               perf_analyzer_bench.write_perf_analyzer_report]
    for writer in writers:
        params = list(inspect.signature(writer).parameters.values())
        assert len(params) == 2 and params[1].annotation in ("ReportTarget", "'ReportTarget'"), writer
