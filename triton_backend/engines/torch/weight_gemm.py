"""Row-invariant CPU matmuls on compact weights: int8 and fp8 e4m3 (per output channel scale), int4
(group-wise scales; or group-wise scales and minimums, GGUF's Q4_1), int8 with group-wise scales (GGUF's
Q8_0) and 16-bit (float16, bfloat16), accumulated in float32.

The row kernel (:mod:`~triton_backend.engines.torch.row_gemm`) streams float32 weights; a one-row decode
step is bound by that stream (~540 MB for SmolLM2-135M with its LM head). This kernel reads compact weights:

- int8 and int4 (every layout; group scales and minimums float32, or float16 as GGUF blocks hold them):
  each row's activations are quantized to 16 bits per block (the weight's group, else 32), a block's dot
  product with a weight column is exact in int32, and the float32 sum over blocks runs in a fixed order
  (the C source's comment; :func:`emulate` spells it in torch and equals the kernel bit for bit). Within
  ~1e-5 of float32 arithmetic on the decoded weights, and no per-weight int-to-float conversion.
- fp8, float16, bfloat16: the row kernel's panels (32 output columns, k-major) decoded in registers
  (exactly); every output is two fused multiply-add chains, over the even and over the odd ``k`` in
  ascending order, then their sum (fp8: then times the channel scale): the float32 row kernel run on the
  even and on the odd columns of the decoded weights, summed, bit for bit.

Either way nothing depends on the other rows of a call: rows are bit-identical batched or alone
(tests/test_weight_gemm.py).
Why not torch's or another library's kernels: measured in docs/quantized-weights.md.

The C++ source, ``weight_gemm.cpp`` beside this module (and ``weight_gemm_fp8.h``, which it includes:
both are hashed into the library's name), is built and hash-checked like the row kernel's.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import logging
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from triton_backend.engines.torch.row_gemm import PANEL, build_flags, compiled_library, cpu_isa, kernel_input, pool_address

logger = logging.getLogger(__name__)

_SOURCE_FILE = Path(__file__).with_name("weight_gemm.cpp")
_SOURCE = _SOURCE_FILE.read_text() + Path(__file__).with_name("weight_gemm_fp8.h").read_text()
_EXTRA_FLAGS = ["-mf16c"]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


class WeightFormat(enum.IntEnum):
    """A packed weight's element type (the C source's ``Format``)."""

    INT8 = 1
    INT4 = 2
    FLOAT16 = 3
    BFLOAT16 = 4
    FP8 = 5  # e4m3 ("fn": finite, max 448)


# the C source's format codes beyond WeightFormat's: int4 with minimums, int8 with group scales
_INT4_MIN_CODE, _INT8_GROUP_CODE, _HALF_BIT = 6, 7, 16


@dataclass(frozen=True)
class PackedWeight:
    """A ``[n, k]`` weight in the kernel's panels: ``data`` uint8 ``[panels, k, row bytes]``;
    ``scales`` float32: int8 (``group`` 0) and fp8 ``[n]`` per output channel, int4 and grouped int8
    ``[panels, k / group, 32]``, else None; ``mins`` (int4 with minimums: unsigned nibbles) like int4's scales."""

    format: WeightFormat
    n: int
    k: int
    data: torch.Tensor
    scales: torch.Tensor | None = None
    group: int = 0
    mins: torch.Tensor | None = None

    @property
    def channel_scaled(self) -> bool:
        """Whether a scale per output channel multiplies the chain (int8 per channel, fp8)."""
        return self.format is WeightFormat.FP8 or (self.format is WeightFormat.INT8 and self.group == 0)

    @property
    def code(self) -> int:
        """The C source's format code (float16 group scales add its half bit)."""
        half = _HALF_BIT if self.group and self.scales is not None and self.scales.dtype == torch.float16 else 0
        if self.mins is not None:
            return _INT4_MIN_CODE | half
        if self.format is WeightFormat.INT8 and self.group:
            return _INT8_GROUP_CODE | half
        return int(self.format) | half

    def nbytes(self) -> int:
        """What the kernel holds for this weight (panels, scales and minimums)."""
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.mins) if t is not None)
        return self.data.numel() * self.data.element_size() + extra


