"""scripts/cpu_peer_bench.py: its settings, the check that every speculative row equals its plain
row, the report and headline writer (on rows given here: the engines are not under test), and the
llama.cpp rows skipped with a reason where no interpreter with llama_cpp is given."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cpu_peer_bench", ROOT / "scripts" / "cpu_peer_bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["cpu_peer_bench"] = bench
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("argv, message", [
    (["--precisions", "int3"], "precisions"),
    (["--precisions", ""], "precisions"),
    (["--workloads", "copy"], "workloads"),
    (["--methods", "plain,medusa"], "methods"),
    (["--threads", "0"], "threads"),
    (["--max-tokens", "1"], "max_tokens"),
    (["--repeats", "-1"], "repeats"),
    (["--label", "../x"], "label"),
])
def test_bad_settings_are_refused_with_a_clear_error(argv: list[str], message: str) -> None:
    with pytest.raises(bench.PeerBenchError, match=message):
        bench.parse_args(argv)


def test_rows_cover_every_precision_and_method_and_llamacpp_only_when_usable() -> None:
    config = bench.parse_args(["--precisions", "int8,int4", "--ngram-k", "5", "--lookup-tokens", "3"])
    ours = bench.row_specs(config, llamacpp=False)
    assert [(r.precision, r.method) for r in ours] == [(p, m) for p in ("int8", "int4") for m in bench.OUR_METHODS]
    assert {r.plain_name for r in ours} == {"int8 plain", "int4 plain"}
    both = bench.row_specs(config, llamacpp=True)
    peers = [r for r in both if r.engine == "llamacpp"]
    assert [r.method for r in peers] == list(bench.LLAMACPP_METHODS) and peers[1].k == 3
    assert all(r.plain_name == "llama.cpp plain" for r in peers)
    some = bench.row_specs(bench.parse_args(["--precisions", "int4", "--methods", "plain,auto"]), llamacpp=False)
    assert [r.name for r in some] == ["int4 plain", "int4 auto"]
    without_plain = bench.row_specs(bench.parse_args(["--precisions", "int4", "--methods", "auto"]), llamacpp=False)
    assert [r.name for r in without_plain] == ["int4 plain", "int4 auto"]  # plain added: the rows' reference


def test_llamacpp_rows_skip_with_a_reason_without_llama_cpp(tmp_path: Path) -> None:
    usable, why = bench.llamacpp_status(None)
    assert not usable and "--llamacpp-python" in why
    usable, why = bench.llamacpp_status(str(tmp_path / "nope"))
    assert not usable and "not a file" in why
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        usable, why = bench.llamacpp_status(sys.executable)  # this interpreter: no llama_cpp
        assert not usable and "no llama_cpp" in why
    else:
        assert bench.llamacpp_status(sys.executable)[0]


def _sample(workload: str, index: int, tokens: list[int], latency: float, ttft: float, repeat: int = 0) -> dict:
    return {"workload": workload, "index": index, "tokens": tokens, "latency_s": latency, "ttft_s": ttft,
            "target_passes": len(tokens), "repeat": repeat}


def _results(rows: list, *, differ: str | None = None, speed: dict[str, float] | None = None) -> dict[str, dict]:
    """Rows' results: every row the same tokens (``differ``'s second prompt one token off), its
    seconds scaled by ``speed`` (a row twice as fast takes half the time)."""
    out = {}
    for r in rows:
        factor = 1.0 / (speed or {}).get(r.name, 1.0)
        samples = []
        for w in ("chat", "code"):
            for i in range(2):
                tokens = [10 + i, 11, 12, 13]
                if r.name == differ and i == 1:
                    tokens[-1] = 99
                samples.append(_sample(w, i, tokens, 1.0 * factor, 0.1 * factor))
        out[r.name] = {"samples": samples, "load_s": [1.0], "info": {}}
    return out


def test_a_speculative_row_that_differs_from_its_plain_row_is_caught_and_writes_no_headline() -> None:
    config = bench.parse_args(["--precisions", "int4", "--workloads", "chat,code"])
    rows = bench.row_specs(config, llamacpp=True)
    bad = "int4 auto"
    summary = bench.summarize(config, rows, _results(rows, differ=bad))
    assert summary["identity"][bad]["identical"] is False
    assert summary["identity"][bad]["mismatches"] == ["chat[1] repeat 0", "code[1] repeat 0"]
    assert all(v["identical"] for k, v in summary["identity"].items() if k != bad)
    assert not summary["ours_identical_to_plain"] and summary["headline"] == {}
    assert "NO" in bench.report_markdown(summary)


def test_report_and_headline_from_rows(tmp_path: Path) -> None:
    config = bench.parse_args(["--precisions", "int8,int4"])
    rows = bench.row_specs(config, llamacpp=True)
    speed = {"int4 plain": 2.0, "int4 auto": 3.0, "int8 plain": 1.5, "int8 auto": 2.4, "llama.cpp plain": 2.5,
             "llama.cpp prompt lookup k=4": 1.0}
    summary = bench.summarize(config, rows, _results(rows, speed=speed), llamacpp="llama-cpp-python 0.3.36")
    assert summary["ours_identical_to_plain"]
    h = summary["headline"]
    assert h["int4_auto_x_int4_plain"] == pytest.approx(1.5) and h["int8_auto_x_int8_plain"] == pytest.approx(1.6)
    assert h["int4_plain_x_llamacpp_plain"] == pytest.approx(0.8)
    assert h["cpu_best_x_llamacpp_best"] == pytest.approx(3.0 / 2.5)
    plain = next(e for e in summary["rows"] if e["name"] == "int4 plain")
    assert plain["all"]["tok_s"] == pytest.approx(2.0 * 4) and plain["all"]["decode_tok_s"] == pytest.approx(3 / 0.45)

    headline = tmp_path / "headline.json"
    headline.write_text(json.dumps({"other_key": 1.0}))
    paths = bench.write_report(summary, tmp_path / "out", "cpu", headline=headline)
    written = json.loads(headline.read_text())
    assert written["other_key"] == 1.0 and written["int4_auto_x_int4_plain"] == pytest.approx(1.5)
    report = json.loads(paths["json"].read_text())
    assert str(tmp_path) not in paths["json"].read_text() and report["rows"][0]["name"] == "int8 plain"
    md = paths["markdown"].read_text()
    assert "llama-cpp-python 0.3.36" in md and "| int4 auto | int4 | 12.0 |" in md
    bench.write_report(summary, tmp_path / "out", "avx2", headline=headline)
    assert "avx2_cpu_best_x_llamacpp_best" in json.loads(headline.read_text())


def test_without_llamacpp_rows_only_our_figures_are_written() -> None:
    config = bench.parse_args(["--precisions", "int4"])
    rows = bench.row_specs(config, llamacpp=False)
    summary = bench.summarize(config, rows, _results(rows), skipped="no --llamacpp-python given")
    assert set(summary["headline"]) == {"int4_auto_x_int4_plain"}
    assert "not run (no --llamacpp-python given)" in bench.report_markdown(summary)


def test_prefix_share_is_the_part_of_float32s_output_kept_before_the_first_difference() -> None:
    reference = [_sample("chat", 0, [1, 2, 3, 4], 1.0, 0.1), _sample("code", 0, [5, 6, 7, 8], 1.0, 0.1)]
    assert bench.prefix_share(reference, reference) == 1.0
    other = [_sample("chat", 0, [1, 2, 9, 4], 1.0, 0.1), _sample("code", 0, [0, 6, 7, 8], 1.0, 0.1)]
    assert bench.prefix_share(other, reference) == pytest.approx((2 / 4 + 0) / 2)
