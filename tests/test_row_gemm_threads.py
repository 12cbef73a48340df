"""The row kernel's helper threads (``RowGemm.set_threads``, ``RuntimeConfig.kernel_threads``):
every thread count gives the same bits as one thread for any number of rows, shapes too small
to share run alone, concurrent callers and a forked child stay correct, and the engine's kernel
name (its cached pass costs' key) says the thread count."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.conftest import ROW_KERNEL_ISAS as ISAS, tiny_llama
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.core.errors import ConfigError
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch.llama_engine import LlamaEngine, kernel_threads

pytestmark = pytest.mark.skipif(not ISAS, reason="the row-invariant kernel needs x86-64 with AVX2 + FMA")


@pytest.mark.parametrize("k,n", [(576, 196), (75, 1000), (64, 40)])  # 40: two panels, fewer than three threads
def test_every_thread_count_gives_the_bits_of_one(row_gemm, k, n):
    gen = torch.Generator().manual_seed(k + n)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(70, k, generator=gen)
    row_gemm.set_threads(1)
    alone = {m: (row_gemm(x[:m], w, b), row_gemm(x[:m], w)) for m in (1, 2, 3, 8, 13, 16, 70)}
    for threads, min_rows in ((2, 1), (3, 1), (2, 4)):
        assert row_gemm.set_threads(threads, min_rows) == threads
        assert row_gemm.threads == threads and f"-t{threads}x{min_rows}" in row_gemm.name
        for m, (with_bias, without) in alone.items():
            assert torch.equal(row_gemm(x[:m], w, b), with_bias), (threads, m)
            assert torch.equal(row_gemm(x[:m], w), without), (threads, m)
    row_gemm.set_threads(1)
    assert row_gemm.threads == 1 and "-t" not in row_gemm.name


def test_bad_thread_counts_are_refused(row_gemm):
    with pytest.raises(ValueError, match=">= 1"):
        row_gemm.set_threads(0)
    with pytest.raises(ValueError, match=">= 1"):
        row_gemm.set_threads(2, 0)
    with pytest.raises(ConfigError, match="kernel_threads"):
        RuntimeConfig(kernel_threads=-1)
    with pytest.raises(ConfigError, match="kernel_threads"):
        RuntimeConfig(kernel_threads=17)


def test_concurrent_callers_share_the_pool_safely(row_gemm):
    """Two Python threads call at once (ctypes releases the GIL): one call takes the helpers,
    the other runs on its caller's thread; both give the single-thread bits."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(640, 256, generator=gen)
    xs = [torch.randn(m, 256, generator=gen) for m in (1, 5, 9)]
    expected = [row_gemm(x, w) for x in xs]
    row_gemm.set_threads(2)
    bound = row_gemm.bind(w)
    failures: list[int] = []

    def run(index: int) -> None:
        for _ in range(200):
            for x, want in zip(xs, expected):
                if not torch.equal(bound(x), want):
                    failures.append(index)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not failures


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_computes_alone(row_gemm):
    """A child forked after the helpers started has none of them: its calls run alone, same bits."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(320, 128, generator=gen), torch.randn(6, 128, generator=gen)
    row_gemm.set_threads(2)
    want = row_gemm(x, w)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, just the answer
        try:
            os.write(write, b"1" if torch.equal(row_gemm(x, w), want) else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"


def test_engine_sets_the_threads_it_is_configured_with():
    small = dict(max_batch_size=2, max_seq_len=32)
    try:
        engine = LlamaEngine(tiny_llama(3), runtime=RuntimeConfig(kernel_threads=2, **small))
        assert engine.forward_impl.row_invariant and engine.kernel_name.split("+")[0].endswith("-t2x1")
        engine = LlamaEngine(tiny_llama(3), runtime=RuntimeConfig(kernel_threads=1, **small))
        assert "-t" not in engine.kernel_name
    finally:
        kernel = row_gemm_module.load_row_gemm()
        kernel.set_threads(1)
    assert kernel_threads(3) == 3
    assert 1 <= kernel_threads(0) <= 8


def test_attention_gives_the_bits_of_one_thread(row_gemm):
    """Pooled attention splits the (query, head) pairs: causal chains and tree masks alike."""
    gen = torch.Generator().manual_seed(11)
    kv_heads, heads, d, positions, start, n = 3, 9, 64, 60, 40, 7
    keys, values = torch.randn(kv_heads, positions, d, generator=gen), torch.randn(kv_heads, positions, d, generator=gen)
    q = torch.randn(n, heads, d, generator=gen)
    visible = (torch.rand(n, start + n, generator=gen) > 0.3).to(torch.uint8)
    visible[torch.arange(n), start + torch.arange(n)] = 1
    results = {}
    for threads in (1, 2, 3):
        row_gemm.set_threads(threads)
        for mask in (None, visible):
            out, scratch = torch.empty(n, heads, d), torch.empty(positions)
            row_gemm.attention(q, keys, values, start, mask, d ** -0.5, out, scratch)
            results.setdefault(mask is None, []).append(out)
    for outs in results.values():
        assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_compact_weights_share_the_pool_with_the_same_bits(row_gemm):
    from triton_backend.engines.torch.weight_gemm import load_weight_gemm, pack_float, pack_int4, pack_int8

    kernel = load_weight_gemm()
    if kernel is None:
        pytest.skip("no compact-weight kernel here")
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(200, 128, generator=gen)
    scales = w.abs().amax(1) / 127
    q8 = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    q4 = (w * 2).round().clamp(-8, 7).to(torch.int8)
    packs = [pack_int8(q8, scales), pack_float(w.half()), pack_int4(q4, torch.rand(200, 2, generator=gen), 64)]
    x = torch.randn(9, 128, generator=gen)
    row_gemm.set_threads(1)
    alone = [kernel.bind(p)(x[:m]) for p in packs for m in (1, 3, 9)]
    row_gemm.set_threads(2)
    shared = [kernel.bind(p)(x[:m]) for p in packs for m in (1, 3, 9)]
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))


def test_auto_threads_respect_a_cgroup_cpu_quota(tmp_path):
    """A container limited to 1.5 CPUs gets 2 kernel threads, one limited to 1 CPU one, whatever
    its affinity mask shows; no quota (or an unreadable one) leaves the affinity count."""
    from triton_backend.engines.torch.cpu_cores import quota_cores, usable_cores

    affinity = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert quota_cores(v2) == 1.5 and usable_cores(8, v2) == min(2, affinity)
    (v2 / "cpu.max").write_text("100000 100000\n")
    assert usable_cores(8, v2) == 1
    (v2 / "cpu.max").write_text("max 100000\n")
    assert quota_cores(v2) is None and usable_cores(8, v2) == min(8, affinity)
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert quota_cores(v1.parent) is None
    (v1 / "cpu.cfs_quota_us").write_text("250000\n")
    assert quota_cores(v1.parent) == 2.5 and usable_cores(2, v1.parent) == min(2, affinity)
    (v2 / "cpu.max").write_text("garbage\n")
    assert quota_cores(v2) is None
    assert usable_cores(1, tmp_path / "none") == 1
