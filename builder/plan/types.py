"""What the planner returns: a choice of precisions/TP and each model's per-GPU footprint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from builder.plan.gpus import GIB, GpuSpec
from builder.plan.memory import Footprint
from builder.plan.spec import KVCacheDtype, Limits, Precision

_PRECISION_RANK = {Precision.FP16: 0, Precision.BF16: 0, Precision.FP8: 1, Precision.INT8_SQ: 2, Precision.INT4_AWQ: 3}
_KV_RANK = {KVCacheDtype.FP16: 0, KVCacheDtype.FP8: 1, KVCacheDtype.INT8: 2}


@dataclass(frozen=True)
class Choice:
    """One combination the planner weighs."""

    target: Precision
    kv: KVCacheDtype
    draft: Precision | None
    tp: int

    @property
    def rank(self) -> tuple[int, int, int, int]:
        """Lower is better: target precision, KV dtype, draft precision, TP size."""
        draft = _PRECISION_RANK[self.draft] if self.draft is not None else 0
        return (_PRECISION_RANK[self.target], _KV_RANK[self.kv], draft, self.tp)

    def value_of(self, dim: int) -> str:
        values = (self.target.value, self.kv.value, self.draft.value if self.draft else "-", f"{self.tp}")
        return values[dim]

    def describe(self) -> str:
        draft = f", draft {self.draft.value}" if self.draft is not None else ""
        return f"target {self.target.value}, KV cache {self.kv.value}{draft}, TP {self.tp}"


@dataclass(frozen=True)
class ModelPlan:
    role: str  # target, draft or medusa
    source: str
    params: int
    precision: Precision
    requested: Precision
    footprint: Footprint  # per GPU
    decode_step_ms: float  # memory-bound lower bound of one pass
    int4_group_size: int | None = None  # int4_awq: the AWQ group size (128, or 64 where widths need it)
    torch_linear_bytes: int = 0  # target/draft: what the torch runtime's CPU slot engine holds for linears + LM head
    torch_float_bytes: int = 0  # target/draft: the float32 parameters it keeps beside them (memory.torch_float_bytes)

    @property
    def precision_label(self) -> str:
        """The precision as plans print it: ``int4_awq g64`` names the group size."""
        return self.precision.value + (f" g{self.int4_group_size}" if self.int4_group_size else "")

    def to_dict(self) -> dict[str, Any]:
        fp = self.footprint
        return {"role": self.role, "source": self.source, "params": self.params, "precision": self.precision.value,
                "requested_precision": self.requested.value,
                **({"int4_group_size": self.int4_group_size} if self.int4_group_size else {}),
                **({"torch_cpu_linear_bytes": self.torch_linear_bytes} if self.torch_linear_bytes else {}),
                **({"torch_cpu_float_bytes": self.torch_float_bytes} if self.torch_float_bytes else {}),
                "per_gpu_bytes": {"weights": fp.weights, "kv_cache": fp.kv_cache, "activations": fp.activations,
                                  "total": fp.total},
                "per_gpu_gib": {"weights": _gib(fp.weights), "kv_cache": _gib(fp.kv_cache),
                                "activations": _gib(fp.activations), "total": _gib(fp.total)},
                "decode_step_ms_lower_bound": round(self.decode_step_ms, 3)}


@dataclass(frozen=True)
class Plan:
    gpu: GpuSpec
    gpu_count: int
    tp: int
    pp: int
    kv_cache_dtype: KVCacheDtype
    workspace_bytes: int
    models: tuple[ModelPlan, ...]
    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    limits: Limits

    @property
    def total_per_gpu(self) -> int:
        return sum(m.footprint.total for m in self.models) + self.workspace_bytes

    @property
    def capacity(self) -> int:
        return self.gpu.memory_bytes

    @property
    def headroom(self) -> int:
        return self.capacity - self.total_per_gpu

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    @property
    def replicas(self) -> int:
        """Independent copies of the deployment the GPUs could hold (data parallel)."""
        return self.gpu_count // (self.tp * self.pp)

    def model(self, role: str) -> ModelPlan | None:
        return next((m for m in self.models if m.role == role), None)

    def precision_of(self, role: str) -> Precision | None:
        plan = self.model(role)
        return plan.precision if plan is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.to_dict(), "gpu_count": self.gpu_count, "tp_size": self.tp, "pp_size": self.pp,
            "replicas": self.replicas, "kv_cache_dtype": self.kv_cache_dtype.value,
            "precisions": {m.role: m.precision.value for m in self.models},
            "models": [m.to_dict() for m in self.models],
            "workspace_bytes": self.workspace_bytes,
            "total_per_gpu_bytes": self.total_per_gpu, "capacity_bytes": self.capacity, "headroom_bytes": self.headroom,
            "total_per_gpu_gib": _gib(self.total_per_gpu), "capacity_gib": _gib(self.capacity),
            "headroom_gib": _gib(self.headroom), "fits": self.fits,
            "limits": {"max_batch_size": self.limits.max_batch_size, "max_input_len": self.limits.max_input_len,
                       "max_output_len": self.limits.max_output_len, "max_draft_len": self.limits.max_draft_len,
                       "max_num_tokens": self.limits.max_num_tokens},
            "reasons": list(self.reasons), "notes": list(self.notes),
        }


def _gib(value: int) -> float:
    return round(value / GIB, 3)
