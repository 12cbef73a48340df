"""One decoupled request's response pattern, kept strict for Triton's gRPC streams.

Per request (:class:`FencedSender`): responses leave one at a time (whatever thread sends
them), the final flag exactly once, nothing after it, and nothing but the final flag once
the request is cancelled (its stream is gone; the flag still releases the request in
Triton). Plain Python: the Triton response sender is passed in as callables.

Measured against Triton 2.51 (``scripts/abrupt_clients.py``): clients that send several
requests on one stream and vanish abort nothing with this pattern. A client in Triton's
``triton_grpc_error`` mode still can: Triton closes the stream on the first error response
and then crashes on the stream's other requests' next responses (a Triton bug, fixed in
later releases). Holding error responses until the instance's other requests were done
(and new ones waiting) helped with a thread-per-request runner but not with the batching
scheduler, so it was dropped; the supervisor (:mod:`triton_backend.serving.launch.triton_supervisor`) restarts
the server instead.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)


class FencedSender:
    """One request's responses through ``send(response, final)`` and ``send_final()``
    (the final flag alone), one at a time, the final one exactly once. ``cancelled``: whether
    the request is known to be cancelled, read before each response under the lock (keep it
    cheap: :class:`~triton_backend.serving.triton.io.TritonResponseSink` passes the answer its caller
    got from Triton just before, not a second round trip)."""

    def __init__(self, send: Callable[[Any, bool], None], send_final: Callable[[], None],
                 cancelled: Callable[[], bool]) -> None:
        self._send = send
        self._send_final = send_final
        self._cancelled_probe = cancelled
        self._lock = threading.Lock()
        self._done = False

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
        self._deliver(response, final, "a response")

    def fail(self, response: Any) -> None:
        self._deliver(response, True, "an error response")

    def close(self) -> None:
        """End the request with the final flag alone (after cancellation)."""
        with self._lock:
            if self._done:
                return
            self._done = True
            self._send_final()

    def _deliver(self, response: Any, final: bool, what: str) -> None:
        with self._lock:
            if self._done:
                logger.warning("dropped %s sent after the request's final one", what)
                return
            self._done = final
            if not self._cancelled():
                self._send(response, final)
            elif final:  # nothing but the final flag after a cancellation
                self._send_final()


__all__ = ["FencedSender"]
