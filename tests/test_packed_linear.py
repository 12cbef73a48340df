"""Prepacked CPU linear layers: same results as ``nn.Linear`` (within float32 rounding) for
every row count, tied weights stay tied, and the engine packs only where it should."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import tiny_llama
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.torch.packed_linear import PackedLinear, pack_linear_layers, packing_available
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.core.errors import ConfigError

needs_mkl = pytest.mark.skipif(not packing_available(), reason="this torch build has no MKL packed GEMM")


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear_for_every_row_count(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear, rows=8)
    with torch.inference_mode():
        for rows in range(1, 40):  # plain kernel, one packed chunk, several chunks, plain again
            x = torch.randn(1, rows, 96)
            want, got = linear(x), packed(x)
            assert got.shape == want.shape == (1, rows, 200)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert packed.weight is linear.weight  # shared, not copied


@needs_mkl
def test_packed_linear_falls_back_when_gradients_are_needed():
    linear = nn.Linear(16, 8)
    packed = PackedLinear(linear, rows=4)
    x = torch.randn(4, 16)
    packed(x).sum().backward()
    assert linear.weight.grad is not None


def test_rows_below_four_are_refused():
    with pytest.raises(ValueError, match="rows"):
        PackedLinear(nn.Linear(4, 4), rows=3)


@needs_mkl
def test_pack_linear_layers_keeps_tied_weights_tied_and_outputs_close():
    model = tiny_llama(3)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie, like SmolLM2
    ids = torch.randint(0, 32, (1, 12))
    with torch.inference_mode():
        want = model(ids).logits
        count = pack_linear_layers(model, 16)
        got = model(ids).logits
    assert count == 2 * 7 + 1  # 7 projections per layer, 2 layers, the LM head
    assert isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    assert pack_linear_layers(model, 16) == 0  # already packed: nothing left to pack


@needs_mkl
def test_engine_packs_cpu_float32_only_when_asked():
    packed = TorchEngine(tiny_llama(1), runtime=RuntimeConfig(), eos_token_ids=[])
    plain = TorchEngine(tiny_llama(1), runtime=RuntimeConfig(packed_gemm_rows=0), eos_token_ids=[])
    half = TorchEngine(tiny_llama(1), runtime=RuntimeConfig(dtype="bfloat16"), eos_token_ids=[])
    assert isinstance(packed.model.lm_head, PackedLinear)
    assert type(plain.model.lm_head) is nn.Linear
    assert type(half.model.lm_head) is nn.Linear
    seq = list(range(3, 20))
    a = packed.new_session().logits(seq, 5)
    b = plain.new_session().logits(seq, 5)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 3, 65, -1, 4.0, "16"])
def test_runtime_config_rejects_bad_packed_rows(rows):
    with pytest.raises(ConfigError, match="packed_gemm_rows"):
        RuntimeConfig(packed_gemm_rows=rows)
