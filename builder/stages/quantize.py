"""Quantization with NVIDIA Model Optimizer (``nvidia-modelopt``): INT4-AWQ, FP8,
INT8-SmoothQuant weights and an FP8/INT8 KV cache, calibrated on a text set.

The configs are modelopt's own (``mtq.INT4_AWQ_CFG``, ``mtq.FP8_DEFAULT_CFG``,
``mtq.INT8_SMOOTHQUANT_CFG``, ``mtq.FP8_KV_CFG``), copied before the KV-cache entries are
appended, so modelopt's defaults are never mutated.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from builder.errors import BuildError
from builder.plan.spec import KVCacheDtype, Precision

logger = logging.getLogger(__name__)

_WEIGHT_CONFIGS = {Precision.FP8: "FP8_DEFAULT_CFG", Precision.INT8_SQ: "INT8_SMOOTHQUANT_CFG",
                   Precision.INT4_AWQ: "INT4_AWQ_CFG"}
_KV_QUANTIZERS = "*[kv]_bmm_quantizer"


@dataclass(frozen=True)
class QuantizationResult:
    precision: Precision
    kv_cache_dtype: KVCacheDtype
    quantized: bool  # False: nothing to quantize (16-bit weights and KV cache)
    seconds: float
    modelopt_version: str


def needs_quantization(precision: Precision, kv: KVCacheDtype) -> bool:
    return precision.is_quantized or kv in (KVCacheDtype.FP8, KVCacheDtype.INT8)


def _append(cfg: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    quant_cfg = cfg["quant_cfg"]
    if isinstance(quant_cfg, list):
        cfg["quant_cfg"] = quant_cfg + entries
    else:  # older modelopt: a dict of pattern -> settings
        for entry in entries:
            quant_cfg[entry["quantizer_name"]] = entry.get("cfg", {"enable": entry.get("enable", True)})


def _set_int4_group(cfg: dict[str, Any], group: int) -> None:
    """AWQ's block size along the input (``block_sizes[-1]``) in the weight quantizer's entry."""
    quant_cfg = cfg["quant_cfg"]
    entries = quant_cfg if isinstance(quant_cfg, list) else [{"quantizer_name": k, "cfg": v} for k, v in quant_cfg.items()]
    found = False
    for entry in entries:
        settings = entry.get("cfg")
        if entry.get("quantizer_name") == "*weight_quantizer" and isinstance(settings, dict) and "block_sizes" in settings:
            settings["block_sizes"] = {**settings["block_sizes"], -1: group}
            found = True
    if not found:
        raise BuildError("modelopt's INT4-AWQ config has no weight-quantizer block size to set")


def quant_config(precision: Precision, kv: KVCacheDtype, int4_group: int | None = None) -> dict[str, Any]:
    """The modelopt config for these weights and this KV cache (INT4-AWQ in groups of ``int4_group``
    input channels, the plan's choice; modelopt's default 128 when not given)."""
    import modelopt.torch.quantization as mtq

    if precision.is_quantized:
        cfg = copy.deepcopy(getattr(mtq, _WEIGHT_CONFIGS[precision]))
        if precision is Precision.INT4_AWQ and int4_group is not None:
            _set_int4_group(cfg, int4_group)
    elif precision.is_float:
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        raise ValueError(f"precision {precision.value} must be resolved before quantizing")
    if kv is KVCacheDtype.FP8:
        _append(cfg, copy.deepcopy(list(mtq.FP8_KV_CFG["quant_cfg"])))
    elif kv is KVCacheDtype.INT8:
        _append(cfg, [{"quantizer_name": _KV_QUANTIZERS, "cfg": {"num_bits": 8, "axis": None}}])
    return cfg


def quantize_model(model: Any, precision: Precision, kv: KVCacheDtype,
                   forward_loop: Callable[[Any], None], int4_group: int | None = None) -> QuantizationResult:
    """Quantize ``model`` in place (fake-quant modules with calibrated scales)."""
    import modelopt
    import modelopt.torch.quantization as mtq

    start = time.perf_counter()
    if not needs_quantization(precision, kv):
        return QuantizationResult(precision, kv, False, 0.0, modelopt.__version__)
    cfg = quant_config(precision, kv, int4_group)
    logger.info("quantizing %s to %s (KV cache %s) with modelopt %s", type(model).__name__, precision.value,
                kv.value, modelopt.__version__)
    try:
        mtq.quantize(model, cfg, forward_loop)
    except (RuntimeError, ValueError, NotImplementedError, AssertionError) as exc:
        raise BuildError(f"modelopt could not quantize to {precision.value}: {exc}") from exc
    return QuantizationResult(precision, kv, True, time.perf_counter() - start, modelopt.__version__)
