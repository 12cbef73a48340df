"""Fixtures and helpers for the reliability tests (fuzzing, faults, load) against a REAL
Triton Inference Server on loopback and free ports.

One server serves every reliability module of a test session: pytest makes a separate
session fixture per module that imports it, so the server is cached here, at module
level, and stopped when the session ends. Its ``default_max_tokens`` is tiny, so a fuzzed
request that leaves ``max_tokens`` out costs a few tokens only.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np
import pytest
from triton_fixtures import RunningTriton, one_measurement

from builder.loadtest.raw_requests import BIG, OUTPUT_NAMES, StreamOutcome, infer_input, post, stream_request
from builder.stages.model_repository import render_model_repository
from triton_backend.serving.launch.triton_server import ServerConfig, TritonServer
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig

DEPLOYMENT = DeploymentConfig()
# decoupled front models (decoupled_mode true): their clients stream and cancel mid-stream
SERVING = ServingConfig(max_concurrency=4, unary_instance_count=2, default_max_tokens=4, max_queue_size=8,
                        decoupled_mode=True)
MODEL = SERVING.model_name
_SHARED: dict[str, Any] = {}


@pytest.fixture(scope="session")
def reliable_triton(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> RunningTriton:
    """The reliability tests' server, started once per test session."""
    if "triton" not in _SHARED:
        work = tmp_path_factory.mktemp("reliability")
        repository = render_model_repository(DEPLOYMENT, work / "model_repo", SERVING)
        server = TritonServer(ServerConfig(repository, exit_timeout_s=5, startup_timeout_s=300,
                                           log_file=work / "tritonserver.log"))
        with one_measurement():
            endpoints = server.start()
        request.config.add_cleanup(server.stop)
        _SHARED["triton"] = RunningTriton(server, endpoints, repository)
    triton = _SHARED["triton"]
    assert triton.server.running, f"the reliability server died; log: {triton.server.log_path}"
    return triton


@pytest.fixture(scope="session")
def reliable_decoder():
    """The served deployment, in-process: what the server must reproduce exactly."""
    if "decoder" not in _SHARED:
        from triton_backend.deployment.torch_deployment import build_decoder

        with one_measurement():  # the server's pass-cost table, so the two draft alike
            _SHARED["decoder"] = build_decoder(DEPLOYMENT)
    return _SHARED["decoder"]


# raw gRPC streaming with arbitrary tensors, and raw POSTs: builder/loadtest/raw_requests.py


def http_infer(url: str, tensors: list[tuple[str, np.ndarray, str]], *, timeout_s: float = 120.0,
               model: str = SERVING.unary_model_name or "") -> StreamOutcome:
    """One request through Triton's HTTP ``infer`` API on the unary entry point (which forwards
    it to the decoupled model through BLS)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=timeout_s,
                                              connection_timeout=timeout_s)
    try:
        inputs = []
        for name, array, wire in tensors:
            tensor = httpclient.InferInput(name, list(array.shape), wire)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        reply = client.infer(model, inputs)
    except InferenceServerException as exc:
        return StreamOutcome(error=exc.message())
    finally:
        client.close()
    outcome = StreamOutcome(final=True)
    outcome.responses.append({n: reply.as_numpy(n) for n in OUTPUT_NAMES if reply.as_numpy(n) is not None})
    return outcome


def assert_client_safe(message: str) -> None:
    """An error a client sees: short, one line of text, no traceback or source location."""
    assert message, "empty error message"
    assert len(message) < 600, f"error message too long ({len(message)} chars): {message[:200]}..."
    assert "Traceback" not in message and 'File "' not in message, message


def wait_idle(triton: RunningTriton, timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once no request is in flight (cancelled ones end at their next verified block)."""
    gauge = f'specdec_requests_in_flight{{model="{MODEL}"}}'
    deadline = time.monotonic() + timeout_s
    metrics = triton.metrics()
    while metrics.get(gauge, 0.0) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
        metrics = triton.metrics()
    assert metrics.get(gauge, 0.0) == 0, f"{metrics.get(gauge)} requests still in flight after {timeout_s}s"
    return metrics


def delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


__all__ = ["BIG", "DEPLOYMENT", "MODEL", "SERVING", "StreamOutcome", "assert_client_safe", "delta", "http_infer",
           "infer_input", "post", "reliable_decoder", "reliable_triton", "stream_request", "wait_idle"]

