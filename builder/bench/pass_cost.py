"""Where target time goes: the cost of one batched pass by rows in the batch x tokens per row,
the slot engine (compact Llama forward, static KV cache) against the Hugging Face path
(:class:`~triton_backend.engines.torch.hf_batched.HFBatchedEngine` over the previous default
runtime), the same weights, in one process, interleaved.

Every row sits on its own slot over a warm cache of ``context`` tokens and writes ``tokens``
new ones at position ``context``; the next measurement starts there again (rollback by start
position), so every pass sees the same cache. Speculation pays only when verifying k + 1
tokens costs little more than one step, and batching pays when B rows cost little more than
one: this table is both curves.

Headline figures (:mod:`builder.headline`): ``engine_plain_decode_x_hf`` (one row x one
token: HF pass time / ours, i.e. our single-stream plain tokens/s over HF's) and
``engine_decode_throughput_8_over_1`` (ours: tokens/s of 8 decode rows in one pass over 1 row).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from builder.bench.rows import torch_threads
from builder.bench.writer import ReportTarget
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.batch import BatchRow
from triton_backend.core.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_BATCH = (1, 2, 4, 8, 16)
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)
ENGINES = ("ours", "hf")


@dataclass(frozen=True)
class PassCostConfig:
    target: str
    sizes: tuple[int, ...] = DEFAULT_SIZES  # tokens per row
    batch: tuple[int, ...] = DEFAULT_BATCH  # rows per pass
    context: int = 200
    repeats: int = 9
    num_threads: int = 1
    packed_gemm_rows: int = RuntimeConfig().packed_gemm_rows
    row_kernel: bool = RuntimeConfig().row_kernel  # ours: the row-invariant CPU matmul (engines/row_gemm.py)
    device: str = "cpu"  # the engines' device ("cpu", "cuda", "cuda:N")

    def __post_init__(self) -> None:
        if not self.sizes or not self.batch or min(self.sizes) < 1 or min(self.batch) < 1:
            raise ConfigError("pass sizes and batch sizes must be positive")
        if self.context < 1 or self.repeats < 1:
            raise ConfigError("context and repeats must be positive")


def load_engines(config: PassCostConfig, max_rows: int) -> dict[str, Any]:
    """Both engines over one set of weights (loaded once)."""
    from triton_backend.engines.torch.hf_batched import HFBatchedEngine
    from triton_backend.engines.torch.llama_engine import LlamaEngine
    from triton_backend.engines.torch.hf_engine import TorchEngine
    from triton_backend.engines.torch.model_loading import load_model

    runtime = RuntimeConfig(num_threads=config.num_threads, packed_gemm_rows=config.packed_gemm_rows,
                            row_kernel=config.row_kernel, device=config.device, max_batch_size=max_rows, max_seq_len=config.context + max(config.sizes) + 1)
    model = load_model(config.target, runtime)
    ours = LlamaEngine(model, name="ours", runtime=runtime, eos_token_ids=[])
    hf = HFBatchedEngine(TorchEngine(model, name="hf", runtime=runtime, eos_token_ids=[]), max_rows)
    return {"ours": ours, "hf": hf}


def _warm_slots(engine: Any, rows: int, context: list[int]) -> list[int]:
    slots = [engine.allocate() for _ in range(rows)]
    for slot in slots:
        engine.forward([BatchRow(slot, 0, context)])
    return slots


def _pass_seconds(engine: Any, slots: list[int], start: int, tokens: list[int]) -> float:
    rows = [BatchRow(slot, start, tokens, num_logits=len(tokens)) for slot in slots]
    _synchronize()
    t0 = time.perf_counter()
    engine.forward(rows)
    _synchronize()  # a CUDA pass runs asynchronously: time it to its end
    return time.perf_counter() - t0


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure_pass_cost(config: PassCostConfig) -> dict:
    """Median seconds per pass for each (rows, tokens) and engine, and the derived ratios."""
    batch, sizes = sorted(set(config.batch) | {1}), sorted(set(config.sizes) | {1})
    engines = load_engines(config, max(batch))
    vocab = min(e.vocab_size for e in engines.values())
    context = [(13 * i + 5) % vocab for i in range(config.context)]
    slots = {name: _warm_slots(e, max(batch), context) for name, e in engines.items()}
    cells = [(b, n) for b in batch for n in sizes]
    times: dict[tuple[str, int, int], list[float]] = {(e, b, n): [] for e in engines for b, n in cells}
    # HF on as many torch threads as our row kernel runs (ours keeps one torch thread: its kernel has its own)
    ours_threads = getattr(engines["ours"], "threads", config.num_threads)
    threads = {name: config.num_threads if name == "ours" else max(config.num_threads, ours_threads) for name in engines}
    for name, engine in engines.items():  # warm-up
        with torch_threads(threads[name]):
            _pass_seconds(engine, slots[name][:max(batch)], config.context, [7] * max(sizes))
    with tqdm(total=config.repeats * len(cells) * len(engines), desc="pass cost", unit="pass") as bar:
        for _ in range(config.repeats):
            for b, n in cells:
                drafted = [(7 * i + 11) % vocab for i in range(n)]
                for name, engine in engines.items():
                    with torch_threads(threads[name]):  # (a multi-threaded engine's threads settle after)
                        times[(name, b, n)].append(_pass_seconds(engine, slots[name][:b], config.context, drafted))
                    bar.update(1)
    med = {key: statistics.median(v) for key, v in times.items()}
    rows = []
    for b, n in cells:
        row: dict = {"rows": b, "tokens": n}
        for name in engines:
            row[f"{name}_ms"] = med[(name, b, n)] * 1e3
            row[f"{name}_x_step"] = med[(name, b, n)] / med[(name, 1, 1)]
        row["speedup"] = med[("hf", b, n)] / med[("ours", b, n)]
        rows.append(row)
    headline = {"engine_plain_decode_x_hf": med[("hf", 1, 1)] / med[("ours", 1, 1)]}
    if 8 in batch:
        headline["engine_decode_throughput_8_over_1"] = 8 * med[("ours", 1, 1)] / med[("ours", 8, 1)]
    return {"config": {"target": config.target, "context": config.context, "repeats": config.repeats,
                       "threads": ours_threads, "hf_threads": threads["hf"], "device": config.device, "packed_gemm_rows": config.packed_gemm_rows,
                       "row_kernel": engines["ours"].forward_impl.row_invariant},
            "rows": rows, "headline": headline}


def pass_cost_markdown(result: dict) -> str:
    cfg = result["config"]
    kernel = "row-invariant CPU kernel" if cfg.get("row_kernel") else "torch kernels"
    lines = [f"Batched pass cost on a {cfg['context']}-token cached context per row ({cfg['target']}, float32, "
             f"{cfg['threads']} thread(s) (HF: {cfg.get('hf_threads', cfg['threads'])} torch threads), median of "
             f"{cfg['repeats']}; ours on the {kernel}); x step = pass time / one "
             "row x one token of the same engine; speedup = HF ms / ours ms.", "",
             "| rows | tokens per row | ours ms | ours x step | HF ms | HF x step | speedup |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['rows']} | {r['tokens']} | {r['ours_ms']:.1f} | {r['ours_x_step']:.2f} | {r['hf_ms']:.1f} | "
                     f"{r['hf_x_step']:.2f} | {r['speedup']:.2f} |")
    lines += ["", "Headline: " + ", ".join(f"{k} = {v:.2f}" for k, v in result["headline"].items())]
    return "\n".join(lines) + "\n"


def write_pass_cost(result: dict, target: ReportTarget) -> dict[str, Path]:
    """The table's markdown and JSON in ``target.out_dir``; its headline figures merged into
    ``target.headline`` (see :func:`builder.bench.config.headline_file`; None: not written)."""
    out_dir, label, headline = target.out_dir, target.label, target.headline
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / f"pass-cost-{label}.md", "json": out_dir / f"pass-cost-{label}.json"}
    paths["markdown"].write_text(pass_cost_markdown(result))
    from builder.report_paths import portable

    paths["json"].write_text(json.dumps(portable(result), indent=2) + "\n")
    if headline is not None:
        from builder.headline import device_keys, update_headline

        figures = device_keys(result["headline"], result["config"].get("device", "cpu"))
        update_headline({k: round(v, 3) for k, v in figures.items()}, headline)
        paths["headline"] = headline
    return paths
