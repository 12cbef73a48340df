"""The torch runtime serving a TensorRT-LLM checkpoint's own tensors (what ``specbuild build``
exports with Model Optimizer and ``trtllm-build`` would compile), for Llama-family models:

=======================  ============================================================================
``quant_algo``           linear tensors (``<name>.weight``, ``.weights_scaling_factor``, ...)
=======================  ============================================================================
none (fp16/bf16)         16-bit ``weight [out, in]``: served as 16-bit weights, float32 accumulation
``W4A16_AWQ``            ``weight`` int8 ``[out / 2, in]`` (two int4 per byte, the low nibble the even
                         output row), ``weights_scaling_factor [out, in / group]``,
                         ``prequant_scaling_factor [in]`` (AWQ's factor on the activations)
``W8A16``                ``weight`` int8 ``[out, in]``, ``weights_scaling_factor [out]``
``W8A8_SQ_PER_CHANNEL``  as ``W8A16`` plus SmoothQuant's ``prequant_scaling_factor [in]``; served
                         weight-only (activations stay float32; TensorRT-LLM also quantizes them)
``FP8``                  ``weight`` float8_e4m3fn ``[out, in]``, ``weights_scaling_factor`` one float32
                         (``amax / 448``; qkv and fc + gate share one, as TensorRT-LLM fuses them);
                         served weight-only: activations stay float32, where TensorRT-LLM's FP8 GEMMs
                         also quantize them (``activation_scaling_factor``), so logits can differ from
                         a GPU FP8 engine's; exactness holds against plain decoding of these weights
=======================  ============================================================================

TensorRT-LLM's names map to the Hugging Face layers the slot engine runs: ``attention.qkv`` (q, k and
v stacked by output rows) -> ``q_proj``/``k_proj``/``v_proj``, ``attention.dense`` -> ``o_proj``,
``mlp.fc`` -> ``gate_proj``, ``mlp.gate`` -> ``up_proj``, ``mlp.proj`` -> ``down_proj``. The embedding,
norms and LM head are 16-bit in the checkpoint; :func:`apply_checkpoint` copies them into the float
model (their float32 values then equal the checkpoint's) and serves the head in its 16-bit type.

A tensor-parallel checkpoint (``rank0`` .. ``rank<TP-1>.safetensors``) is merged back into this layout
first (:mod:`~triton_backend.engines.torch.trtllm_shards`); pipeline-parallel ones are refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from triton_backend.core.runtime_config import WeightPrecision
from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.torch.compact_weights import HEAD, CompactLinear
from triton_backend.engines.torch.trtllm_shards import merge_ranks
from triton_backend.engines.torch.weight_gemm import pack_float, pack_fp8, pack_int4, pack_int8

logger = logging.getLogger(__name__)

_PRECISIONS = {None: None, "W4A16_AWQ": WeightPrecision.INT4, "W8A16": WeightPrecision.INT8,
               "W8A8_SQ_PER_CHANNEL": WeightPrecision.INT8, "FP8": WeightPrecision.FP8}
_MLP = {"mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}


@dataclass(frozen=True)
class CheckpointWeights:
    """A checkpoint read for the torch runtime: its linears (HF names) in their compact form, the
    16-bit float tensors under HF names, the precision its linears hold and its int4 group size."""

    precision: WeightPrecision
    group_size: int
    linears: dict[str, CompactLinear]
    floats: dict[str, torch.Tensor]


def unpack_rows_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[out / 2, in]`` bytes -> ``[out, in]`` int8 values in ``[-8, 7]`` (low nibble: even row)."""
    b = packed.view(torch.uint8).to(torch.int16)
    low, high = b & 0xF, (b >> 4) & 0xF
    both = torch.stack([low, high], dim=1).reshape(2 * packed.shape[0], packed.shape[1])
    return torch.where(both >= 8, both - 16, both).to(torch.int8)


