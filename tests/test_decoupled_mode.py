"""tensorrtllm_backend's ``decoupled_mode`` switch and tensorrt_llm's ``exclude_input_in_output``
parameter: rendered from the typed ServingConfig into the front models only (``specdec`` always
decoupled, ``specdec_unary`` never), settable from ``specbuild serve`` and ``specbuild deploy``
(flags or ``SPECBUILD_*`` variables), and a built repository re-rendered for another setting
keeps its manifest true. TensorRT-LLM's request defaults as the front models apply them."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pytest

from builder.cli.deploy import add_deploy_arguments, config_from_settings, resolve_settings
from builder.stages.manifest import refresh_manifest, verify_manifest, write_manifest
from builder.stages.model_repository import render_model_repository, render_front_models
from triton_backend.core.errors import ConfigError, InvalidRequestError
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig
from triton_backend.serving.trtllm_inputs import trtllm_request_defaults

FRONT = ("ensemble", "tensorrt_llm", "tensorrt_llm_bls")


def _decoupled(repo: Path) -> dict[str, bool]:
    return {m.parent.name: re.search(r"decoupled: (\w+)", m.read_text()).group(1) == "true"
            for m in repo.glob("*/config.pbtxt") if "decoupled:" in m.read_text()}


def _exclude(repo: Path, model: str) -> str:
    return re.search(r'key: "exclude_input_in_output"\n  value: \{ string_value: "(\w+)" \}',
                     (repo / model / "config.pbtxt").read_text()).group(1)


@pytest.mark.parametrize("mode", [False, True])
def test_decoupled_mode_renders_the_front_models_only(tmp_path: Path, mode: bool) -> None:
    repo = render_model_repository(DeploymentConfig(), tmp_path, ServingConfig(decoupled_mode=mode))
    flags = _decoupled(repo)
    assert all(flags[m] is mode for m in FRONT)
    assert flags["specdec"] is True and flags["specdec_unary"] is False
    assert all(_exclude(repo, m) == "true" for m in FRONT)  # NVIDIA's setups
    with pytest.raises(ConfigError, match="decoupled_mode"):
        ServingConfig(decoupled_mode="false")


def test_a_built_repository_takes_another_mode_and_its_manifest_stays_true(tmp_path: Path) -> None:
    repo = render_model_repository(DeploymentConfig(), tmp_path / "model_repo")
    write_manifest(tmp_path, {}, ["model_repo"])
    before = (repo / "specdec" / "config.pbtxt").stat().st_mtime_ns
    assert render_front_models(ServingConfig(), repo) == []  # same setting: nothing rewritten
    changed = render_front_models(ServingConfig(decoupled_mode=True, exclude_input_in_output=False), repo)
    assert {p.parent.name for p in changed} == set(FRONT) and verify_manifest(tmp_path)
    refresh_manifest(tmp_path, [p.relative_to(tmp_path).as_posix() for p in changed])
    assert verify_manifest(tmp_path) == [] and all(_decoupled(repo)[m] for m in FRONT)
    assert _exclude(repo, "tensorrt_llm") == "false"
    assert (repo / "specdec" / "config.pbtxt").stat().st_mtime_ns == before


def test_deploy_settings_and_serve_flags() -> None:
    parser = argparse.ArgumentParser()
    add_deploy_arguments(parser)
    default = config_from_settings(resolve_settings(parser.parse_args([]), environ={}))
    assert (default.decoupled_mode, default.exclude_input_in_output) == (False, True)
    env = {"SPECBUILD_DECOUPLED_MODE": "true", "SPECBUILD_EXCLUDE_INPUT_IN_OUTPUT": "false"}
    config = config_from_settings(resolve_settings(parser.parse_args([]), environ=env))
    assert config.serving() == ServingConfig(decoupled_mode=True, exclude_input_in_output=False)
    flagged = config_from_settings(resolve_settings(parser.parse_args(["--decoupled-mode", "false"]), environ=env))
    assert flagged.decoupled_mode is False

    from builder.cli.main import build_parser

    serve = build_parser().parse_args(["serve", "--decoupled-mode", "true", "--exclude-input-in-output", "false"])
    assert (serve.decoupled_mode, serve.exclude_input_in_output) == ("true", "false")


def _one(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype)


def test_tensorrt_llm_request_defaults() -> None:
    """Neither top-k nor top-p above 0: greedy, whatever the temperature (TensorRT-LLM's
    sampling layers turn top_k = top_p = 0 into top_k = 1); the model's exclude_input_in_output
    where the request does not say."""
    greedy = trtllm_request_defaults({"runtime_top_k": _one(0, np.int32), "runtime_top_p": _one(0.0, np.float32)},
                                     True)
    assert greedy["temperature"][0][0] == 0.0 and greedy["exclude_input_in_output"][0][0]
    assert "temperature" in trtllm_request_defaults({}, None)
    assert "temperature" not in trtllm_request_defaults({"top_k": _one(5, np.int32)}, None)
    assert "temperature" not in trtllm_request_defaults({"runtime_top_p": _one(0.9, np.float32)}, None)
    assert "exclude_input_in_output" not in trtllm_request_defaults(
        {"exclude_input_in_output": _one(False, np.bool_)}, True)
    with pytest.raises(InvalidRequestError, match="top_k"):
        trtllm_request_defaults({"top_k": _one(5, np.int32), "runtime_top_k": _one(6, np.int32)}, None)


@pytest.mark.parametrize("mode", [False, True])
def test_ensemble_pipeline_renders_nvidias_ensemble_of_the_three_stage_models(tmp_path: Path, mode: bool) -> None:
    """ensemble_mode 'pipeline': ensemble is a Triton ensemble preprocessing -> tensorrt_llm ->
    postprocessing whose every mapped tensor exists, with the same type, in the model it maps to;
    tensorrt_llm runs one request per execution; switching back restores the forwarder's shim."""
    from builder.stages.ensemble_pipeline import pipeline_inputs

    serving = ServingConfig(decoupled_mode=mode, ensemble_mode="pipeline")
    repo = render_model_repository(DeploymentConfig(), tmp_path, serving)
    config = (repo / "ensemble" / "config.pbtxt").read_text()
    assert 'platform: "ensemble"' in config and not list((repo / "ensemble" / "1").iterdir())

    def tensors(text: str, section: str) -> dict[str, str]:
        body = re.search(rf"\n{section} \[(.*?)\n\]", text, re.S).group(1)
        return dict(re.findall(r'name: "(\w+)"\s+data_type: (\w+)', body))

    ours = {**tensors(config, "input"), **tensors(config, "output")}
    steps = re.findall(r'model_name: "(\w+)"(.*?)\n    \}', config, re.S)
    assert [name for name, _ in steps] == ["preprocessing", "tensorrt_llm", "postprocessing"]
    produced: dict[str, str] = {}
    for name, body in steps:
        model = (repo / name / "config.pbtxt").read_text()
        model_in, model_out = tensors(model, "input"), tensors(model, "output")
        for key, value in re.findall(r'input_map \{\s+key: "(\w+)"\s+value: "(\w+)"', body):
            assert model_in[key] == (ours.get(value) or produced[value]), (name, key, value)
        for key, value in re.findall(r'output_map \{\s+key: "(\w+)"\s+value: "(\w+)"', body):
            produced[value] = model_out[key]
            assert value.startswith("_") or ours[value] == model_out[key], (name, key, value)
    assert set(tensors(config, "output")) <= set(produced)
    assert {s.name for s in pipeline_inputs() if not s.optional} == {"text_input", "max_tokens"}
    token_model = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert ("preferred_batch_size: [ 1 ]" in token_model) is (not mode)  # decoupled: no batching queue at all
    assert "dynamic_batching" not in token_model or "preferred_batch_size: [ 1 ]" in token_model
    render_front_models(ServingConfig(decoupled_mode=mode), repo)
    assert (repo / "ensemble" / "1" / "model.py").is_file() and "backend: \"python\"" in (
        repo / "ensemble" / "config.pbtxt").read_text()
    with pytest.raises(ConfigError, match="ensemble_mode"):
        ServingConfig(ensemble_mode="triton")
