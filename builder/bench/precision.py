"""Plain decoding of each weight precision against float32, one process: speed and agreement.

Engines: the slot engine over one loaded model, once per precision (``RuntimeConfig.weights``: the
float weights quantized at load, round to nearest, the LM head too; int4 in the planner's groups),
all on the CPU kernels, one thread. A target whose float32 weights are a GGUF file dequantized (the
reference model: Q4_1 with a Q8_0 embedding) is served at the precision of its blocks from the blocks
themselves (:mod:`~triton_backend.engines.torch.gguf_blocks`: float32's very weights), unless
``gguf_blocks`` is off; the row's ``weights`` says which.

* Speed: one row, one token per pass (a plain decode step, plus its greedy pick) over a warm cache
  of ``context`` tokens; each repeat runs ``steps`` steps per engine in turn (interleaved: a loaded
  machine slows all alike), then rolls every slot back. ``<p>_plain_x_fp32``: the median float32
  step over the median step of precision ``p`` (plain tokens/s over float32's).
* Agreement: for each held-out prompt (``builder/data/heldout_prompts.txt``, chat template) the
  float32 engine's greedy continuation of ``max_tokens`` tokens; each precision then reads prompt +
  continuation in one pass (teacher-forced) and ``<p>_greedy_agreement`` is the share of those
  positions whose argmax is float32's token.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.eval.agreement import HELDOUT_PROMPTS
from builder.bench.writer import ReportTarget
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ConfigError
from triton_backend.core.reference_model import DEFAULT_REFERENCE
from triton_backend.engines.batch import BatchRow

logger = logging.getLogger(__name__)

KEYS = {WeightPrecision.INT8: "int8", WeightPrecision.INT4: "int4", WeightPrecision.FLOAT16: "fp16",
        WeightPrecision.BFLOAT16: "bf16", WeightPrecision.FP8: "fp8"}


@dataclass(frozen=True)
class PrecisionBenchConfig:
    target: str = DEFAULT_REFERENCE
    precisions: tuple[WeightPrecision, ...] = (WeightPrecision.INT8, WeightPrecision.INT4)
    prompts_file: Path = HELDOUT_PROMPTS
    prompts: int = 16  # held-out prompts for the agreement
    max_tokens: int = 64  # greedy tokens per prompt (teacher-forced positions)
    context: int = 128  # cached tokens under the timed decode steps
    steps: int = 32  # decode steps per engine per repeat
    repeats: int = 7
    num_threads: int = 1
    gguf_blocks: bool = True  # a GGUF target's own blocks where they serve a precision (else round to nearest)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precisions", tuple(WeightPrecision(p) for p in self.precisions))
        if WeightPrecision.FLOAT32 in self.precisions or not self.precisions:
            raise ConfigError("precisions: one or more of int8, int4, fp8, float16, bfloat16 (float32 is the baseline)")
        if min(self.prompts, self.max_tokens, self.context, self.steps, self.repeats) < 1:
            raise ConfigError("prompts, max_tokens, context, steps and repeats must be positive")


def load_engines(config: PrecisionBenchConfig) -> tuple[dict[str, Any], dict[str, str], Any]:
    """The float32 engine and one per precision over one loaded model, where each one's weights come
    from (float32, GGUF blocks, round to nearest), and the tokenizer."""
    from triton_backend.engines.torch.llama_engine import LlamaEngine
    from triton_backend.engines.torch.model_loading import gguf_compact, load_model, load_tokenizer, with_head

    length = max(config.context + config.steps + 1, 1024)
    runtimes = {"fp32": RuntimeConfig(num_threads=config.num_threads, max_batch_size=2, max_seq_len=length)}
    for p in config.precisions:
        runtimes[KEYS[p]] = RuntimeConfig(num_threads=config.num_threads, max_batch_size=2, max_seq_len=length, weights=p)
    model = load_model(config.target, runtimes["fp32"])
    engines, sources = {}, {}
    for name, r in runtimes.items():
        compact = gguf_compact(config.target, model.config, r) if config.gguf_blocks else None
        if compact is not None:
            compact = with_head(model, compact, r)
        engines[name] = LlamaEngine(model, name=name, runtime=r, eos_token_ids=[], compact=compact)
        sources[name] = "float32" if name == "fp32" else "GGUF blocks" if compact is not None else "round to nearest"
    for name, engine in engines.items():
        if not engine.forward_impl.row_invariant:
            raise ConfigError(f"{name}: the CPU kernels do not run here (x86-64 with AVX2 + FMA, one torch thread)")
    return engines, sources, load_tokenizer(config.target)


def time_steps(engines: dict[str, Any], config: PrecisionBenchConfig) -> dict[str, list[float]]:
    """Seconds per plain decode step (one row, one token, argmax), per engine, one value per repeat."""
    vocab = min(e.vocab_size for e in engines.values())
    context = [(13 * i + 5) % vocab for i in range(config.context)]
    slots = {}
    for name, engine in engines.items():
        slots[name] = engine.allocate()
        engine.forward([BatchRow(slots[name], 0, context)])
    out: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(config.repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            token, start = context[-1], time.perf_counter()
            for i in range(config.steps):
                logits = engine.forward([BatchRow(slots[name], config.context + i, [token])])[0].logits
                token = int(logits[-1].argmax())
            out[name].append((time.perf_counter() - start) / config.steps)
    for name, engine in engines.items():
        engine.release(slots[name])
    return {name: v[1:] for name, v in out.items()}


def greedy_agreement(engines: dict[str, Any], tokenizer: Any, config: PrecisionBenchConfig) -> dict[str, float]:
    """Share of teacher-forced positions where each precision's argmax is float32's greedy token
    (:mod:`builder.eval.agreement`)."""
    from builder.eval.agreement import greedy_references, heldout_prompts
    from builder.eval.agreement import greedy_agreement as agreement_of

    references = greedy_references(engines["fp32"], tokenizer, heldout_prompts(config.prompts_file, config.prompts),
                                   config.max_tokens)
    return {name: agreement_of(engine, references) for name, engine in engines.items() if name != "fp32"}


def run_precision_bench(config: PrecisionBenchConfig) -> dict:
    engines, sources, tokenizer = load_engines(config)
    steps = time_steps(engines, config)
    med = {name: statistics.median(v) for name, v in steps.items()}
    agreement = greedy_agreement(engines, tokenizer, config)
    rows = []
    for name, engine in engines.items():
        rows.append({"precision": name, "weights": sources[name], "kernel": engine.kernel_name,
                     "linear_mib": engine.linear_weight_bytes() / 2**20,
                     "step_ms": med[name] * 1e3, "tok_s": 1 / med[name], "x_fp32": med["fp32"] / med[name],
                     "agreement": agreement.get(name, 1.0)})
    headline: dict[str, float] = {}
    for name in agreement:
        headline[f"{name}_plain_x_fp32"] = med["fp32"] / med[name]
        headline[f"{name}_greedy_agreement"] = agreement[name]
    return {"config": {"target": config.target, "context": config.context, "steps": config.steps,
                       "repeats": config.repeats, "threads": engines["fp32"].threads, "prompts": config.prompts,
                       "max_tokens": config.max_tokens},
            "rows": rows, "steps_s": steps, "headline": headline}


def precision_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"Plain decoding by weight precision ({cfg['target']}, one row, {cfg['context']}-token context, "
             f"{cfg['threads']} thread(s), median of {cfg['repeats']} x {cfg['steps']} steps, interleaved); agreement: "
             f"teacher-forced share of float32's greedy tokens, {cfg['prompts']} held-out prompts x {cfg['max_tokens']} "
             "tokens.", "",
             "| precision | weights | linear weights MiB | step ms | tok/s | x fp32 | greedy agreement |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['precision']} | {r.get('weights', '-')} | {r['linear_mib']:.0f} | {r['step_ms']:.1f} | {r['tok_s']:.1f} | "
                     f"{r['x_fp32']:.2f} | {r['agreement']:.3f} |")
    lines += ["", "Headline: " + ", ".join(f"{k} = {v:.3f}" for k, v in result["headline"].items())]
    return "\n".join(lines) + "\n"


def write_precision_bench(result: dict, target: ReportTarget) -> dict[str, Path]:
    """Markdown and JSON in ``target.out_dir``; the headline figures merged into ``target.headline``
    (None: not written)."""
    from builder.headline import update_headline

    out_dir, label, headline = target.out_dir, target.label, target.headline
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / f"precision_{label}.md", "json": out_dir / f"precision_{label}.json"}
    paths["markdown"].write_text(precision_markdown(result))
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    if headline is not None:
        update_headline(result["headline"], headline)
        paths["headline"] = headline
    return paths


__all__ = ["PrecisionBenchConfig", "precision_markdown", "run_precision_bench", "write_precision_bench"]
