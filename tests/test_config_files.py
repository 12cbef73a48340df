"""The typed configs as files: one config per speculation concern and method, each field
described; older flat deployment files still load; config problems are ConfigError, request
problems InvalidRequestError; the deployment config loads without torch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from triton_backend.core.config import (
    CrossRequestConfig, CrossRequestContinuation, DraftLengthConfig, FallbackConfig, FallbackRule, MedusaConfig, NgramConfig, SpeculationConfig, SpeculationMode,
    TreeAcceptance,
)
from triton_backend.core.config_io import descriptions, read_config
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.core.errors import ConfigError, InvalidRequestError

REPO_ROOT = Path(__file__).resolve().parents[1]
FLAT = {  # a deployment's speculation section as written before the per-method configs
    "mode": "ngram", "num_draft_tokens": 6, "adaptive": True, "min_draft_tokens": 2, "verify_cost_per_token": 0.1,
    "fallback": True, "fallback_rule": "threshold", "fallback_threshold": 0.4, "fallback_window": 100,
    "fallback_min_drafted": 20, "gain_margin": 0.05, "prior_acceptance": 0.6, "prior_strength": 3.0,
    "acceptance_decay": 0.8, "probe_interval": 16, "ngram_min": 2, "ngram_max": 4, "tree_acceptance": "typical",
    "typical_threshold": 0.1, "typical_alpha": 0.2,
}


@pytest.mark.parametrize("cls", [SpeculationConfig, DraftLengthConfig, FallbackConfig, NgramConfig, MedusaConfig])
def test_every_speculation_field_is_described(cls: type) -> None:
    docs = descriptions(cls)
    assert docs and all(len(doc) > 10 for doc in docs.values()), docs


def test_method_configs_name_their_method() -> None:
    assert NgramConfig.method is SpeculationMode.NGRAM and MedusaConfig.method is SpeculationMode.MEDUSA
    assert "method" not in {f.name for f in dataclasses.fields(NgramConfig)}  # not a setting: the class's own


def test_the_flat_spelling_is_migrated_to_the_nested_one(caplog: pytest.LogCaptureFixture) -> None:
    spec = SpeculationConfig.from_dict(FLAT)
    assert "deprecated" in caplog.text
    assert spec == SpeculationConfig(
        method=SpeculationMode.NGRAM,
        draft_length=DraftLengthConfig(num_draft_tokens=6, adaptive=True, min_draft_tokens=2,
                                       verify_cost_per_token=0.1),
        fallback=FallbackConfig(enabled=True, rule=FallbackRule.THRESHOLD, threshold=0.4, window=100, min_drafted=20,
                                gain_margin=0.05, prior_acceptance=0.6, prior_strength=3.0, acceptance_decay=0.8,
                                probe_interval=16),
        ngram=NgramConfig(min_n=2, max_n=4),
        medusa=MedusaConfig(tree_acceptance=TreeAcceptance.TYPICAL, typical_threshold=0.1, typical_alpha=0.2))
    with pytest.raises(ConfigError, match="unknown speculation fields: \\['bogus'\\]"):
        SpeculationConfig.from_dict({**FLAT, "bogus": 1})


def test_an_old_deployment_file_loads_as_the_same_deployment(tmp_path: Path) -> None:
    new = DeploymentConfig(speculation=SpeculationConfig.from_dict(FLAT))
    old = json.loads(new.to_json())
    old["speculation"] = FLAT
    (tmp_path / "deployment.json").write_text(json.dumps(old))
    assert DeploymentConfig.load(tmp_path / "deployment.json") == new
    assert DeploymentConfig.from_dict(json.loads(new.to_json())) == new  # the nested spelling round-trips
    cross = SpeculationConfig(ngram=NgramConfig(cross_request=CrossRequestConfig(
        enabled=True, max_tokens=4096, continuation=CrossRequestContinuation.RECENT)))
    opted_in = DeploymentConfig(speculation=cross)
    assert DeploymentConfig.from_dict(json.loads(opted_in.to_json())) == opted_in  # the opt-in round-trips too


@pytest.mark.parametrize("section, message", [
    ({"fallback": {"windw": 3}}, "unknown fallback fields: \\['windw'\\]"),
    ({"draft_length": {"num_draft_tokens": 65}}, "num_draft_tokens must be in \\[0, 64\\]"),
    ({"ngram": {"min_n": 4, "max_n": 2}}, "min_n <= max_n"),
    ({"medusa": {"tree_acceptance": "lenient"}}, "tree_acceptance must be exact or typical"),
    ({"fallback": {"rule": "sometimes"}}, "fallback rule must be gain or threshold"),
    ({"method": "telepathy"}, "unknown speculation mode"),
    ({"ngram": [1, 3]}, "ngram must be an object"),
])
def test_bad_speculation_sections_are_config_errors(section: dict, message: str, tmp_path: Path) -> None:
    (tmp_path / "deployment.json").write_text(json.dumps({"speculation": section}))
    with pytest.raises(ConfigError, match=message) as info:
        DeploymentConfig.load(tmp_path / "deployment.json")
    assert not isinstance(info.value, InvalidRequestError)


def test_a_requests_choices_are_request_errors() -> None:
    spec = SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=4, min_draft_tokens=3))
    chosen = spec.for_request("ngram", 1)
    assert chosen.method is SpeculationMode.NGRAM and chosen.draft_length.num_draft_tokens == 1
    assert chosen.draft_length.min_draft_tokens == 1  # clamped to the request's shorter bound
    assert spec.for_request(None, None) is spec
    for method, k in (("telepathy", None), (None, 65), (None, -1)):
        with pytest.raises(InvalidRequestError):
            spec.for_request(method, k)


def test_read_config_names_missing_fields() -> None:
    @dataclasses.dataclass(frozen=True)
    class Engine:
        path: str
        count: int = 1

    with pytest.raises(ConfigError, match="engine needs path"):
        read_config(Engine, {"count": 2}, "engine")


def test_the_deployment_config_loads_without_torch_and_without_cycles() -> None:
    code = ("import sys; import triton_backend.deployment.deployment_config, triton_backend.engines.trtllm.trtllm_config; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
    # trtllm_deployment first: it imports deployment_config, which imports neither of the builders
    subprocess.run([sys.executable, "-c", "import triton_backend.deployment.trtllm_deployment, triton_backend.deployment.torch_deployment"],
                   check=True, cwd=REPO_ROOT)
