"""Typed configuration of the torch runtime: device, precision of the weights, threads, the slot
engine's KV cache, and where a self draft takes its context from. A bad setting raises
:class:`~triton_backend.core.errors.ConfigError` (it comes from a deployment). Re-exported by
:mod:`triton_backend.core.config`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from triton_backend.core.checks import config_check as _config, is_int as _is_int
from triton_backend.core.errors import ConfigError


class WeightPrecision(str, enum.Enum):
    """What the slot engine's linear layers (and LM head) hold: float32, 16-bit (float16,
    bfloat16) or weight-only int8 / fp8 e4m3 (a scale per output channel) / int4 (a scale per group
    of input channels), always accumulated in float32 (``engines/torch/weight_gemm.py``)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT4 = "int4"
    FP8 = "fp8"  # e4m3; activations stay float32 (TensorRT-LLM's FP8 GEMMs quantize them too)

    @property
    def is_quantized(self) -> bool:
        return self in (WeightPrecision.INT8, WeightPrecision.INT4, WeightPrecision.FP8)


class DraftContext(str, enum.Enum):
    """Where a draft over the target's own model (a self draft) gets the keys and values of the
    committed tokens: ``draft``: it runs them itself (the prompt prefilled through the draft);
    ``prompt``: the prompt's are copied from the target's cache after the target's prefill (the
    request's first round is then plain); ``committed``: as ``prompt``, and every round the
    verified positions the draft does not hold (the token after its last accepted draft). Every draft token is verified, so output is the
    same whichever; only acceptance and the draft's prefill time differ."""

    DRAFT = "draft"
    PROMPT = "prompt"
    COMMITTED = "committed"


INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the torch runtime runs: device, dtype, torch threads (``kernel_threads``: the row
    kernel's, a process-wide setting), how many rows the CPU
    float32 linear layers are prepacked for (0: not packed; see ``engines/packed_linear.py``),
    and the slot engine's KV cache (``max_batch_size`` slots x ``max_seq_len`` positions).
    ``weights``: the precision of the slot engine's linear weights (activations stay ``dtype``,
    float32 for anything but float32 weights); float weights are quantized at load (round to
    nearest) unless the engine is given a checkpoint's quantized tensors. ``int4_group_size``: 0
    picks 128 where every input width divides by it, else 64 (the planner's rule).
    ``drafter_weights``: what an EAGLE-3 drafter's linear weights are held in on the CPU kernels
    (None, or ``"stored"`` in a file: as its file stores them). Draft quality only: every draft is
    verified by the target, so the output is the same whichever. int8 (the default) reads a quarter
    of float32's bytes each round, after the target's pass has pushed the drafter out of the cache
    (``docs/drafting-strategy.md``, "The drafter's weights")."""

    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 1
    packed_gemm_rows: int = 8
    # the slot engine (engines/llama_engine.py): KV-cache slots (concurrent sequences) x positions
    max_batch_size: int = 16
    max_seq_len: int = 2048
    batch_invariant: bool = False  # pad one-row passes too: every row bit-identical batched or alone
    row_kernel: bool = True  # CPU float32, one thread: the row-invariant matmul kernel (engines/row_gemm.py) where it builds
    kernel_threads: int = 0  # the row kernel's threads for passes of >= 2 rows (0: this process's cores, up to 8)
    torch_engine: str = "auto"  # auto: the compact Llama forward where it covers the model, else hf
    weights: WeightPrecision = WeightPrecision.FLOAT32
    int4_group_size: int = 0
    quantize_lm_head: bool = True  # quantizing at load: the LM head too (false: float16, as a checkpoint stores it)
    drafter_weights: WeightPrecision | None = WeightPrecision.INT8

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "weights", WeightPrecision(self.weights))
        except ValueError:
            raise ConfigError(f"weights must be one of {[w.value for w in WeightPrecision]}, got {self.weights!r}") from None
        if self.drafter_weights is not None:
            try:
                object.__setattr__(self, "drafter_weights", None if self.drafter_weights == "stored"
                                   else WeightPrecision(self.drafter_weights))
            except ValueError:
                raise ConfigError(f"drafter_weights must be stored or one of {[w.value for w in WeightPrecision]}, "
                                  f"got {self.drafter_weights!r}") from None
        _config(self.int4_group_size == 0 or self.int4_group_size in INT4_GROUP_SIZES,
                f"int4_group_size must be 0 (auto) or one of {INT4_GROUP_SIZES}, got {self.int4_group_size!r}")
        _config(isinstance(self.quantize_lm_head, bool), "quantize_lm_head must be true or false")
        _config(self.weights is WeightPrecision.FLOAT32 or self.dtype == "float32",
                f"{self.weights.value} weights compute in float32: dtype must be float32, got {self.dtype!r}")
        _config(_is_int(self.max_batch_size) and 1 <= self.max_batch_size <= 4096,
                 f"max_batch_size (KV-cache slots) must be in [1, 4096], got {self.max_batch_size!r}")
        _config(_is_int(self.max_seq_len) and 1 <= self.max_seq_len <= 1 << 20,
                 f"max_seq_len must be in [1, 2^20], got {self.max_seq_len!r}")
        _config(isinstance(self.batch_invariant, bool), "batch_invariant must be true or false")
        _config(isinstance(self.row_kernel, bool), "row_kernel must be true or false")
        _config(_is_int(self.kernel_threads) and 0 <= self.kernel_threads <= 16,
                f"kernel_threads must be 0 (auto) or 1..16, got {self.kernel_threads!r}")
        _config(self.torch_engine in ("auto", "llama", "hf"), f"torch_engine must be auto, llama or hf, got {self.torch_engine!r}")
        _config(_is_int(self.packed_gemm_rows) and (self.packed_gemm_rows == 0 or 4 <= self.packed_gemm_rows <= 64),
                 f"packed_gemm_rows must be 0 (off) or 4..64, got {self.packed_gemm_rows!r}")
        _config(self.dtype in ("float32", "float16", "bfloat16"), f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        _config(_is_int(self.num_threads) and self.num_threads >= 1, "num_threads must be >= 1")


__all__ = ["INT4_GROUP_SIZES", "DraftContext", "RuntimeConfig", "WeightPrecision"]
