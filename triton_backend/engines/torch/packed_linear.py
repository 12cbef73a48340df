"""Linear layers with weights prepacked for MKL's small-batch GEMM (CPU, float32).

Why: a speculative verify pass multiplies every weight matrix by a handful of rows
(``k + 1`` drafted positions, or a Medusa tree). On CPU a float32 ``F.linear`` with 3-16
rows costs 2-4x the one-row case, because the GEMM repacks the whole weight matrix on every
call; that repacking, not arithmetic, made verification expensive. With the weights packed
once at load time (``cblas_sgemm_pack`` through ``torch.ops.mkl``), a pass over up to
``rows`` positions costs about what one decode step costs (measured numbers in the README).

A :class:`PackedLinear` keeps the original weight (shared, not copied: tied embeddings stay
tied) and uses it for calls of up to three rows (GEMV-like kernels are as fast there) and
for calls wider than ``MAX_CHUNKS * rows`` (prefill, where the GEMM's own packing is
amortised). Other calls run on the packed copy in chunks of ``rows`` (the last one
zero-padded); the packed copy costs about twice the weight's memory, once.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

SMALL_ROWS = 3  # up to this many rows, the plain kernel (GEMV-like) is as fast (measured)
MAX_CHUNKS = 4  # wider calls (prefill) use the plain kernel


def packing_available() -> bool:
    """Whether this torch build has MKL's packed GEMM ops."""
    mkl = getattr(torch.ops, "mkl", None)
    return bool(torch.backends.mkl.is_available()) and mkl is not None and hasattr(mkl, "_mkl_reorder_linear_weight")


_SHARED: dict[tuple[int, int, int], torch.Tensor] = {}  # (id, data_ptr, rows) of a live weight -> its packed copy


def packed_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """MKL's packed copy of a float32 CPU ``[out, in]`` weight for ``rows``-row GEMMs, made once
    per weight: engines over shared weights (a layer-skip draft, a second engine on the same
    model) share it too (it costs several times the weight's own memory)."""
    import weakref

    key = (id(weight), weight.data_ptr(), rows)
    if key not in _SHARED:
        _SHARED[key] = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        weakref.finalize(weight, _SHARED.pop, key, None)
    return _SHARED[key]


def packed_matmul(flat: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: int) -> torch.Tensor:
    """``flat @ weight.T + bias`` for ``flat`` ``[m, in]`` on the packed weight, in chunks of
    ``rows`` (the last zero-padded). Each row's result is bit-identical to a plain float32
    GEMM of >= 4 rows, wherever the row sits (measured; tests/test_llama_engine.py checks it)."""
    m, width = flat.shape
    padded = -(-m // rows) * rows
    if padded > m:
        flat = torch.cat([flat, flat.new_zeros(padded - m, width)])
    chunks = [torch.ops.mkl._mkl_linear(chunk, packed, weight, bias, rows) for chunk in flat.split(rows)]
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return out[:m] if padded > m else out


class PackedLinear(nn.Module):
    """A drop-in ``nn.Linear`` (inference only) that runs inputs of ``SMALL_ROWS + 1`` to
    ``MAX_CHUNKS * rows`` rows on a packed weight, in chunks of ``rows``."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        if rows <= SMALL_ROWS:
            raise ValueError(f"rows must be > {SMALL_ROWS}, got {rows}")
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.rows = rows
        self.register_buffer("packed", packed_weight(linear.weight, rows), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        m = flat.shape[0]
        if m <= SMALL_ROWS or m > MAX_CHUNKS * self.rows or torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return packed_matmul(flat, self.packed, self.weight, self.bias, self.rows).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self.rows}"


def pack_linear_layers(model: nn.Module, rows: int) -> int:
    """Replace every plain float32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`
    (in place); returns how many were packed. Does nothing where packing is unavailable."""
    if not packing_available():
        logger.info("MKL packed GEMM unavailable in this torch build: linear layers left as they are")
        return 0
    done: dict[int, PackedLinear] = {}  # a module reachable twice is packed once
    extra = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                if id(child) not in done:
                    done[id(child)] = PackedLinear(child, rows)
                    extra += done[id(child)].packed.numel() * done[id(child)].packed.element_size()
                setattr(module, name, done[id(child)])
    count = len(done)
    if count:
        logger.info("packed %d linear layers for %d-row GEMMs (+%.0f MB)", count, rows, extra / 2**20)
    return count
