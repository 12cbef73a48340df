"""``specbuild demo``: the whole path once, end to end.

Prepare the default deployment (the reference target SmolLM2-135M-Instruct with n-gram
prompt lookup, the best drafter this environment has for it), render its Triton model
repository, start a real Triton server on loopback, send one streaming gRPC request,
collect the answer and its acceptance statistics, and stop the server.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from builder.ops.local_run import DEFAULT_PROMPT
from builder.stages.model_repository import render_model_repository
from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, RemoteResult, generate
from builder.ops.triton_server import Endpoints, ServerConfig, TritonServer, TritonSource
from triton_backend.serving.interface import ServingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    deployment_file: Path | None = None  # None: the default deployment (reference target + n-gram)
    request: GenerateRequest = field(default_factory=lambda: GenerateRequest(
        prompt=DEFAULT_PROMPT, max_tokens=64, chat=True, stream=True))
    protocol: ClientProtocol = ClientProtocol.GRPC
    source: TritonSource = TritonSource.AUTO
    startup_timeout_s: float = 300.0


@dataclass(frozen=True)
class DemoResult:
    result: RemoteResult
    endpoints: Endpoints
    deployment_json: str


def run_demo(config: DemoConfig, on_text: Callable[[str], None] | None = None) -> DemoResult:
    from triton_backend.deployment.config import DeploymentConfig
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.serving.service import load_deployment

    if config.deployment_file is not None:
        deployment = load_deployment(config.deployment_file)
    else:
        deployment = DeploymentConfig()
        ensure_reference_model(deployment.target)  # fetch + convert once, before Triton loads it
    with tempfile.TemporaryDirectory(prefix="specbuild-demo-") as work:
        repository = render_model_repository(deployment, Path(work) / "model_repo", ServingConfig())
        server_config = ServerConfig(repository, source=config.source, startup_timeout_s=config.startup_timeout_s,
                                     exit_timeout_s=10, log_file=Path(work) / "tritonserver.log")
        with TritonServer(server_config) as server:
            endpoints = server.endpoints
            assert endpoints is not None
            url = endpoints.grpc_url if config.protocol is ClientProtocol.GRPC else endpoints.http_url
            logger.info("Triton ready: %s", " | ".join(endpoints.describe().splitlines()))
            result = generate(ClientConfig(url, config.protocol), config.request, on_text)
    return DemoResult(result, endpoints, deployment.to_json())


__all__ = ["DemoConfig", "DemoResult", "run_demo"]
