"""Linears fused into one kernel call (engines/torch/fused_linear.py): the fused call gives, bit for
bit, the separate calls' outputs side by side, on the float32 row kernel and on every compact format;
each linear, rebound to its slice of the shared storage, still gives its old bits alone; linears that
cannot share a call (a width off the panels, an input scale, mixed kernels, a bias on only some) are left as they are; an
engine with fused layers decodes the same tokens."""

from __future__ import annotations

import pytest
import torch

from test_weight_gemm import FORMATS, packed
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch import weight_gemm as wg
from triton_backend.engines.torch.compact_weights import CompactLinear
from triton_backend.engines.torch.fused_linear import fuse
from triton_backend.engines.torch.llama_forward import RowLinear

pytestmark = pytest.mark.skipif(row_gemm_module.cpu_isa() is None, reason="the CPU kernels need x86-64 with AVX2 + FMA")


def _float_linears(row, widths, k, gen):
    return [RowLinear(torch.randn(n, k, generator=gen), None, pack_rows=0, invariant=True, row_gemm=row) for n in widths]


def test_float_row_kernel_fusion_gives_the_same_bits():
    row = row_gemm_module.load_row_gemm()
    gen = torch.Generator().manual_seed(1)
    linears = _float_linears(row, (96, 32, 64), 80, gen)
    x = torch.randn(5, 80, generator=gen)
    alone = [l(x) for l in linears]
    fused = fuse(linears)
    assert fused is not None and fused.widths == (96, 32, 64)
    parts = fused.split(fused(x))
    for a, p, l in zip(alone, parts, linears):
        assert torch.equal(a, p) and p.is_contiguous()
        assert torch.equal(l(x), a)  # rebound to its slice: the same bits alone
    one = fused.split(fused(x[2:3]))
    assert all(torch.equal(o[0], a[2]) for o, a in zip(one, alone))


@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_fusion_gives_the_same_bits(fmt):
    compact = wg.load_weight_gemm()
    gen = torch.Generator().manual_seed(2)
    k = 128
    linears = []
    for n in (64, 32, 96):
        weight = packed(fmt, torch.randn(n, k, generator=gen))[0]
        linears.append(RowLinear(None, None, pack_rows=0, invariant=True, compact=CompactLinear(weight),
                                 weight_gemm=compact))
    x = torch.randn(4, k, generator=gen)
    alone = [l(x) for l in linears]
    fused = fuse(linears)
    assert fused is not None
    for a, p, l in zip(alone, fused.split(fused(x)), linears):
        assert torch.equal(a, p)
        assert torch.equal(l(x), a)
        assert l.compact.weight.data.data_ptr() == l._run.weight.data.data_ptr()  # the slice, not a copy


def test_linears_that_cannot_share_a_call_are_left_alone():
    row = row_gemm_module.load_row_gemm()
    gen = torch.Generator().manual_seed(3)
    assert fuse(_float_linears(row, (96, 33), 64, gen)) is None  # 33: not whole panels
    assert fuse(_float_linears(row, (32,), 64, gen)) is None
    mixed = _float_linears(row, (32,), 64, gen) + [RowLinear(torch.randn(32, 64), None, pack_rows=0, invariant=True)]
    assert fuse(mixed) is None
    biased = _float_linears(row, (32, 32), 64, gen)
    biased[0] = RowLinear(torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen), pack_rows=0, invariant=True,
                          row_gemm=row)
    assert fuse(biased) is None  # a bias on only one of them: each left alone, not an error
    weight = packed("int4-32", torch.randn(32, 64, generator=gen))[0]
    scaled = [RowLinear(None, None, pack_rows=0, invariant=True, compact=CompactLinear(weight, torch.ones(64)),
                        weight_gemm=wg.load_weight_gemm()) for _ in range(2)]
    assert fuse(scaled) is None
    other = [RowLinear(None, None, pack_rows=0, invariant=True, compact=CompactLinear(packed(f, torch.randn(32, 64))[0]),
                       weight_gemm=wg.load_weight_gemm()) for f in ("int4-32", "int8")]
    assert fuse(other) is None


def test_an_engine_with_fused_layers_gives_the_same_logits():
    """The forward fuses q/k/v and gate/up where the widths are whole panels; the same passes with
    every layer unfused (each linear alone) give the same logits, bit for bit, prefill and decode."""
    from conftest import tiny_llama
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.engines.torch.llama_engine import LlamaEngine
    from triton_backend.engines.batch import BatchRow

    engine = LlamaEngine(tiny_llama(4, hidden=64, vocab=48), name="tiny", eos_token_ids=[],
                         runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
    fwd = engine.forward_impl
    assert fwd.kernel is not None and all(l.qkv is not None and l.gate_up is not None for l in fwd.layers)
    prompt = [1, 5, 9, 2, 7, 3]

    def passes() -> list[torch.Tensor]:
        slot = engine.allocate()
        try:
            first = engine.forward([BatchRow(slot, 0, prompt, num_logits=len(prompt))])[0].logits
            step = engine.forward([BatchRow(slot, len(prompt), [11])])[0].logits
            return [first, step]
        finally:
            engine.release(slot)

    fused = passes()
    for layer in fwd.layers:
        layer.qkv = layer.gate_up = None
    assert all(torch.equal(a, b) for a, b in zip(passes(), fused))
