"""The Docker images' entrypoint, run here outside a container: ``docker/entrypoint.sh`` builds
the reference target from a spec into a temporary engine cache, reuses that build by its spec
hash, starts the REAL Triton server (bundled with nvidia-pytriton) on loopback and free ports,
answers over HTTP and gRPC exactly as in-process greedy decoding does, reports healthy through
``docker/healthcheck.sh``, and exits 0 on SIGTERM. Also: the cache key, the MPI launch line of
multi-rank TensorRT-LLM repositories, settings from flags and variables, and clear errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from builder.ops.deploy import (BuildMode, DeployConfig, DeployError, MpiTritonServer, cache_key, launch_world_size,
                            mpi_command)
from builder.cli.deploy import config_from_settings, resolve_settings
from builder.stages.model_repository import render_model_repository
from builder.plan.spec import BuildSpec
from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, generate
from triton_backend.serving.launch.triton_server import Endpoints, ServerConfig, TritonInstallation, free_port
from builder.ops.default_deployment import default_deployment
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.serving.service import parse_request

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO / "docker" / "healthcheck.sh"
SPEC_TEXT = """\
target: {source: smollm2-135m-instruct, precision: auto}
gpu: {kind: h100-80gb, count: 1}
limits: {max_batch_size: 4, max_input_len: 1024, max_output_len: 256, max_draft_len: 4}
"""
PROMPT = "Rewrite this sentence in the past tense: 'The dog runs to the park and plays with the ball.'"


def entrypoint_env(engine_cache: Path, **settings: str) -> dict[str, str]:
    """This environment with the entrypoint's variables set (nothing inherited from a shell)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECBUILD_") or k == "SPECBUILD_CACHE_DIR"}
    env.update(SPECBUILD_PYTHON=sys.executable, SPECBUILD_ENGINE_CACHE=str(engine_cache),
               SPECBUILD_BUILD_MODE=BuildMode.TORCH_ONLY.value, SPECBUILD_HOST="127.0.0.1")
    env.update(settings)
    return env


def run_entrypoint(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=timeout)


