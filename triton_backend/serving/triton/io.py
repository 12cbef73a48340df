"""Triton's side of the served tensors: a request's inputs, responses, errors and the
decoupled response sink. Works only inside Triton's Python backend stub, where
``triton_python_backend_utils`` is importable; it is imported lazily.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Callable, Mapping, Sequence

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


# Forwarding (BLS) between the front models and the serving model. Triton 2.51 does not pass
# an error's code across a BLS call (the caller sees INTERNAL) nor a caller's cancellation to
# its child request, so the forwarder names its child in a request parameter, the serving
# model prefixes that child's error messages with their typed code ("overloaded|..."), and a
# cancelled caller's child is cancelled through a datagram to the serving model's instances
# (CancelChannel; a second BLS request could wait behind the forwarded ones for minutes).
FORWARD_ID_PARAM = "specbuild_forward_id"
# The HTTP guard (triton_backend/serving/front/http_guard.py) names each HTTP generate request in this parameter
# and, when its client goes away (Triton 2.51's HTTP frontend cannot tell a model), sends the
# name over the cancellation channel: the serving model registers a request under it, a front
# model passes it on as its child's forward id.
CANCEL_ID_PARAM = "specbuild_cancel_id"
_CODE_SEPARATOR = "|"
_UNAVAILABLE_CODES = ("model_load", "overloaded")


def error_code(exc: BaseException | str) -> str:
    """The typed code of an error (``internal`` for anything not ours)."""
    return exc.code if isinstance(exc, SpecbuildError) else "internal"


def triton_error(message: str, code: str) -> Any:
    pb_utils = _pb()
    if code in _UNAVAILABLE_CODES:
        kind = pb_utils.TritonError.UNAVAILABLE
    elif code in ("invalid_request", "context_length"):
        kind = pb_utils.TritonError.INVALID_ARG
    else:
        kind = pb_utils.TritonError.INTERNAL
    return pb_utils.TritonError(message, kind)


def error_response(exc: BaseException | str, forwarded: bool = False) -> Any:
    """A response carrying a short, client-safe message (never a traceback). ``forwarded``: to
    a front model, with the typed code in front of the message (see FORWARD_ID_PARAM)."""
    code = "invalid_request" if isinstance(exc, InvalidRequestError) else error_code(exc)
    message = f"{code}{_CODE_SEPARATOR}{exc}" if forwarded else str(exc)
    return _pb().InferenceResponse(error=triton_error(message, code))


def forwarded_error(message: str) -> Any:
    """The TritonError a front model returns for its child's error ``message``: the typed code
    taken back off the message (an error without one, e.g. Triton's own, stays INTERNAL)."""
    code, separator, rest = message.partition(_CODE_SEPARATOR)
    if separator and code.replace("_", "").isalpha() and code.islower():
        return triton_error(rest, code)
    return triton_error(message, "internal")


def request_parameters(request: Any) -> dict[str, Any]:
    """A Triton request's parameters (``{}`` when it has none or they do not parse)."""
    import json

    try:
        parameters = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError):
        return {}
    return parameters if isinstance(parameters, dict) else {}


CANCEL_FOLDER_PREFIX = "specbuild-cancel-"  # + "<Triton server pid>-<serving model>"


def server_cancel_folders(server_pid: int) -> list[Any]:
    """The cancellation folders of every model of the Triton server ``server_pid``."""
    import tempfile
    from pathlib import Path

    return sorted(Path(tempfile.gettempdir()).glob(f"{CANCEL_FOLDER_PREFIX}{int(server_pid)}-*"))


def cancel_on_server(server_pid: int, forward_id: str) -> int:
    """Sends a cancellation for ``forward_id`` to every instance of every model of the server
    ``server_pid`` that listens (the caller need not know which model serves it: ids are
    unique); how many it reached."""
    reached = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        for folder in server_cancel_folders(server_pid):
            for path in folder.glob("*.sock"):
                try:
                    sock.sendto(forward_id.encode("ascii"), str(path))
                    reached += 1
                except OSError:  # an instance that is gone
                    pass
    return reached


class CancelChannel:
    """Cancellations of forwarded requests, from a front model to the serving model's instances,
    as Unix datagrams (one socket per serving instance, in a folder only this user can enter,
    named by the Triton server's pid and the serving model). ``listen`` runs ``on_cancel(id)``
    on a thread of its own for each forward id received; ``send`` reaches every instance."""

    def __init__(self, model: str) -> None:
        import tempfile
        from pathlib import Path

        self.folder = Path(tempfile.gettempdir()) / f"{CANCEL_FOLDER_PREFIX}{os.getppid()}-{model}"
        self._socket: socket.socket | None = None

    def listen(self, on_cancel: Callable[[str], None]) -> None:
        self.folder.mkdir(mode=0o700, exist_ok=True)
        st = self.folder.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            logger.error("%s is not this user's own folder: cancellations of forwarded requests are not received",
                         self.folder)
            return
        path = self.folder / f"{os.getpid()}.sock"
        path.unlink(missing_ok=True)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(str(path))
        threading.Thread(target=self._receive, args=(self._socket, on_cancel), name="cancel-channel",
                         daemon=True).start()

    @staticmethod
    def _receive(sock: socket.socket, on_cancel: Callable[[str], None]) -> None:
        while True:
            try:
                data = sock.recv(256)
            except OSError:  # closed
                return
            try:
                on_cancel(data.decode("ascii", "replace"))
            except Exception:  # keep listening
                logger.exception("cancelling a forwarded request failed")

    def send(self, forward_id: str) -> int:
        """Sends to every serving instance; how many it reached."""
        reached = 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            for path in self.folder.glob("*.sock"):
                try:
                    sock.sendto(forward_id.encode("ascii"), str(path))
                    reached += 1
                except OSError:  # an instance that is gone
                    pass
        return reached

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            (self.folder / f"{os.getpid()}.sock").unlink(missing_ok=True)


class TritonResponseSink:
    """Sends a decoupled request's responses through its response sender
    (:mod:`triton_backend.serving.triton.response_fence`): one at a time, the final flag exactly once,
    nothing but the final flag after a cancellation.

    Asking Triton whether the request is cancelled is a blocking round trip to the server
    process, so it is asked once per response, by the caller: the service asks
    :meth:`cancelled` before handing over each chunk (the response pump, or a request's own
    loop). The fence reads the answer remembered from that question (a cancellation, once
    seen, stays); only an error response asks again here, as errors are rare."""

    def __init__(self, request: Any, forwarded: bool = False) -> None:
        self._request = request
        self._cancelled = False
        self._forwarded = forwarded
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
        self._out.fail(error_response(exc, self._forwarded))

    def cancelled(self) -> bool:
        """Asks Triton (unless a cancellation was seen already) and remembers the answer."""
        if not self._cancelled:
            self._cancelled = bool(self._request.is_cancelled())
        return self._cancelled

    def cancel(self) -> None:
        """Cancelled from elsewhere (the front model whose client went away): seen at the next
        question, as a cancellation through Triton would be."""
        self._cancelled = True

    def close(self) -> None:
        """End the request with no further response (after cancellation)."""
        self._out.close()


__all__ = ["CANCEL_FOLDER_PREFIX", "CANCEL_ID_PARAM", "CancelChannel", "FORWARD_ID_PARAM", "TritonResponseSink", "error_code", "error_response", "forwarded_error",
           "request_parameters", "triton_error", "inference_response", "model_parameters", "request_arrays", "cancel_on_server", "server_cancel_folders"]
