"""The response pattern of one model instance, kept safe for Triton 2.51's gRPC streams.

Why: with a client that sends several requests on one decoupled gRPC stream in Triton's
``triton_grpc_error`` mode (the stream closes on the first error), Triton 2.51 finishes
the stream as soon as the backend sends an error response, while the stream's other
requests are still answering; their next response or final flag then reaches a finished
call and the server dies (SIGSEGV, or ``proto_buffer_writer.h:65 ASSERTION FAILED``). The
backend cannot see which requests share a stream, so an error response is held back
until every other request of this instance has sent its last response (errors never
overlap anyone's answer), and requests arriving meanwhile wait before they start. Both
halves are needed: holding errors only for the requests that arrived before them still
let Triton 2.51 crash within ~20 sessions (a stream's later requests answer after the
error closed it).

Per request (:class:`FencedSender`): responses leave one at a time, the final flag exactly
once, nothing after it, and nothing but the final flag once the request is cancelled.
Plain Python: the Triton response sender is passed in as two callables.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

ADMIT_WAIT_S = 120.0  # bound on how long a new request waits for held errors to leave


class ResponseFence:
    """Counts the requests of one instance in flight; holds error responses until no other
    request is answering, and new requests until held errors are out."""

    def __init__(self, admit_wait_s: float = ADMIT_WAIT_S) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._held: list[Callable[[], None]] = []  # error responses waiting for the others
        self._admit_wait_s = admit_wait_s
        self.errors_held = 0  # how many error responses had to wait (for the log / tests)

    def admit(self) -> None:
        """A new request: wait (bounded) while error responses are held back. When the bound
        passes (a request that never ends?), the held errors go out anyway."""
        with self._cond:
            deadline = time.monotonic() + self._admit_wait_s
            while self._held and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            overdue, self._held = self._held, []
            self._active += 1 - len(overdue)
            self._cond.notify_all()
        if overdue:
            logger.warning("%d error responses held back for %.0fs: sending them now", len(overdue), self._admit_wait_s)
            self._send_all(overdue)

    def finish(self, last: Callable[[], None], error: bool) -> None:
        """Send a request's last response (``error``: an error response) and count it done."""
        with self._cond:
            if error and self._active - len(self._held) > 1:
                self._held.append(last)
                self.errors_held += 1
                return
            self._active -= 1
        try:
            last()
        finally:
            self._release_held()

    def _release_held(self) -> None:
        with self._cond:
            if not self._held or self._active != len(self._held):
                return
            held, self._held = self._held, []
            self._active -= len(held)
            self._cond.notify_all()
        self._send_all(held)  # every other request is done: nothing of theirs can follow

    @staticmethod
    def _send_all(held: list[Callable[[], None]]) -> None:
        for send in held:
            try:
                send()
            except Exception:  # the client is gone; the others must still go out
                logger.exception("could not send a held error response")

    @property
    def active(self) -> int:
        with self._cond:
            return self._active


class FencedSender:
    """One request's responses through ``send(response, final)`` and ``send_final()``
    (the final flag alone), in order, the final one exactly once."""

    def __init__(self, fence: ResponseFence, send: Callable[[Any, bool], None], send_final: Callable[[], None],
                 cancelled: Callable[[], bool]) -> None:
        self._fence = fence
        self._send = send
        self._send_final = send_final
        self._cancelled_probe = cancelled
        self._lock = threading.Lock()
        self._done = False
        fence.admit()

    @property
    def done(self) -> bool:
        return self._done

    def _cancelled(self) -> bool:
        try:
            return bool(self._cancelled_probe())
        except Exception:  # the probe itself failed: answer as if not cancelled
            logger.exception("could not ask whether a request is cancelled")
            return False

    def respond(self, response: Any, final: bool) -> None:
        with self._lock:
            if self._done:
                logger.warning("dropped a response sent after the request's final one")
                return
            if not final:
                if not self._cancelled():  # nothing but the final flag after a cancellation
                    self._send(response, False)
                return
            self._done = True
        if self._cancelled():
            self._fence.finish(self._send_final, error=False)
        else:
            self._fence.finish(lambda: self._send(response, True), error=False)

    def fail(self, response: Any) -> None:
        with self._lock:
            if self._done:
                logger.warning("dropped an error response sent after the request's final one")
                return
            self._done = True
        if self._cancelled():
            self._fence.finish(self._send_final, error=False)
        else:
            self._fence.finish(lambda: self._send(response, True), error=True)

    def close(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._fence.finish(self._send_final, error=False)


__all__ = ["ADMIT_WAIT_S", "FencedSender", "ResponseFence"]
