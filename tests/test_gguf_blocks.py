"""GGUF blocks imported into the compact-weight kernel (engines/torch/gguf_blocks.py): Q4_0, Q4_1 and Q8_0
tensors of a file written by the ``gguf`` package decode, in the kernel's layout, to the very float32
values the ``gguf`` package's dequantization gives; the tensor table is read past string-array metadata;
q/k rows follow transformers' GGUF reorder; bad files and unimported types are refused. Real SmolLM2
(slow): every linear of the reference GGUF equals the float32 reference model's weight bit for bit, and
the int4 engine built on them is row-invariant and predicts float32's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.batch import BatchRow
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch.gguf_blocks import GGUFBlocks, compact_from_blocks, rotary_rows
from triton_backend.engines.torch.weight_gemm import WeightFormat, dequantize, load_weight_gemm

gguf = pytest.importorskip("gguf")
SHAPES = {"Q4_0": (40, 96), "Q4_1": (64, 128), "Q8_0": (33, 64)}


def _write(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}" for i in range(300)])  # a string array the table reader must skip
    writer.add_float32("test.value", 0.5)
    for name, (kind, data) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def gguf_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    gen = np.random.default_rng(4)
    data = {kind: (gen.standard_normal(shape) * 0.05 + 0.01).astype(np.float32) for kind, shape in SHAPES.items()}
    tensors = {f"w.{kind}": (kind, d) for kind, d in data.items()}
    tensors["norm"] = ("F32", gen.standard_normal(64).astype(np.float32))
    return _write(tmp_path / "t.gguf", tensors), data


def test_blocks_decode_to_the_gguf_dequantization_bit_for_bit(gguf_file):
    path, data = gguf_file
    blocks = GGUFBlocks(path)
    assert set(blocks.tensors) == {"w.Q4_0", "w.Q4_1", "w.Q8_0", "norm"}
    for kind, original in data.items():
        qtype = gguf.GGMLQuantizationType[kind]
        want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype))
        t = blocks.tensor(f"w.{kind}")
        assert (t.kind, t.n, t.k) == (kind, *original.shape)
        weight = compact_from_blocks(t).weight
        assert weight.format is (WeightFormat.INT8 if kind == "Q8_0" else WeightFormat.INT4) and weight.group == 32
        assert (weight.mins is not None) == (kind == "Q4_1") and weight.scales.dtype == torch.float16  # exact, half the bytes
        assert torch.equal(dequantize(weight), want), kind


@pytest.mark.skipif(row_gemm_module.cpu_isa() is None, reason="the CPU kernels need x86-64 with AVX2 + FMA")
def test_the_kernel_multiplies_by_the_imported_weights(gguf_file):
    path, _ = gguf_file
    kernel = load_weight_gemm()
    gen = torch.Generator().manual_seed(1)
    for name in ("w.Q4_0", "w.Q4_1", "w.Q8_0"):
        weight = compact_from_blocks(GGUFBlocks(path).tensor(name)).weight
        x = torch.randn(5, weight.k, generator=gen)
        got = kernel.bind(weight)(x)
        want = x.double() @ dequantize(weight).double().T
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-4, name
        for i in range(5):  # every row the same bits alone
            assert torch.equal(kernel.bind(weight)(x[i:i + 1]), got[i:i + 1])


def test_rotary_rows_follow_transformers_gguf_reorder():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    for n, heads in ((576, 9), (192, 3), (64, 4)):
        gguf_rows = np.arange(n)[:, None].astype(np.float32)
        hf = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": heads})
        want = hf.process(gguf_rows, "blk.0.attn_q.weight").weights[:, 0].astype(np.int64)
        assert torch.equal(rotary_rows(n, heads), torch.from_numpy(want))


def test_bad_files_and_types_are_refused(gguf_file, tmp_path):
    path, _ = gguf_file
    blocks = GGUFBlocks(path)
    with pytest.raises(ModelLoadError, match="F32"):
        blocks.tensor("norm")
    with pytest.raises(ModelLoadError, match="no tensor"):
        blocks.tensor("missing")
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="magic"):
        GGUFBlocks(tmp_path / "bad.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-600])
    with pytest.raises(ModelLoadError, match="past the end"):
        GGUFBlocks(cut).tensor("w.Q8_0")  # written last but for the 256-byte norm


# -- real weights --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(row_gemm_module.cpu_isa() is None, reason="the CPU kernels need x86-64 with AVX2 + FMA")
def test_smollm2_gguf_blocks_are_the_float32_weights_and_serve_int4(reference):
    from test_quantized_engine import check_exactness
    from triton_backend.engines.torch.llama_engine import LlamaEngine
    from triton_backend.engines.torch.model_loading import gguf_compact, with_head

    base, tokenizer = reference
    runtime = RuntimeConfig(weights=WeightPrecision.INT4, max_batch_size=4, max_seq_len=256)
    compact = gguf_compact("smollm2-135m-instruct", base.model.config, runtime)
    assert compact is not None and len(compact) == 30 * 7 + 1
    params = dict(base.model.named_parameters(remove_duplicate=False))
    embed = base.model.get_input_embeddings().weight
    for name, linear in compact.items():
        float_weight = params.get(f"{name}.weight", embed)
        assert float_weight.is_meta or torch.equal(dequantize(linear.weight), float_weight), name
    assert torch.equal(dequantize(compact["lm_head"].weight), embed)  # Q8_0, tied to the embedding
    engine = LlamaEngine(base.model, eos_token_ids=[], runtime=runtime, compact=with_head(base.model, compact, runtime))
    assert engine.weights is WeightPrecision.INT4
    prompts = [tokenizer.encode(p) for p in ("The capital of France is a city", "def fib(n): return n if n < 2 else",
                                            "1, 2, 3, 4, 5, 6,", "Hello there, how are you today?")]
    check_exactness(engine, prompts)
    ids = tokenizer.encode("Write a haiku about the sea and the stars above it.")
    slot, fslot = engine.allocate(), base.allocate()
    got = engine.forward([BatchRow(slot, 0, ids, num_logits=len(ids))])[0].logits
    want = base.forward([BatchRow(fslot, 0, ids, num_logits=len(ids))])[0].logits
    engine.release(slot)
    base.release(fslot)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-3
