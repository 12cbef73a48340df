"""Starting a real Triton Inference Server on a model repository.

Where the ``tritonserver`` comes from: :mod:`triton_backend.serving.launch.triton_install`. The server listens
on loopback by default, on free ports unless given. Stopping: SIGTERM (Triton finishes its
in-flight requests; :mod:`triton_backend.serving.launch.triton_drain` ends the slow unload after that), and
whatever it leaves (backend stubs, their shared memory, cancellation sockets) is removed by
:meth:`TritonServer.reap`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from triton_backend.serving.launch.processes import (become_subreaper, collect_defunct_stubs, die_with_parent, process_group_members,
                                   remove_cancel_channels, remove_shared_memory)
from triton_backend.serving.launch.triton_install import (ServerError, TritonInstallation, TritonSource, find_installation,
                                        pytriton_installation, server_environment)

logger = logging.getLogger(__name__)


_SERVERS = itertools.count(1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise unless a server can listen on ``port`` now. With SO_REUSEADDR, as Triton's and the
    guard's listeners bind: connections of a stopped server left in TIME_WAIT do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ServerError(f"{what} port {port} on {host} is already in use ({exc.strerror}); "
                              "pick another port or leave it out to use a free one") from None


ADMIN_APIS = ("model-repository", "logging", "statistics", "shared-memory", "trace")  # Triton's API group names
DEFAULT_ADMIN_HEADER = "specbuild-admin-key"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # Triton 2.51 expects gRPC metadata "<prefix><header>"
_HEADER = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_KEY = re.compile(r"^[A-Za-z0-9._~+/=-]{16,256}$")


@dataclass(frozen=True)
class RestrictedApi:
    """Triton's restricted-API settings: the API groups in ``apis`` answer only requests that
    carry the header ``header`` with the value ``key`` (HTTP: that header; gRPC: the metadata
    ``triton-grpc-protocol-<header>``); anyone else gets 403 (HTTP) / UNAVAILABLE (gRPC)."""

    key: str
    header: str = DEFAULT_ADMIN_HEADER
    apis: tuple[str, ...] = ADMIN_APIS

    def __post_init__(self) -> None:
        if not _HEADER.match(self.header):
            raise ServerError(f"admin header {self.header!r}: use lower-case letters, digits and '-'")
        if not _KEY.match(self.key):
            raise ServerError("admin key: use 16 to 256 characters of letters, digits and ._~+/=-")
        unknown = set(self.apis) - set(ADMIN_APIS) - {"health", "metadata", "inference", "model-config"}
        if unknown or not self.apis:
            raise ServerError(f"restricted APIs: unknown {sorted(unknown)} (or none given)")

    @classmethod
    def random(cls, header: str = DEFAULT_ADMIN_HEADER) -> "RestrictedApi":
        """A key nobody knows: the admin APIs are closed to every client."""
        import secrets

        return cls(secrets.token_urlsafe(32), header)

    @classmethod
    def from_settings(cls, key: str | None, header: str = DEFAULT_ADMIN_HEADER,
                      open_admin: bool = False) -> "RestrictedApi | None":
        """``serve`` / ``deploy``: the admin APIs behind ``key`` when one is given, open when
        ``open_admin``, else closed to everyone (a random key that is never shown)."""
        if open_admin:
            if key:
                raise ServerError("give an admin key or open the admin APIs, not both")
            return None
        return cls(key, header) if key else cls.random(header)

    def flags(self) -> list[str]:
        setting = f"{','.join(self.apis)}:{self.header}={self.key}"
        return [f"--http-restricted-api={setting}", f"--grpc-restricted-protocol={setting}"]


API_KEY_HEADER = "authorization"  # the inference APIs' key travels as the OpenAI front's does
_API_KEY = re.compile(r"^[A-Za-z0-9._~+/-]{1,256}$")


@dataclass(frozen=True)
class InferenceKey:
    """``serve --api-key``: Triton's ``inference`` API group (``infer``, ``generate``,
    ``generate_stream``; gRPC ``ModelInfer`` / ``ModelStreamInfer``) answers only requests with
    ``Authorization: Bearer <key>`` (HTTP, through the guard too) or the gRPC metadata
    ``triton-grpc-protocol-authorization: Bearer <key>``; anyone else gets 403 / UNAVAILABLE."""

    key: str

    def __post_init__(self) -> None:
        if not _API_KEY.match(self.key):
            raise ServerError("API key: use 1 to 256 characters of letters, digits and ._~+/- (Triton takes no others)")

    @property
    def value(self) -> str:
        return f"Bearer {self.key}"

    @property
    def grpc_metadata(self) -> dict[str, str]:
        """What a gRPC client sends (tritonclient's ``headers=``)."""
        return {GRPC_HEADER_PREFIX + API_KEY_HEADER: self.value}

    def flags(self) -> list[str]:
        setting = f"inference:{API_KEY_HEADER}={self.value}"
        return [f"--http-restricted-api={setting}", f"--grpc-restricted-protocol={setting}"]


@dataclass(frozen=True)
class ServerConfig:
    """How to start Triton. Ports left ``None`` are picked free at start. ``http_host``: where
    Triton's HTTP endpoint binds when not on ``host`` (behind :mod:`triton_backend.serving.front.http_guard` it
    is loopback, on an internal port). ``restricted``: admin API groups behind a header key."""

    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    source: TritonSource = TritonSource.AUTO
    startup_timeout_s: float = 300.0
    exit_timeout_s: int = 30
    log_verbose: int = 0
    log_file: Path | None = None  # default: a file in a fresh temporary folder
    echo_log: bool = False  # copy Triton's log lines to stderr as they come
    http_host: str | None = None  # None: ``host``
    restricted: RestrictedApi | None = None  # None: every API open (as Triton's default)
    api_key: InferenceKey | None = None  # None: inference open to every client that reaches a port

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_repository", Path(self.model_repository))
        object.__setattr__(self, "source", TritonSource(self.source))
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ServerError(f"{name} must be in 1..65535, got {port}")


@dataclass(frozen=True)
class Endpoints:
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_url: str | None = None  # the OpenAI-compatible front, where one runs (triton_backend.serving.front.openai)
    http_host: str | None = None  # None: ``host``

    @property
    def http_url(self) -> str:
        return f"http://{self.http_host or self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def describe(self) -> str:
        return (f"HTTP    {self.http_url}  (health: {self.http_url}/v2/health/ready)\n"
                f"gRPC    {self.grpc_url}\n"
                f"metrics {self.metrics_url}"
                + (f"\nOpenAI  {self.openai_url}/v1  (health: {self.openai_url}/health)" if self.openai_url else ""))


_ERROR_MARKERS = ("error", "failed", "already in use", "exception", "unavailable")


class TritonServer:
    """One tritonserver process: ``start()`` waits for readiness, ``stop()`` shuts it down."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.endpoints: Endpoints | None = None
        self.log_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=400)
        self._reader: threading.Thread | None = None
        # the Python backend's shared-memory regions (/dev/shm) of this server, removed in reap()
        self.shm_prefix = f"specbuild_{os.getpid()}_{next(_SERVERS)}_"

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, endpoints: Endpoints | None = None) -> Endpoints:
        """Start and wait until ready. ``endpoints``: exactly these (a restart keeps its ports),
        not checked for being free (the old server's connections may linger in TIME_WAIT)."""
        cfg = self.config
        if not cfg.model_repository.is_dir():
            raise ServerError(f"model repository {cfg.model_repository} is not a folder")
        installation = find_installation(cfg.source)
        endpoints = endpoints or self._endpoints()
        self.log_path = cfg.log_file or Path(tempfile.mkdtemp(prefix="specbuild-triton-")) / "tritonserver.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command(installation, endpoints)
        become_subreaper()
        shown = " ".join(cmd)
        for secret in (cfg.restricted.key if cfg.restricted else None, cfg.api_key.key if cfg.api_key else None):
            if secret:  # keys stay out of the log
                shown = shown.replace(secret, "***")
        logger.info("starting %s: %s", installation.description, shown)
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=server_environment(installation), start_new_session=True,
                                      preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        self._reader = threading.Thread(target=self._pump, args=(self._proc.stdout,), daemon=True)
        self._reader.start()
        try:
            self._wait_ready(endpoints)
        except BaseException:
            self.stop()
            raise
        self.endpoints = endpoints
        return endpoints

    def command(self, installation: TritonInstallation, endpoints: Endpoints) -> list[str]:
        cfg = self.config
        cmd = [str(installation.binary), f"--model-repository={cfg.model_repository.resolve()}",
               f"--http-address={endpoints.http_host or endpoints.host}", f"--http-port={endpoints.http_port}",
               f"--grpc-address={endpoints.host}", f"--grpc-port={endpoints.grpc_port}",
               f"--metrics-address={endpoints.host}", f"--metrics-port={endpoints.metrics_port}",
               "--allow-metrics=true", "--strict-readiness=true", "--exit-on-error=true", "--disable-auto-complete-config",
               f"--exit-timeout-secs={cfg.exit_timeout_s}", f"--log-verbose={cfg.log_verbose}"]
        if installation.backend_dir is not None:
            cmd.append(f"--backend-directory={installation.backend_dir}")
        cmd.append(f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}")
        if cfg.restricted is not None:
            cmd += cfg.restricted.flags()
        if cfg.api_key is not None:
            cmd += cfg.api_key.flags()
        return cmd

    def _endpoints(self) -> Endpoints:
        cfg = self.config
        ports = {}
        for name, what in (("http_port", "HTTP"), ("grpc_port", "gRPC"), ("metrics_port", "metrics")):
            port = getattr(cfg, name)
            host = cfg.http_host or cfg.host if name == "http_port" else cfg.host
            if port is None:
                port = free_port(host)
                while port in ports.values():
                    port = free_port(host)
            else:
                check_port_free(host, port, what)
            ports[name] = port
        return Endpoints(cfg.host, **ports, http_host=cfg.http_host)

    def _pump(self, stream: IO[bytes] | None) -> None:
        assert stream is not None and self.log_path is not None
        with open(self.log_path, "ab") as log:
            for raw in iter(stream.readline, b""):
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self._tail.append(line)
                if self.config.echo_log:
                    print(line, file=sys.stderr, flush=True)

    def _wait_ready(self, endpoints: Endpoints) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        url = f"{endpoints.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if self._reader is not None:
                    self._reader.join(timeout=5)
                raise ServerError(f"tritonserver exited with status {self._proc.returncode} before it was ready:\n"
                                  f"{self.error_summary()}\n(full log: {self.log_path})")
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        logger.info("Triton is ready")
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise ServerError(f"Triton was not ready within {self.config.startup_timeout_s:.0f}s; "
                          f"last log lines:\n{self.error_summary()}\n(full log: {self.log_path})")

    def error_summary(self, limit: int = 25) -> str:
        """Triton's own error lines (or the last lines of its log when none is marked)."""
        lines = list(self._tail)
        errors = [ln for ln in lines if ln[:1] == "E" and ln[1:5].isdigit()]
        errors += [ln for ln in lines if ln not in errors and any(m in ln.lower() for m in _ERROR_MARKERS)
                   and not ln.startswith(("W", "I"))]
        chosen = errors or lines
        return "\n".join(chosen[-limit:]) if chosen else "(Triton wrote nothing)"

    def ready(self) -> bool:
        """Whether the server answers its readiness probe now."""
        if self.endpoints is None:
            return False
        try:
            with urllib.request.urlopen(f"{self.endpoints.http_url}/v2/health/ready", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def send_signal(self, sig: int) -> None:
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        assert self._proc is not None
        code = self._proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout=5)
        return code

    def reap(self) -> list[int]:
        """Once the server has exited: SIGKILL whatever is left of its process group (Python
        backend stubs that outlived it hold the model's memory), then remove what a server that
        did not unload its models leaves: its shared-memory regions and its models' cancellation
        sockets. Returns the pids killed."""
        if self._proc is None or self._proc.poll() is None:
            return []
        leftovers = self._kill_group()
        remove_shared_memory(self.shm_prefix)
        remove_cancel_channels(self._proc.pid)
        return leftovers

    def _kill_group(self) -> list[int]:
        assert self._proc is not None
        leftovers = process_group_members(self._proc.pid)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftovers:
            logger.warning("killed %d process(es) left behind by tritonserver %d: %s", len(leftovers), self._proc.pid,
                           ", ".join(map(str, leftovers)))
        deadline = time.monotonic() + 5
        while (left := process_group_members(self._proc.pid, zombies=True)) and time.monotonic() < deadline:
            for pid in left:  # ours to collect when this process is their subreaper (see start)
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            if not process_group_members(self._proc.pid):
                break
            time.sleep(0.05)  # SIGKILL is asynchronous: let them go before saying they are gone
        return leftovers

    def kill(self) -> None:
        """SIGKILL the server and its backend stubs (its process group)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)

    def stop(self) -> int | None:
        """SIGTERM (Triton finishes in-flight requests), then SIGKILL the group if it hangs."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(self.config.exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                logger.warning("tritonserver did not stop in time; killing it")
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(10)
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.reap()
        return self._proc.returncode

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ADMIN_APIS", "API_KEY_HEADER", "DEFAULT_ADMIN_HEADER", "GRPC_HEADER_PREFIX", "InferenceKey", "RestrictedApi", "Endpoints", "ServerConfig", "ServerError", "TritonInstallation", "TritonServer", "TritonSource",
           "check_port_free", "collect_defunct_stubs", "find_installation", "free_port", "process_group_members", "pytriton_installation", "server_environment"]
