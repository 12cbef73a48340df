"""Fixtures and helpers for the reliability tests (fuzzing, faults, load) against a REAL
Triton Inference Server on loopback and free ports.

One server serves every reliability module of a test session: pytest makes a separate
session fixture per module that imports it, so the server is cached here, at module
level, and stopped when the session ends. Its ``default_max_tokens`` is tiny, so a fuzzed
request that leaves ``max_tokens`` out costs a few tokens only.
"""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_fixtures import RunningTriton

from builder.stages.model_repository import render_model_repository
from builder.ops.triton_server import ServerConfig, TritonServer
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

        _SHARED["decoder"] = build_decoder(DEPLOYMENT)
    return _SHARED["decoder"]


# -- raw gRPC streaming with arbitrary tensors ---------------------------------------------
@dataclass
class StreamOutcome:
    """What one decoupled request got back: its responses' outputs, or an error message."""

    responses: list[dict[str, np.ndarray]] = field(default_factory=list)
    error: str | None = None
    final: bool = False
    cancelled: bool = False

    @property
    def text(self) -> str:
        return "".join(b.decode("utf-8") for r in self.responses if "text_output" in r
                       for b in np.asarray(r["text_output"]).reshape(-1))

    def stat(self, name: str) -> Any:
        for r in reversed(self.responses):
            if name in r:
                value = np.asarray(r[name]).reshape(-1)[0]
                return value.decode("utf-8") if isinstance(value, bytes) else value.item()
        return None


_OUTPUT_NAMES = ("text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                 "target_passes", "fallback", "num_output_tokens", "speculation_method", "finish_reason")


def infer_input(name: str, array: np.ndarray, wire: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), wire)
    tensor.set_data_from_numpy(array)
    return tensor


def _replies(q: "queue.Queue[tuple[Any, Any]]", timeout_s: float) -> Iterator[tuple[Any, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no final response within {timeout_s:.0f}s")
        try:
            yield q.get(timeout=left)
        except queue.Empty:
            raise TimeoutError(f"no final response within {timeout_s:.0f}s") from None


def stream_request(url: str, tensors: list[grpcclient.InferInput], *, timeout_s: float = 120.0,
                   cancel_after_s: float | None = None, model: str = MODEL) -> StreamOutcome:
    """Send one request over a fresh gRPC stream and collect its responses until the final one.

    ``cancel_after_s``: cancel the request (gRPC stream cancellation, which Triton turns into
    request cancellation) once that long has passed after the first response, or after
    that long if none came."""
    outcome = StreamOutcome()
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        try:
            client.async_stream_infer(model, tensors, enable_empty_final_response=True)
            _collect_until_final(outcome, replies, timeout_s, cancel_after_s)
        finally:
            # cancel only an unfinished request (a cancellation just after the final response can
            # leave Triton 2.51 unable to unload the model)
            client.stop_stream(cancel_requests=not (outcome.final or outcome.error is not None))
    return outcome


def _collect_until_final(outcome: StreamOutcome, replies: "queue.Queue[tuple[Any, Any]]", timeout_s: float,
                         cancel_after_s: float | None) -> None:
    started = time.monotonic()
    try:
        for result, error in _replies(replies, timeout_s if cancel_after_s is None else cancel_after_s):
            if error is not None:
                outcome.error = error.message()
                return
            outcome.responses.append({n: result.as_numpy(n) for n in _OUTPUT_NAMES if result.as_numpy(n) is not None})
            flag = result.get_response().parameters.get("triton_final_response")
            if flag is not None and flag.bool_param:
                outcome.final = True
                return
            if cancel_after_s is not None:  # a first response came: cancel a little later
                time.sleep(max(0.0, cancel_after_s - (time.monotonic() - started)))
                outcome.cancelled = True
                return
    except TimeoutError:
        if cancel_after_s is None:
            raise
        outcome.cancelled = True


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
    outcome.responses.append({n: reply.as_numpy(n) for n in _OUTPUT_NAMES if reply.as_numpy(n) is not None})
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


__all__ = ["DEPLOYMENT", "MODEL", "SERVING", "StreamOutcome", "assert_client_safe", "delta", "http_infer",
           "infer_input", "reliable_decoder", "reliable_triton", "stream_request", "wait_idle"]


BIG = json.dumps({"text_input": "x" * 6_000_000, "max_tokens": 4}).encode()  # over the HTTP guard's bound


def post(url: str, body: bytes | None, headers: dict[str, str] | None = None,
         timeout_s: float = 120) -> tuple[int, bytes, float]:
    """(status, body, seconds); a form-encoded POST unless headers say otherwise (urllib's default);
    status 0 when nothing answered (the body then holds the error)."""
    request = urllib.request.Request(url, data=body, headers=headers or {})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, reply.read(), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.monotonic() - started
    except OSError as exc:
        return 0, str(exc).encode(), time.monotonic() - started
