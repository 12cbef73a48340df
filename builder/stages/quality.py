"""The build's quality stage: what a plan's precision costs, measured on the weights the deployment
serves.

For each model (target, draft) whose planned precision the torch runtime holds in a compact form
(:func:`builder.plan.memory.torch_weight_precision`: int4_awq -> int4, int8_sq -> weight-only int8,
fp16 / bf16 -> 16-bit, fp8 -> weight-only e4m3), the slot engine serves those weights as the build's deployment does -- the
exported TensorRT-LLM checkpoint's own tensors where the build wrote a single-rank one, else the float
weights quantized at load (round to nearest, the LM head 16-bit) -- and is compared with the float32
model:

* greedy agreement (:mod:`builder.eval.agreement`): the float32 model's greedy continuation of
  ``quality.max_tokens`` tokens for each of ``quality.prompts`` held-out prompts, read teacher-forced
  by the served weights; the share of positions whose argmax is float32's token;
* perplexity (:mod:`builder.eval.perplexity`) of both on a held-out text that is not the
  calibration text, and their ratio.

A model below ``quality.min_agreement`` or above ``quality.max_ppl_ratio`` gets a warning (logged and
among the build's notices). A model whose float32 copy would not fit this machine's available
memory is not measured; the manifest and the notices say so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.errors import BuildSpecError
from builder.eval.agreement import HELDOUT_PROMPTS, greedy_agreement, greedy_references, heldout_prompts, prompt_ids
from builder.eval.perplexity import HELDOUT_TEXT, perplexity, text_windows
from builder.plan.architecture import ModelArchitecture
from builder.plan.memory import torch_weight_precision
from builder.plan.spec import QualitySpec
from builder.plan.types import ModelPlan
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

LOAD_FACTOR = 2.5  # a float32 model loading: its parameters, plus the transient copies of loading and quantizing


@dataclass(frozen=True)
class QualityTarget:
    """One model to measure: its source, the precision the deployment serves it in, and from where."""

    role: str
    source: str
    arch: ModelArchitecture
    precision: WeightPrecision
    checkpoint: Path | None  # the exported checkpoint the deployment serves; None: quantized at load
    checkpoint_label: str | None = None  # its folder relative to the build
    int4_group_size: int = 0


def quality_target(role: str, source: str, arch: ModelArchitecture, planned: ModelPlan,
                   checkpoint: Path | None, checkpoint_label: str | None) -> QualityTarget | str:
    """What to measure for ``role``, or why it is not measured."""
    served = torch_weight_precision(planned.precision)
    if served is WeightPrecision.FLOAT32:  # every planned precision has its torch kernel: only float32 lands here
        return "float32: nothing to compare"
    return QualityTarget(role, source, arch, served, checkpoint, checkpoint_label, planned.int4_group_size or 0)


def available_memory() -> int | None:
    """Bytes this machine can give a new allocation now (``MemAvailable``), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_needed(arch: ModelArchitecture) -> int:
    """What measuring one model needs at its peak: one float32 copy loading (the engines run in turn)."""
    return int(arch.hf_params * 4 * LOAD_FACTOR)


def too_large(arch: ModelArchitecture, available: int | None) -> str | None:
    need = memory_needed(arch)
    if available is not None and need > available:
        return (f"its float32 copy needs about {need / 2**30:.1f} GiB to measure and this machine has "
                f"{available / 2**30:.1f} GiB available")
    return None


def _runtime(length: int, threads: int, weights: WeightPrecision = WeightPrecision.FLOAT32,
             group: int = 0) -> RuntimeConfig:
    return RuntimeConfig(num_threads=threads, max_batch_size=1, max_seq_len=length, weights=weights,
                         int4_group_size=group, quantize_lm_head=False)  # the head 16-bit, as the deployment renders it