def _panels(w: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` -> ``[panels, k, 32]`` (rows past ``n`` zero)."""
    n, k = w.shape
    padded = -(-n // PANEL) * PANEL
    if padded > n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    return w.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


CHUNK = 8  # output columns per chunk of a panel (the integer formats' layout)


def _chunk_groups(t: torch.Tensor) -> torch.Tensor:
    """Group scales / minimums ``[n, k / g]`` -> ``[panels, 4, k / g, 8]`` (rows past ``n`` zero): float16
    kept as it is (half the bytes, widened exactly in the kernel), anything else as float32."""
    p = _panels(t if t.dtype == torch.float16 else t.float())  # [panels, k / g, 32]
    return p.view(p.shape[0], p.shape[1], PANEL // CHUNK, CHUNK).transpose(1, 2).contiguous()


def _int8_layout(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[n, k]`` -> uint8 ``[panels, 4, k' / 2, 16]`` (k' = k rounded up to even, zero past k):
    byte ``2c + t`` of pair ``p`` is column ``c``'s weight at ``k = 2p + t``."""
    if q.shape[1] % 2:
        q = torch.cat([q, q.new_zeros(q.shape[0], 1)], dim=1)
    p = _panels(q).view(torch.uint8)  # [panels, k', 32]
    panels, k = p.shape[:2]
    return p.view(panels, k // 2, 2, PANEL // CHUNK, CHUNK).permute(0, 3, 1, 4, 2).reshape(panels, PANEL // CHUNK, k // 2,
                                                                                           2 * CHUNK).contiguous()


def _int4_layout(nibbles: torch.Tensor) -> torch.Tensor:
    """values 0 .. 15 ``[n, k]`` (k a multiple of 8) -> uint8 ``[panels, 4, k / 8, 32]``: the 16-bit lane
    ``2c + t`` of octet ``o`` holds, in its nibble ``i``, column ``c``'s weight at ``k = 8o + 2i + t``."""
    p = _panels(nibbles.to(torch.int32))  # [panels, k, 32]
    panels, k = p.shape[:2]
    v = p.view(panels, k // 8, 4, 2, PANEL // CHUNK, CHUNK)  # [panel, o, i, t, chunk, c]
    lanes = (v[:, :, 0] | (v[:, :, 1] << 4) | (v[:, :, 2] << 8) | (v[:, :, 3] << 12))  # [panel, o, t, chunk, c]
    lanes = lanes.permute(0, 3, 1, 4, 2).reshape(panels, PANEL // CHUNK, k // 8, 2 * CHUNK)
    return lanes.to(torch.int16).contiguous().view(torch.uint8)


def _unpack_int8_layout(data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_int8_layout`: int8 ``[panels * 32, k']``."""
    panels, chunks, pairs = data.shape[:3]
    v = data.view(torch.int8).view(panels, chunks, pairs, CHUNK, 2)  # [panel, chunk, p, c, t]
    return v.permute(0, 1, 3, 2, 4).reshape(panels * PANEL, pairs * 2)


def _unpack_int4_layout(data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_int4_layout`: values 0 .. 15 ``[panels * 32, k]`` (int16)."""
    panels, chunks, octets = data.shape[:3]
    lanes = data.view(torch.int16).to(torch.int32).view(panels, chunks, octets, CHUNK, 2)  # [panel, chunk, o, c, t]
    nib = torch.stack([(lanes >> (4 * i)) & 0xF for i in range(4)], dim=-2)  # [panel, chunk, o, c, i, t]
    return nib.permute(0, 1, 3, 2, 4, 5).reshape(panels * PANEL, octets * 8).to(torch.int16)


def _unchunk_groups(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_chunk_groups`: ``[panels * 32, k / g]``."""
    panels, chunks, groups = t.shape[:3]
    return t.permute(0, 1, 3, 2).reshape(panels * PANEL, groups).float()


def _check_groups(name: str, k: int, group: int, scales: torch.Tensor, n: int) -> None:
    if group <= 0 or group % 2 or k % group or scales.shape != (n, k // group):
        raise ValueError(f"{name} needs k a multiple of the (even) group {group} and scales [n, k / group] = "
                         f"[{n}, {k // group if group > 0 else '?'}], got k {k}, scales {tuple(scales.shape)}")


def pack_int8(q: torch.Tensor, scales: torch.Tensor, group: int = 0) -> PackedWeight:
    """``q`` int8 ``[n, k]``, ``scales`` ``[n]``: the weight ``q * scales[:, None]`` (the scale applied
    after the chain). With ``group``: ``scales`` ``[n, k / group]``, the weight ``float(q) * scale`` per
    group decoded in registers (GGUF's Q8_0, group 32; Q6_K's values, group 16)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack_int8 needs int8 [n, k], got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if group:
        _check_groups("pack_int8", k, group, scales, n)
        return PackedWeight(WeightFormat.INT8, n, k, _int8_layout(q), _chunk_groups(scales), group)
    if scales.shape != (n,):
        raise ValueError(f"pack_int8 needs int8 [n, k] and scales [n], got {q.dtype} {tuple(q.shape)}, {tuple(scales.shape)}")
    return PackedWeight(WeightFormat.INT8, n, k, _int8_layout(q), scales.float().contiguous())


def pack_fp8(q: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
    """``q`` float8_e4m3fn ``[n, k]`` (no NaN), ``scales`` ``[n]``: the weight ``float(q) * scales[:, None]``
    (a per-tensor scale is ``n`` equal values)."""
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2 or scales.shape != (q.shape[0],):
        raise ValueError(f"pack_fp8 needs float8_e4m3fn [n, k] and scales [n], got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(scales.shape)}")
    bits = q.view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError("fp8 weights must be finite (e4m3 NaN bytes 0x7f / 0xff found)")
    n, k = q.shape
    return PackedWeight(WeightFormat.FP8, n, k, _panels(bits), scales.float().contiguous())


def pack_int4(q: torch.Tensor, scales: torch.Tensor, group: int, mins: torch.Tensor | None = None) -> PackedWeight:
    """``q`` int8 ``[n, k]`` in ``[-8, 7]``, ``scales`` ``[n, k / group]``: the weight
    ``q * scales`` repeated over each group of ``group`` input channels. With ``mins`` (``[n, k / group]``,
    asymmetric: GGUF's Q4_1): ``q`` in ``[0, 15]`` and the weight ``float(q) * scale + min`` (two roundings).
    float16 ``scales`` (and ``mins``: then float16 too) are held in float16, else float32."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack_int4 needs int8 [n, k], got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    _check_groups("pack_int4", k, group, scales, n)
    if group % 8:
        raise ValueError(f"pack_int4 needs a group that is a multiple of 8, got {group}")
    low, high = (-8, 7) if mins is None else (0, 15)
    if q.numel() and any(int(v) < low or int(v) > high for v in torch.aminmax(q)):
        raise ValueError(f"int4 values must lie in [{low}, {high}]" + ("" if mins is None else " (with minimums)"))
    if mins is not None and (mins.shape != scales.shape or (mins.dtype == torch.float16) != (scales.dtype == torch.float16)):
        raise ValueError(f"int4 minimums must be shaped (and float16 or not) as the scales {tuple(scales.shape)} "
                         f"{scales.dtype}, got {tuple(mins.shape)} {mins.dtype}")
    stored = q if mins is not None else q + 8  # symmetric values are stored as q + 8 (0 .. 15)
    return PackedWeight(WeightFormat.INT4, n, k, _int4_layout(stored), _chunk_groups(scales), group,
                        None if mins is None else _chunk_groups(mins))


def pack_float(w: torch.Tensor) -> PackedWeight:
    """A float16 or bfloat16 ``[n, k]`` weight, as it is (read in 16 bits, accumulated in float32)."""
    fmt = {torch.float16: WeightFormat.FLOAT16, torch.bfloat16: WeightFormat.BFLOAT16}.get(w.dtype)
    if fmt is None or w.dim() != 2:
        raise ValueError(f"pack_float needs a float16 or bfloat16 [n, k] weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    return PackedWeight(fmt, n, k, _panels(w).view(torch.uint8))


def unpack(weight: PackedWeight) -> torch.Tensor:
    """The float32 ``[n, k]`` weight the kernel computes with (int4, grouped int8: ``float(q) * scale``,
    one rounding; int4 with minimums: ``float(q) * scale + min``, two; int8 per channel, fp8: ``q``, the
    channel scale applied after the chain, see :func:`dequantize`)."""
    panels = weight.data.shape[0]
    if weight.format is WeightFormat.INT4:
        q = _unpack_int4_layout(weight.data).float()
        if weight.mins is None:
            q = q - 8
        g = weight.group
        full = q * _unchunk_groups(weight.scales).repeat_interleave(g, dim=1)
        if weight.mins is not None:
            full = full + _unchunk_groups(weight.mins).repeat_interleave(g, dim=1)
        return full[:weight.n].contiguous()
    if weight.format is WeightFormat.INT8:
        q = _unpack_int8_layout(weight.data)[:, :weight.k].float()
        if weight.group:
            q = q * _unchunk_groups(weight.scales).repeat_interleave(weight.group, dim=1)
        return q[:weight.n].contiguous()
    if weight.format is WeightFormat.FP8:
        full = weight.data.view(torch.float8_e4m3fn).float()
    else:
        dtype = torch.float16 if weight.format is WeightFormat.FLOAT16 else torch.bfloat16
        full = weight.data.view(dtype).float()
    return full.transpose(1, 2).reshape(panels * PANEL, weight.k)[:weight.n].contiguous()


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """The float32 ``[n, k]`` weight the packed one stands for (for torch's kernels where this
    kernel cannot run; int8's and fp8's channel scale folded in, so not bit-identical to the kernel)."""
    w = unpack(weight)
    return w * weight.scales[:, None] if weight.channel_scaled else w


ACT_BLOCK = 32  # the integer formats' activation block where the weight has no groups (int8 per channel)
ACT_MAX = 32767.0  # activations are quantized to 16 bits: q in [-32767, 32767]


def is_integer(weight: PackedWeight) -> bool:
    """Whether the kernel runs ``weight`` on 16-bit activations and integer dot products (int8, int4)."""
    return weight.format in (WeightFormat.INT8, WeightFormat.INT4)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integer formats' activations, as the C source computes them (float32, round to nearest even):
    ``(q int64 [M, blocks, block] (zero past k), dx float32 [M, blocks], sx int64 [M, blocks])``."""
    m, k = x.shape
    blocks = -(-k // block)
    xp = torch.nn.functional.pad(x.float(), (0, blocks * block - k)).view(m, blocks, block)
    amax = xp.abs().amax(-1)
    # a true division (a Python number over a tensor would be a reciprocal times the number: two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, ACT_MAX) / amax, torch.zeros_like(amax))
    q = torch.round(xp * inv[..., None]).clamp(-ACT_MAX, ACT_MAX).to(torch.int64)
    return q, amax / ACT_MAX, q.sum(-1)


def emulate(weight: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes for an integer-format ``weight`` (int8, int4), in torch, bit for bit: the
    C source's arithmetic step by step (its comment). Slow: for tests and for reading."""
    if not is_integer(weight):
        raise ValueError(f"emulate covers the integer formats (int8, int4), not {weight.format.name}")
    g = weight.group
    q, dx, sx = quantize_activations(x, g or ACT_BLOCK)
    blocks, block = q.shape[1:]
    if weight.format is WeightFormat.INT4:
        w = _unpack_int4_layout(weight.data)[:weight.n].to(torch.int64)
    else:
        w = _unpack_int8_layout(weight.data)[:weight.n].to(torch.int64)
    w = torch.nn.functional.pad(w, (0, blocks * block - w.shape[1])).view(weight.n, blocks, block)
    isum = torch.einsum("mbk,nbk->mnb", q, w)  # exact
    scales = None if weight.channel_scaled else _unchunk_groups(weight.scales)[:weight.n]
    mins = None if weight.mins is None else _unchunk_groups(weight.mins)[:weight.n]
    acc = torch.zeros(x.shape[0], weight.n)
    for b in range(blocks):
        d = dx[:, b:b + 1]
        if scales is None:
            acc = acc + isum[:, :, b].float() * d
            continue
        i = isum[:, :, b] - 8 * sx[:, b:b + 1] if weight.format is WeightFormat.INT4 and mins is None else isum[:, :, b]
        acc = acc + (i.float() * d) * scales[None, :, b]
        if mins is not None:
            acc = acc + mins[None, :, b] * (d * sx[:, b:b + 1].float())
    if scales is None:
        acc = acc * weight.scales[None, :]
    return acc if bias is None else acc + bias.float()


def kernel_digest(isa: str) -> str:
    return hashlib.sha256((_SOURCE + " ".join(build_flags(isa) + _EXTRA_FLAGS)).encode()).hexdigest()[:16]


class BoundWeightGemm:
    """One linear layer on the kernel: ``x [M, k] -> x W^T + bias [M, n]`` (float32). Holds the
    packed weight and the bias, whose memory the kernel reads through raw pointers."""

    def __init__(self, fn: Callable[..., int], weight: PackedWeight, bias: torch.Tensor | None) -> None:
        if bias is not None and (bias.shape != (weight.n,)):
            raise ValueError(f"bias must be [{weight.n}], got {tuple(bias.shape)}")
        self.weight = weight
        self.bias = None if bias is None else bias.float().contiguous()
        self.n, self.k = weight.n, weight.k
        self._fn = fn
        self._args = (weight.code, weight.data.data_ptr(),
                      None if weight.scales is None else weight.scales.data_ptr(),
                      None if weight.mins is None else weight.mins.data_ptr(), weight.group,
                      None if self.bias is None else self.bias.data_ptr())

    def nbytes(self) -> int:
        return self.weight.nbytes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = kernel_input(x, self.k, "weight_gemm")
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m:
            fmt, w, s, mn, g, b = self._args
            if self._fn(fmt, x.data_ptr(), m, self.k, w, s, mn, g, b, self.n, y.data_ptr()) != 0:
                raise ValueError(f"weight_gemm refused format {self.weight.format.name} with k {self.k}, group {g}")
        return y


class WeightGemm:
    """The loaded kernel: :meth:`bind` a :class:`PackedWeight` (and bias) to a callable layer."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa
        self.name = f"weight_gemm-{isa}-{kernel_digest(isa)}"
        fn = lib.specbuild_weight_gemm
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ctypes.c_int, p, i64, i64, p, p, p, i64, p, i64, p]
        fn.restype = ctypes.c_int
        self._fn = fn

    def bind(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> BoundWeightGemm:
        return BoundWeightGemm(self._fn, weight, bias)


def load_weight_gemm() -> WeightGemm | None:
    """The compact-weight kernel, built on first use; ``None`` where it cannot run here (logged)."""
    isa = cpu_isa()
    if isa is None:
        logger.info("compact-weight CPU kernel unavailable (needs x86-64 with AVX2 + FMA)")
        return None
    with _lock:
        if isa not in _loaded:
            try:
                _loaded[isa] = compiled_library(f"weight_gemm-{isa}", _SOURCE_FILE,
                                                build_flags(isa) + _EXTRA_FLAGS, kernel_digest(isa))
                _share_pool(_loaded[isa], isa)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("compact-weight CPU kernel unavailable (%s)", exc)
                _loaded[isa] = None
    lib = _loaded[isa]
    return None if lib is None else WeightGemm(lib, isa)


def _share_pool(lib: ctypes.CDLL, isa: str) -> None:
    """Hand the row kernel's thread pool to ``lib`` (its calls then split their panels among the
    threads ``RowGemm.set_threads`` started; without it, each call runs on its caller's thread)."""
    address = pool_address(isa)
    if address:
        lib.specbuild_weight_set_pool.argtypes = [ctypes.c_void_p]
        lib.specbuild_weight_set_pool.restype = None
        lib.specbuild_weight_set_pool(address)


__all__ = ["ACT_BLOCK", "BoundWeightGemm", "PackedWeight", "WeightFormat", "WeightGemm", "dequantize", "emulate",
           "is_integer", "kernel_digest", "load_weight_gemm", "pack_float", "pack_fp8", "pack_int4", "pack_int8",
           "quantize_activations", "unpack"]
