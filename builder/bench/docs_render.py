"""Figure tables in README.md and docs/*.md, rendered from the files the benchmarks wrote.

A table lives between two markers naming its block::

    <!-- BEGIN rendered:headline (specbuild bench render-readme) -->
    ...
    <!-- END rendered:headline -->

and is replaced by :func:`render_file` with what its renderer makes of its source file under
``benchmarks/results/``. ``specbuild bench render-readme`` rewrites every block;
``--check`` only reports the stale ones (``tests/test_readme.py`` fails on any), so no figure
a reader sees can drift from the file a benchmark wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from builder.bench.config import DEFAULT_OUT
from builder.headline import read_headline
from triton_backend.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = ("README.md", "docs/benchmarks.md")
_BLOCK = re.compile(r"(<!-- BEGIN rendered:(?P<name>[a-z_-]+)[^\n]*-->\n)(?P<body>.*?)(<!-- END rendered:(?P=name) -->)",
                    re.DOTALL)


@dataclass(frozen=True)
class HeadlineRow:
    key: str  # the headline.json key
    label: str  # what it measures
    goal: float | None  # None: reported, no goal
    at_most: bool = False  # the goal is an upper bound (counts of failures)
    digits: int = 2
    pending: bool = False  # its bench exists but has not run on the idle VM yet: rendered "not measured yet"
    parts: tuple["HeadlineRow", ...] = ()  # more figures of one run, each with its goal, in this row (one README line)

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *(p.key for p in self.parts))


HEADLINE_ROWS = (
    HeadlineRow("engine_plain_decode_x_hf", "slot engine 1 x 1 pass over the HF path", 1.15),
    HeadlineRow("engine_decode_throughput_8_over_1", "8 decode rows in one pass over 1", 3.5),
    HeadlineRow("serving_throughput_8_over_1", "served plain tok/s, 8 streams over 1", 3.5),
    HeadlineRow("policy_worst_ratio_to_best", "load-aware over the best of off/always, worst concurrency", 0.97),
    HeadlineRow("worst_speculative_row_x_plain", "worst speculative row x plain", 0.98),
    HeadlineRow("best_copy_x_plain", "best row x plain, copy", 1.8),
    HeadlineRow("best_all_x_plain", "best row x plain, all workloads", 1.2),
    HeadlineRow("copy_x_hf_prompt_lookup", "copy: ours over HF prompt lookup", 1.3),
    HeadlineRow("eagle_acceptance_pos1", "EAGLE acceptance at draft position 1", 0.6),
    HeadlineRow("eagle_tokens_per_pass", "EAGLE tokens per target pass", 2.5),
    HeadlineRow("eagle_chat_x_plain", "EAGLE chat x plain", 1.5),
    HeadlineRow("auto_all_x_plain", "auto (n-gram or model drafter per round) x plain, all workloads", 1.6, pending=True),
    HeadlineRow("selfdraft_chat_x_plain", "self draft (target's weights in int8/int4) chat x plain", 1.4, pending=True),
    HeadlineRow("eagle_data_positions_per_s", "drafter data: positions/s, one process",
                150.0, digits=1),
    HeadlineRow("eagle_data_positions_per_cpu_s", "drafter data: positions per CPU second, one process", 150.0, digits=1),
    HeadlineRow("eagle_data_positions_total", "drafter data: training positions in the committed corpus", 10_000_000,
                digits=0),
    HeadlineRow("eagle_heldout_chat_tokens_per_pass", "held-out split (bench heldout): EAGLE tokens per "
                "target pass, chat / all workloads / auto x plain, chat / all workloads / every speculative row "
                "identical to plain (1 = yes)", 2.5, pending=True, parts=(
                    HeadlineRow("eagle_heldout_all_tokens_per_pass", "", None),
                    HeadlineRow("heldout_chat_auto_x_plain", "", 1.8),
                    HeadlineRow("heldout_all_auto_x_plain", "", 2.0),
                    HeadlineRow("heldout_rows_identical_to_plain", "", 1.0, digits=0))),
    HeadlineRow("eagle_mtbench_chat_tokens_per_pass", "MT-Bench first turns (bench mtbench, written outside the "
                "project): EAGLE tokens per target pass, chat / all workloads / auto x plain, chat / all workloads / "
                "every speculative row identical to plain (1 = yes)", None, pending=True, parts=(
                    HeadlineRow("eagle_mtbench_all_tokens_per_pass", "", None),
                    HeadlineRow("mtbench_chat_auto_x_plain", "", None),
                    HeadlineRow("mtbench_all_auto_x_plain", "", None),
                    HeadlineRow("mtbench_rows_identical_to_plain", "", 1.0, digits=0))),
    HeadlineRow("openai_latency_x_grpc", "OpenAI API p50 latency over gRPC's, worst concurrency", 1.05, at_most=True),
    HeadlineRow("abrupt_client_aborts_per_1000", "abrupt gRPC client sessions that abort Triton, per 1,000", 0.0,
                at_most=True, digits=0),
    HeadlineRow("guided_json_x_plain", "JSON schema output: best speculative row x plain, both constrained", 1.5),
    HeadlineRow("guided_plain_x_unconstrained", "JSON schema output: constrained x unconstrained plain, per decoding step",
                0.9),
    HeadlineRow("guided_valid_share", "JSON schema output: share of constrained outputs valid for their schema", 1.0),
    HeadlineRow("int4_plain_x_fp32", "int4 weights: plain tok/s, 1 row, over float32", 2.5),
    HeadlineRow("int8_plain_x_fp32", "int8 weights: plain tok/s, 1 row, over float32", 1.6),
    HeadlineRow("int4_greedy_agreement", "int4 weights: float32's greedy token, teacher-forced share", None, digits=3),
    HeadlineRow("int8_greedy_agreement", "int8 weights: float32's greedy token, teacher-forced share", None, digits=3),
    HeadlineRow("fp8_plain_x_fp32", "fp8 weights: plain tok/s, 1 row, over float32", None),
    HeadlineRow("fp8_greedy_agreement", "fp8 weights: float32's greedy token, teacher-forced share", None, digits=3),
    HeadlineRow("int4_plain_x_llamacpp_plain", "CPU peers (scripts/cpu_peer_bench.py, each row its own process, same "
                "GGUF and threads): int4 plain over llama.cpp plain / our fastest exact row over llama.cpp's fastest / "
                "int4 auto x int4 plain / int8 auto x int8 plain", 1.0, pending=True, parts=(
                    HeadlineRow("cpu_best_x_llamacpp_best", "", 1.5),
                    HeadlineRow("int4_auto_x_int4_plain", "", 1.6),
                    HeadlineRow("int8_auto_x_int8_plain", "", 1.6))),
    HeadlineRow("gpu_engine_plain_decode_x_hf", "H200: slot engine 1 x 1 pass over the HF path", None),
    HeadlineRow("gpu_eagle_data_positions_per_s", "H200: drafter data, positions/s (batched generate)", None, digits=0),
    HeadlineRow("gpu_auto_all_x_plain", "H200: auto x plain, all workloads (3 prompts, 48 tokens)", None),
    HeadlineRow("gpu_eagle_tokens_per_pass", "H200: EAGLE tokens per target pass (3 prompts)", None),
    HeadlineRow("poisoned_batch_collateral_failures", "reliability (scripts/reliability.py): plain requests failed "
                "beside refused guides / inference ports served without the key / 500s on malformed values / 3.9 MB "
                "prompt refused, ms / SIGTERM to exit with nothing in flight, s / a request after 16 abandoned HTTP "
                "clients, s", 0.0, at_most=True, digits=0, parts=(
                    HeadlineRow("unauthenticated_ports_with_key", "", 0.0, at_most=True, digits=0),
                    HeadlineRow("malformed_value_500s", "", 0.0, at_most=True, digits=0),
                    HeadlineRow("oversize_prompt_refusal_ms", "", 100.0, at_most=True, digits=0),
                    HeadlineRow("shutdown_s", "", 5.0, at_most=True, digits=1),
                    HeadlineRow("abandoned_http_fresh_request_s", "", None, digits=1))),
    HeadlineRow("prefix_cache_ttft_x_cold", "prefix cache and chunked prefill (scripts/prefix_cache_bench.py): "
                "follow-up turn's TTFT over cold, 1,643 tokens shared with a finished request / 4 streams' tok/s "
                "kept while a 2,000-token prompt prefills / at this prefill_chunk_tokens", 0.25, at_most=True, digits=3,
                parts=(HeadlineRow("chunked_prefill_stream_rate_kept", "", 0.7),
                       HeadlineRow("chunked_prefill_chunk_tokens", "", None, digits=0))),
    HeadlineRow("agent_bench_x_plain", "agent conversations through the OpenAI API (scripts/agent_bench.py: 2 at once, "
                "2,234-token system prompt + tools, tool results fed back): prefix cache + chunked prefill + auto over "
                "all three off, output tok/s / median TTFT", 2.0,
                parts=(HeadlineRow("agent_bench_ttft_x_plain", "", None, digits=3),)),
)


def _num(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}"


def render_headline(figures: dict[str, Any], rows: tuple[HeadlineRow, ...] = HEADLINE_ROWS) -> str:
    missing = [k for r in rows for k in r.keys if k not in figures and not r.pending]
    if missing:
        raise ConfigError(f"headline figures {missing} are not in the headline file")
    lines = ["| figure (`headline.json` key) | value | goal | met |", "|---|---|---|---|"]
    for r in rows:
        cells = [_cells(part, figures) for part in (r, *r.parts)]
        keys = ", ".join(f"`{k}`" for k in r.keys)
        if any(value is None for value, _, _ in cells):
            lines.append(f"| {r.label} ({keys}) | not measured yet | {' / '.join(c[1] for c in cells)} | - |")
            continue
        met = [c[2] for c in cells if c[2] != "-"]
        verdict = "-" if not met else "yes" if all(m == "yes" for m in met) else "no"
        lines.append(f"| {r.label} ({keys}) | {' / '.join(str(c[0]) for c in cells)} | "
                     f"{' / '.join(c[1] for c in cells)} | {verdict} |")
    return "\n".join(lines)


def _cells(r: HeadlineRow, figures: dict[str, Any]) -> tuple[str | None, str, str]:
    """(value, goal, met) of one figure as the table writes them (value ``None``: not in the file)."""
    goal = "reported" if r.goal is None else ("<= " if r.at_most else ">= ") + _num(r.goal, r.digits)
    if r.key not in figures:
        return None, goal, "-"
    value = float(figures[r.key])
    met = "-" if r.goal is None else "yes" if (value <= r.goal if r.at_most else value >= r.goal) else "no"
    return _num(value, r.digits), goal, met


def render_methods(bench: dict[str, Any]) -> str:
    """Speed-up over plain decoding, workload x row, from a ``bench-<label>.json``."""
    rows = [e for e in bench["rows"] if e["row"] != "plain"]
    names = list(dict.fromkeys(e["row"] for e in rows))
    workloads = list(dict.fromkeys(e["workload"] for e in bench["rows"]))
    cell = {(e["workload"], e["row"]): e.get("speedup_vs_plain") for e in rows}
    plain = {e["workload"]: e["tokens_per_s"] for e in bench["rows"] if e["row"] == "plain"}
    lines = ["| workload | plain tok/s | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for w in workloads:
        values = ["-" if cell.get((w, n)) is None else f"{cell[(w, n)]:.2f}" for n in names]
        lines.append(f"| {w} | {plain.get(w, 0.0):.1f} | " + " | ".join(values) + " |")
    return "\n".join(lines)


PASS_CELLS = ((1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (4, 1), (8, 1), (8, 4), (16, 1), (16, 4))


def render_pass_cost(result: dict[str, Any]) -> str:
    """ms per pass (and x one 1-row, 1-token step), rows x tokens, from a ``pass-cost-<label>.json``."""
    by = {(r["rows"], r["tokens"]): r for r in result["rows"]}
    cells = [c for c in PASS_CELLS if c in by]
    lines = ["| rows x tokens | " + " | ".join(f"{b}x{t}" for b, t in cells) + " |", "|---" * (len(cells) + 1) + "|"]
    for engine, name in (("ours", "slot engine"), ("hf", "HF-wrapped")):
        lines.append(f"| {name} | " + " | ".join(
            f"{by[c][f'{engine}_ms']:.1f} ({by[c][f'{engine}_x_step']:.2f})" for c in cells) + " |")
    return "\n".join(lines)


MODE_LABELS = {"serial": "serial (one at a time)", "off": "batched, speculation off", "always": "always on",
               "load_aware": "load-aware"}


def render_concurrency(summary: dict[str, Any]) -> str:
    """Aggregate tok/s per serving mode and stream count, from a ``concurrency-<label>.json``."""
    modes = list(dict.fromkeys(r["mode"] for r in summary["rows"]))
    levels = sorted({r["concurrency"] for r in summary["rows"]})
    rate = {(r["mode"], r["concurrency"]): r["tokens_per_s"] for r in summary["rows"]}
    lines = ["| streams | " + " | ".join(MODE_LABELS.get(m, m) + " tok/s" for m in modes) + " |",
             "|---" * (len(modes) + 1) + "|"]
    for c in levels:
        lines.append(f"| {c} | " + " | ".join("-" if (m, c) not in rate else f"{rate[(m, c)]:.1f}" for m in modes) + " |")
    return "\n".join(lines)


def _json(name: str) -> Callable[[Path], dict[str, Any]]:
    def load(results: Path) -> dict[str, Any]:
        path = results / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the result file {path}: {exc}") from None
    return load


def _headline(results: Path) -> dict[str, Any]:
    path = results / "headline.json"
    if not path.is_file():
        raise ConfigError(f"no headline file {path}")
    try:
        return read_headline(path)
    except ValueError as exc:
        raise ConfigError(f"cannot read the headline file {path}: {exc}") from None


# block name -> (its source under benchmarks/results/, its renderer)
BLOCKS: dict[str, tuple[Callable[[Path], dict[str, Any]], Callable[[dict[str, Any]], str]]] = {
    "headline": (_headline, render_headline),
    "methods": (_json("bench-cpu.json"), render_methods),
    "pass-cost": (_json("pass-cost-cpu.json"), render_pass_cost),
    "concurrency": (_json("concurrency-cpu.json"), render_concurrency),
}


def render_text(text: str, results: Path = DEFAULT_OUT) -> str:
    """``text`` with every rendered block filled from ``results``; a file with an unknown block
    name is an error."""
    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in BLOCKS:
            raise ConfigError(f"unknown rendered block {name!r} (known: {sorted(BLOCKS)})")
        load, render = BLOCKS[name]
        return match.group(1) + render(load(results)) + "\n" + match.group(4)

    return _BLOCK.sub(fill, text)


def blocks_in(text: str) -> list[str]:
    return [m.group("name") for m in _BLOCK.finditer(text)]


def render_docs(root: Path = REPO, results: Path | None = None, *, check: bool = False) -> list[Path]:
    """Render the blocks of README.md and the docs pages from the result files in ``results``
    (default: the repository's ``benchmarks/results``); returns the files that were stale
    (rewritten unless ``check``). Every file is rendered before any is written."""
    results = results if results is not None else root / "benchmarks" / "results"
    rendered = []
    for name in DOC_FILES:
        path = root / name
        text = path.read_text()
        rendered.append((path, text, render_text(text, results)))
    stale = []
    for path, text, new in rendered:
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
    return stale


__all__ = ["BLOCKS", "DOC_FILES", "HEADLINE_ROWS", "HeadlineRow", "blocks_in", "render_docs", "render_headline", "render_text"]