def measure_quality(target: QualityTarget, spec: QualitySpec, threads: int = 1) -> dict[str, Any]:
    """The manifest's record of ``target`` (see the module docstring); loads each engine in turn."""
    from triton_backend.engines.torch.model_loading import load_engine, load_tokenizer

    text_path = Path(spec.text_file) if spec.text_file else HELDOUT_TEXT
    if not text_path.is_file():
        raise BuildSpecError(f"quality.text_file {text_path} not found")
    tokenizer = load_tokenizer(target.source)
    prompts = heldout_prompts(HELDOUT_PROMPTS, spec.prompts)
    windows = text_windows(tokenizer, text_path.read_text(), spec.text_tokens, spec.window)
    if not windows:
        raise BuildSpecError(f"quality.text_file {text_path} has fewer than 2 tokens")
    longest = max(len(prompt_ids(tokenizer, p)) for p in prompts) + spec.max_tokens
    length = max(longest, spec.window) + 1
    base, _ = load_engine(target.source, _runtime(length, threads), name=f"{target.role}-float32")
    references = greedy_references(base, tokenizer, prompts, spec.max_tokens)
    float_ppl, tokens = perplexity(base, windows)
    del base
    if target.checkpoint is not None:
        served, _ = load_engine(target.source, _runtime(length, threads), name=f"{target.role}-checkpoint",
                                checkpoint=target.checkpoint)
    else:
        served, _ = load_engine(target.source, _runtime(length, threads, target.precision, target.int4_group_size),
                                name=f"{target.role}-{target.precision.value}")
    agreement = greedy_agreement(served, references)
    served_ppl, _ = perplexity(served, windows)
    record = {
        "precision": target.precision.value,
        "served": (f"checkpoint {target.checkpoint_label}" if target.checkpoint is not None else "quantized at load"),
        "kernel": served.kernel_name,
        "method": {"agreement": "teacher-forced share of float32's greedy tokens",
                   "prompts": len(references), "max_tokens": spec.max_tokens, "prompts_file": HELDOUT_PROMPTS.name,
                   "perplexity_text": text_path.name, "perplexity_tokens": tokens, "window": spec.window},
        "greedy_agreement": round(agreement, 4),
        "perplexity": {"float32": round(float_ppl, 4), "served": round(served_ppl, 4),
                       "ratio": round(served_ppl / float_ppl, 4)},
        "thresholds": {"min_agreement": spec.min_agreement, "max_ppl_ratio": spec.max_ppl_ratio},
    }
    record["warnings"] = quality_warnings(target.role, record, spec)
    return record


def quality_warnings(role: str, record: dict[str, Any], spec: QualitySpec) -> list[str]:
    """The record's threshold breaches, as the build's notices word them."""
    out = []
    what = f"quality, {role} ({record['precision']}, {record['served']})"
    if record["greedy_agreement"] < spec.min_agreement:
        out.append(f"{what}: greedy agreement with float32 {record['greedy_agreement']:.3f} is below "
                   f"quality.min_agreement {spec.min_agreement:g}")
    ppl = record["perplexity"]
    if ppl["ratio"] > spec.max_ppl_ratio:
        out.append(f"{what}: perplexity {ppl['served']:.2f} vs float32 {ppl['float32']:.2f} (x{ppl['ratio']:.3f}) "
                   f"is above quality.max_ppl_ratio {spec.max_ppl_ratio:g}")
    return out


def run_quality(targets: list[QualityTarget | tuple[str, str]], spec: QualitySpec, threads: int = 1,
                available: int | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``(manifest section, notices)`` for each role: a :class:`QualityTarget` measured, or a
    ``(role, reason)`` recorded as skipped. ``available``: memory to plan with (None: this machine's)."""
    section: dict[str, dict[str, Any]] = {}
    notices: list[str] = []
    available = available_memory() if available is None else available
    for item in targets:
        if isinstance(item, tuple):
            role, reason = item
        else:
            role, reason = item.role, too_large(item.arch, available)
            if reason is None:
                try:
                    section[role] = record = measure_quality(item, spec, threads)
                except ModelLoadError as exc:
                    reason = f"the slot engine cannot serve it: {exc}"
                else:
                    for warning in record["warnings"]:
                        logger.warning(warning)
                    notices += record["warnings"]
                    logger.info("%s", quality_line(role, record))
                    continue
        notices.append(f"quality, {role}: not measured ({reason})")
        section[role] = {"skipped": reason}
    return section, notices


def quality_line(role: str, record: dict[str, Any]) -> str:
    """One line for the build's output."""
    if "skipped" in record:
        return f"quality {role}: not measured ({record['skipped']})"
    m, ppl = record["method"], record["perplexity"]
    return (f"quality {role}: {record['precision']} ({record['served']}): greedy agreement {record['greedy_agreement']:.3f} "
            f"over {m['prompts']} prompts x {m['max_tokens']} tokens; perplexity {ppl['float32']:.2f} (float32) -> "
            f"{ppl['served']:.2f} (x{ppl['ratio']:.3f}) on {m['perplexity_tokens']} tokens")


__all__ = ["QualityTarget", "measure_quality", "quality_line", "quality_target", "quality_warnings", "run_quality"]
