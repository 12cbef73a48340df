"""Fixtures for tests against a REAL Triton Inference Server (the tritonserver bundled with
nvidia-pytriton, or one on PATH), started once per test session on loopback and free ports.

Import them into a test module: ``from triton_fixtures import triton, local_decoder``.
"""

from __future__ import annotations

import contextlib
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from builder.stages.model_repository import render_model_repository
from builder.ops.triton_server import Endpoints, ServerConfig, TritonServer
from triton_backend.deployment.config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig

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
def running_triton(work: Path, deployment: DeploymentConfig, serving: ServingConfig) -> Iterator[RunningTriton]:
    """A real Triton server on free loopback ports over ``deployment`` rendered into ``work``."""
    repository = render_model_repository(deployment, work / "model_repo", serving)
    server = TritonServer(ServerConfig(repository, exit_timeout_s=5, startup_timeout_s=300,
                                       log_file=work / "tritonserver.log"))
    endpoints = server.start()
    try:
        yield RunningTriton(server, endpoints, repository)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    with running_triton(tmp_path_factory.mktemp("triton"), DEPLOYMENT, SERVING) as running:
        yield running


@pytest.fixture(scope="session")
def local_decoder():
    """The same deployment, in-process: what the server must reproduce exactly."""
    from triton_backend.deployment.torch_deployment import build_decoder

    return build_decoder(DEPLOYMENT)
