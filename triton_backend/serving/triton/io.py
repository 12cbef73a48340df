"""Triton's side of the served tensors: a request's inputs, responses, errors and the
decoupled response sink. Works only inside Triton's Python backend stub, where
``triton_python_backend_utils`` is importable; it is imported lazily.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import numpy as np

from triton_backend.core.errors import InvalidRequestError, SpecbuildError
from triton_backend.serving.tensors import TensorSpec
from triton_backend.serving.triton.response_fence import FencedSender

logger = logging.getLogger(__name__)


def _pb() -> Any:
    try:
        import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend
    except ImportError as exc:  # pragma: no cover - only inside Triton
        raise RuntimeError("triton_python_backend_utils is only importable inside Triton's Python backend") from exc
    return pb_utils


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """config.pbtxt ``parameters`` as ``{key: string_value}``."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


def request_arrays(request: Any, specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """The request's known inputs as numpy arrays (copied: they outlive ``execute``)."""
    pb_utils = _pb()
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            out[spec.name] = np.array(tensor.as_numpy(), copy=True)
    return out


def inference_response(outputs: Mapping[str, np.ndarray]) -> Any:
    pb_utils = _pb()
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, arr) for name, arr in outputs.items()])


def error_response(exc: BaseException | str) -> Any:
    """A response carrying a short, client-safe message (never a traceback)."""
    pb_utils = _pb()
    code = pb_utils.TritonError.INTERNAL
    if isinstance(exc, InvalidRequestError):
        code = pb_utils.TritonError.INVALID_ARG
    elif isinstance(exc, SpecbuildError):
        code = pb_utils.TritonError.UNAVAILABLE if exc.code in ("model_load", "overloaded") else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), code))


class TritonResponseSink:
    """Sends a decoupled request's responses through its response sender
    (:mod:`triton_backend.serving.triton.response_fence`): one at a time, the final flag exactly once,
    nothing but the final flag after a cancellation.

    Asking Triton whether the request is cancelled is a blocking round trip to the server
    process, so it is asked once per response, by the caller: the service asks
    :meth:`cancelled` before handing over each chunk (the response pump, or a request's own
    loop). The fence reads the answer remembered from that question (a cancellation, once
    seen, stays); only an error response asks again here, as errors are rare."""

    def __init__(self, request: Any) -> None:
        self._request = request
        self._cancelled = False
        sender = request.get_response_sender()
        final_flag = _pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._out = FencedSender(lambda response, final: sender.send(response, flags=final_flag if final else 0),
                                 lambda: sender.send(flags=final_flag), lambda: self._cancelled)

    def send(self, outputs: Mapping[str, np.ndarray], final: bool) -> None:
        self._out.respond(inference_response(outputs), final)

    def fail(self, exc: BaseException | str) -> None:
        try:
            self.cancelled()
        except Exception:  # answer as if not cancelled: the error still ends the request
            logger.exception("could not ask whether a request is cancelled")
        self._out.fail(error_response(exc))

    def cancelled(self) -> bool:
        """Asks Triton (unless a cancellation was seen already) and remembers the answer."""
        if not self._cancelled:
            self._cancelled = bool(self._request.is_cancelled())
        return self._cancelled

    def close(self) -> None:
        """End the request with no further response (after cancellation)."""
        self._out.close()


__all__ = ["TritonResponseSink", "error_response", "inference_response", "model_parameters", "request_arrays"]
