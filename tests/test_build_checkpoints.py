"""Real modelopt quantization + TensorRT-LLM checkpoint export, checked by an independent
unpacker (tests/build_fixtures.py): INT4-AWQ and FP8 on a tiny random Llama (dims multiples
of 128, TP 1 and 2), FP8 and INT8-SmoothQuant on the real SmolLM2-135M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from build_fixtures import check_checkpoint, make_tiny_llama, unpack_int4
from builder.plan.architecture import load_architecture
from builder.stages.calibration import load_calibration_texts, make_forward_loop
from builder.stages.checkpoint_export import export_checkpoint
from builder.stages.quantize import quantize_model
from builder.plan.spec import CalibrationSpec, KVCacheDtype, Precision

pytestmark = pytest.mark.slow

CALIBRATION = CalibrationSpec(num_samples=4, max_length=64)


@pytest.fixture(scope="module")
def reference_dir() -> Path:
    from triton_backend.core.reference_model import ensure_reference_model

    return ensure_reference_model()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, reference_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", reference_dir)


def quantize_and_export(source: str, precision: Precision, kv: KVCacheDtype, out: Path, tp: int = 1):
    """(original float32 state dict, checkpoint folder, checkpoint config)."""
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.engines.torch.model_loading import load_model, load_tokenizer

    torch.set_num_threads(1)
    model = load_model(source, RuntimeConfig()).eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loop = make_forward_loop(load_tokenizer(source), load_calibration_texts(CALIBRATION), CALIBRATION.max_length)
    quantize_model(model, precision, kv, loop)
    info = export_checkpoint(model, load_architecture(source), precision, kv, out, tp, 1)
    return state, info.directory, info.config


def test_unpack_int4_round_trip():
    values = torch.randint(-8, 8, (6, 10), dtype=torch.int16)
    nib = values & 0x0F
    packed = (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8).view(torch.int8)
    assert torch.equal(unpack_int4(packed), values.float())


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_llama_int4_awq(tiny_dir, tmp_path, tp):
    state, folder, config = quantize_and_export(str(tiny_dir), Precision.INT4_AWQ, KVCacheDtype.FP8, tmp_path / "ckpt", tp)
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ" and config["quantization"]["group_size"] == 128
    assert config["mapping"]["tp_size"] == tp and sorted(p.name for p in folder.glob("rank*")) == [f"rank{r}.safetensors" for r in range(tp)]
    report = check_checkpoint(folder, state, num_layers=2, precision="int4_awq", tp=tp, fp8_kv=True)
    assert report.tensors == tp * (2 * 5 + 2 * 2 + 3)
    # int4 with 128-wide groups: errors well above fp16 rounding, well below the weights' range
    worst = max(report.max_rel_error.values())
    assert 1e-3 < worst < 0.15, report.max_rel_error


def test_tiny_llama_fp8(tiny_dir, tmp_path):
    state, folder, config = quantize_and_export(str(tiny_dir), Precision.FP8, KVCacheDtype.FP16, tmp_path / "ckpt")
    assert (config["quantization"]["quant_algo"], config["quantization"]["kv_cache_quant_algo"]) == ("FP8", None)
    report = check_checkpoint(folder, state, num_layers=2, precision="fp8", tp=1, fp8_kv=False)
    assert 1e-3 < max(report.max_rel_error.values()) <= 2**-4 + 1e-3, report.max_rel_error


def test_smollm2_fp8_with_fp8_kv_cache(tmp_path):
    state, folder, config = quantize_and_export("smollm2-135m-instruct", Precision.FP8, KVCacheDtype.FP8, tmp_path / "ckpt")
    assert (config["quantization"]["quant_algo"], config["quantization"]["kv_cache_quant_algo"]) == ("FP8", "FP8")
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    report = check_checkpoint(folder, state, num_layers=30, precision="fp8", tp=1, fp8_kv=True)
    assert len(report.max_rel_error) == 30 * 5


def test_smollm2_int8_smoothquant(tmp_path):
    state, folder, config = quantize_and_export("smollm2-135m-instruct", Precision.INT8_SQ, KVCacheDtype.FP16, tmp_path / "ckpt")
    assert config["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    # every element within half a quantization step of the smoothed weight (the checker's bound);
    # in weight space the error can be large where SmoothQuant moved scale out of quiet input
    # channels, which the activations there (multiplied by 1/prequant) cancel
    report = check_checkpoint(folder, state, num_layers=30, precision="int8_sq", tp=1, fp8_kv=False)
    assert len(report.max_rel_error) == 30 * 5


def test_smollm2_fp16_checkpoint_matches_the_planner_parameter_count(tmp_path):
    """The planner sizes weights from the config alone; the exported checkpoint holds exactly
    that many values (LM head stored apart from the tied embedding)."""
    from safetensors import safe_open

    state, folder, config = quantize_and_export("smollm2-135m-instruct", Precision.FP16, KVCacheDtype.FP16, tmp_path / "ckpt")
    check_checkpoint(folder, state, num_layers=30, precision="fp16", tp=1, fp8_kv=False)
    with safe_open(str(folder / "rank0.safetensors"), "pt") as f:
        total = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    arch = load_architecture("smollm2-135m-instruct")
    assert total == arch.total_params == 162_826_560
    assert json.loads((folder / "config.json").read_text())["share_embedding_table"] is False


@pytest.mark.parametrize("kv, algo", [(KVCacheDtype.FP8, "FP8"), (KVCacheDtype.INT8, "INT8")])
def test_16_bit_weights_with_a_quantized_kv_cache(tiny_dir, tmp_path, kv, algo):
    state, folder, config = quantize_and_export(str(tiny_dir), Precision.FP16, kv, tmp_path / "ckpt")
    assert (config["quantization"]["quant_algo"], config["quantization"]["kv_cache_quant_algo"]) == (None, algo)
    from safetensors import safe_open

    with safe_open(str(folder / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.0.attention.qkv.weight").dtype == torch.float16
        scale = f.get_tensor("transformer.layers.0.attention.kv_cache_scaling_factor")
        assert scale.numel() == 1 and float(scale) > 0
