"""Triton tensor I/O, written once: tensor specs, numpy input readers, response builders.

The numpy half (``TensorSpec``, ``read_*``, ``string_tensor``) has no Triton dependency
and is what :mod:`triton_backend.serving.service` parses requests with. The ``pb_utils`` half
(``request_arrays``, ``send_outputs``, ``send_error``) only works inside Triton's Python
backend stub, where ``triton_python_backend_utils`` is importable; it is imported lazily.

Arrays follow Triton's batched layout: with ``max_batch_size > 0`` every tensor is
``[batch, *dims]``; this model takes one prompt per request, so ``batch == 1``.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from triton_backend.core.errors import InvalidRequestError, SpecbuildError
from triton_backend.serving.triton.response_fence import FencedSender

logger = logging.getLogger(__name__)


class TritonType(str, enum.Enum):
    """Triton data types used by the model (config.pbtxt spelling)."""

    STRING = "TYPE_STRING"
    BOOL = "TYPE_BOOL"
    INT32 = "TYPE_INT32"
    INT64 = "TYPE_INT64"
    UINT8 = "TYPE_UINT8"
    UINT64 = "TYPE_UINT64"
    FP16 = "TYPE_FP16"
    FP32 = "TYPE_FP32"

    @property
    def numpy(self) -> Any:
        return {"TYPE_STRING": np.object_, "TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
                "TYPE_UINT8": np.uint8, "TYPE_UINT64": np.uint64, "TYPE_FP16": np.float16,
                "TYPE_FP32": np.float32}[self.value]

    @property
    def wire(self) -> str:
        """The datatype name on the KServe v2 wire (what clients put in InferInput)."""
        return "BYTES" if self is TritonType.STRING else self.value[len("TYPE_"):]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor: the single source of truth for config.pbtxt and parsing."""

    name: str
    dtype: TritonType
    dims: tuple[int, ...] = (1,)
    optional: bool = True
    doc: str = ""


# -- numpy side: reading inputs -------------------------------------------------------------
def _batch_of_one(arrays: Mapping[str, np.ndarray], spec: TensorSpec) -> np.ndarray | None:
    arr = arrays.get(spec.name)
    if arr is None:
        if not spec.optional:
            raise InvalidRequestError(f"input '{spec.name}' is required")
        return None
    arr = np.asarray(arr)
    if arr.ndim == 0 or arr.shape[0] != 1:
        raise InvalidRequestError(
            f"input '{spec.name}' has shape {list(arr.shape)}: send one prompt per request (batch size 1)")
    return arr[0]


def read_scalar(arrays: Mapping[str, np.ndarray], spec: TensorSpec) -> Any:
    """The single value of a ``[1, 1]`` input as a Python scalar, or ``None`` if absent."""
    item = _batch_of_one(arrays, spec)
    if item is None:
        return None
    if item.size != 1:
        raise InvalidRequestError(f"input '{spec.name}' must hold exactly one value, got {item.size}")
    value = item.reshape(-1)[0]
    if spec.dtype is TritonType.STRING:
        return decode_utf8(value, spec.name)
    if spec.dtype is TritonType.BOOL:
        return bool(value)
    if spec.dtype is TritonType.FP32:
        out = float(value)
        if not math.isfinite(out):
            raise InvalidRequestError(f"input '{spec.name}' must be a finite number, got {out}")
        return out
    return int(value)


def read_strings(arrays: Mapping[str, np.ndarray], spec: TensorSpec) -> list[str]:
    """All strings of a ``[1, n]`` BYTES input (empty strings dropped); ``[]`` if absent."""
    item = _batch_of_one(arrays, spec)
    if item is None:
        return []
    values = [decode_utf8(v, spec.name) for v in item.reshape(-1)]
    return [v for v in values if v]


def read_ids(arrays: Mapping[str, np.ndarray], spec: TensorSpec) -> list[int] | None:
    """The integers of a ``[1, n]`` (or ``[1, ...]``) integer input, flattened; ``None`` if absent."""
    item = _batch_of_one(arrays, spec)
    if item is None:
        return None
    if item.dtype.kind not in "iu":
        raise InvalidRequestError(f"input '{spec.name}' must hold integers")
    return [int(v) for v in item.reshape(-1)]


def read_matrix(arrays: Mapping[str, np.ndarray], spec: TensorSpec) -> np.ndarray | None:
    """The request's own item of a batched input (``arr[0]``, any rank); ``None`` if absent."""
    return _batch_of_one(arrays, spec)


def decode_utf8(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"input '{name}' is not valid UTF-8") from None
    raise InvalidRequestError(f"input '{name}' must be BYTES (UTF-8 text)")


# -- numpy side: building outputs -----------------------------------------------------------
def string_tensor(*values: str) -> np.ndarray:
    """A ``[1, n]`` BYTES array holding UTF-8 ``values``."""
    return np.array([[v.encode("utf-8") for v in values]], dtype=np.object_)


def scalar_tensor(value: Any, dtype: TritonType) -> np.ndarray:
    """A ``[1, 1]`` array of ``dtype``."""
    return np.array([[value]], dtype=dtype.numpy)


def array_tensor(values: Any, dtype: TritonType) -> np.ndarray:
    """``values`` (any nesting) as one batch item: ``[1, *shape]`` of ``dtype``."""
    return np.asarray(values, dtype=dtype.numpy)[np.newaxis, ...]


# -- Triton side (inside the Python backend stub only) --------------------------------------
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


__all__ = [
    "TensorSpec", "TritonResponseSink", "TritonType", "decode_utf8", "error_response", "inference_response",
    "model_parameters", "array_tensor", "read_ids", "read_matrix",
    "read_scalar", "read_strings", "request_arrays", "scalar_tensor", "string_tensor",
]
