"""Linears that read the same input, run as one kernel call (a layer's q/k/v, its gate/up).

The row kernels hold a weight in panels of 32 output columns, panel after panel (float32 panels in
:mod:`~triton_backend.engines.torch.row_gemm`; the compact formats, their group scales and minimums
in :mod:`~triton_backend.engines.torch.weight_gemm`). Where every linear's width is a whole number of
panels, their weights laid one after another are one weight of the summed width, and each output
column is still its own fixed-order chain over the input: one call gives the very bits of the separate
calls, for a third (q/k/v) or half (gate/up) of the calls, the per-call Python and ctypes costs and, on
the integer formats, the quantization of the input that each call repeats.

:func:`fuse` concatenates the storage once and rebinds each linear to its slice of it, so memory does
not grow and the linears still run alone (the static path, layer-skip drafts) with the same bits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from triton_backend.engines.torch.row_gemm import PANEL, BoundGemm
from triton_backend.engines.torch.weight_gemm import BoundWeightGemm


class FusedLinear:
    """``x [M, k] -> [M, sum of widths]``: the fused linears' outputs side by side (see :meth:`split`)."""

    def __init__(self, run: BoundGemm | BoundWeightGemm, widths: tuple[int, ...]) -> None:
        self._run = run
        self.widths = widths

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Each linear's columns of ``y``, contiguous (views when ``y`` has one row, else copies)."""
        out, start = [], 0
        for w in self.widths:
            out.append(y[:, start:start + w].contiguous())
            start += w
        return out


def _cat(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("cannot fuse linears where only some have a bias")
    return torch.cat([p.contiguous() for p in parts])  # type: ignore[misc]


def _slices(whole: torch.Tensor | None, sizes: Sequence[int]) -> list[torch.Tensor | None]:
    if whole is None:
        return [None] * len(sizes)
    out, start = [], 0
    for s in sizes:
        out.append(whole[start:start + s])
        start += s
    return out


def fuse(linears: Sequence[object]) -> FusedLinear | None:
    """One call for ``linears`` (objects holding a bound kernel in ``_run``: the forward's ``RowLinear``),
    each rebound to its slice of the shared storage; None where they cannot share one call (not all on
    the same row kernel, a width not a whole number of panels, different input sizes, formats, groups,
    scale types, an input scale, or a bias on only some of them)."""
    runs = [getattr(l, "_run", None) for l in linears]
    if len(runs) < 2 or any(getattr(l, "input_scale", None) is not None for l in linears):
        return None
    if len({getattr(r, "bias", None) is None for r in runs}) > 1:  # only some with a bias: each runs alone
        return None
    if all(isinstance(r, BoundWeightGemm) for r in runs):
        return _fuse_compact(linears, runs)  # type: ignore[arg-type]
    if all(isinstance(r, BoundGemm) for r in runs):
        return _fuse_float(linears, runs)  # type: ignore[arg-type]
    return None


def _fuse_float(linears: Sequence[object], runs: Sequence[BoundGemm]) -> FusedLinear | None:
    k = runs[0].k
    if any(r.k != k or r.n % PANEL for r in runs):
        return None
    packed = torch.cat([r.packed for r in runs])
    bias = _cat([r.bias for r in runs])
    sizes = [r.packed.numel() for r in runs]
    fn = runs[0]._fn
    for lin, run, part, b in zip(linears, runs, _slices(packed, sizes), _slices(bias, [r.n for r in runs])):
        lin._run = BoundGemm(fn, part, b, run.n, k)  # type: ignore[attr-defined]
    return FusedLinear(BoundGemm(fn, packed, bias, sum(r.n for r in runs), k), tuple(r.n for r in runs))


def _fuse_compact(linears: Sequence[object], runs: Sequence[BoundWeightGemm]) -> FusedLinear | None:
    weights = [r.weight for r in runs]
    first = weights[0]
    same = all(w.k == first.k and w.code == first.code and w.group == first.group and w.n % PANEL == 0
               and (w.scales is None) == (first.scales is None) and (w.mins is None) == (first.mins is None)
               and (w.scales is None or w.scales.dtype == first.scales.dtype) for w in weights)
    if not same:
        return None
    data = torch.cat([w.data for w in weights])
    scales, mins = _cat([w.scales for w in weights]), _cat([w.mins for w in weights])  # all or none: checked above
    bias = _cat([r.bias for r in runs])
    whole = replace(first, n=sum(w.n for w in weights), data=data, scales=scales, mins=mins)
    fn = runs[0]._fn
    data_parts = _slices(data, [w.data.shape[0] for w in weights])
    scale_parts = _slices(scales, [0 if w.scales is None else w.scales.shape[0] for w in weights])
    min_parts = _slices(mins, [0 if w.mins is None else w.mins.shape[0] for w in weights])
    bias_parts = _slices(bias, [w.n for w in weights])
    for lin, w, d, s, m, b in zip(linears, weights, data_parts, scale_parts, min_parts, bias_parts):
        lin._run = BoundWeightGemm(fn, replace(w, data=d, scales=s, mins=m), b)  # type: ignore[attr-defined]
        if getattr(lin, "compact", None) is not None:
            lin.compact = replace(lin.compact, weight=lin._run.weight)  # type: ignore[attr-defined]
    return FusedLinear(BoundWeightGemm(fn, whole, bias), tuple(w.n for w in weights))


__all__ = ["FusedLinear", "fuse"]
