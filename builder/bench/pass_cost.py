"""Where verification time goes: the cost of one target pass over n tokens, relative to a
one-token decode step, with the runtime's prepacked linear layers and without them.

Speculation pays only when verifying k + 1 tokens costs little more than one step (the
round's cost in :mod:`triton_backend.controller`). This measures that curve on the real
weights, both variants side by side in one process, interleaved, on a warm cache of
``context`` tokens (each pass is rolled back so every measurement sees the same context).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from triton_backend.config import RuntimeConfig
from triton_backend.engines.torch_engine import TorchEngine
from triton_backend.errors import InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 16)


@dataclass(frozen=True)
class PassCostConfig:
    target: str
    sizes: tuple[int, ...] = DEFAULT_SIZES
    context: int = 200
    repeats: int = 9
    num_threads: int = 1
    packed_gemm_rows: int = RuntimeConfig().packed_gemm_rows

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1 or self.context < 1 or self.repeats < 1:
            raise InvalidRequestError("sizes, context and repeats must be positive")


def _pass_seconds(engine: TorchEngine, context: list[int], size: int) -> float:
    session = engine.new_session()
    session.logits(context, 1)
    drafted = [(7 * i + 11) % engine.vocab_size for i in range(size)]
    start = time.perf_counter()
    session.logits(context + drafted, size)  # the context is cached: one pass over `size` new tokens
    return time.perf_counter() - start


def measure_pass_cost(config: PassCostConfig) -> dict:
    """Median seconds per pass for each size and variant, and ratios to the one-token step."""
    from triton_backend.model_loading import load_engine

    variants = {
        "packed": load_engine(config.target, RuntimeConfig(num_threads=config.num_threads,
                                                           packed_gemm_rows=config.packed_gemm_rows))[0],
        "unpacked": load_engine(config.target, RuntimeConfig(num_threads=config.num_threads, packed_gemm_rows=0))[0],
    }
    context = [(13 * i + 5) % min(e.vocab_size for e in variants.values()) for i in range(config.context)]
    sizes = sorted(set(config.sizes) | {1})
    times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in variants for n in sizes}
    for name, engine in variants.items():  # warm-up
        _pass_seconds(engine, context, max(sizes))
    with tqdm(total=config.repeats * len(sizes) * len(variants), desc="pass cost", unit="pass") as bar:
        for _ in range(config.repeats):
            for n in sizes:
                for name, engine in variants.items():
                    times[(name, n)].append(_pass_seconds(engine, context, n))
                    bar.update(1)
    rows = []
    for n in sizes:
        row: dict = {"tokens": n}
        for name in variants:
            med = statistics.median(times[(name, n)])
            row[f"{name}_ms"] = med * 1e3
            row[f"{name}_x_step"] = med / statistics.median(times[(name, 1)])
        row["packed_speedup"] = row["unpacked_ms"] / row["packed_ms"]
        rows.append(row)
    return {"config": {"target": config.target, "context": config.context, "repeats": config.repeats,
                       "threads": config.num_threads, "packed_gemm_rows": config.packed_gemm_rows},
            "rows": rows}


def pass_cost_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"Target pass cost on a {cfg['context']}-token cached context ({cfg['target']}, float32, "
             f"{cfg['threads']} thread(s), median of {cfg['repeats']}); x step = pass time / one-token step "
             f"of the same variant.", "",
             "| tokens per pass | packed ms | packed x step | unpacked ms | unpacked x step | packed speedup |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['tokens']} | {r['packed_ms']:.1f} | {r['packed_x_step']:.2f} | {r['unpacked_ms']:.1f} | "
                     f"{r['unpacked_x_step']:.2f} | {r['packed_speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def write_pass_cost(result: dict, out_dir: Path, label: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / f"pass-cost-{label}.md", "json": out_dir / f"pass-cost-{label}.json"}
    paths["markdown"].write_text(pass_cost_markdown(result))
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    return paths
