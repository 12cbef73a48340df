"""Keeping Triton up: restart it after an abnormal exit, reap what it leaves behind.

:class:`TritonSupervisor` starts one :class:`~triton_backend.serving.launch.triton_server.TritonServer` and
watches it. When it exits without being told to (a crash: SIGSEGV, SIGABRT, ...), the
supervisor kills what is left of its process group (Python-backend stubs hold the model's
memory), collects the defunct stubs it inherited, logs why, waits a backoff and starts a new
server on the same ports. Each restart is counted and printed to stderr (``specbuild: Triton
restart N: ...``).

Giving up is for servers that cannot come up (a broken repository, a taken port): after
``RestartPolicy.max_fast_failures`` restarts in a row that never became ready it gives up
with a clear message and the server's last error lines. A server that was ready and then
crashed may have been crashed by a client (Triton 2.51 has such paths), so that crash never
counts toward giving up: otherwise a few requests would end the service for good. It is
restarted after a backoff that grows while crashes come within ``fast_failure_s`` of a start
(up to ``backoff_max_s``). Requests in flight at a crash are lost: the clients see their
stream or connection fail and may retry.

Stopping (SIGTERM to ``specbuild serve``): Triton gets SIGTERM, refuses new requests and
finishes the ones in flight; once nothing is in flight (:mod:`triton_backend.serving.launch.triton_drain`) its
process group is ended without waiting for its slow model unload, a clean stop (status 0).
Requests still in flight ``exit_timeout_s + EXIT_GRACE_S`` seconds after the signal (or a
server whose metrics do not tell, left to exit on its own until then; Triton 2.51 does not
exit while a client holds a gRPC stream open) end it by force (status 1). Its process group is
reaped in every case, so no stub outlives it.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from triton_backend.serving.launch.triton_drain import POLL_S, Drain, Verdict
from triton_backend.serving.launch.triton_server import Endpoints, ServerConfig, ServerError, TritonServer, collect_defunct_stubs

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 10  # after Triton's own exit timeout


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart Triton and when to give up. ``max_fast_failures``: restarts in a row that
    may fail to become ready (0: never restart). ``fast_failure_s``: crashes of a ready server
    that come within this long of its start make the next backoff longer (they never count
    toward giving up)."""

    max_fast_failures: int = 5
    fast_failure_s: float = 60.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_fast_failures < 0:
            raise ServerError(f"max_fast_failures must be >= 0, got {self.max_fast_failures}")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ServerError("backoff: need 0 <= backoff_initial_s <= backoff_max_s")

    def backoff_s(self, failures: int) -> float:
        """Seconds to wait before restart number ``failures`` of a fast-failure streak (1-based)."""
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, failures - 1))


def describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class TritonSupervisor:
    """Runs Triton in the foreground and restarts it after abnormal exits (see module doc)."""

    def __init__(self, config: ServerConfig, factory: Callable[[ServerConfig], TritonServer] = TritonServer,
                 policy: RestartPolicy | None = None, busy: Callable[[], int] = lambda: 0) -> None:
        self.config = config
        self.busy = busy  # requests in flight that Triton's metrics do not show (the HTTP guard's relays)
        self.drain: Drain | None = None  # the last stop's drain
        self.factory = factory
        self.policy = policy or RestartPolicy()
        self.restarts = 0
        self.exit_reasons: list[str] = []  # why each abnormal exit happened
        self.recovery_s: list[float] = []  # abnormal exit -> ready again, per recovery
        self.gave_up = False
        self.server: TritonServer | None = None
        self.endpoints: Endpoints | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Endpoints:
        """First start: a failure here is a configuration problem and is raised, not retried."""
        server = self.factory(self.config)
        self.server = server
        self.endpoints = server.start()
        return self.endpoints

    def request_stop(self) -> None:
        """Stop for good (a signal handler may call this): SIGTERM to the current server."""
        self._stopping.set()
        with self._lock:
            server = self.server
        if server is not None:
            server.send_signal(signal.SIGTERM)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def run(self) -> int:
        """Until told to stop or giving up: the last server's exit status (1 when it had to be
        killed, 2 when the supervisor gave up)."""
        crashes = 0  # crashes of ready servers in a row, each soon after its start: the backoff only
        while True:
            assert self.server is not None
            started = time.monotonic()
            code = self._wait(self.server)
            reaped = self.server.reap()
            collect_defunct_stubs()
            if self.stopping:
                return self._stopped(code)
            lasted = time.monotonic() - started
            crashes = crashes + 1 if lasted < self.policy.fast_failure_s else 1
            reason = f"Triton exited unexpectedly ({describe_status(code)}) after {lasted:.1f}s"
            if reaped:
                reason += f"; killed {len(reaped)} leftover process(es) of its group ({', '.join(map(str, reaped))})"
            logger.error("%s; its last error lines:\n%s", reason, self.server.error_summary(limit=10))
            self.exit_reasons.append(reason)
            if self.policy.max_fast_failures == 0:
                return self._give_up(reason, 1)
            crashed = time.monotonic()
            failures = 0  # restarts in a row that did not become ready
            while True:
                if self._stopping.wait(self.policy.backoff_s(max(crashes, failures))):
                    return self._stopped(code)
                error = self._restart(reason)
                if error is None:
                    self.recovery_s.append(time.monotonic() - crashed)
                    break
                if self.stopping:
                    return self._stopped(code)
                failures += 1
                reason = f"restart {self.restarts} failed: {error}"
                self.exit_reasons.append(reason)
                if failures >= self.policy.max_fast_failures:
                    return self._give_up(reason, failures)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            server = self.server
        if server is not None:
            server.stop()
            server.reap()

    # -- internals ---------------------------------------------------------------------------
    def _restart(self, reason: str) -> str | None:
        """Start a new server on the same ports; ``None`` when it is ready, else why not."""
        self.restarts += 1
        assert self.endpoints is not None
        print(f"specbuild: Triton restart {self.restarts}: {reason}", file=sys.stderr, flush=True)
        server = self.factory(self.config)
        with self._lock:
            self.server = server
        try:
            server.start(self.endpoints)
        except ServerError as exc:
            server.reap()
            logger.error("restart %d failed: %s", self.restarts, exc)
            return str(exc).splitlines()[0]
        if self.stopping:  # a stop request came while it was starting
            server.send_signal(signal.SIGTERM)
        logger.info("Triton is back after restart %d", self.restarts)
        return None

    def _stopped(self, code: int) -> int:
        """The exit status of a requested stop: Triton's own, or 1 when a signal ended it (Triton
        2.51 can abort in its own shutdown, even with requests in flight, before the drain's
        deadline; a negative status would reach the shell as 256 - n)."""
        if code >= 0:
            logger.info("Triton exited with status %d", code)
            return code
        in_flight = self.drain.last_in_flight if self.drain is not None else None
        logger.warning("Triton was %s while stopping (%s); stopped all the same", describe_status(code),
                       "no request in flight known" if not in_flight else f"{in_flight} request(s) in flight, cut off")
        return 1

    def _give_up(self, reason: str, failures: int) -> int:
        self.gave_up = True
        message = (f"specbuild: giving up on Triton after {failures} failed restart(s) in a row ({reason}). "
                   f"Restarts so far: {self.restarts}. Check the model repository and the server log.")
        if self.server is not None and self.server.log_path is not None:
            message += f" Log: {self.server.log_path}"
        logger.error(message)
        print(message, file=sys.stderr, flush=True)
        return 2

    def _wait(self, server: TritonServer) -> int:
        """The server's exit status. Once told to stop: 0 as soon as the drain finds nothing in
        flight (the server is ended then, see the module doc), 1 when requests are still in
        flight (or the server still up) ``exit_timeout_s + EXIT_GRACE_S`` after the signal."""
        while True:
            try:
                return server.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                if not self.stopping:
                    continue
            if self.drain is None:  # a server that never became ready has no metrics to judge by
                url = server.endpoints.metrics_url if server.endpoints is not None else None
                self.drain = Drain(url, server.config.exit_timeout_s + EXIT_GRACE_S, self.busy)
            verdict = self.drain.poll()
            if verdict is Verdict.DRAINED:
                took = time.monotonic() - self.drain.started
                server.kill()
                logger.info("nothing in flight %.1fs after the stop signal: Triton stopped without unloading its "
                            "models", took)
                return 0
            if verdict is Verdict.OVERDUE:
                logger.error("Triton did not finish within %ds of the stop signal (%s); killing it",
                             server.config.exit_timeout_s + EXIT_GRACE_S,
                             "a client still holds a gRPC stream open?" if not self.drain.last_in_flight
                             else f"{self.drain.last_in_flight} request(s) in flight")
                server.kill()
                return 1


__all__ = ["EXIT_GRACE_S", "RestartPolicy", "TritonSupervisor", "describe_status"]
