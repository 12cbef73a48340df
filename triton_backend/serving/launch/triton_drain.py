"""Stopping Triton in seconds: drain in-flight requests, then end it without its slow unload.

On SIGTERM Triton 2.51 refuses new inference requests at once and lets the ones in flight
finish; then it unloads every model, one Python-backend instance after another, and waits for
each stub process to finish its interpreter's teardown. With nothing in flight that took 10-21 s
on the shared 2-core development machine for the default repository (19 stubs; the tokenizer
models' stubs alone ~15 s), and all that while its gRPC and metrics ports stay bound, so a
restart on the same ports failed. The unload serves no client: every request has been
answered by then.

So once a stop is requested (:class:`~triton_backend.serving.launch.triton_supervisor.TritonSupervisor`),
:class:`Drain` watches the server's Prometheus endpoint (which answers until the end): the
serving model's ``specdec_requests_in_flight`` gauges (from arrival to the last response,
queued requests included) and Triton's ``nv_inference_pending_request_count``, plus whatever
the caller counts itself (the HTTP guard's relays still writing an answer). When the total is 0
in ``IDLE_POLLS`` polls in a row, the server's process group is SIGKILLed: the drain is complete
and the stop is a clean one (status 0); its shared-memory regions and cancellation sockets are
removed after it (:meth:`~triton_backend.serving.launch.triton_server.TritonServer.reap`). Requests still in flight
at the deadline (the exit timeout) end the drain too (status 1). A server whose metrics do not
carry the in-flight gauge (another runtime) is left to exit on its own, as Triton does.
"""

from __future__ import annotations

import enum
import logging
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from triton_backend.serving.triton.metrics import IN_FLIGHT_GAUGE

logger = logging.getLogger(__name__)

PENDING_GAUGE = "nv_inference_pending_request_count"  # Triton's own: requests waiting in its schedulers
IDLE_POLLS = 2  # polls in a row with nothing in flight (a request between two hops is seen by one of them)
POLL_S = 0.2
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)", re.M)


def in_flight(metrics_text: str) -> int | None:
    """Requests in flight by a server's Prometheus text: the serving models' in-flight gauges
    plus Triton's pending requests; ``None`` when no in-flight gauge is there (a runtime that
    does not publish it: nothing to judge by)."""
    total, seen = 0.0, False
    for match in _SAMPLE.finditer(metrics_text):
        name = match.group("name")
        if name in (IN_FLIGHT_GAUGE, PENDING_GAUGE):
            try:
                value = float(match.group("value"))
            except ValueError:
                continue
            seen = seen or name == IN_FLIGHT_GAUGE
            total += max(value, 0.0)
    return int(total) if seen else None


def read_in_flight(metrics_url: str, timeout_s: float = 1.0) -> int | None:
    """:func:`in_flight` of the server at ``metrics_url`` (``None`` when it does not answer)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as reply:
            return in_flight(reply.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


class Verdict(str, enum.Enum):
    WAIT = "wait"  # requests in flight (or not known yet): keep waiting
    DRAINED = "drained"  # nothing in flight: end the server now, a clean stop
    OVERDUE = "overdue"  # the deadline passed with requests in flight (or never knowing)
    UNKNOWN = "unknown"  # no in-flight gauge: leave the server to exit on its own until the deadline


@dataclass
class Drain:
    """One stop's drain. ``busy``: requests in flight that the server's metrics do not show (the
    guard's relays). ``deadline_s``: from the stop request; then :attr:`Verdict.OVERDUE`."""

    metrics_url: str | None  # None: none to read (left to exit on its own until the deadline)
    deadline_s: float
    busy: Callable[[], int] = lambda: 0
    started: float = field(default_factory=time.monotonic)
    idle_polls: int = 0
    last_in_flight: int | None = None  # the last count the metrics told (they stop answering late in a shutdown)

    def poll(self) -> Verdict:
        elapsed = time.monotonic() - self.started
        count = read_in_flight(self.metrics_url) if self.metrics_url else None
        if count is None:
            self.idle_polls = 0
            return Verdict.OVERDUE if elapsed > self.deadline_s else Verdict.UNKNOWN
        count += self.busy()
        self.last_in_flight = count
        self.idle_polls = self.idle_polls + 1 if count == 0 else 0
        if self.idle_polls >= IDLE_POLLS:
            return Verdict.DRAINED
        return Verdict.OVERDUE if elapsed > self.deadline_s else Verdict.WAIT


__all__ = ["Drain", "IDLE_POLLS", "POLL_S", "Verdict", "in_flight", "read_in_flight"]
