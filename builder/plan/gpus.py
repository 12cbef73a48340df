"""The GPU catalogue: memory, bandwidth and what the tensor cores support.

``memory_mib`` is the total device memory as the driver reports it (nvidia-smi), which is
what TensorRT-LLM can allocate from; bandwidth is the vendor's peak HBM/GDDR figure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from builder.errors import UnknownGpuError

GIB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    memory_mib: int
    bandwidth_gbps: float  # GB/s
    compute_capability: tuple[int, int]

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2**20

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def supports_fp8(self) -> bool:
        """FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards."""
        return self.compute_capability >= (8, 9)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(memory_gib=round(self.memory_gib, 2), supports_fp8=self.supports_fp8)
        return data


CATALOGUE: dict[str, GpuSpec] = {g.key: g for g in (
    GpuSpec("h100-80gb", "NVIDIA H100 80GB (SXM)", 81_559, 3350.0, (9, 0)),
    GpuSpec("h200-141gb", "NVIDIA H200 141GB", 143_771, 4800.0, (9, 0)),
    GpuSpec("a100-40gb", "NVIDIA A100 40GB", 40_960, 1555.0, (8, 0)),
    GpuSpec("a100-80gb", "NVIDIA A100 80GB", 81_920, 2039.0, (8, 0)),
    GpuSpec("l40s-48gb", "NVIDIA L40S 48GB", 46_068, 864.0, (8, 9)),
    GpuSpec("rtx4090-24gb", "NVIDIA GeForce RTX 4090 24GB", 24_564, 1008.0, (8, 9)),
)}

# Unambiguous short names. "a100" alone is ambiguous (40 or 80 GB) and is refused.
ALIASES: dict[str, str] = {
    "h100": "h100-80gb", "h100-80g": "h100-80gb", "h200": "h200-141gb", "l40s": "l40s-48gb",
    "rtx4090": "rtx4090-24gb", "4090": "rtx4090-24gb", "a100-40g": "a100-40gb", "a100-80g": "a100-80gb",
}


def get_gpu(kind: str) -> GpuSpec:
    """The catalogue entry for ``kind`` (a key such as ``h100-80gb`` or a listed alias)."""
    key = str(kind).strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key in CATALOGUE:
        return CATALOGUE[key]
    known = ", ".join(sorted(CATALOGUE))
    raise UnknownGpuError(f"unknown GPU {kind!r}; known: {known} (aliases: {', '.join(sorted(ALIASES))})")
