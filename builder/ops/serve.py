"""``specbuild serve``: find or render a model repository and run Triton on it in the foreground.

What to serve (``ServeConfig.source``):

- nothing: the default deployment (:mod:`builder.ops.default_deployment`: the reference target,
  ``auto`` with the packaged EAGLE-3 drafter merged with n-gram lookup), rendered;
- a model repository (a folder with ``<model>/config.pbtxt``), served as is;
- a folder holding ``model_repo/`` (a built deployment), its ``model_repo/``;
- a DeploymentConfig JSON file, or a folder holding ``deployment.json``: rendered first.

Relative model paths in a deployment file are taken relative to that file.
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import threading
import types
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from builder.stages.model_repository import deployment_dir, is_model_repository, render_model_repository
from triton_backend.serving.front.http_guard import GuardConfig, HttpGuard
from triton_backend.serving.front.openai.app import OpenAIConfig, OpenAIServer
from triton_backend.serving.front.openai.backend import BackendConfig, tokenizer_source
from triton_backend.serving.launch.triton_server import Endpoints, InferenceKey, ServerConfig, ServerError, TritonServer, free_port
from triton_backend.serving.launch.triton_supervisor import RestartPolicy, TritonSupervisor
from triton_backend.core.errors import ConfigError
from triton_backend.serving.interface import ServingConfig

logger = logging.getLogger(__name__)

DEPLOYMENT_FILE = "deployment.json"
REPOSITORY_DIR = "model_repo"


@dataclass(frozen=True)
class ServeConfig:
    source: Path | None = None
    server: ServerConfig = field(default_factory=lambda: ServerConfig(model_repository=Path(".")))
    serving: ServingConfig = field(default_factory=ServingConfig)
    repository_dir: Path | None = None  # where to render a deployment (default: a temporary folder)
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # after Triton exits abnormally
    openai: OpenAIConfig | None = None  # an OpenAI-compatible API in front of Triton (None: none)
    # the HTTP guard on the public HTTP port (Triton's own HTTP then on loopback); None: Triton's HTTP is public
    max_body_bytes: int | None = field(default_factory=lambda: GuardConfig().max_body_bytes)


def find_deployment(source: Path | None) -> Path | None:
    """The deployment file ``source`` names, or ``None`` when it names a model repository."""
    if source is None:
        return None
    if source.is_file():
        return source
    if not source.is_dir():
        raise ConfigError(f"{source} does not exist")
    if is_model_repository(source) or is_model_repository(source / REPOSITORY_DIR):
        return None
    if (source / DEPLOYMENT_FILE).is_file():
        return source / DEPLOYMENT_FILE
    raise ConfigError(f"{source} holds no model repository (<model>/config.pbtxt), no {REPOSITORY_DIR}/ "
                              f"and no {DEPLOYMENT_FILE}")


def prepare_repository(config: ServeConfig) -> tuple[Path, bool]:
    """``(model repository, rendered here)`` for ``config.source``."""
    source = config.source
    if source is not None and source.is_dir() and is_model_repository(source):
        return source, False
    if source is not None and source.is_dir() and is_model_repository(source / REPOSITORY_DIR):
        return source / REPOSITORY_DIR, False
    deployment_file = find_deployment(source)
    if deployment_file is not None:
        from triton_backend.serving.service import load_deployment  # relative model paths: relative to the file

        deployment = load_deployment(deployment_file)
    out = config.repository_dir or Path(tempfile.mkdtemp(prefix="specbuild-repo-"))
    try:
        if deployment_file is None:  # its drafter path is written relative to the repository where it can be
            from builder.ops.default_deployment import default_deployment

            deployment = default_deployment(relative_to=deployment_dir(out, config.serving))
        return render_model_repository(deployment, out, config.serving), config.repository_dir is None
    except BaseException:
        if config.repository_dir is None:
            shutil.rmtree(out, ignore_errors=True)
        raise


def start_openai_front(config: OpenAIConfig, endpoints: Endpoints, repository: Path,
                       model_name: str = "specdec", api_key: InferenceKey | None = None) -> OpenAIServer:
    """The OpenAI front on its own thread, talking gRPC to the Triton at ``endpoints`` (with
    ``api_key``, the key Triton's inference APIs need)."""
    backend = BackendConfig(grpc_url=endpoints.grpc_url, tokenizer=tokenizer_source(repository, model_name),
                            model_name=model_name, grpc_headers=api_key.grpc_metadata if api_key else None)
    front = OpenAIServer(config, backend)
    front.start()
    return front


def serve_forever(config: ServeConfig, on_ready: Callable[[Endpoints, Path], None] | None = None,
                  server_factory: Callable[[ServerConfig], TritonServer] = TritonServer) -> int:
    """Start the HTTP guard (:mod:`triton_backend.serving.front.http_guard`, unless ``config.max_body_bytes`` is
    ``None``) and Triton, call ``on_ready``, run until SIGTERM/SIGINT arrives (the guard's port closes
    at once; forwarded to Triton as SIGTERM: it finishes in-flight requests, and is ended as soon as
    none is left, :mod:`triton_backend.serving.launch.triton_drain`), restarting it after abnormal exits as
    ``config.restart`` says (:mod:`triton_backend.serving.launch.triton_supervisor`). With ``config.openai``, the
    OpenAI front runs beside it (:mod:`triton_backend.serving.front.openai`), started once Triton is ready and
    stopped before it; a restarted Triton is reached again on the same port. Returns Triton's last status
    (2 when the supervisor gave up). ``server_factory`` makes each server (e.g. one launched
    under MPI, :mod:`builder.ops.deploy`)."""
    repository, temporary = prepare_repository(config)
    server_config = replace(config.server, model_repository=repository, echo_log=True)
    guard = None
    if config.max_body_bytes is not None:  # Triton's HTTP moves to an internal loopback port behind the guard
        internal = free_port("127.0.0.1")
        guard = HttpGuard(GuardConfig(host=server_config.host, port=server_config.http_port,
                                      max_body_bytes=config.max_body_bytes, restricted=server_config.restricted),
                          f"http://127.0.0.1:{internal}")
        server_config = replace(server_config, http_host="127.0.0.1", http_port=internal)
    supervisor = TritonSupervisor(server_config, server_factory, config.restart,
                                  busy=(lambda: guard.in_flight) if guard is not None else (lambda: 0))
    if guard is not None:  # the guard cancels abandoned HTTP requests in the current server's models
        guard.server_pid = lambda: supervisor.server.pid if supervisor.server is not None else None
    previous: dict[int, object] = {}
    front: OpenAIServer | None = None

    def forward(signum: int, frame: types.FrameType | None) -> None:
        logger.info("received signal %d: stopping Triton", signum)
        if guard is not None:  # the public HTTP port closes first; its requests in flight go on
            guard.stop_accepting()
        supervisor.request_stop()
        if front is not None:  # stops listening, lets its requests finish, then lets go of Triton
            threading.Thread(target=front.stop, name="openai-front-stop", daemon=True).start()

    try:
        if guard is not None:
            guard.start()  # first: a taken public port fails before Triton's long start
        endpoints = supervisor.start()
        if guard is not None:
            assert guard.port is not None
            endpoints = replace(endpoints, http_port=guard.port, http_host=None)
        if config.openai is not None:
            front = start_openai_front(replace(config.openai, shutdown_timeout_s=config.server.exit_timeout_s),
                                       endpoints, repository, config.serving.model_name, server_config.api_key)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
        if on_ready is not None:
            on_ready(endpoints if front is None else replace(endpoints, openai_url=front.url), repository)
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if front is not None:
            front.stop()
        supervisor.stop()
        if guard is not None:
            guard.stop()
        if temporary:
            shutil.rmtree(repository, ignore_errors=True)


__all__ = ["RestartPolicy", "ServeConfig", "ServerError", "find_deployment", "prepare_repository", "serve_forever",
           "start_openai_front"]
