"""The slot engine's row-invariant CPU matmul (engines/row_gemm.py): accuracy against a float64
product, bit-identical rows whatever the number of rows or their position, both ISA builds
where the CPU has them, the typed refusals, and the engine falling back to torch's kernels."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ROW_KERNEL_ISAS as ISAS, tiny_llama
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch.llama_engine import LlamaEngine

pytestmark = pytest.mark.skipif(not ISAS, reason="the row-invariant kernel needs x86-64 with AVX2 + FMA")


# K: a multiple of both vector widths, a remainder for each; N: multiples of 8 and 4 and odd
@pytest.mark.parametrize("k,n", [(64, 48), (75, 37), (16, 8), (13, 5), (576, 192)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float64_product(row_gemm, k, n, bias):
    gen = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    for m in (1, 2, 3, 5, 8, 70):  # 70 crosses the kernel's 64-row sweeps
        x = torch.randn(m, k, generator=gen)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        got = row_gemm(x, w, b)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("k,n", [(576, 196), (75, 37)])
def test_every_row_is_bit_identical_whatever_the_batch(row_gemm, k, n):
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(70, k, generator=gen)
    full = row_gemm(x, w, b)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 25):  # 13, 25: near-equal tiles (7 + 6, 9 + 8 + 8)
        for i in range(0, 70 - m, 13):
            assert torch.equal(row_gemm(x[i:i + m], w, b), full[i:i + m]), (m, i)
    # and the rows do not depend on what the other rows hold
    other = x.clone()
    other[1:] = torch.randn(69, k, generator=gen)
    assert torch.equal(row_gemm(other, w, b)[0], full[0])


@pytest.mark.skipif(ISAS != ["avx2", "avx512"], reason="needs a CPU with AVX-512 (both builds)")
def test_both_builds_give_the_same_bits(monkeypatch):
    """The AVX-512 build sweeps up to 8 rows per panel with 16-lane vectors, the AVX2 build 3
    rows with 8-lane ones; each output is still the same single FMA chain over k, so an engine
    gives the same tokens on either machine kind."""
    kernels = {}
    for isa in ISAS:
        monkeypatch.setenv("SPECBUILD_ROW_KERNEL_ISA", isa)
        kernels[isa] = row_gemm_module.load_row_gemm()
        assert kernels[isa] is not None and kernels[isa].isa == isa
    gen = torch.Generator().manual_seed(7)
    for k, n in ((576, 196), (75, 37), (1536, 64)):
        w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        for m in (1, 2, 3, 7, 8, 9, 13, 16, 17):
            x = torch.randn(m, k, generator=gen)
            assert torch.equal(kernels["avx2"](x, w, b), kernels["avx512"](x, w, b)), (k, n, m)
            assert torch.equal(kernels["avx2"](x, w), kernels["avx512"](x, w)), (k, n, m)
            assert torch.equal(kernels["avx2"].rms_norm(x, b[:1].expand(k).contiguous(), 1e-5),
                               kernels["avx512"].rms_norm(x, b[:1].expand(k).contiguous(), 1e-5)), (k, m)


def test_bad_inputs_are_refused(row_gemm):
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"x \[M, 16\]"):
        row_gemm(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match=r"x \[M, 16\]"):
        row_gemm.bind(w)(torch.randn(16))
    with pytest.raises(ValueError, match="float32"):
        row_gemm(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="float32"):
        row_gemm(torch.randn(2, 16), w, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        row_gemm(torch.randn(2, 16), torch.randn(16, 8).T)
    assert row_gemm(torch.randn(0, 16), w).shape == (0, 8)


def test_engine_uses_it_only_where_it_applies():
    model = tiny_llama(3)
    small = dict(max_batch_size=2, max_seq_len=32)
    assert LlamaEngine(model, runtime=RuntimeConfig(**small)).forward_impl.row_invariant
    for runtime in (RuntimeConfig(row_kernel=False, **small), RuntimeConfig(num_threads=2, **small)):
        engine = LlamaEngine(tiny_llama(3), runtime=runtime)
        assert not engine.forward_impl.row_invariant and engine.batched_decode == (not runtime.batch_invariant)
    torch.set_num_threads(1)


def _reference_attention(q, keys, values, start, visible, scale):
    n, heads, d = q.shape
    g = heads // keys.shape[0]
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        seen = visible[i].bool() if visible is not None else torch.arange(start + n) <= start + i
        for h in range(heads):
            k, v = keys[h // g, :start + n][seen].double(), values[h // g, :start + n][seen].double()
            out[i, h] = torch.softmax(k @ q[i, h].double() * scale, 0) @ v
    return out


@pytest.mark.parametrize("d, kv_heads, heads", [(64, 2, 6), (12, 2, 6), (32, 1, 8), (128, 2, 4), (64, 4, 4), (16, 1, 2)])
def test_attention_matches_softmax_and_each_query_equals_a_decode_step(row_gemm, d, kv_heads, heads):
    """Every head size and grouping the kernel has a path for (query heads per kv head read
    together where their accumulators fit in registers, else one (query, head) pair at a time)."""
    gen = torch.Generator().manual_seed(d)
    positions, start, n = 40, 20, 5
    keys, values = torch.randn(kv_heads, positions, d, generator=gen), torch.randn(kv_heads, positions, d, generator=gen)
    q = torch.randn(n, heads, d, generator=gen)
    scratch, out = torch.empty(positions), torch.empty(n, heads, d)
    row_gemm.attention(q, keys, values, start, None, d ** -0.5, out, scratch)
    assert float((out.double() - _reference_attention(q, keys, values, start, None, d ** -0.5)).abs().max()) < 1e-5
    for i in range(n):  # query i of the chain == a one-token pass at position start + i
        one = torch.empty(1, heads, d)
        row_gemm.attention(q[i:i + 1].contiguous(), keys, values, start + i, None, d ** -0.5, one, scratch)
        assert torch.equal(one[0], out[i])
    # a tree: node 2's ancestors are node 0; its result equals the chain [prefix, node 0, node 2] decoded
    visible = torch.zeros(n, start + n, dtype=torch.uint8)
    visible[:, :start] = 1
    for i, ancestors in enumerate([[0], [1], [0, 2], [1, 3], [0, 2, 4]]):
        visible[i, [start + a for a in ancestors]] = 1
    tree = torch.empty(n, heads, d)
    row_gemm.attention(q, keys, values, start, visible, d ** -0.5, tree, scratch)
    assert float((tree.double() - _reference_attention(q, keys, values, start, visible, d ** -0.5)).abs().max()) < 1e-5
    moved_k, moved_v = keys.clone(), values.clone()
    moved_k[:, start + 1], moved_v[:, start + 1] = keys[:, start + 2], values[:, start + 2]  # keep path 0 -> 2
    one = torch.empty(1, heads, d)
    row_gemm.attention(q[2:3].contiguous(), moved_k, moved_v, start + 1, None, d ** -0.5, one, scratch)
    assert torch.equal(one[0], tree[2])


def test_attention_refuses_inconsistent_inputs(row_gemm):
    keys = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="inconsistent"):
        row_gemm.attention(torch.randn(3, 4, 16), keys, keys.clone(), 6, None, 0.25, torch.empty(3, 4, 16), torch.empty(8))
    with pytest.raises(ValueError, match="uint8"):
        row_gemm.attention(torch.randn(2, 4, 16), keys, keys.clone(), 2, torch.ones(2, 4), 0.25, torch.empty(2, 4, 16),
                           torch.empty(8))


def test_fused_norm_and_signed_rope_give_the_same_bits():
    from triton_backend.engines.torch import llama_forward as lf
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, generator=gen)
    for t in (1, 3, 40):
        x = torch.randn(t, 96, generator=gen)
        fused = lf.rms_norm(x, w, 1e-5)
        xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.equal(fused, w * xf)
        q = torch.randn(t, 3, 64, generator=gen)
        cos, sin = torch.randn(t, 1, 64, generator=gen), torch.randn(t, 1, 64, generator=gen)
        assert torch.equal(lf.rotate_signed(q, cos, lf.signed_sin(sin)), lf.rotate(q, cos, sin))


def test_kernel_norm_and_rope_are_row_invariant_and_match_torch():
    """The row kernel's RMS norm (one call a norm on a decode step) computes each row alone (the
    same bits alone or in any batch) within float32 rounding of torch's; its RoPE gives the very
    bits of ``rotate_signed``, in place; bad shapes are refused."""
    from triton_backend.engines.torch import llama_forward as lf
    kernel = row_gemm_module.load_row_gemm()
    if kernel is None:
        pytest.skip("no row kernel on this CPU")
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(576, generator=gen)
    x = torch.randn(17, 576, generator=gen) * 4
    full = kernel.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(full, lf.rms_norm(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    for i in (0, 5, 16):
        assert torch.equal(kernel.rms_norm(x[i:i + 1], w, 1e-5)[0], full[i])
    assert torch.equal(kernel.rms_norm(x[3:9], w, 1e-5), full[3:9])
    for t in (1, 4):
        q = torch.randn(t, 9, 64, generator=gen)
        cos, sin = torch.randn(t, 1, 64, generator=gen), lf.signed_sin(torch.randn(t, 1, 64, generator=gen))
        want = lf.rotate_signed(q, cos, sin)
        got = q.clone()
        assert kernel.rope_(got, cos, sin) is got and torch.equal(got, want)
    with pytest.raises(ValueError, match="weight"):
        kernel.rms_norm(x, torch.randn(575), 1e-5)
    with pytest.raises(ValueError, match="cos/sin"):
        kernel.rope_(torch.randn(2, 9, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64))
    with pytest.raises(ValueError, match="even head size"):
        kernel.rope_(torch.randn(2, 9, 63), torch.randn(2, 1, 63), torch.randn(2, 1, 63))


def test_kernel_rope_store_equals_rotation_then_cache_writes():
    """``rope_store``: a fused q/k/v output's tokens of one row, q rotated out and k (rotated) and v
    stored at the row's cache positions, the same bits as ``rope_`` then slice writes; nothing
    outside the row's tokens and positions is touched; bad shapes are refused."""
    from triton_backend.engines.torch import llama_forward as lf
    kernel = row_gemm_module.load_row_gemm()
    if kernel is None:
        pytest.skip("no row kernel on this CPU")
    gen = torch.Generator().manual_seed(12)
    t, heads, kvh, d, positions = 7, 6, 2, 16, 20
    y = torch.randn(t, (heads + 2 * kvh) * d, generator=gen)
    cos, sin = torch.randn(t, 1, d, generator=gen), lf.signed_sin(torch.randn(t, 1, d, generator=gen))
    keys, values = torch.randn(kvh, positions, d, generator=gen), torch.randn(kvh, positions, d, generator=gen)
    k0, v0 = keys.clone(), values.clone()
    q = torch.full((t, heads, d), 7.0)
    offset, n, start = 2, 3, 9
    kernel.rope_store(y, q, offset, n, cos, sin, keys, values, start)
    rows = y[offset:offset + n]
    want_q = kernel.rope_(rows[:, :heads * d].reshape(n, heads, d).clone(), cos[offset:offset + n].contiguous(),
                          sin[offset:offset + n].contiguous())
    want_k = kernel.rope_(rows[:, heads * d:(heads + kvh) * d].reshape(n, kvh, d).clone(),
                          cos[offset:offset + n].contiguous(), sin[offset:offset + n].contiguous())
    assert torch.equal(q[offset:offset + n], want_q) and bool((q[:offset] == 7).all()) and bool((q[offset + n:] == 7).all())
    assert torch.equal(keys[:, start:start + n], want_k.transpose(0, 1))
    assert torch.equal(values[:, start:start + n], rows[:, (heads + kvh) * d:].reshape(n, kvh, d).transpose(0, 1))
    outside = [i for i in range(positions) if not start <= i < start + n]
    assert torch.equal(keys[:, outside], k0[:, outside]) and torch.equal(values[:, outside], v0[:, outside])
    with pytest.raises(ValueError, match="inconsistent"):
        kernel.rope_store(y, q, 5, 3, cos, sin, keys, values, 0)  # tokens past T
    with pytest.raises(ValueError, match="inconsistent"):
        kernel.rope_store(y, q, 0, 3, cos, sin, keys, values, positions - 2)  # positions past the cache
    with pytest.raises(ValueError, match="inconsistent"):
        kernel.rope_store(y[:, :-1].contiguous(), q, 0, 1, cos, sin, keys, values, 0)


