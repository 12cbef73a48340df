"""The supervisor's exit status when asked to stop, with a scripted server (the process is outside
what is tested here; tests/test_abrupt_clients.py runs the real Triton path)."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from triton_backend.serving.launch.triton_server import Endpoints, ServerConfig
from triton_backend.serving.launch.triton_supervisor import RestartPolicy, TritonSupervisor


class ScriptedServer:
    """Exits with ``status`` once it gets SIGTERM; counts how often it was started."""

    starts = 0

    def __init__(self, config: ServerConfig, status: int) -> None:
        self.config, self.status, self.log_path = config, status, None
        self.endpoints: Endpoints | None = None  # set once started
        self._stopped = threading.Event()

    def start(self, endpoints: Endpoints | None = None) -> Endpoints:
        ScriptedServer.starts += 1
        self.endpoints = endpoints or Endpoints("127.0.0.1", 1, 2, 3)  # nothing listens: no metrics to read
        return self.endpoints

    def wait(self, timeout: float | None = None) -> int:
        if not self._stopped.wait(timeout):
            raise subprocess.TimeoutExpired("tritonserver", timeout or 0)
        return self.status

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM:
            self._stopped.set()

    def stop(self) -> None:
        self._stopped.set()

    def kill(self) -> None:
        self._stopped.set()

    def reap(self) -> list[int]:
        return []

    def error_summary(self, limit: int = 25) -> str:
        return ""


@pytest.mark.parametrize("status, expected", [(0, 0), (1, 1), (-signal.SIGABRT, 1), (-signal.SIGSEGV, 1)])
def test_a_requested_stop_returns_a_shell_status_and_never_restarts(tmp_path: Path, status: int, expected: int) -> None:
    ScriptedServer.starts = 0
    def factory(config: ServerConfig) -> Any:
        return ScriptedServer(config, status)

    supervisor = TritonSupervisor(ServerConfig(tmp_path, exit_timeout_s=1), factory,
                                  RestartPolicy(backoff_initial_s=0.0, backoff_max_s=0.0))
    supervisor.start()
    threading.Timer(0.2, supervisor.request_stop).start()
    assert supervisor.run() == expected  # a signal's negative status would reach the shell as 250 (SIGABRT)
    assert ScriptedServer.starts == 1 and supervisor.restarts == 0
