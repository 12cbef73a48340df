"""Fixtures for tests against a REAL Triton Inference Server (the tritonserver bundled with
nvidia-pytriton, or one on PATH), started once per test session on loopback and free ports.

Import them into a test module: ``from triton_fixtures import triton, local_decoder``.
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from builder.stages.model_repository import render_model_repository
from triton_backend.serving.launch.triton_server import Endpoints, ServerConfig, TritonServer
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig
from triton_backend.speculation.pass_cost import CACHE_BUSY_ENV

# the deployment the server serves and the in-process reference decoder is built from
DEPLOYMENT = DeploymentConfig()
SERVING = ServingConfig(max_concurrency=4, unary_instance_count=4, decoupled_mode=True)  # streaming front models


@dataclass
class RunningTriton:
    server: TritonServer
    endpoints: Endpoints
    repository: Path

    def metrics(self) -> dict[str, float]:
        """Prometheus samples ``name{labels}`` -> value (labels sorted as Triton writes them)."""
        with urllib.request.urlopen(self.endpoints.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if match:
                samples[match.group(1)] = float(match.group(2))
        return samples


@contextlib.contextmanager
def one_measurement() -> Iterator[None]:
    """While the server starts or the reference decoder is built: a pass-cost measurement taken on a
    busy machine (CI's) is cached all the same, so the server and the in-process reference decide
    their drafts from one table (each measuring its own would draft differently, exactly or not)."""
    before = os.environ.get(CACHE_BUSY_ENV)
    os.environ[CACHE_BUSY_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[CACHE_BUSY_ENV]
        else:
            os.environ[CACHE_BUSY_ENV] = before


@contextlib.contextmanager
def running_triton(work: Path, deployment: DeploymentConfig, serving: ServingConfig) -> Iterator[RunningTriton]:
    """A real Triton server on free loopback ports over ``deployment`` rendered into ``work``."""
    repository = render_model_repository(deployment, work / "model_repo", serving)
    server = TritonServer(ServerConfig(repository, exit_timeout_s=5, startup_timeout_s=300,
                                       log_file=work / "tritonserver.log"))
    with one_measurement():
        endpoints = server.start()
    try:
        yield RunningTriton(server, endpoints, repository)
    finally:
        server.stop()


# One server and one in-process decoder for the whole test session. These fixtures are imported
# into each test module that uses them, and pytest makes a separate session-scoped instance per
# importing module (each kept to the end of the session): without this cache every such module
# started its own Triton server (~1.6 GB with its model stubs) and built its own decoder, and a
# full run held eight servers at once.
_SHARED: dict[str, object] = {}


@pytest.fixture(scope="session")
def triton(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> RunningTriton:
    if "triton" not in _SHARED:
        stack = contextlib.ExitStack()
        _SHARED["triton"] = stack.enter_context(running_triton(tmp_path_factory.mktemp("triton"), DEPLOYMENT, SERVING))
        request.config.add_cleanup(stack.close)
    running = _SHARED["triton"]
    assert isinstance(running, RunningTriton) and running.server.running, "the shared Triton server died"
    return running


@pytest.fixture(scope="session")
def local_decoder():
    """The same deployment, in-process: what the server must reproduce exactly."""
    if "decoder" not in _SHARED:
        from triton_backend.deployment.torch_deployment import build_decoder

        with one_measurement():
            _SHARED["decoder"] = build_decoder(DEPLOYMENT)
    return _SHARED["decoder"]