def test_a_pass_s_layer_calls_give_the_checked_calls_bits(monkeypatch):
    """The per-pass call plan (row_gemm.LayerCalls: checks once, raw addresses per layer, the norms into
    one buffer) gives the very logits and captured features of each layer's checked calls, on a batch holding a prefill, a tree row
    and a chain row in two slots; a row outside the cache or a misshapen q/k/v output is refused."""
    from triton_backend.engines.batch import BatchRow
    from triton_backend.engines.torch import llama_forward as lf

    engine = LlamaEngine(tiny_llama(5, hidden=64, vocab=48), name="tiny", eos_token_ids=[],
                         runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
    assert engine.forward_impl.kernel is not None and all(l.qkv is not None for l in engine.forward_impl.layers)

    def passes() -> list[torch.Tensor]:
        a, b = engine.allocate(), engine.allocate()
        try:
            out = engine.forward([BatchRow(a, 0, [1, 5, 9, 2, 7], num_logits=5, capture=(0, 1)),
                                  BatchRow(b, 0, [3, 4, 8], num_logits=3)])
            out += engine.forward([BatchRow(a, 5, [11, 12, 13, 14], num_logits=4, tree_parents=[-1, 0, -1], capture=(0,)),
                                   BatchRow(b, 3, [6, 10], num_logits=2)])
            out += engine.forward([BatchRow(b, 5, [2])])
            return [t for o in out for t in (o.logits, o.features) if t is not None]
        finally:
            engine.release(a)
            engine.release(b)

    planned = passes()
    monkeypatch.setattr(lf, "LAYER_CALLS", False)
    checked = passes()
    assert len(planned) == len(checked) > 5 and all(torch.equal(x, y) for x, y in zip(planned, checked))

    kernel = engine.forward_impl.kernel
    cache = engine.cache
    d = engine.forward_impl.shape.head_dim
    heads = engine.forward_impl.shape.num_heads
    cos = sin = torch.zeros(2, d)
    scratch = torch.empty(64)
    with pytest.raises(ValueError, match="outside"):
        kernel.layer_calls(cache.keys, cache.values, 2, heads, cos, sin, [(0, 63, 0, 2, None)], 1.0, scratch)
    calls = kernel.layer_calls(cache.keys, cache.values, 2, heads, cos, sin, [(0, 0, 0, 2, None)], 1.0, scratch)
    with pytest.raises(ValueError, match="q/k/v output"):
        calls.rope_store(0, torch.zeros(2, calls.width - 1))
    with pytest.raises(ValueError, match="rms_norm"):
        calls.rms_norm(torch.zeros(3, 64), torch.ones(64), 1e-5)  # 3 rows in a 2-token pass
    normed = calls.rms_norm(torch.ones(2, 64), torch.ones(64), 1e-5)
    assert torch.equal(normed, kernel.rms_norm(torch.ones(2, 64), torch.ones(64), 1e-5))


def assert_compiles_without_warnings(source, flags) -> None:
    """``source`` passes a syntax-only compile with ``flags`` and -Wall -Wextra -Werror (skipped
    without a C++ compiler)."""
    import shutil
    import subprocess

    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    done = subprocess.run([compiler, *flags, "-Wall", "-Wextra", "-Werror", "-fsyntax-only", str(source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("isa", ISAS)
def test_the_source_is_a_real_file_that_compiles_without_warnings(isa, tmp_path):
    """The kernels' C++ lives in row_gemm.cpp beside its loader (not in a Python string), its
    text names the built library, and it compiles clean with -Wall -Wextra."""
    import hashlib
    from pathlib import Path

    source = Path(row_gemm_module.__file__).with_name("row_gemm.cpp")
    assert source.is_file() and "specbuild_panel_gemm" in source.read_text()
    flags = row_gemm_module._FLAGS + row_gemm_module._ISA_FLAGS[isa]
    want = hashlib.sha256((source.read_text() + " ".join(flags)).encode()).hexdigest()[:16]
    assert row_gemm_module.kernel_digest(isa) == want
    assert_compiles_without_warnings(source, flags)