def _linear(tensors: dict[str, torch.Tensor], name: str, algo: str | None, group: int) -> list[tuple[torch.Tensor, ...]]:
    """``(values, scales, input_scale)`` of one checkpoint linear, values unpacked to ``[out, in]``."""
    weight = tensors[f"{name}.weight"]
    pre = tensors.get(f"{name}.prequant_scaling_factor")
    pre = None if pre is None else pre.float().reshape(-1)
    if algo is None:
        return [(weight, None, None)]
    scales = tensors[f"{name}.weights_scaling_factor"].float()
    if algo == "W4A16_AWQ":
        q = unpack_rows_int4(weight)
        if scales.shape != (q.shape[0], q.shape[1] // group):
            raise ModelLoadError(f"{name}: int4 scales {tuple(scales.shape)} do not match {tuple(q.shape)} in groups of {group}")
        return [(q, scales, pre)]
    if algo == "FP8":
        if weight.dtype != torch.float8_e4m3fn or scales.numel() not in (1, weight.shape[0]):
            raise ModelLoadError(f"{name}: fp8 weight {weight.dtype} {tuple(weight.shape)} with scales {tuple(scales.shape)}")
        return [(weight, scales.reshape(-1).expand(weight.shape[0]).contiguous(), None)]
    if weight.dtype != torch.int8 or scales.reshape(-1).shape != (weight.shape[0],):
        raise ModelLoadError(f"{name}: int8 weight {weight.dtype} {tuple(weight.shape)} with scales {tuple(scales.shape)}")
    return [(weight, scales.reshape(-1), pre)]


def _compact(values: torch.Tensor, scales: torch.Tensor | None, pre: torch.Tensor | None, algo: str | None,
             group: int) -> CompactLinear:
    if algo is None:
        return CompactLinear(pack_float(values.contiguous()))
    if algo == "W4A16_AWQ":
        weight = pack_int4(values.contiguous(), scales.contiguous(), group)
    elif algo == "FP8":
        try:
            weight = pack_fp8(values.contiguous(), scales.contiguous())
        except ValueError as exc:  # NaN bytes
            raise ModelLoadError(f"the checkpoint's fp8 weights: {exc}") from None
    else:
        weight = pack_int8(values.contiguous(), scales.contiguous())
    return CompactLinear(weight, pre)


def _read_ranks(folder: Path, model_config: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The checkpoint's config and its tensors in the single-rank layout (TP ranks merged)."""
    from safetensors.torch import load_file

    try:
        config = json.loads((folder / "config.json").read_text())
        mapping = config.get("mapping") or {}
        tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
        if pp != 1 or tp < 1:
            raise ModelLoadError(f"{folder}: the torch runtime reads tensor-parallel checkpoints (PP = 1), got {mapping}")
        ranks = [load_file(str(folder / f"rank{r}.safetensors")) for r in range(tp)]
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the TensorRT-LLM checkpoint in {folder}: {exc}") from None
    if tp == 1:
        return config, ranks[0]
    merged = merge_ranks(ranks, config, model_config)
    logger.info("merged the %d TP ranks of %s", tp, folder)
    return config, merged


def read_checkpoint(folder: str | Path, model_config: Any) -> CheckpointWeights:
    """The tensors of the TensorRT-LLM checkpoint in ``folder`` (``config.json`` + ``rank<r>.safetensors``,
    any TP, PP = 1) for a model of ``model_config`` (the Hugging Face config: head counts)."""
    folder = Path(folder)
    config, tensors = _read_ranks(folder, model_config)
    quant = config.get("quantization") or {}
    algo = quant.get("quant_algo")
    if algo not in _PRECISIONS:
        raise ModelLoadError(f"{folder}: quant_algo {algo!r} has no torch-runtime kernel (served: "
                             f"{', '.join(str(a) for a in _PRECISIONS)})")
    group = int(quant.get("group_size") or 128) if algo == "W4A16_AWQ" else 0
    float_precision = WeightPrecision.BFLOAT16 if config.get("dtype") == "bfloat16" else WeightPrecision.FLOAT16
    heads, hidden = int(model_config.num_attention_heads), int(model_config.hidden_size)
    head_dim = int(getattr(model_config, "head_dim", None) or hidden // heads)
    kv = int(getattr(model_config, "num_key_value_heads", None) or heads) * head_dim
    linears: dict[str, CompactLinear] = {}
    floats = {"model.embed_tokens.weight": tensors["transformer.vocab_embedding.weight"],
              "model.norm.weight": tensors["transformer.ln_f.weight"]}
    for i in range(int(model_config.num_hidden_layers)):
        t, h = f"transformer.layers.{i}.", f"model.layers.{i}."
        floats[h + "input_layernorm.weight"] = tensors[t + "input_layernorm.weight"]
        floats[h + "post_attention_layernorm.weight"] = tensors[t + "post_layernorm.weight"]
        (values, scales, pre), = _linear(tensors, t + "attention.qkv", algo, group)
        bounds = [0, heads * head_dim, heads * head_dim + kv, heads * head_dim + 2 * kv]
        if values.shape[0] != bounds[-1]:
            raise ModelLoadError(f"{t}attention.qkv has {values.shape[0]} rows, the model's q, k, v {bounds[-1]}")
        for part, (a, b) in zip(("q", "k", "v"), zip(bounds, bounds[1:])):
            linears[h + f"self_attn.{part}_proj"] = _compact(values[a:b], None if scales is None else scales[a:b],
                                                             None if pre is None else pre.clone(), algo, group)
        for src, dst in (("attention.dense", "self_attn.o_proj"), *_MLP.items()):
            (values, scales, pre), = _linear(tensors, t + src, algo, group)
            linears[h + dst] = _compact(values, scales, pre, algo, group)
    if "lm_head.weight" in tensors:
        linears[HEAD] = CompactLinear(pack_float(tensors["lm_head.weight"].contiguous()))
    precision = _PRECISIONS[algo] or float_precision
    logger.info("read TensorRT-LLM checkpoint %s: %s linears (quant_algo %s%s)", folder, precision.value, algo,
                f", groups of {group}" if group else "")
    return CheckpointWeights(precision, group, linears, floats)


def apply_checkpoint(model: torch.nn.Module, checkpoint: CheckpointWeights) -> dict[str, CompactLinear]:
    """Copy the checkpoint's float tensors (embedding, norms) into ``model`` in place and return its
    linears for the engine (:class:`~triton_backend.engines.torch.llama_engine.LlamaEngine`'s ``compact``)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, value in checkpoint.floats.items():
            if params[name].shape != value.shape:
                raise ModelLoadError(f"checkpoint tensor {name} {tuple(value.shape)} does not fit the model's "
                                     f"{tuple(params[name].shape)}")
            params[name].copy_(value.to(params[name].dtype))
    return dict(checkpoint.linears)


__all__ = ["CheckpointWeights", "apply_checkpoint", "read_checkpoint", "unpack_rows_int4"]
