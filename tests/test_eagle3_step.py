"""The EAGLE-3 drafter's serving-time step (:mod:`triton_backend.speculation.drafters.eagle3_step`)
against the reference net it is built from: chains alone and batched, tree nodes, ``fc``, the
head, the cache entries it writes, on both CPU kernels."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_engine
from test_eagle3_serving import _net
from triton_backend.engines.torch.weight_gemm import load_weight_gemm, pack_float
from triton_backend.speculation.drafters.eagle3_step import Eagle3Step
from triton_backend.speculation.drafters.eagle_model import EagleKV, TreeStep


def _kernels(target):
    kernel = target.forward_impl.kernel
    compact = load_weight_gemm()
    if kernel is None or compact is None:
        pytest.skip("needs the row and compact-weight CPU kernels (x86-64 with AVX2 + FMA)")
    return kernel, compact


@pytest.fixture(params=["row", "float16", "bfloat16"])
def pair(request):
    """(reference net, step) with the same weights: float32 on the row kernel, or 16-bit values
    (the net holds them in float32) on the compact kernel."""
    target = tiny_engine(0, layers=4)
    kernel, compact = _kernels(target)
    net = _net(target.model.config, scale=0.1)
    if request.param == "row":
        return net, Eagle3Step(net, kernel.bind, kernel.name)
    dtype = getattr(torch, request.param)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.to(dtype).float())
    return net, Eagle3Step(net, lambda w: compact.bind(pack_float(w.to(dtype).contiguous())), compact.name)


def _caches(net, rows: int = 3) -> tuple[EagleKV, EagleKV]:
    info = net.info
    return tuple(EagleKV.empty(info, rows, 8, torch.float32) for _ in range(2))  # type: ignore[return-value]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=2e-4, rtol=2e-4), float((a - b).abs().max())


def test_fc_and_head_are_the_nets(pair):
    net, step = pair
    h = net.info.hidden_size
    features = torch.randn(2, 3, net.info.feature_size)
    with torch.inference_mode():
        _close(step.fc(features), net.fc(features))
        g = torch.randn(5, h)
        _close(step.logits(g), net.logits(g))


def test_chains_alone_and_batched_write_and_read_the_nets_entries(pair):
    """One row in cache row 1 (a prompt of 5, then single steps past the cache's first capacity),
    then three ragged rows together: outputs and cache entries as the reference's."""
    net, step = pair
    h = net.info.hidden_size
    ref_kv, kv = _caches(net)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for start, t in ((0, 5), (5, 1), (6, 1), (7, 3)):  # the last one grows the cache
            hidden, embeds = torch.randn(1, t, h, generator=gen), torch.randn(1, t, h, generator=gen)
            starts, slots = torch.tensor([start]), torch.tensor([1])
            _close(step(hidden, embeds, starts, kv, slots=slots), net(hidden, embeds, starts, ref_kv, slots=slots))
        _close(kv.k[:, :, :10], ref_kv.k[:, :, :10])
        _close(kv.v[:, :, :10], ref_kv.v[:, :, :10])
        starts, slots = torch.tensor([10, 0, 4]), torch.tensor([1, 0, 2])
        hidden, embeds = torch.randn(3, 2, h, generator=gen), torch.randn(3, 2, h, generator=gen)
        _close(step(hidden, embeds, starts, kv, slots=slots), net(hidden, embeds, starts, ref_kv, slots=slots))
        _close(kv.k[:, :, :12], ref_kv.k[:, :, :12])


def test_tree_nodes_are_placed_and_masked_as_the_nets(pair):
    """Two rows' nodes after 4 committed entries each: three siblings at one position; a node
    and its child (which sees the node's entry written in the same step) and a padding node."""
    net, step = pair
    h = net.info.hidden_size
    ref_kv, kv = _caches(net, rows=2)
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        prefix = torch.randn(2, 4, h, generator=gen), torch.randn(2, 4, h, generator=gen)
        for cache, run in ((kv, step), (ref_kv, net)):
            run(*prefix, torch.tensor([0, 0]), cache, slots=torch.tensor([0, 1]))
        end = 7
        visible = torch.zeros(2, 3, end, dtype=torch.bool)
        visible[:, :, :4] = True
        visible[0, 0, 4] = visible[0, 1, 5] = visible[0, 2, 6] = True
        visible[1, 0, 4] = visible[1, 1, 4] = visible[1, 1, 5] = visible[1, 2, 6] = True
        tree = TreeStep(torch.tensor([[4, 4, 4], [4, 5, 6]]), torch.tensor([[4, 5, 6], [4, 5, 6]]), visible)
        hidden, embeds = torch.randn(2, 3, h, generator=gen), torch.randn(2, 3, h, generator=gen)
        slots = torch.tensor([1, 0])
        _close(step(hidden, embeds, torch.tensor([4, 4]), kv, tree=tree, slots=slots),
               net(hidden, embeds, torch.tensor([4, 4]), ref_kv, tree=tree, slots=slots))
        _close(kv.k[:, :, :end], ref_kv.k[:, :, :end])
        _close(kv.v[:, :, :end], ref_kv.v[:, :, :end])
