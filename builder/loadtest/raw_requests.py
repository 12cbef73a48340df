"""Requests with arbitrary tensors and bodies, for the reliability tests and ``scripts/reliability.py``:
one decoupled gRPC request collected to its final response (or cancelled part way), and an HTTP POST
that reports status 0 when nothing answered instead of raising."""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import tritonclient.grpc as grpcclient

from triton_backend.serving.interface import ServingConfig

MODEL = ServingConfig().model_name  # the serving model's default name
OUTPUT_NAMES = ("text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                "target_passes", "fallback", "num_output_tokens", "speculation_method", "finish_reason")
BIG = json.dumps({"text_input": "x" * 6_000_000, "max_tokens": 4}).encode()  # over the HTTP guard's bound


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
            outcome.responses.append({n: result.as_numpy(n) for n in OUTPUT_NAMES if result.as_numpy(n) is not None})
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
