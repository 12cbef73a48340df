"""The build's quality stage (builder/stages/quality.py): the reference model's weights quantized at
load against float32 (small N/M), the warnings past the thresholds, the models it does not measure,
and a build that skips it. The full build in test_build_pipeline.py measures an exported checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from builder.cli.main import main as cli_main
from builder.errors import BuildSpecError
from builder.plan.architecture import load_architecture
from builder.plan.spec import BuildSpec, ModelSpec, QualitySpec
from builder.stages.quality import QualityTarget, measure_quality, quality_target, quality_warnings, run_quality
from triton_backend.core.runtime_config import WeightPrecision
from triton_backend.core.reference_model import DEFAULT_REFERENCE
from triton_backend.engines.torch import row_gemm

SMALL = QualitySpec(prompts=2, max_tokens=8, text_tokens=128, window=64)


@pytest.fixture(scope="module")
def reference_arch():
    return load_architecture(DEFAULT_REFERENCE)


@pytest.mark.skipif(row_gemm.cpu_isa() is None, reason="the CPU kernels need x86-64 with AVX2 + FMA")
def test_reference_model_int8_and_float16_against_float32(reference_arch):
    """float16 linears agree with float32 on every greedy token at the same perplexity (to 1e-3);
    int8 round-to-nearest stays within the default thresholds."""
    torch.set_num_threads(1)
    half = measure_quality(QualityTarget("target", DEFAULT_REFERENCE, reference_arch, WeightPrecision.FLOAT16, None), SMALL)
    assert half["greedy_agreement"] == 1.0 and abs(half["perplexity"]["ratio"] - 1) < 1e-3
    assert half["method"]["prompts"] == 2 and half["method"]["max_tokens"] == 8 and half["method"]["perplexity_tokens"] == 126
    int8 = measure_quality(QualityTarget("target", DEFAULT_REFERENCE, reference_arch, WeightPrecision.INT8, None), SMALL)
    assert int8["served"] == "quantized at load" and "weight_gemm" in int8["kernel"]
    assert int8["perplexity"]["float32"] == half["perplexity"]["float32"] and math.isfinite(int8["perplexity"]["served"])
    assert 0.9 <= int8["greedy_agreement"] <= 1 and int8["perplexity"]["ratio"] < 1.1 and int8["warnings"] == []


def test_warnings_past_the_thresholds():
    record = {"precision": "int4", "served": "quantized at load", "greedy_agreement": 0.62,
              "perplexity": {"float32": 10.0, "served": 12.0, "ratio": 1.2}}
    warnings = quality_warnings("draft", record, QualitySpec())
    assert len(warnings) == 2 and "0.620 is below quality.min_agreement 0.9" in warnings[0]
    assert "(x1.200) is above quality.max_ppl_ratio 1.1" in warnings[1]
    assert quality_warnings("draft", record, QualitySpec(min_agreement=0.6, max_ppl_ratio=1.25)) == []


def test_models_it_cannot_measure_are_recorded_with_a_notice(reference_arch):
    from builder.plan.planner import plan_deployment

    plan = plan_deployment(BuildSpec(target=ModelSpec(DEFAULT_REFERENCE, "fp8")))
    fp8 = quality_target("target", DEFAULT_REFERENCE, reference_arch, plan.model("target"), None, None)
    assert isinstance(fp8, QualityTarget) and fp8.precision is WeightPrecision.FP8  # served as e4m3, so measured
    reason = "float32: nothing to compare"
    big = QualityTarget("target", DEFAULT_REFERENCE, reference_arch, WeightPrecision.INT8, None)
    section, notices = run_quality([big, ("draft", reason)], SMALL, available=2**20)
    assert "needs about" in section["target"]["skipped"]
    assert section["draft"] == {"skipped": reason}
    assert notices[0].startswith("quality, target: not measured (its float32 copy needs about")
    assert notices[1] == f"quality, draft: not measured ({reason})"


def test_thresholds_are_typed():
    with pytest.raises(BuildSpecError, match="min_agreement"):
        BuildSpec.from_dict({"target": DEFAULT_REFERENCE, "quality": {"min_agreement": 1.5}})
    with pytest.raises(BuildSpecError, match="max_ppl_ratio"):
        BuildSpec.from_dict({"target": DEFAULT_REFERENCE, "quality": {"max_ppl_ratio": "high"}})
    spec = BuildSpec.from_dict({"target": DEFAULT_REFERENCE, "quality": {"enabled": False, "prompts": 4}})
    assert spec.quality.enabled is False and spec.quality.prompts == 4


def test_a_build_with_skip_quality_records_no_measurement(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["build", "--target", DEFAULT_REFERENCE, "--precision", "int8_sq", "--torch-only", "--skip-quality",
                     "--no-progress", "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert "quality stage off" in manifest["quality"]["skipped"]
    assert "quality" not in [s["name"] for s in manifest["stages"]] and "quality target" not in capsys.readouterr().out
