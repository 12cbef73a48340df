"""Medusa heads into a TensorRT-LLM checkpoint with real modelopt (a tiny random Llama target):
TensorRT-LLM's documented tensor names and config keys, the shared LM head filled from the
target's, the tree size as max_draft_len, FP8 like the target, and bad heads refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from build_fixtures import make_tiny_llama
from builder.plan.architecture import load_architecture
from builder.stages.calibration import load_calibration_texts, make_forward_loop
from builder.errors import BuildSpecError
from builder.stages.checkpoint_export import export_checkpoint
from builder.stages.medusa_heads import attach_medusa_heads, record_medusa_tree
from builder.stages.quantize import quantize_model
from builder.plan.spec import CalibrationSpec, KVCacheDtype, MedusaSpec, Precision
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.speculation.drafters.medusa_model import MedusaHeads, MedusaHeadsInfo, save_medusa
from triton_backend.engines.torch.model_loading import load_model, load_tokenizer

pytestmark = pytest.mark.slow

CHOICES = ((0,), (1,), (0, 0), (0, 1), (1, 0))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from triton_backend.core.reference_model import ensure_reference_model

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", ensure_reference_model())


@pytest.fixture(scope="module")
def heads_file(tmp_path_factory) -> tuple[Path, MedusaHeads]:
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaHeadsInfo(num_heads=2, num_layers=1, hidden_size=256, vocab_size=49152,
                                        medusa_choices=CHOICES))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    path = save_medusa(tmp_path_factory.mktemp("heads") / "heads.safetensors", heads, torch.arange(100))
    return path, heads


def _export(tiny_dir: Path, spec: MedusaSpec, precision: Precision, out: Path) -> tuple[dict, dict, torch.Tensor]:
    torch.set_num_threads(1)
    model = load_model(str(tiny_dir), RuntimeConfig()).eval()
    lm_head = model.get_output_embeddings().weight.detach().clone()
    attach_medusa_heads(model, spec)
    if precision.is_quantized:
        calib = CalibrationSpec(num_samples=2, max_length=32)
        quantize_model(model, precision, KVCacheDtype.FP16,
                       make_forward_loop(load_tokenizer(str(tiny_dir)), load_calibration_texts(calib), calib.max_length))
    export_checkpoint(model, load_architecture(str(tiny_dir)), precision, KVCacheDtype.FP16, out, 1, 1)
    recorded = record_medusa_tree(out, spec)
    with safe_open(str(out / "rank0.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("medusa_heads.")}
    return json.loads((out / "config.json").read_text()), {"recorded": recorded, "tensors": tensors}, lm_head


def test_fp16_checkpoint_has_the_documented_medusa_layout(tiny_dir, heads_file, tmp_path):
    path, heads = heads_file
    config, got, lm_head = _export(tiny_dir, MedusaSpec(num_heads=2, num_layers=1, source=str(path)), Precision.FP16,
                                   tmp_path / "ckpt")
    assert config["architecture"] == "MedusaForCausalLM" and config["num_medusa_heads"] == 2
    assert config["num_medusa_layers"] == 1 and config["max_draft_len"] == len(CHOICES)
    assert got["recorded"]["medusa_choices"] == [list(c) for c in CHOICES]
    tensors = got["tensors"]
    assert set(tensors) == {f"medusa_heads.{i}.{name}" for i in range(2)
                            for name in ("medusa_layers.0.linear.weight", "medusa_layers.0.linear.bias", "lm_head.weight")}
    for i in range(2):
        mine = heads.medusa_heads[i].medusa_layers[0].linear
        assert torch.allclose(tensors[f"medusa_heads.{i}.medusa_layers.0.linear.weight"].float(), mine.weight.half().float())
        assert torch.allclose(tensors[f"medusa_heads.{i}.medusa_layers.0.linear.bias"].float(), mine.bias.half().float())
        assert torch.allclose(tensors[f"medusa_heads.{i}.lm_head.weight"].float(), lm_head.half().float())  # shared head


def test_fp8_target_quantizes_the_heads_too(tiny_dir, heads_file, tmp_path):
    path, _ = heads_file
    config, got, _ = _export(tiny_dir, MedusaSpec(num_heads=2, num_layers=1, source=str(path)), Precision.FP8,
                             tmp_path / "ckpt")
    assert config["quantization"]["quant_algo"] == "FP8" and config["num_medusa_heads"] == 2
    assert got["tensors"]["medusa_heads.0.medusa_layers.0.linear.weight"].dtype == torch.float8_e4m3fn


def test_heads_not_matching_the_spec_are_refused(tiny_dir, heads_file):
    path, _ = heads_file
    model = load_model(str(tiny_dir), RuntimeConfig()).eval()
    with pytest.raises(BuildSpecError, match="2 heads x 1 layers"):
        attach_medusa_heads(model, MedusaSpec(num_heads=4, num_layers=1, source=str(path)))


def test_torch_only_build_serves_the_trained_heads(tiny_dir, heads_file, tmp_path):
    from builder.cli.main import main as cli_main
    from triton_backend.deployment.torch_deployment import build_decoder
    from triton_backend.serving.service import load_deployment

    path, _ = heads_file
    out = tmp_path / "out"
    assert cli_main(["build", "--target", str(tiny_dir), "--torch-only", "--medusa-heads", "2", "--medusa-source",
                     str(path), "-o", str(out), "--no-progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert not any("Medusa heads are in the TensorRT-LLM" in n for n in manifest["notices"])
    deployment = load_deployment(out / manifest["model_repo"]["deployment"])
    assert Path(deployment.medusa).is_file() and Path(deployment.medusa).parent == (out / "weights" / "medusa").resolve()
    decoder = build_decoder(deployment)
    from triton_backend.core.config import FallbackConfig, SamplingParams, SpeculationConfig, SpeculationMode

    assert decoder.resolve(SpeculationMode.AUTO)[0] is SpeculationMode.MEDUSA
    params = SamplingParams(max_tokens=12)
    medusa = decoder.generate([1, 2, 3], params, SpeculationConfig(method="medusa",
                                                                   fallback=FallbackConfig(enabled=False)))
    assert medusa.token_ids == decoder.generate([1, 2, 3], params, SpeculationConfig(method="off")).token_ids
