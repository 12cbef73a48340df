"""The slot engine's linear layers in a compact precision (16-bit, int8, fp8, int4): what each layer
holds (:class:`CompactLinear`), made from float weights at load (round to nearest) or read from a
TensorRT-LLM checkpoint (:mod:`~triton_backend.engines.torch.trtllm_weights`).

A layer may carry an ``input_scale`` (AWQ's or SmoothQuant's per-input-channel factor): the layer
computes ``(x * input_scale) W^T``, as TensorRT-LLM's weight-only GEMMs do with a checkpoint's
``prequant_scaling_factor`` (one elementwise product per row: rows stay independent).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.engines.torch.quantize_weights import quantize_fp8, quantize_int4, quantize_int8
from triton_backend.engines.torch.weight_gemm import PackedWeight, pack_float, pack_fp8, pack_int4, pack_int8

logger = logging.getLogger(__name__)

HEAD = "lm_head"  # the LM head's name among the linears
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class CompactLinear:
    """One linear layer's compact weight and optional per-input-channel activation factor."""

    weight: PackedWeight
    input_scale: torch.Tensor | None = None  # float32 [k]

    def nbytes(self) -> int:
        extra = 0 if self.input_scale is None else self.input_scale.numel() * self.input_scale.element_size()
        return self.weight.nbytes() + extra


def linear_names(num_layers: int, *, head: bool) -> list[str]:
    """Every decoder linear of a Llama-family model (HF names, without ``.weight``), then the head."""
    names = [f"model.layers.{i}.{lin}" for i in range(num_layers) for lin in LAYER_LINEARS]
    return names + ([HEAD] if head else [])


def int4_group(widths: Iterable[int], requested: int = 0) -> int:
    """The int4 group size for linears of these input widths: ``requested`` when given (it must
    divide every width), else 128 where it divides every width, else 64 (TensorRT-LLM's AWQ
    kernels run both); raises ``ValueError`` when no such group divides them."""
    widths = list(widths)
    for group in ([requested] if requested else [128, 64]):
        if all(w % group == 0 for w in widths):
            return group
    raise ValueError(f"int4 groups of {requested or '128 or 64'} do not divide the input widths {sorted(set(widths))}")


def compact_linear(weight: torch.Tensor, precision: WeightPrecision, group: int = 0) -> CompactLinear:
    """A float ``[n, k]`` weight in ``precision`` (round to nearest for int8/int4/fp8)."""
    if precision is WeightPrecision.FLOAT16:
        return CompactLinear(pack_float(weight.to(torch.float16).contiguous()))
    if precision is WeightPrecision.BFLOAT16:
        return CompactLinear(pack_float(weight.to(torch.bfloat16).contiguous()))
    if precision is WeightPrecision.INT8:
        return CompactLinear(pack_int8(*quantize_int8(weight)))
    if precision is WeightPrecision.FP8:
        return CompactLinear(pack_fp8(*quantize_fp8(weight)))
    if precision is WeightPrecision.INT4:
        group = group or int4_group([weight.shape[1]])
        return CompactLinear(pack_int4(*quantize_int4(weight, group), group))
    raise ValueError(f"{precision.value} is not a compact precision")


def head_precision(runtime: RuntimeConfig) -> WeightPrecision:
    """The LM head's precision when quantizing at load: ``runtime.weights`` when
    ``runtime.quantize_lm_head`` (or the weights are 16-bit), else float16 (as TensorRT-LLM checkpoints keep it)."""
    quantized = runtime.quantize_lm_head or not runtime.weights.is_quantized
    return runtime.weights if quantized else WeightPrecision.FLOAT16


def compact_linears(tensors: Mapping[str, torch.Tensor], names: list[str], precision: WeightPrecision,
                    group: int = 0) -> dict[str, CompactLinear]:
    """``names`` (their ``<name>.weight`` in ``tensors``) in ``precision``; int4 with one group size
    for the whole model (see :func:`int4_group`)."""
    if precision is WeightPrecision.INT4:
        group = int4_group((tensors[f"{n}.weight"].shape[1] for n in names), group)
    out = {name: compact_linear(tensors[f"{name}.weight"].detach(), precision, group) for name in names}
    total = sum(c.nbytes() for c in out.values())
    logger.info("%d linear layers in %s%s: %.1f MiB", len(out), precision.value,
                f" (groups of {group})" if precision is WeightPrecision.INT4 else "", total / 2**20)
    return out


__all__ = ["CompactLinear", "HEAD", "LAYER_LINEARS", "compact_linear", "compact_linears", "head_precision", "int4_group", "linear_names"]
