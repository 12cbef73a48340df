"""The compact-weight CPU kernel (engines/torch/weight_gemm.py): fp8 e4m3, float16 and bfloat16 weights give,
bit for bit, what the float32 row kernel gives on the even and on the odd columns of their decoded
weights, summed (the kernel's two chains); int8 and int4 (per channel, grouped, with minimums) give, bit
for bit, the C source's 16-bit-activation integer arithmetic as weight_gemm.emulate spells it in torch,
within 1e-4 of float64 on the decoded weights; every row is
the same bits whatever the batch; both ISA builds agree; every finite e4m3 byte decodes to its value;
round-to-nearest quantization and the panel packing round-trip; bad inputs are refused; the C++ compiles clean."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from test_row_gemm_engine import assert_compiles_without_warnings
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch import weight_gemm as wg
from triton_backend.engines.torch.quantize_weights import FP8_MAX, dequantize_int4, quantize_fp8, quantize_int4, quantize_int8

ISAS = [isa for isa in ("avx2", "avx512") if row_gemm_module.cpu_isa() in (isa, "avx512")]
pytestmark = pytest.mark.skipif(not ISAS, reason="the CPU kernels need x86-64 with AVX2 + FMA")
FORMATS = ["int8", "fp8", "int4-32", "int4-64", "int4min-32", "int4min-32h", "int8g-32", "int8g-16", "int8g-32h",
           "float16", "bfloat16"]  # h: float16 group scales (and minimums), as GGUF blocks hold them


def asymmetric_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1's values for ``w``: ``q`` in [0, 15], a float16 scale and minimum per group."""
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scales = ((high - low) / 15).half().float().clamp_min(2**-14)
    mins = low.half().float()
    q = torch.round((blocks - mins[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int8).reshape(n, k)
    return q, scales, mins


def grouped_int8(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    scales = (blocks.abs().amax(-1) / 127).half().float().clamp_min(2**-14)
    return torch.round(blocks / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k), scales


def _group(fmt: str) -> int:
    return int(fmt.split("-")[1].rstrip("h"))


def packed(fmt: str, w: torch.Tensor) -> tuple[wg.PackedWeight, torch.Tensor, torch.Tensor | None]:
    """``(packed, decoded float32 weight the chain multiplies, int8 / fp8 channel scales or None)``."""
    if fmt == "int8":
        q, s = quantize_int8(w)
        return wg.pack_int8(q, s), q.float(), s
    if fmt == "fp8":
        q, s = quantize_fp8(w)
        return wg.pack_fp8(q, s), q.float(), s
    if fmt.startswith("int4min") or fmt.startswith("int8g"):
        group, half = _group(fmt), fmt.endswith("h")
        held = (lambda t: t.half()) if half else (lambda t: t)  # noqa: E731
        if fmt.startswith("int8g"):
            q, s = grouped_int8(w, group)
            return wg.pack_int8(q, held(s), group), q.float() * s.repeat_interleave(group, dim=1), None
        q, s, m = asymmetric_int4(w, group)
        decoded = q.float() * s.repeat_interleave(group, 1) + m.repeat_interleave(group, 1)
        return wg.pack_int4(q, held(s), group, held(m)), decoded, None
    if fmt.startswith("int4"):
        group = int(fmt.split("-")[1])
        q, s = quantize_int4(w, group)
        return wg.pack_int4(q, s, group), dequantize_int4(q, s), None
    dtype = getattr(torch, fmt)
    return wg.pack_float(w.to(dtype)), w.to(dtype).float(), None


def two_chains(row, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's order on the float32 row kernel: one chain over the even k, one over the odd k, summed."""
    even = row(x[:, 0::2].contiguous(), w[:, 0::2].contiguous())
    return even + row(x[:, 1::2].contiguous(), w[:, 1::2].contiguous()) if w.shape[1] > 1 else even


@pytest.fixture(params=ISAS)
def kernels(request, monkeypatch):
    monkeypatch.setenv("SPECBUILD_ROW_KERNEL_ISA", request.param)
    row, compact = row_gemm_module.load_row_gemm(), wg.load_weight_gemm()
    assert row is not None and compact is not None and compact.isa == request.param
    return row, compact


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", [(64, 48), (192, 37), (576, 200), (75, 33)])
def test_equals_the_row_kernel_on_the_decoded_weight(kernels, fmt, k, n):
    if "-" in fmt and k % _group(fmt):
        pytest.skip("groups must divide k")
    row, compact = kernels
    gen = torch.Generator().manual_seed(k + n)
    w, b = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen)
    weight, decoded, scales = packed(fmt, w)
    layer = compact.bind(weight, b)
    assert torch.equal(wg.dequantize(weight), decoded * scales[:, None] if scales is not None else decoded)
    for m in (1, 2, 3, 5, 8, 13, 30):
        x = torch.randn(m, k, generator=gen)
        if m == 3:
            x[1, :min(k, 40)] = 0.0  # an all-zero activation block
        got = layer(x)
        if wg.is_integer(weight):  # 16-bit activations, integer dot products: the C source's arithmetic
            want = wg.emulate(weight, x, b)
        else:
            chains = two_chains(row, x, decoded)
            want = chains * scales + b if scales is not None else chains + b
        assert torch.equal(got, want), (fmt, m)
        ref = x.double() @ wg.dequantize(weight).double().T + b.double()
        assert float((got.double() - ref).abs().max() / ref.abs().max()) < (1e-4 if wg.is_integer(weight) else 1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_is_bit_identical_whatever_the_batch(kernels, fmt):
    _, compact = kernels
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 576, generator=gen)
    layer = compact.bind(packed(fmt, w)[0])
    x = torch.randn(40, 576, generator=gen)
    full = layer(x)
    for m in (1, 2, 3, 4, 7, 9, 12, 13, 17):
        for i in range(0, 40 - m, 11):
            assert torch.equal(layer(x[i:i + m]), full[i:i + m]), (m, i)


@pytest.mark.skipif(ISAS != ["avx2", "avx512"], reason="needs a CPU with AVX-512 (both builds)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_both_builds_give_the_same_bits(monkeypatch, fmt):
    built = {}
    for isa in ISAS:
        monkeypatch.setenv("SPECBUILD_ROW_KERNEL_ISA", isa)
        built[isa] = wg.load_weight_gemm()
    gen = torch.Generator().manual_seed(11)
    weight = packed(fmt, torch.randn(70, 1536, generator=gen))[0]
    for m in (1, 3, 8, 13):
        x = torch.randn(m, 1536, generator=gen)
        assert torch.equal(built["avx2"].bind(weight)(x), built["avx512"].bind(weight)(x)), m


@pytest.mark.parametrize("scale", [1.0, 3e-3])
def test_every_finite_e4m3_byte_decodes_to_its_value(kernels, scale):
    """All 254 finite bytes (subnormals, both zeros, +-448) as one weight row each, read by one-hot rows."""
    _, compact = kernels
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    q = finite.view(torch.float8_e4m3fn).reshape(-1, 1).repeat(1, 64)  # [254, 64]
    layer = compact.bind(wg.pack_fp8(q, torch.full((254,), scale)))
    x = torch.eye(64)[:3] * 2.0
    want = (q[:, 0].float() * 2.0 * torch.tensor(scale)).expand(3, -1)
    assert torch.equal(layer(x), want)


def test_quantization_is_round_to_nearest_and_packing_round_trips():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(45, 128, generator=gen)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert float(((q.float() * s[:, None] - w).abs() - s[:, None] / 2).max()) <= 1e-6
    assert torch.equal(wg.unpack(wg.pack_int8(q, s)), q.float())
    q4, s4 = quantize_int4(w, 32)
    assert int(q4.min()) >= -8 and int(q4.max()) <= 7 and s4.shape == (45, 4)
    bound = s4.repeat_interleave(32, dim=1) / 2
    assert float(((dequantize_int4(q4, s4) - w).abs() - bound).max()) <= 1e-6
    assert torch.equal(wg.unpack(wg.pack_int4(q4, s4, 32)), dequantize_int4(q4, s4))
    q8, s8 = quantize_fp8(w * torch.linspace(1e-3, 1, 45)[:, None])  # channels of very different ranges
    assert q8.dtype == torch.float8_e4m3fn and torch.equal(q8.float().abs().amax(1), torch.full((45,), FP8_MAX))
    scaled = w * torch.linspace(1e-3, 1, 45)[:, None] / s8[:, None]
    assert float(((q8.float() - scaled).abs() - scaled.abs() * 2**-4).max()) <= 1e-6  # half a 3-bit mantissa step
    assert torch.equal(wg.unpack(wg.pack_fp8(q8, s8)), q8.float())
    half = w.to(torch.bfloat16)
    assert torch.equal(wg.unpack(wg.pack_float(half)), half.float())
    assert wg.pack_int4(q4, s4, 32).nbytes() == 64 * 128 // 2 + 64 * 4 * 4  # padded to 2 panels of 32


def test_bad_inputs_are_refused(kernels):
    _, compact = kernels
    q = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="group"):
        wg.pack_int4(q, torch.ones(8, 3), 24)
    with pytest.raises(ValueError, match="even"):
        wg.pack_int4(torch.zeros(8, 63, dtype=torch.int8), torch.ones(8, 3), 21)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        wg.pack_int4(q + 9, torch.ones(8, 2), 32)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        wg.pack_int4(q - 1, torch.ones(8, 2), 32, torch.zeros(8, 2))
    with pytest.raises(ValueError, match="multiple of 8"):
        wg.pack_int4(q, torch.ones(8, 32), 2)
    with pytest.raises(ValueError, match="minimums"):
        wg.pack_int4(q, torch.ones(8, 2), 32, torch.zeros(8, 3))
    with pytest.raises(ValueError, match="group"):
        wg.pack_int8(q, torch.ones(8, 3), 32)
    with pytest.raises(ValueError, match="int8"):
        wg.pack_int8(q.float(), torch.ones(8))
    with pytest.raises(ValueError, match="finite"):
        wg.pack_fp8(torch.full((8, 64), float("nan")).to(torch.float8_e4m3fn), torch.ones(8))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        wg.pack_fp8(q, torch.ones(8))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        wg.pack_float(torch.zeros(8, 64))
    layer = compact.bind(wg.pack_int8(q, torch.ones(8)))
    with pytest.raises(ValueError, match=r"x \[M, 64\]"):
        layer(torch.randn(2, 63))
    with pytest.raises(ValueError, match="float32"):
        layer(torch.randn(2, 64, dtype=torch.float64))
    assert layer(torch.randn(0, 64)).shape == (0, 8)


@pytest.mark.parametrize("isa", ISAS)
def test_the_source_is_a_real_file_that_compiles_without_warnings(isa):
    source, header = Path(wg.__file__).with_name("weight_gemm.cpp"), Path(wg.__file__).with_name("weight_gemm_fp8.h")
    assert '#include "weight_gemm_fp8.h"' in source.read_text()
    flags = row_gemm_module._FLAGS + row_gemm_module._ISA_FLAGS[isa] + wg._EXTRA_FLAGS
    text = source.read_text() + header.read_text()
    assert wg.kernel_digest(isa) == hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:16]
    assert_compiles_without_warnings(source, flags)
