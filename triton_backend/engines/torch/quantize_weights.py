"""Round-to-nearest weight-only quantization of float weights (symmetric, as TensorRT-LLM and
Model Optimizer store them): int8 with one scale per output channel (``amax / 127``), int4 with
one scale per group of input channels (``amax / 7``, values in ``[-8, 7]``). Used where a plan's
precision is served from float weights (no exported checkpoint); a checkpoint's own tensors
(:mod:`~triton_backend.engines.torch.trtllm_weights`) are used as they are.
"""

from __future__ import annotations

import torch

_TINY = 1e-12  # an all-zero channel or group gets this scale (its values quantize to 0)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [n, k], scales float32 [n])`` with ``w ~ q * scales[:, None]``."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(_TINY)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [n, k] in [-8, 7], scales float32 [n, k / group])``, ``w ~ q * scales`` per group."""
    n, k = w.shape
    if group <= 0 or k % group:
        raise ValueError(f"int4 groups of {group} do not divide the input width {k}")
    blocks = w.float().reshape(n, k // group, group)
    scales = (blocks.abs().amax(dim=-1) / 7.0).clamp_min(_TINY)
    q = torch.round(blocks / scales[..., None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(n, k), scales


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight the kernel computes with: ``float(q) * scale`` (one rounding), per group."""
    n, k = q.shape
    groups = scales.shape[1]
    return (q.float().reshape(n, groups, k // groups) * scales.float()[..., None]).reshape(n, k)


__all__ = ["dequantize_int4", "quantize_int4", "quantize_int8"]
