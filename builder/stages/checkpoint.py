"""One model's TensorRT-LLM checkpoint: load in float32, (attach Medusa heads,) calibrate and
quantize with modelopt, export per TP rank, check what was written."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

from builder.plan.architecture import ModelArchitecture
from builder.stages.calibration import load_calibration_texts, make_forward_loop
from builder.stages.checkpoint_export import export_checkpoint
from builder.plan.types import Plan
from builder.stages.quantize import quantize_model
from builder.plan.spec import BuildSpec, ModelSpec

logger = logging.getLogger(__name__)


def build_checkpoint(spec: BuildSpec, plan: Plan, role: str, model_spec: ModelSpec, arch: ModelArchitecture,
                     out: Path, device: str = "cpu") -> dict[str, Any]:
    """Quantize and export ``role``'s model into ``out/checkpoints/<role>``; returns what the
    manifest records about it."""
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.engines.torch.model_loading import load_model, load_tokenizer

    precision = plan.precision_of(role)
    assert precision is not None
    kv = plan.kv_cache_dtype
    tokenizer = load_tokenizer(model_spec.source)
    model = load_model(model_spec.source, RuntimeConfig(dtype="float32")).to(device).eval()
    if role == "target" and spec.medusa is not None:
        from builder.stages.medusa_heads import attach_medusa_heads

        attach_medusa_heads(model, spec.medusa)
    texts = load_calibration_texts(spec.calibration)
    loop = make_forward_loop(tokenizer, texts, spec.calibration.max_length, device)
    planned = plan.model(role)
    group = planned.int4_group_size if planned is not None else None
    quant = quantize_model(model, precision, kv, loop, group)
    info = export_checkpoint(model, arch, precision, kv, out / "checkpoints" / role, plan.tp, plan.pp, group)
    medusa = None
    if role == "target" and spec.medusa is not None:
        from builder.stages.medusa_heads import record_medusa_tree

        medusa = record_medusa_tree(out / "checkpoints" / role, spec.medusa)
    del model
    gc.collect()
    quantization = info.config.get("quantization") or {}
    return {
        "dir": f"checkpoints/{role}", "architecture": info.config.get("architecture"), "dtype": info.dtype,
        "precision": precision.value, "kv_cache_dtype": kv.value,
        "quant_algo": quantization.get("quant_algo"), "kv_cache_quant_algo": quantization.get("kv_cache_quant_algo"),
        **({"int4_group_size": quantization.get("group_size")} if group else {}),
        "ranks": len(info.files), "calibration_samples": len(texts) if quant.quantized else 0,
        "quantization_seconds": round(quant.seconds, 2), "export_seconds": round(info.seconds, 2),
        "modelopt_version": quant.modelopt_version, **({"medusa": medusa} if medusa else {}),
    }