def healthy(port: int) -> bool:
    env = dict(os.environ, SPECBUILD_HTTP_PORT=str(port), SPECBUILD_PYTHON=sys.executable)
    return subprocess.run(["sh", str(HEALTHCHECK)], env=env, capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    """``(spec, engine cache, repository)`` after the entrypoint built the spec once (the
    build's ~0.5 GB of float32 weights are removed afterwards)."""
    work = tmp_path_factory.mktemp("deploy")
    spec = work / "reference.yaml"
    spec.write_text(SPEC_TEXT)
    env = entrypoint_env(work / "engines", SPECBUILD_SPEC=str(spec))
    proc = run_entrypoint(env, "--prepare-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "building" in proc.stderr and "reusing" not in proc.stderr
    repository = Path(proc.stdout.strip().splitlines()[-1])
    assert repository.parent.parent == work / "engines"
    yield spec, work / "engines", repository
    shutil.rmtree(work, ignore_errors=True)


# -- the real thing ---------------------------------------------------------------------------
@pytest.mark.slow
def test_build_lands_in_the_cache_under_its_key(built) -> None:
    spec, cache, repository = built
    build_dir = repository.parent
    key, _ = cache_key(BuildSpec.load(spec), DeployConfig(spec=spec, engine_cache=cache,
                                                          build_mode=BuildMode.TORCH_ONLY))
    assert build_dir.name == key[:20]
    assert json.loads((build_dir / "deploy-key.json").read_text())["key"] == key
    manifest = json.loads((build_dir / "manifest.json").read_text())
    assert manifest["engines"] == {} and manifest["model_repo"]["model"] == "specdec"
    deployment = json.loads((repository / "specdec" / "1" / "deployment.json").read_text())
    assert (repository / "specdec" / "1" / deployment["target"]).resolve() == (build_dir / "weights" / "target")
    assert not list(cache.glob("*.building"))


@pytest.mark.slow
def test_second_start_reuses_the_cached_build(built) -> None:
    spec, cache, repository = built
    manifest = repository.parent / "manifest.json"
    before = manifest.stat().st_mtime_ns
    proc = run_entrypoint(entrypoint_env(cache), "--spec", str(spec), "--prepare-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reusing the cached build" in proc.stderr and "building" not in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(repository)
    assert manifest.stat().st_mtime_ns == before


def _local_text(decoder, request: GenerateRequest) -> str:
    parsed = parse_request(request.arrays(), DeploymentConfig().speculation)
    prompt = decoder.tokenizer.apply_chat_template([{"role": "user", "content": parsed.prompt}],
                                                   add_generation_prompt=True, tokenize=False)
    return decoder.generate(prompt, parsed.sampling, parsed.speculation).text


def _wait_healthy(proc: subprocess.Popen[str], port: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while not healthy(port):
        if proc.poll() is not None:
            pytest.fail(f"the entrypoint exited with {proc.returncode} before Triton was ready:\n"
                        f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
        if time.monotonic() > deadline:
            pytest.fail("Triton did not become ready in time")
        time.sleep(0.5)


@pytest.mark.slow
def test_entrypoint_serves_the_build_answers_and_stops_cleanly_on_sigterm(built) -> None:
    """The served text is the build's own deployment decoding in process (its planned 16-bit
    weights: the torch runtime serves a plan's precision, docs/quantized-weights.md)."""
    from triton_backend.deployment.torch_deployment import build_decoder
    from triton_backend.serving.service import load_deployment

    spec, cache, repository = built
    deployment = load_deployment(repository / "specdec" / "1" / "deployment.json")
    assert deployment.runtime.weights.value in ("float16", "bfloat16")  # SmolLM2 plans 16-bit on an H100
    local_decoder = build_decoder(deployment)
    http, grpc, metrics = free_port(), free_port(), free_port()
    assert len({http, grpc, metrics}) == 3
    env = entrypoint_env(cache, SPECBUILD_SPEC=str(spec), SPECBUILD_HTTP_PORT=str(http),
                         SPECBUILD_GRPC_PORT=str(grpc), SPECBUILD_METRICS_PORT=str(metrics))
    proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(proc, http, 240)
        request = GenerateRequest(prompt=PROMPT, max_tokens=16, chat=True)
        expected = _local_text(local_decoder, request)
        unary = generate(ClientConfig(f"127.0.0.1:{http}", ClientProtocol.HTTP), request)
        streamed = generate(ClientConfig(f"127.0.0.1:{grpc}", ClientProtocol.GRPC),
                            GenerateRequest(prompt=PROMPT, max_tokens=16, chat=True, stream=True))
        assert unary.text == expected and streamed.text == expected
        assert streamed.stats["total_draft_tokens"] > 0  # the built deployment drafts with n-gram lookup
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "reusing the cached build" in err and "Triton exited with status 0" in err
    assert f"Triton is serving {cache}" in out
    assert not healthy(http)
    for port in (http, grpc, metrics):  # Triton is gone: nothing listens on its ports
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_sigterm_as_soon_as_ready_with_the_openai_front_starting_exits_cleanly(built) -> None:
    """The image serves the OpenAI API too: a stop that comes while its front starts (a few seconds
    after Triton is ready, when a container first turns healthy) is a requested, clean stop: status 0."""
    spec, cache, _ = built
    http, grpc, metrics, openai_port = free_port(), free_port(), free_port(), free_port()
    env = entrypoint_env(cache, SPECBUILD_SPEC=str(spec), SPECBUILD_HTTP_PORT=str(http), SPECBUILD_GRPC_PORT=str(grpc),
                         SPECBUILD_METRICS_PORT=str(metrics), SPECBUILD_OPENAI_PORT=str(openai_port))
    proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not healthy(http) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # past the supervisor's readiness poll (0.25 s): the front is starting now
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    for port in (http, grpc, metrics, openai_port):  # Triton, the guard and the front are gone
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_default_deployment_without_a_spec(tmp_path: Path) -> None:
    proc = run_entrypoint(entrypoint_env(tmp_path / "engines"), "--prepare-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    repository = Path(proc.stdout.strip().splitlines()[-1])
    assert repository.is_relative_to(tmp_path / "engines")
    deployment = DeploymentConfig.load(repository / "specdec" / "1" / "deployment.json")
    assert deployment == default_deployment()  # the reference target, auto with the packaged EAGLE-3 drafter


# -- errors at the edge -----------------------------------------------------------------------
@pytest.mark.parametrize(("settings", "args", "message"), [
    ({"SPECBUILD_SPEC": "/nonexistent/spec.yaml"}, [], "build spec /nonexistent/spec.yaml not found"),
    ({"SPECBUILD_HTTP_PORT": "eighty"}, [], "SPECBUILD_HTTP_PORT='eighty'"),
    ({"SPECBUILD_BUILD_MODE": "fast"}, [], "SPECBUILD_BUILD_MODE='fast': expected one of"),
    ({}, ["--spec", "a.yaml", "--source", "b"], "give a build spec or a source to serve, not both"),
    ({}, ["--world-size", "0"], "world_size must be >= 1"),
    ({"SPECBUILD_ENGINE_CACHE": "/proc/specbuild-engines"}, [], "engine cache /proc/specbuild-engines cannot be created"),
])
def test_bad_settings_get_a_clear_error(tmp_path: Path, settings: dict[str, str], args: list[str], message: str) -> None:
    proc = run_entrypoint(entrypoint_env(tmp_path / "engines", **settings), *args, "--prepare-only", timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_world_size_above_one_needs_a_tensorrt_llm_model(tmp_path: Path) -> None:
    repository = render_model_repository(DeploymentConfig(), tmp_path / "model_repo")
    proc = run_entrypoint(entrypoint_env(tmp_path / "engines"), "--source", str(repository), "--world-size", "2",
                          "--prepare-only", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "world size 2 needs a TensorRT-LLM model" in proc.stderr


def test_other_arguments_run_as_a_command(tmp_path: Path) -> None:
    proc = run_entrypoint(entrypoint_env(tmp_path), sys.executable, "-c", "print('ran as a command')", timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ran as a command"


# -- settings, cache key, launch ------------------------------------------------------------
def _args(**flags: str | None):
    import argparse

    from builder.cli.deploy import SETTINGS

    return argparse.Namespace(**{s.dest: flags.get(s.dest) for s in SETTINGS})


def test_flags_win_over_variables_and_a_served_source_replaces_the_spec_variable() -> None:
    env = {"SPECBUILD_SPEC": "/specs/a.yaml", "SPECBUILD_HTTP_PORT": "9000", "SPECBUILD_REBUILD": "yes"}
    values = resolve_settings(_args(source="/models/repo", http_port="9100"), env)
    assert values["spec"] is None and values["source"] == Path("/models/repo")
    assert values["http_port"] == 9100 and values["rebuild"] is True and values["grpc_port"] == 8001
    config = config_from_settings(resolve_settings(_args(), env))
    assert config.spec == Path("/specs/a.yaml") and config.server.http_port == 9000 and config.world_size is None


def test_cache_key_follows_the_spec_the_mode_and_the_model_files(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = BuildSpec.from_dict({"target": {"source": str(model)}, "gpu": {"kind": "h100-80gb"}})
    config = DeployConfig(spec=tmp_path / "s.yaml", engine_cache=tmp_path)
    key, inputs = cache_key(spec, config)
    assert cache_key(spec, config)[0] == key
    assert inputs["files"][str(model)] == {"config.json": {"size": 2, "mtime_ns": (model / "config.json").stat().st_mtime_ns}}
    assert set(inputs["tools"]) >= {"specbuild", "tensorrt_llm", "torch"}
    other_spec = BuildSpec.from_dict({"target": {"source": str(model)}, "gpu": {"kind": "h100-80gb"},
                                      "limits": {"max_draft_len": 3}})
    assert cache_key(other_spec, config)[0] != key
    torch_only = DeployConfig(spec=tmp_path / "s.yaml", engine_cache=tmp_path, build_mode=BuildMode.TORCH_ONLY)
    assert cache_key(spec, torch_only)[0] != key
    (model / "model.safetensors").write_bytes(b"\0" * 8)  # new weights in the mounted folder
    assert cache_key(spec, config)[0] != key


def test_mpi_launch_line_follows_tensorrtllm_backend() -> None:
    server = ["/opt/tritonserver/bin/tritonserver", "--model-repository=/r", "--http-port=8000"]
    assert mpi_command(server, 1, ()) == server
    assert mpi_command(server, 2, ("tensorrt_llm", "tensorrt_llm_draft")) == [
        "mpirun", "--allow-run-as-root",
        "-n", "1", *server, "--backend-config=python,shm-region-prefix-name=prefix0_", ":",
        "-n", "1", *server, "--model-control-mode=explicit", "--load-model=tensorrt_llm",
        "--load-model=tensorrt_llm_draft", "--backend-config=python,shm-region-prefix-name=prefix1_"]
    with pytest.raises(DeployError):
        mpi_command(server, 2, ())


def test_mpi_server_wraps_the_triton_command(tmp_path: Path) -> None:
    config = ServerConfig(model_repository=tmp_path, host="0.0.0.0")
    server = MpiTritonServer(config, 2, ("tensorrt_llm",), mpirun="/usr/bin/mpirun")
    installation = TritonInstallation(Path("/opt/tritonserver/bin/tritonserver"), None)
    cmd = server.command(installation, Endpoints("0.0.0.0", 8000, 8001, 8002))
    assert cmd[:4] == ["/usr/bin/mpirun", "--allow-run-as-root", "-n", "1"]
    assert cmd.count("/opt/tritonserver/bin/tritonserver") == 2 and cmd.count(":") == 1
    assert cmd.count("--http-port=8000") == 2 and "--load-model=tensorrt_llm" in cmd


def _repository_with_plan(tmp_path: Path, tp: int, pp: int, trtllm: bool) -> Path:
    repository = render_model_repository(DeploymentConfig(), tmp_path / "model_repo")
    (tmp_path / "plan.json").write_text(json.dumps({"tp_size": tp, "pp_size": pp}))
    if trtllm:  # a model served by NVIDIA's TensorRT-LLM backend, as tensorrtllm_backend's repositories have
        # (it replaces the Python-backend drop-in of that name the renderer writes)
        (repository / "tensorrt_llm").mkdir(exist_ok=True)
        (repository / "tensorrt_llm" / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "tensorrtllm"\n')
    return repository


def test_world_size_comes_from_the_plan_when_tensorrt_llm_models_are_served(tmp_path: Path) -> None:
    assert launch_world_size(_repository_with_plan(tmp_path / "a", 2, 2, True), None) == (4, ("tensorrt_llm",))
    assert launch_world_size(_repository_with_plan(tmp_path / "b", 2, 1, False), None) == (1, ())
    assert launch_world_size(_repository_with_plan(tmp_path / "c", 1, 1, True), 2) == (2, ("tensorrt_llm",))
    with pytest.raises(DeployError, match="needs a TensorRT-LLM model"):
        launch_world_size(_repository_with_plan(tmp_path / "d", 2, 1, False), 2)
