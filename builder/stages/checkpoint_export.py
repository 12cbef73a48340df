"""TensorRT-LLM checkpoint export with modelopt: ``config.json`` + ``rank<N>.safetensors``,
one weight file per TP x PP rank, written by ``export_tensorrt_llm_checkpoint``.

After writing, the checkpoint is read back and checked: every rank file present, the
mapping and the quantization algorithms as planned."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.plan.architecture import ModelArchitecture
from builder.errors import BuildError
from builder.plan.spec import KVCacheDtype, Precision

logger = logging.getLogger(__name__)

# quant_algo / kv_cache_quant_algo as TensorRT-LLM's checkpoint config names them
QUANT_ALGOS: dict[Precision, str | None] = {Precision.FP16: None, Precision.BF16: None, Precision.FP8: "FP8",
                                            Precision.INT8_SQ: "W8A8_SQ_PER_CHANNEL", Precision.INT4_AWQ: "W4A16_AWQ"}
KV_ALGOS: dict[KVCacheDtype, str | None] = {KVCacheDtype.FP16: None, KVCacheDtype.FP8: "FP8", KVCacheDtype.INT8: "INT8"}


@dataclass(frozen=True)
class CheckpointInfo:
    directory: Path
    files: tuple[Path, ...]
    config: dict[str, Any]
    dtype: str
    seconds: float


def export_dtype(arch: ModelArchitecture, precision: Precision) -> str:
    """The 16-bit type of everything left unquantized: bf16 when asked or when the model is
    bf16 and quantized, else fp16."""
    if precision is Precision.BF16 or (precision.is_quantized and arch.float_precision == "bf16"):
        return "bfloat16"
    return "float16"


def export_checkpoint(model: Any, arch: ModelArchitecture, precision: Precision, kv: KVCacheDtype,
                      export_dir: Path, tp: int, pp: int, int4_group: int | None = None) -> CheckpointInfo:
    """Write the TensorRT-LLM checkpoint of a (quantized) torch model and check it."""
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    dtype = export_dtype(arch, precision)
    start = time.perf_counter()
    export_dir.mkdir(parents=True, exist_ok=True)
    logger.info("exporting TensorRT-LLM checkpoint to %s (decoder %s, %s, TP %d, PP %d)", export_dir,
                arch.decoder_type.value, dtype, tp, pp)
    try:
        export_tensorrt_llm_checkpoint(model, decoder_type=arch.decoder_type.value, dtype=getattr(torch, dtype),
                                       export_dir=export_dir, inference_tensor_parallel=tp,
                                       inference_pipeline_parallel=pp)
    except (RuntimeError, ValueError, NotImplementedError, AssertionError, KeyError) as exc:
        raise BuildError(f"modelopt could not export the TensorRT-LLM checkpoint: {exc}") from exc
    config, files = check_checkpoint(export_dir, precision, kv, tp, pp, int4_group)
    return CheckpointInfo(export_dir, files, config, dtype, time.perf_counter() - start)


def check_checkpoint(export_dir: Path, precision: Precision, kv: KVCacheDtype, tp: int,
                     pp: int, int4_group: int | None = None) -> tuple[dict[str, Any], tuple[Path, ...]]:
    """The checkpoint's config and rank files; raises :class:`BuildError` when it is not
    what was planned (``int4_group``: the planned AWQ group size)."""
    config_path = export_dir / "config.json"
    if not config_path.is_file():
        raise BuildError(f"export wrote no config.json in {export_dir}")
    config = json.loads(config_path.read_text())
    files = tuple(export_dir / f"rank{r}.safetensors" for r in range(tp * pp))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise BuildError(f"export is missing {missing} in {export_dir}")
    mapping = config.get("mapping", {})
    if (mapping.get("tp_size"), mapping.get("pp_size")) != (tp, pp):
        raise BuildError(f"exported mapping {mapping} is not TP {tp} x PP {pp}")
    quant = config.get("quantization") or {}
    got = (quant.get("quant_algo"), quant.get("kv_cache_quant_algo"))
    want = (QUANT_ALGOS[precision], KV_ALGOS[kv])
    if got != want:
        raise BuildError(f"exported quantization {got} is not the planned {want}")
    if int4_group is not None and quant.get("group_size") != int4_group:
        raise BuildError(f"exported INT4 group size {quant.get('group_size')} is not the planned {int4_group}")
    return config, files
