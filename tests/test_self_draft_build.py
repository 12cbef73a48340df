"""The self draft in the build spec, planner and pipeline: ``draft: self`` (or ``{source: self,
precision, layers}``) plans the target's architecture as the draft (fewer layers when given), no
tokenizer check (same by construction), its memory at its own precision; ``specbuild build`` exports
the target's weights once more at the draft precision, writes both engines' ``trtllm-build`` lines
and renders a torch deployment with the self draft (slow: quantizes a tiny model)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from builder.errors import BuildSpecError, PrecisionError
from builder.plan.architecture import load_architecture
from builder.plan.planner import plan_deployment, self_draft_layers
from builder.plan.spec import BuildSpec, ModelSpec, Precision


def _plan(draft, target: str = "llama-3-8b", **target_fields):
    spec = BuildSpec.from_dict({"target": {"source": target, **target_fields}, "draft": draft})
    return spec, plan_deployment(spec)


def test_a_self_draft_plans_the_targets_architecture_at_a_cheaper_precision():
    spec, plan = _plan("self", precision="fp16")
    assert spec.draft == ModelSpec("self") and spec.draft.is_self
    target, draft = (next(m for m in plan.models if m.role == role) for role in ("target", "draft"))
    assert draft.params == target.params  # the target's own weights
    assert draft.precision.is_quantized and draft.precision is not target.precision  # auto: the best quantized one
    assert 0 < draft.footprint.weights < target.footprint.weights  # counted, at its own precision
    assert any("same tokenizer by construction" in n for n in plan.notes)


def test_a_self_draft_of_fewer_layers_and_explicit_precision():
    _, plan = _plan({"source": "self", "precision": "int4_awq", "layers": 8}, precision="fp16")
    draft = next(m for m in plan.models if m.role == "draft")
    assert draft.precision is Precision.INT4_AWQ
    full = load_architecture("llama-3-8b")
    per_layer = (full.total_params - replace(full, num_layers=1).total_params) // 31
    assert draft.params == full.total_params - 24 * per_layer  # 8 of its 32 layers, embedding and head
    # the same precision as the target is fine over fewer layers, refused over all of them
    _plan({"source": "self", "precision": "fp16", "layers": 8}, precision="fp16")
    with pytest.raises(PrecisionError, match="target itself"):
        _plan({"source": "self", "precision": "fp16"}, precision="fp16")
    assert self_draft_layers(30, 10) == (0, 3, 6, 9, 12, 15, 18, 21, 24, 27)


def test_self_draft_spec_errors():
    with pytest.raises(BuildSpecError, match="needs source 'self'"):
        BuildSpec.from_dict({"target": "llama-3-8b", "draft": {"source": "llama-3.2-1b", "layers": 4}})
    with pytest.raises(BuildSpecError, match="layers must be a positive integer"):
        BuildSpec.from_dict({"target": "llama-3-8b", "draft": {"source": "self", "layers": 0}})
    with pytest.raises(BuildSpecError, match="target cannot be"):
        BuildSpec.from_dict({"target": "self"})
    with pytest.raises(Exception, match="fewer than the target's 32"):
        _plan({"source": "self", "layers": 32})


@pytest.mark.slow
def test_build_exports_the_target_again_and_renders_the_self_draft(tmp_path, monkeypatch):
    from build_fixtures import make_tiny_llama
    from builder.cli.main import main as cli_main
    from test_build_pipeline import CAL, path_without_trtllm_build
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.deployment.deployment_config import DeploymentConfig

    tiny = make_tiny_llama(tmp_path / "tiny", ensure_reference_model(), seed=3)
    monkeypatch.setenv("PATH", path_without_trtllm_build())
    out = tmp_path / "out"
    assert cli_main(["build", "--target", str(tiny), "--precision", "fp16", "--draft", "self", "--draft-precision",
                     "int8_sq", "--max-batch-size", "2", "-o", str(out), *CAL]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["checkpoints"]) == {"target", "draft"}  # the target's weights exported at both precisions
    assert manifest["precisions"]["draft"]["weights"] == "int8_sq"
    assert not (out / "weights" / "draft").exists()  # no second copy of the torch weights
    script = (out / "build_engines.sh").read_text()
    assert "checkpoints/target" in script and "checkpoints/draft" in script and "engines/draft" in script
    deployment = DeploymentConfig.load(out / manifest["model_repo"]["deployment"])
    assert deployment.draft is None and deployment.self_draft is not None
    assert deployment.self_draft.precision.value == "int8"
    assert "self draft" in manifest["model_repo"]["torch_linear_weights"]["draft"]
    # fewer layers: the torch runtime only
    assert cli_main(["build", "--target", str(tiny), "--draft", "self", "--draft-layers", "1", "-o",
                     str(tmp_path / "o2"), *CAL]) == 2
