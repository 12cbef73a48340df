"""``specbuild serve``: find or render a model repository and run Triton on it in the foreground.

What to serve (``ServeConfig.source``):

- nothing: the default deployment (the reference target + n-gram lookup), rendered;
- a model repository (a folder with ``<model>/config.pbtxt``), served as is;
- a folder holding ``model_repo/`` (a built deployment), its ``model_repo/``;
- a DeploymentConfig JSON file, or a folder holding ``deployment.json``: rendered first.

Relative model paths in a deployment file are taken relative to that file.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import types
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from builder.model_repository import is_model_repository, render_model_repository
from builder.triton_server import Endpoints, ServerConfig, ServerError, TritonServer
from triton_backend.errors import InvalidRequestError
from triton_backend.interface import ServingConfig

logger = logging.getLogger(__name__)

DEPLOYMENT_FILE = "deployment.json"
REPOSITORY_DIR = "model_repo"
EXIT_GRACE_S = 10  # after Triton's own exit timeout


@dataclass(frozen=True)
class ServeConfig:
    source: Path | None = None
    server: ServerConfig = field(default_factory=lambda: ServerConfig(model_repository=Path(".")))
    serving: ServingConfig = field(default_factory=ServingConfig)
    repository_dir: Path | None = None  # where to render a deployment (default: a temporary folder)


def find_deployment(source: Path | None) -> Path | None:
    """The deployment file ``source`` names, or ``None`` when it names a model repository."""
    if source is None:
        return None
    if source.is_file():
        return source
    if not source.is_dir():
        raise InvalidRequestError(f"{source} does not exist")
    if is_model_repository(source) or is_model_repository(source / REPOSITORY_DIR):
        return None
    if (source / DEPLOYMENT_FILE).is_file():
        return source / DEPLOYMENT_FILE
    raise InvalidRequestError(f"{source} holds no model repository (<model>/config.pbtxt), no {REPOSITORY_DIR}/ "
                              f"and no {DEPLOYMENT_FILE}")


def prepare_repository(config: ServeConfig) -> tuple[Path, bool]:
    """``(model repository, rendered here)`` for ``config.source``."""
    source = config.source
    if source is not None and source.is_dir() and is_model_repository(source):
        return source, False
    if source is not None and source.is_dir() and is_model_repository(source / REPOSITORY_DIR):
        return source / REPOSITORY_DIR, False
    deployment_file = find_deployment(source)
    if deployment_file is None:
        from triton_backend.deployment import DeploymentConfig

        deployment = DeploymentConfig()
    else:
        from triton_backend.serving import load_deployment  # relative model paths: relative to the file

        deployment = load_deployment(deployment_file)
    out = config.repository_dir or Path(tempfile.mkdtemp(prefix="specbuild-repo-"))
    return render_model_repository(deployment, out, config.serving), config.repository_dir is None


def _wait(server: TritonServer, stopping: threading.Event) -> int:
    """Triton's exit status. Once told to stop, wait at most its exit timeout plus a grace period:
    Triton 2.51 does not exit while a client holds a gRPC stream open (its gRPC server shuts
    down with no deadline), so a client that never closes its stream would keep it up forever."""
    deadline = None
    while deadline is None or time.monotonic() < deadline:
        try:
            code = server.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if deadline is None and stopping.is_set():
                deadline = time.monotonic() + server.config.exit_timeout_s + EXIT_GRACE_S
            continue
        logger.info("Triton exited with status %d", code)
        return code
    logger.error("Triton did not exit within %ds of the stop signal (a client still holds a gRPC stream open?); "
                 "killing it", server.config.exit_timeout_s + EXIT_GRACE_S)
    server.kill()
    return 1


def serve_forever(config: ServeConfig, on_ready: Callable[[Endpoints, Path], None] | None = None,
                  server_factory: Callable[[ServerConfig], TritonServer] = TritonServer) -> int:
    """Start Triton, call ``on_ready``, run until Triton exits or SIGTERM/SIGINT arrives
    (forwarded to Triton as SIGTERM: it finishes in-flight requests). Returns Triton's status.
    ``server_factory`` makes the server (e.g. one launched under MPI, :mod:`builder.deploy`)."""
    repository, temporary = prepare_repository(config)
    server = server_factory(replace(config.server, model_repository=repository, echo_log=True))
    previous: dict[int, object] = {}
    stopping = threading.Event()

    def forward(signum: int, frame: types.FrameType | None) -> None:
        logger.info("received signal %d: stopping Triton", signum)
        server.send_signal(signal.SIGTERM)
        stopping.set()

    try:
        endpoints = server.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
        if on_ready is not None:
            on_ready(endpoints, repository)
        return _wait(server, stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        server.stop()
        if temporary:
            shutil.rmtree(repository, ignore_errors=True)


__all__ = ["ServeConfig", "ServerError", "find_deployment", "prepare_repository", "serve_forever"]
