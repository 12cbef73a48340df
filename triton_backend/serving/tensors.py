"""The served tensors, written once: tensor specs, numpy input readers, output builders.

No Triton dependency: :mod:`triton_backend.serving.service` parses requests with these. What
needs ``triton_python_backend_utils`` (request inputs, responses, the response sink) is in
:mod:`triton_backend.serving.triton.io`.

Arrays follow Triton's batched layout: with ``max_batch_size > 0`` every tensor is
``[batch, *dims]``; this model takes one prompt per request, so ``batch == 1``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from triton_backend.core.errors import InvalidRequestError


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


__all__ = [
    "TensorSpec", "TritonType", "array_tensor", "decode_utf8", "read_ids", "read_matrix", "read_scalar", "read_strings",
    "scalar_tensor", "string_tensor",
]
