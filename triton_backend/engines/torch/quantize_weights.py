"""Round-to-nearest weight-only quantization of float weights (symmetric, as TensorRT-LLM and
Model Optimizer store them): int8 with one scale per output channel (``amax / 127``), int4 with
one scale per group of input channels (``amax / 7``, values in ``[-8, 7]``), fp8 e4m3 with one scale
per output channel (``amax / 448``; see :func:`quantize_fp8` for why per channel). Used where a plan's
precision is served from float weights (no exported checkpoint); a checkpoint's own tensors
(:mod:`~triton_backend.engines.torch.trtllm_weights`) are used as they are.
"""

from __future__ import annotations

from typing import Callable

import torch

_TINY = 1e-12  # an all-zero channel or group gets this scale (its values quantize to 0)
BLOCK_ELEMENTS = 1 << 22  # rows quantized at a time: about 16 MiB of float32 (the temporaries stay that small)


def _by_rows(quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
             w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` over blocks of rows, concatenated. Every scale covers part of one row, so the
    result is the same bits as one call over the whole tensor, with temporaries of one block
    (a 2 GiB float32 LM head would otherwise need several float32 copies of itself)."""
    rows = max(1, BLOCK_ELEMENTS // max(1, w.shape[1]))
    if w.shape[0] <= rows:
        return quantize(w)
    parts = [quantize(block) for block in w.split(rows)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [n, k], scales float32 [n])`` with ``w ~ q * scales[:, None]``."""
    return _by_rows(_int8_block, w)


def _int8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(_TINY)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


FP8_MAX = 448.0  # the largest finite e4m3 value


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [n, k], scales float32 [n])`` with ``w ~ float(q) * scales[:, None]``, each
    value rounded to the nearest e4m3 (ties to even) after dividing by its channel's ``amax / 448``.

    Per output channel, not per tensor as TensorRT-LLM's FP8 checkpoints store it: the kernel applies
    a scale per output channel after the chain either way (a checkpoint's one scale is ``n`` equal
    values), and e4m3's 3-bit mantissa has the same relative precision at any magnitude, so the scale
    only sets the range: with one scale set by the tensor's largest channel, channels of small weights
    fall into e4m3's subnormals (below ``2^-6`` of the scale) and lose mantissa bits."""
    return _by_rows(_fp8_block, w)


def _fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)
    q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [n, k] in [-8, 7], scales float32 [n, k / group])``, ``w ~ q * scales`` per group."""
    if group <= 0 or w.shape[1] % group:
        raise ValueError(f"int4 groups of {group} do not divide the input width {w.shape[1]}")
    return _by_rows(lambda block: _int4_block(block, group), w)


def _int4_block(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = w.float().reshape(n, k // group, group)
    scales = (blocks.abs().amax(dim=-1) / 7.0).clamp_min(_TINY)
    q = torch.round(blocks / scales[..., None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(n, k), scales


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight the kernel computes with: ``float(q) * scale`` (one rounding), per group."""
    n, k = q.shape
    groups = scales.shape[1]
    return (q.float().reshape(n, groups, k // groups) * scales.float()[..., None]).reshape(n, k)


__all__ = ["FP8_MAX", "dequantize_int4", "quantize_fp8", "quantize_int4", "quantize_int8"]
