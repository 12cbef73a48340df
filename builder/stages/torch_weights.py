"""What the torch runtime (the CPU default) serves from a build, and the weights it loads.

The torch runtime computes in float32, float16 or bfloat16. ``dtype: auto`` picks float32 on CPU
and the planned 16-bit precision on CUDA. On CPU in float32 (one thread) its slot engine holds each
model's linears in the planned precision (:func:`builder.plan.memory.torch_weight_precision`: int4
for int4_awq, weight-only int8 for int8_sq, weight-only fp8 e4m3 for fp8, 16-bit for fp16/bf16): the
exported checkpoint's own tensors when the build wrote one (any TP, its rank files merged; PP = 1),
else the float weights quantized at load. The manifest says what each model is served as.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.plan.memory import torch_weight_precision
from builder.plan.types import Plan
from builder.plan.spec import BuildSpec, Precision, TorchDtype
from triton_backend.core.runtime_config import WeightPrecision

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {Precision.FP16: "float16", Precision.BF16: "bfloat16"}


@dataclass(frozen=True)
class TorchServing:
    device: str
    dtype: str  # float32, float16 or bfloat16
    notes: dict[str, str] = field(default_factory=dict)  # per role: how the planned precision is served
    weights: dict[str, WeightPrecision] = field(default_factory=dict)  # per role (target, draft): its linears

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype, "notes": dict(self.notes),
                "linear_weights": {role: w.value for role, w in self.weights.items()}}


def torch_serving(spec: BuildSpec, plan: Plan) -> TorchServing:
    device = spec.torch_runtime.device
    target = plan.precision_of("target") or Precision.FP16
    if spec.torch_runtime.dtype is not TorchDtype.AUTO:
        dtype = spec.torch_runtime.dtype.value
    elif device == "cpu":
        dtype = "float32"
    else:
        dtype = _TORCH_DTYPES.get(target, "float16")
    kernels = device == "cpu" and dtype == "float32"  # the slot engine's CPU kernels hold compact weights
    notes, weights = {}, {}
    for model in plan.models:
        planned = model.precision
        served = torch_weight_precision(planned) if kernels else WeightPrecision.FLOAT32
        if model.role in ("target", "draft"):
            weights[model.role] = served
        if served is not WeightPrecision.FLOAT32:
            notes[model.role] = (f"planned {planned.value}: the CPU slot engine holds {served.value} linear weights "
                                 f"(float32 accumulation" + (", activations unquantized"
                                                             if planned in (Precision.INT8_SQ, Precision.FP8) else "")
                                 + ")")
        elif planned.is_quantized:
            notes[model.role] = (f"planned {planned.value}: the torch runtime has no {planned.value} kernels here, so it "
                                 f"serves the original weights in {dtype} (the TensorRT-LLM engine runs {planned.value})")
        elif _TORCH_DTYPES[planned] != dtype:
            notes[model.role] = f"planned {planned.value}: the torch runtime on {device} serves {dtype} weights"
        else:
            notes[model.role] = f"served in {dtype}, as planned"
    return TorchServing(device, dtype, notes, weights)


def save_torch_weights(source: str, out_dir: Path, dtype: str) -> Path:
    """The model and its tokenizer as a HF directory in ``dtype``, for the torch runtime."""
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.engines.torch.model_loading import load_model, load_tokenizer

    model = load_model(source, RuntimeConfig(dtype=dtype))
    model.save_pretrained(out_dir)
    load_tokenizer(source).save_pretrained(out_dir)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = dtype
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    logger.info("saved the torch runtime's weights of %s (%s) to %s", source, dtype, out_dir)
    return out_dir


def relative_to_file(path: Path, file_dir: Path) -> str:
    """``path`` relative to ``file_dir``: the deployment file resolves model paths from its
    own folder, so the build folder can move as a whole."""
    return os.path.relpath(path.resolve(), file_dir.resolve())
