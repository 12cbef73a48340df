"""The default deployment (what `serve` with no source, `deploy` with no spec, the demo, the committed
model_repo and the images serve): the reference target, `auto` with the packaged EAGLE-3 drafter merged
with n-gram lookup; n-gram lookup alone, said in the log, where the drafter is absent."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from builder.ops.default_deployment import (CACHE_DRAFTERS_DIR, REFERENCE_DRAFTER, default_deployment,
                                            describe_drafters, drafter_search_paths, find_reference_drafter)
from builder.ops.demo import DemoResult, acceptance
from builder.ops.serve import ServeConfig, prepare_repository
from builder.ops.triton_client import RemoteResult
from triton_backend.serving.launch.triton_server import Endpoints
from triton_backend.core.config import SpeculationMode
from triton_backend.core.drafter_format import EagleFormat
from triton_backend.core.errors import ConfigError
from triton_backend.deployment.deployment_config import DeploymentConfig, SelfDraftConfig
from triton_backend.serving.service import load_deployment

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGED = REPO_ROOT / "artifacts" / REFERENCE_DRAFTER
ENDPOINTS = Endpoints("127.0.0.1", 1, 2, 3)


def test_checkout_default_is_auto_with_the_packaged_eagle3_drafter_merged_with_ngram() -> None:
    deployment = default_deployment()
    assert deployment.eagle == str(PACKAGED) and deployment.eagle_format is EagleFormat.EAGLE3
    assert deployment.resolved_eagle_format() is EagleFormat.EAGLE3  # what its config.json says
    spec = deployment.speculation
    assert spec.method is SpeculationMode.AUTO and deployment.ngram and spec.eagle.merge_lookup and spec.eagle.tree
    assert deployment.model_drafters() == [SpeculationMode.EAGLE]
    # everything else is DeploymentConfig()'s own default (unchanged: many callers rely on it)
    assert DeploymentConfig().eagle is None
    assert json.loads(deployment.to_json()) | {"eagle": None, "eagle_format": None} == json.loads(
        DeploymentConfig().to_json())


def test_drafter_path_is_relative_inside_the_checkout_and_absolute_outside(tmp_path: Path) -> None:
    inside = REPO_ROOT / "model_repo" / "specdec" / "1"
    relative = default_deployment(relative_to=inside)
    assert relative.eagle == "../../../artifacts/" + REFERENCE_DRAFTER
    assert (inside / relative.eagle).resolve() == PACKAGED
    assert default_deployment(relative_to=tmp_path / "repo" / "specdec" / "1").eagle == str(PACKAGED)


def test_committed_model_repo_serves_the_packaged_drafter() -> None:
    committed = load_deployment(REPO_ROOT / "model_repo" / "specdec" / "1" / "deployment.json")
    assert committed.eagle == str(PACKAGED) and committed.resolved_eagle_format() is EagleFormat.EAGLE3
    assert committed.speculation.method is SpeculationMode.AUTO and committed.ngram


def test_without_the_drafter_the_default_is_ngram_lookup_and_says_so(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    missing = [tmp_path / "a" / REFERENCE_DRAFTER, tmp_path / "b" / REFERENCE_DRAFTER]
    with caplog.at_level(logging.WARNING, logger="builder.ops.default_deployment"):
        deployment = default_deployment(search=missing)
    assert deployment == DeploymentConfig()
    assert describe_drafters(deployment) == "auto: n-gram lookup"
    message = caplog.text
    assert "no EAGLE-3 drafter found" in message and "n-gram lookup only" in message
    assert all(str(p) in message for p in missing)


def test_the_images_cache_location_is_searched_after_the_checkout(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "cache"))
    checkout, cache = drafter_search_paths()
    assert checkout == PACKAGED and cache == tmp_path / "cache" / CACHE_DRAFTERS_DIR / REFERENCE_DRAFTER
    shutil.copytree(PACKAGED, cache)
    found = default_deployment(search=[tmp_path / "no-checkout" / REFERENCE_DRAFTER, cache])
    assert found.eagle == str(cache.resolve()) and found.resolved_eagle_format() is EagleFormat.EAGLE3


def test_a_folder_that_is_not_an_eagle3_drafter_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    broken = tmp_path / REFERENCE_DRAFTER
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="not an EAGLE drafter"):
        find_reference_drafter([broken])
    no_config = tmp_path / "empty" / REFERENCE_DRAFTER
    no_config.mkdir(parents=True)  # no config.json: what EAGLE-1 files look like, not an EAGLE-3 folder
    with pytest.raises(ConfigError, match="not an EAGLE-3 drafter folder"):
        default_deployment(search=[no_config, PACKAGED])
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="not an EAGLE-3 drafter folder"):
        find_reference_drafter([a_file])


def test_serve_without_a_source_renders_the_default(tmp_path: Path) -> None:
    out = tmp_path / "rendered"
    repository, temporary = prepare_repository(ServeConfig(repository_dir=out))
    assert repository == out and not temporary
    written = json.loads((out / "specdec" / "1" / "deployment.json").read_text())
    assert written["eagle"] == str(PACKAGED) and written["eagle_format"] == "eagle3"  # outside the checkout: absolute
    assert load_deployment(out / "specdec" / "1" / "deployment.json") == default_deployment()


def test_serve_without_a_source_removes_its_temporary_folder_when_rendering_fails(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builder.ops.default_deployment as module

    made: list[Path] = []
    real_mkdtemp = __import__("tempfile").mkdtemp

    def mkdtemp(**kwargs: str) -> str:
        made.append(Path(real_mkdtemp(dir=tmp_path, **kwargs)))
        return str(made[-1])

    monkeypatch.setattr("builder.ops.serve.tempfile.mkdtemp", mkdtemp)
    broken = tmp_path / "broken"
    broken.mkdir()
    monkeypatch.setattr(module, "drafter_search_paths", lambda: [broken])
    with pytest.raises(ConfigError):
        prepare_repository(ServeConfig())
    assert len(made) == 1 and not made[0].exists()


def test_deploy_without_a_spec_renders_the_default(tmp_path: Path) -> None:
    from builder.ops.deploy import DeployConfig, prepare

    prepared = prepare(DeployConfig(engine_cache=tmp_path / "engines"))
    served = load_deployment(prepared.repository / "specdec" / "1" / "deployment.json")
    assert served == default_deployment() and prepared.world_size == 1


def test_describe_drafters_names_what_drafts() -> None:
    assert describe_drafters(default_deployment()) == (
        f"auto: EAGLE-3 drafter artifacts/{REFERENCE_DRAFTER} + n-gram lookup (merged into one tree)"
        if Path.cwd() == REPO_ROOT else
        f"auto: EAGLE-3 drafter {PACKAGED} + n-gram lookup (merged into one tree)")
    assert describe_drafters(DeploymentConfig(ngram=False)) == "auto: no drafter (plain decoding)"
    self_draft = DeploymentConfig(self_draft=SelfDraftConfig(precision="int8"), ngram=False)
    assert describe_drafters(self_draft) == "auto: self draft (self-int8)"


def _result(text: str, latency_s: float, **stats: object) -> RemoteResult:
    return RemoteResult(text=text, stats=dict(stats), latency_s=latency_s)


def test_demo_report_names_the_drafter_its_acceptance_and_the_ratio_to_plain() -> None:
    spec = _result("same", 1.0, num_output_tokens=64, target_passes=25, total_draft_tokens=80,
                   total_accepted_draft_tokens=39, acceptance_rate=0.4875, speculation_method="eagle")
    plain = _result("same", 2.0, num_output_tokens=64, target_passes=64, speculation_method="off")
    assert acceptance(spec) == ("64 tokens in 25 target passes (2.56 per pass), acceptance 0.49 "
                                "(39 of 80 drafted tokens accepted)")
    assert acceptance(plain) == "64 tokens in 64 target passes (1.00 per pass), nothing drafted"
    demo = DemoResult(spec, ENDPOINTS, "{}", plain, "auto: EAGLE-3 drafter d + n-gram lookup")
    lines = demo.comparison().splitlines()
    assert lines[0] == "drafter: auto: EAGLE-3 drafter d + n-gram lookup; served as method=eagle"
    assert lines[1].startswith("speculative: 64 tokens in 25 target passes") and lines[1].endswith(": 64.0 tok/s")
    assert lines[2].startswith("plain decoding, same request, same server: 64 tokens in 64") and "32.0 tok/s" in lines[2]
    assert lines[3].startswith("speed-up 2.00x over plain (one measurement each; text identical")
    different = DemoResult(spec, ENDPOINTS, "{}", _result("other", 1.0, num_output_tokens=64, target_passes=64), "x")
    assert "text DIFFERENT" in different.comparison()
    alone = DemoResult(spec, ENDPOINTS, "{}", None, "x").comparison()
    assert "speed-up" not in alone and alone.splitlines()[1].startswith("speculative: 64 tokens")
