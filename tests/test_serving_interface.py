"""The served model's interface without a server: config.pbtxt rendering (parsed with
Triton's own ModelConfig protobuf), request parsing, and client/server tensor agreement."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builder.stages.model_repository import front_models, render_front_config, RenderError, render_config_pbtxt, render_model_repository, render_template
from builder.ops.triton_client import GenerateRequest
from triton_backend.core.config import SpeculationConfig, SpeculationMode
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.core.errors import ConfigError, InvalidRequestError
from triton_backend.serving.interface import INPUTS, OUTPUTS, ServingConfig
from triton_backend.serving.service import load_deployment, parse_request

REPO_ROOT = Path(__file__).resolve().parent.parent
SPEC = SpeculationConfig()


def _parse_pbtxt(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_config_pbtxt_parses_as_triton_model_config() -> None:
    serving = ServingConfig(max_concurrency=3, instance_count=2)
    config = _parse_pbtxt(render_config_pbtxt(serving))
    assert config.name == "specdec" and config.backend == "python"
    assert config.model_transaction_policy.decoupled is True
    assert config.instance_group[0].count == 2
    # the serving model takes ours and every tensor the tensorrtllm_backend front models forward
    assert [i.name for i in config.input][:len(INPUTS)] == [s.name for s in INPUTS]
    assert [o.name for o in config.output][:len(OUTPUTS)] == [s.name for s in OUTPUTS]
    by_name = {i.name: i for i in config.input}
    assert model_config_pb2.DataType.Name(by_name["text_input"].data_type) == "TYPE_STRING"
    assert by_name["text_input"].optional and by_name["max_tokens"].optional  # text_input or input_ids
    assert {"input_ids", "seed", "beam_width"} <= set(by_name)
    for model in front_models(serving):  # the tensorrtllm_backend names parse too
        front = _parse_pbtxt(render_front_config(serving, model))
        assert front.name == model.name and front.parameters["target_model"].string_value == "specdec"
    assert model_config_pb2.DataType.Name(by_name["random_seed"].data_type) == "TYPE_UINT64"
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert ServingConfig.from_parameters("specdec", params) == ServingConfig(max_concurrency=3)

    unary = _parse_pbtxt(render_config_pbtxt(serving, unary=True))
    assert unary.name == "specdec_unary" and unary.model_transaction_policy.decoupled is False
    assert unary.parameters["target_model"].string_value == "specdec"


def test_no_placeholder_left_unfilled() -> None:
    for unary in (False, True):
        text = render_config_pbtxt(ServingConfig(), unary=unary)
        assert "${" not in text and "$" not in text
    with pytest.raises(RenderError, match="not filled"):
        render_template("name: ${name} count: ${count}", {"name": "x"})
    with pytest.raises(RenderError, match="unfilled placeholder"):
        render_template("a: ${a}", {"a": "${b}"})


def test_committed_model_repo_is_the_rendered_default(tmp_path: Path) -> None:
    from builder.ops.default_deployment import default_deployment

    committed_root = REPO_ROOT / "model_repo"
    # the default deployment as rendered into model_repo/ (its drafter path relative to the file there)
    out = render_model_repository(default_deployment(relative_to=committed_root / "specdec" / "1"), tmp_path / "repo")
    rendered = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(committed_root) for p in committed_root.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    assert rendered == committed
    for rel in rendered:
        assert (out / rel).read_text() == (committed_root / rel).read_text(), (
            f"model_repo/{rel} is stale: run `specbuild serve --render-only --repository-dir model_repo`")


def test_deployment_round_trips_and_relative_paths_resolve(tmp_path: Path) -> None:
    out = render_model_repository(DeploymentConfig(draft="drafts/small", ngram=False), tmp_path,
                                  ServingConfig(model_name="m", unary_model_name=None))
    assert not (tmp_path / "specdec_unary").exists()
    loaded = load_deployment(out / "m" / "1" / "deployment.json")
    assert loaded.draft == str((out / "m" / "1" / "drafts" / "small").resolve())
    assert loaded.target == DeploymentConfig().target and loaded.ngram is False


def test_serving_config_validation() -> None:
    with pytest.raises(ConfigError, match="max_concurrency"):
        ServingConfig(max_concurrency=0)
    with pytest.raises(ConfigError, match="differ"):
        ServingConfig(model_name="a", unary_model_name="a")
    with pytest.raises(ConfigError, match="lacks parameters"):
        ServingConfig.from_parameters("specdec", {"deployment_file": "deployment.json"})


def test_client_request_parses_back_to_the_same_parameters() -> None:
    request = GenerateRequest(prompt="héllo ✓", max_tokens=12, temperature=0.7, top_k=20, top_p=0.9, seed=2**63 + 5,
                              stop=("\n\n", "END"), end_id=7, speculation="ngram", num_draft_tokens=6, chat=True,
                              stream=True)
    parsed = parse_request(request.arrays(), SPEC)
    assert parsed.prompt == "héllo ✓" and parsed.stream and parsed.chat
    s = parsed.sampling
    assert (s.max_tokens, s.top_k, s.seed, s.stop, s.stop_token_ids) == (12, 20, 2**63 + 5, ("\n\n", "END"), ((7,),))
    assert math.isclose(s.temperature, 0.7, rel_tol=1e-6) and math.isclose(s.top_p, 0.9, rel_tol=1e-6)
    assert parsed.speculation.method is SpeculationMode.NGRAM and parsed.speculation.draft_length.num_draft_tokens == 6


def test_defaults_when_optional_inputs_are_absent() -> None:
    parsed = parse_request(GenerateRequest(prompt="hi").arrays(), SPEC, default_max_tokens=33)
    assert parsed.sampling.max_tokens == 33 and parsed.sampling.greedy and not parsed.stream and not parsed.chat
    assert parsed.speculation == SPEC
    off = parse_request(GenerateRequest(prompt="hi", num_draft_tokens=0).arrays(), SPEC)
    assert off.speculation.draft_length.num_draft_tokens == 0


def _arrays(**overrides: object) -> dict[str, np.ndarray]:
    arrays = GenerateRequest(prompt="hello", max_tokens=8).arrays()
    for name, value in overrides.items():
        if value is None:
            arrays.pop(name)
        else:
            arrays[name] = value  # type: ignore[assignment]
    return arrays


@pytest.mark.parametrize(("overrides", "message"), [
    ({"text_input": None}, "text_input' is required"),
    ({"text_input": np.array([[b""]], dtype=object)}, "text_input is empty"),
    ({"text_input": np.array([[b"\xff\xfe"]], dtype=object)}, "not valid UTF-8"),
    ({"text_input": np.array([[b"a"], [b"b"]], dtype=object)}, "batch size 1"),
    ({"text_input": np.array([[b"a", b"b"]], dtype=object)}, "exactly one value"),
    ({"max_tokens": np.array([[0]], dtype=np.int32)}, "max_tokens must be a positive integer"),
    ({"max_tokens": np.array([[-5]], dtype=np.int32)}, "max_tokens must be a positive integer"),
    ({"top_p": np.array([[5.0]], dtype=np.float32)}, r"top_p must be in \(0, 1\]"),
    ({"temperature": np.array([[np.nan]], dtype=np.float32)}, "finite"),
    ({"top_k": np.array([[-1]], dtype=np.int32)}, "top_k"),
    ({"speculation": np.array([[b"medusa9"]], dtype=object)}, "unknown speculation mode"),
    ({"num_draft_tokens": np.array([[999]], dtype=np.int32)}, "num_draft_tokens"),
    ({"repetition_penalty": np.array([[0.0]], dtype=np.float32)}, "repetition_penalty must be > 0"),
])
def test_bad_requests_get_short_typed_errors(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        parse_request(_arrays(**overrides), SPEC)
    assert len(str(info.value)) < 200


def test_empty_bad_words_and_stop_words_are_accepted() -> None:
    parsed = parse_request(_arrays(bad_words=np.array([[b""]], dtype=object),
                                   stop_words=np.array([[b""]], dtype=object)), SPEC)
    assert parsed.sampling.stop == ()


def test_serve_finds_what_to_serve(tmp_path: Path) -> None:
    from builder.ops.serve import ServeConfig, prepare_repository

    committed = REPO_ROOT / "model_repo"
    assert prepare_repository(ServeConfig(source=committed)) == (committed, False)
    built = tmp_path / "built"
    render_model_repository(DeploymentConfig(), built / "model_repo")
    assert prepare_repository(ServeConfig(source=built)) == (built / "model_repo", False)

    deployment_dir = tmp_path / "dep"
    (deployment_dir / "weights").mkdir(parents=True)
    (deployment_dir / "weights" / "config.json").write_text("{}")
    (deployment_dir / "deployment.json").write_text(DeploymentConfig(target="weights", ngram=True).to_json())
    for source in (deployment_dir, deployment_dir / "deployment.json"):
        out = tmp_path / f"rendered-{source.name}"
        repo, temporary = prepare_repository(ServeConfig(source=source, repository_dir=out))
        assert repo == out and not temporary
        served = DeploymentConfig.load(repo / "specdec" / "1" / "deployment.json")
        assert served.target == str((deployment_dir / "weights").resolve())  # relative to the source file

    with pytest.raises(ConfigError, match="no model repository"):
        prepare_repository(ServeConfig(source=tmp_path / "dep" / "weights"))


def test_perf_analyzer_input_file_matches_the_served_tensors() -> None:
    """benchmarks/perf_analyzer/inputs.json (for ``perf_analyzer --input-data``) names only
    served inputs, with values of their types, and every entry parses to a valid request."""
    import json

    specs = {spec.name: spec for spec in INPUTS}
    entries = json.loads((REPO_ROOT / "benchmarks" / "perf_analyzer" / "inputs.json").read_text())["data"]
    assert len(entries) >= 3
    for entry in entries:
        assert set(entry) <= set(specs), set(entry) - set(specs)
        arrays = {}
        for name, values in entry.items():
            spec = specs[name]
            if spec.dtype.numpy is np.object_:
                arrays[name] = np.array([[v.encode() for v in values]], dtype=np.object_)
            else:
                arrays[name] = np.array([values], dtype=spec.dtype.numpy)
        parsed = parse_request(arrays, SPEC)
        assert parsed.prompt and parsed.stream and parsed.chat


def test_exclude_input_in_output_parses() -> None:
    arrays = _arrays(exclude_input_in_output=np.array([[False]]))
    assert parse_request(arrays, SPEC).include_prompt
    assert not parse_request(_arrays(exclude_input_in_output=np.array([[True]])), SPEC).include_prompt
    assert not parse_request(_arrays(), SPEC).include_prompt
