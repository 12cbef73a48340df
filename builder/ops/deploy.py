"""``specbuild deploy``: what the Docker images run. Prepare a model repository, then serve it
with Triton in the foreground.

What to serve (:class:`DeployConfig`), one of:

- ``spec``: a build spec. ``specbuild build`` runs into ``<engine_cache>/<key>/`` unless a
  finished build with the same key is there already, which is reused as is;
- ``source``: a model repository, a build folder or a deployment JSON, served as
  ``specbuild serve`` would serve it;
- neither: the default deployment (:mod:`builder.ops.default_deployment`: the reference target,
  ``auto`` with the packaged EAGLE-3 drafter merged with n-gram lookup).

The cache key is the sha256 of: the spec (canonical JSON), the build mode, the calibration
device, whether ``trtllm-build`` is on PATH, the versions of specbuild and of the tools that
shape engines (TensorRT-LLM, TensorRT, modelopt, torch, transformers), and a fingerprint
(relative path, size, mtime) of every local file the spec names (models, Medusa heads,
calibration text). A build runs in a scratch folder beside its cache entry and is renamed
into place only when finished; a lock file makes containers sharing the cache wait for one
another instead of building the same thing twice.

Launch: when the repository holds a TensorRT-LLM model (``backend: "tensorrtllm"``) and the
plan shards the engines over TP x PP > 1 ranks, Triton runs under MPI with one process per
rank, as NVIDIA's tensorrtllm_backend launches it: rank 0 serves the whole repository and the
endpoints; ranks > 0 load only the TensorRT-LLM models (``--model-control-mode=explicit``);
each rank gets its own Python-backend shared-memory prefix. A repository whose ``specdec``
deployment serves compiled engines itself (``engine_runtime: trtllm``) runs in one Triton
process: TensorRT-LLM's executor spawns a multi-rank engine's ranks (orchestrator mode). Such a
build is served only when its manifest marks every engine "compiled" and TensorRT-LLM imports.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import importlib.util
import json
import logging
import re
import shutil
import signal
import types
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

from builder.stages.compile import TRTLLM_BUILD, EngineStatus
from builder.stages.manifest import MANIFEST_NAME, refresh_manifest, verify_manifest
from triton_backend.serving.front.http_guard import DEFAULT_MAX_BODY_BYTES
from triton_backend.serving.front.openai.app import OpenAIConfig
from builder.ops.serve import REPOSITORY_DIR, ServeConfig, prepare_repository, serve_forever
from builder.plan.spec import BuildSpec
from triton_backend.serving.launch.triton_server import Endpoints, ServerConfig, TritonInstallation, TritonServer
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig
from triton_backend.engines.trtllm.trtllm_config import EngineRuntime
from triton_backend.core.errors import ConfigError, SpecbuildError
from triton_backend.core.reference_model import cache_dir

logger = logging.getLogger(__name__)

KEY_FORMAT = 1
KEY_FILE = "deploy-key.json"
KEY_TOOLS = ("specbuild", "tensorrt_llm", "tensorrt", "nvidia-modelopt", "torch", "transformers")
_BACKEND_LINE = re.compile(r'^\s*backend\s*:\s*"([^"]+)"', re.MULTILINE)
TRTLLM_BACKEND = "tensorrtllm"


class DeployError(SpecbuildError, RuntimeError):
    """The deployment cannot be prepared or launched as configured."""

    code = "deploy"


class BuildMode(str, enum.Enum):
    FULL = "full"  # quantize, export checkpoints, compile engines (when trtllm-build is on PATH), render
    TORCH_ONLY = "torch-only"  # the torch runtime's weights and the repository only


def default_engine_cache() -> Path:
    return cache_dir() / "deployments"


@dataclass(frozen=True)
class DeployConfig:
    spec: Path | None = None
    source: Path | None = None
    engine_cache: Path = field(default_factory=default_engine_cache)
    build_mode: BuildMode = BuildMode.FULL
    calibration_device: str = "cpu"
    build_threads: int = 1
    rebuild: bool = False  # ignore a cached build with the same key
    verify_cache: bool = False  # re-hash a cached build's files against its manifest before reuse
    server: ServerConfig = field(default_factory=lambda: ServerConfig(model_repository=Path(".")))
    world_size: int | None = None  # None: TP x PP of the plan when the repository has TensorRT-LLM models
    mpirun: str = "mpirun"
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES  # the HTTP guard's bound (None: no guard)
    openai: OpenAIConfig | None = None  # the OpenAI-compatible front beside Triton (triton_backend.serving.front.openai)
    decoupled_mode: bool = False  # ServingConfig.decoupled_mode of the models rendered here
    exclude_input_in_output: bool = True  # ServingConfig.exclude_input_in_output of the models rendered here

    def serving(self, **fields: Any) -> ServingConfig:
        """The ServingConfig of the models rendered here (``fields``: the build's own settings)."""
        return ServingConfig(decoupled_mode=self.decoupled_mode, exclude_input_in_output=self.exclude_input_in_output,
                             **fields)

    def __post_init__(self) -> None:
        object.__setattr__(self, "build_mode", BuildMode(self.build_mode))
        object.__setattr__(self, "engine_cache", Path(self.engine_cache))
        if self.spec is not None and self.source is not None:
            raise DeployError("give a build spec or a source to serve, not both")
        if self.build_threads < 1:
            raise DeployError(f"build_threads must be >= 1, got {self.build_threads}")
        if self.world_size is not None and self.world_size < 1:
            raise DeployError(f"world_size must be >= 1, got {self.world_size}")


@dataclass(frozen=True)
class Prepared:
    repository: Path
    build_dir: Path | None  # the build folder of a spec (cached)
    reused: bool  # the build came from the cache
    world_size: int
    trtllm_models: tuple[str, ...]


# -- cache key ------------------------------------------------------------------------------
def fingerprint(path: Path) -> dict[str, Any] | None:
    """Size and mtime of a file, or of every file under a folder; ``None``: not a local path."""
    if path.is_file():
        st = path.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if path.is_dir():
        return {p.relative_to(path).as_posix(): {"size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                for p in sorted(path.rglob("*")) if p.is_file()}
    return None


def spec_files(spec: BuildSpec) -> list[str]:
    """Every source the spec names that may be a local file or folder."""
    names = [spec.target.source]
    if spec.draft is not None:
        names.append(spec.draft.source)
    if spec.medusa is not None and spec.medusa.source is not None:
        names.append(spec.medusa.source)
    if spec.calibration.text_file is not None:
        names.append(spec.calibration.text_file)
    return names


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cache_key(spec: BuildSpec, config: DeployConfig) -> tuple[str, dict[str, Any]]:
    """``(sha256 hex, what was hashed)`` for a spec built under ``config``."""
    full = config.build_mode is BuildMode.FULL
    inputs = {
        "format": KEY_FORMAT,
        "spec": spec.to_dict(),
        "build_mode": config.build_mode.value,
        "calibration_device": config.calibration_device if full else None,
        "trtllm_build": full and shutil.which(TRTLLM_BUILD) is not None,
        "tools": {name: _version(name) for name in KEY_TOOLS},
        "files": {name: fingerprint(Path(name)) for name in spec_files(spec)},
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return digest, inputs


# -- build or reuse -------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process holds %s (building the same spec): waiting for it", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached(entry: Path, key: str, config: DeployConfig) -> bool:
    """A finished build with this key is in ``entry`` (and, if asked, its files are intact)."""
    if not (entry / MANIFEST_NAME).is_file() or not (entry / KEY_FILE).is_file():
        return False
    if json.loads((entry / KEY_FILE).read_text()).get("key") != key:
        logger.warning("%s holds a build with another key (a hash prefix collision): replacing it", entry)
        return False
    if config.rebuild:
        logger.info("rebuild asked for: replacing the cached build %s", entry)
        return False
    if config.verify_cache:
        changed = verify_manifest(entry)
        if changed:
            logger.warning("cached build %s no longer matches its manifest (%d files changed, e.g. %s): rebuilding",
                           entry, len(changed), changed[0])
            return False
    return True


def _run_build(spec: BuildSpec, config: DeployConfig, scratch: Path, failed_dir: Path) -> None:
    from builder.stages.pipeline import BuildOptions, run_build
    from builder.stages.compile import CompileMode

    options = BuildOptions(output_dir=scratch, compile=CompileMode.AUTO,
                           torch_only=config.build_mode is BuildMode.TORCH_ONLY, progress=False,
                           device=config.calibration_device, threads=config.build_threads)
    result = run_build(spec, options)
    for notice in result.notices:
        logger.info("build notice: %s", notice)
    failed = [e for e in result.engines if e.status is EngineStatus.FAILED]
    if failed:
        shutil.rmtree(failed_dir, ignore_errors=True)
        scratch.rename(failed_dir)
        raise DeployError(f"the {failed[0].role} engine failed to compile; the build is kept in {failed_dir} for "
                          f"inspection: {failed[0].detail[:600]}")


def build_or_reuse(spec_path: Path, config: DeployConfig) -> tuple[Path, bool]:
    """``(build folder, reused)`` for the spec file: the cached build with the spec's key, or
    a fresh build put there."""
    spec = BuildSpec.load(spec_path)
    key, inputs = cache_key(spec, config)
    entry = config.engine_cache / key[:20]
    with _locked(config.engine_cache / f"{key[:20]}.lock"):
        if _cached(entry, key, config):
            logger.info("reusing the cached build %s (key %s)", entry, key[:20])
            return entry, True
        scratch = config.engine_cache / f"{key[:20]}.building"
        shutil.rmtree(scratch, ignore_errors=True)  # left by a build that was killed
        logger.info("building %s into %s (key %s, mode %s)", spec_path, entry, key[:20], config.build_mode.value)
        _run_build(spec, config, scratch, config.engine_cache / f"{key[:20]}.failed")
        (scratch / KEY_FILE).write_text(json.dumps({"key": key, "spec_file": str(spec_path), **inputs},
                                                   indent=2, sort_keys=True) + "\n")
        shutil.rmtree(entry, ignore_errors=True)
        scratch.rename(entry)
        return entry, False


# -- launch ---------------------------------------------------------------------------------
def tensorrtllm_models(repository: Path) -> tuple[str, ...]:
    """Names of the repository's models served by NVIDIA's TensorRT-LLM backend."""
    names = []
    for config in sorted(repository.glob("*/config.pbtxt")):
        match = _BACKEND_LINE.search(config.read_text())
        if match and match.group(1) == TRTLLM_BACKEND:
            names.append(config.parent.name)
    return tuple(names)


def deployment_runtimes(repository: Path) -> set[EngineRuntime]:
    """The engine runtimes the repository's deployment files select (read as typed deployments)."""
    runtimes = set()
    for path in sorted(repository.glob("*/*/deployment.json")):
        try:
            runtimes.add(DeploymentConfig.load(path).engine_runtime)
        except ConfigError as exc:
            raise DeployError(f"deployment file {path}: {exc}") from None
    return runtimes


def check_engines_servable(build_dir: Path) -> None:
    """A build whose repository serves its TensorRT-LLM engines needs every engine marked
    "compiled" in the manifest and TensorRT-LLM importable; say which is missing, before Triton
    starts."""
    repository = build_dir / REPOSITORY_DIR
    if EngineRuntime.TRTLLM not in deployment_runtimes(repository):
        return
    manifest_path = build_dir / MANIFEST_NAME
    engines = json.loads(manifest_path.read_text()).get("engines", {}) if manifest_path.is_file() else {}
    unfinished = {role: e.get("status") for role, e in engines.items() if e.get("status") != EngineStatus.COMPILED.value}
    if not engines or unfinished:
        raise DeployError(f"{repository} serves TensorRT-LLM engines, but the build's manifest does not mark them all "
                          f"compiled ({unfinished or 'no engines recorded'}); rebuild, or serve the torch weights")
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise DeployError(f"{repository} serves compiled TensorRT-LLM engines, and TensorRT-LLM is not installed "
                          "here: run the GPU image (docker/Dockerfile.gpu), or rebuild with --build-mode torch-only")


def planned_world_size(build_dir: Path) -> int:
    """TP x PP of the build's plan (1 when the folder has no plan)."""
    plan_file = build_dir / "plan.json"
    if not plan_file.is_file():
        return 1
    plan = json.loads(plan_file.read_text())
    return int(plan["tp_size"]) * int(plan["pp_size"])


def launch_world_size(repository: Path, requested: int | None) -> tuple[int, tuple[str, ...]]:
    """``(MPI world size, TensorRT-LLM models)``: the plan's TP x PP when the repository has
    TensorRT-LLM models to shard, else one Triton process."""
    models = tensorrtllm_models(repository)
    planned = planned_world_size(repository.parent)
    if requested is not None:
        if requested > 1 and not models:
            raise DeployError(f"world size {requested} needs a TensorRT-LLM model (backend \"{TRTLLM_BACKEND}\") in "
                              f"{repository}: ranks > 0 would have nothing to load")
        return requested, models
    if not models:
        if planned > 1 and EngineRuntime.TRTLLM in deployment_runtimes(repository):
            logger.info("the plan shards the engines over %d ranks (TP x PP): the trtllm runtime's executor spawns "
                        "them itself (orchestrator mode) from one Triton process", planned)
        elif planned > 1:
            logger.warning("the plan shards the TensorRT-LLM engines over %d ranks (TP x PP), but %s has no "
                           "TensorRT-LLM model: its Python-backend models run in one Triton process", planned, repository)
        return 1, models
    return planned, models


def mpi_command(server_cmd: list[str], world_size: int, trtllm_models: tuple[str, ...],
                mpirun: str = "mpirun") -> list[str]:
    """One ``tritonserver`` per rank under ``mpirun`` (the command as is for world size 1)."""
    if world_size == 1:
        return list(server_cmd)
    if not trtllm_models:
        raise DeployError("an MPI launch needs the TensorRT-LLM model names that ranks > 0 load")
    cmd = [mpirun, "--allow-run-as-root"]
    for rank in range(world_size):
        cmd += ["-n", "1", *server_cmd]
        if rank > 0:
            cmd += ["--model-control-mode=explicit", *(f"--load-model={name}" for name in trtllm_models)]
        cmd += [f"--backend-config=python,shm-region-prefix-name=prefix{rank}_", ":"]
    return cmd[:-1]


class MpiTritonServer(TritonServer):
    """A :class:`TritonServer` whose process is ``mpirun`` with one ``tritonserver`` per rank."""

    def __init__(self, config: ServerConfig, world_size: int, trtllm_models: tuple[str, ...],
                 mpirun: str = "mpirun") -> None:
        super().__init__(config)
        self.world_size = world_size
        self.trtllm_models = trtllm_models
        self.mpirun = mpirun

    def command(self, installation: TritonInstallation, endpoints: Endpoints) -> list[str]:
        return mpi_command(super().command(installation, endpoints), self.world_size, self.trtllm_models, self.mpirun)


# -- the whole thing ------------------------------------------------------------------------
def _default_repository(config: DeployConfig) -> Path:
    from builder.ops.default_deployment import default_deployment
    from builder.stages.model_repository import render_model_repository
    from triton_backend.core.reference_model import ensure_reference_model

    deployment = default_deployment()  # names its drafter by absolute path (hashed into the folder name)
    ensure_reference_model(deployment.target)  # fetched at image build time; here: before Triton loads it
    name = hashlib.sha256(deployment.to_json().encode()).hexdigest()[:20]
    return render_model_repository(deployment, config.engine_cache / f"default-{name}" / REPOSITORY_DIR,
                                   config.serving())


def _source_repository(config: DeployConfig) -> Path:
    assert config.source is not None
    name = hashlib.sha256(str(config.source.resolve()).encode()).hexdigest()[:20]
    rendered = config.engine_cache / f"source-{name}" / REPOSITORY_DIR
    serving = config.serving()  # a model repository given is served as is
    return prepare_repository(ServeConfig(source=config.source, repository_dir=rendered, serving=serving))[0]


def _build_front_models(spec_path: Path, build_dir: Path, config: DeployConfig) -> None:
    """The tensorrtllm_backend-named models of a build, rendered again with this deployment's
    ``decoupled_mode`` / ``exclude_input_in_output`` (the build's key does not depend on them;
    they hold no state)."""
    from builder.stages.model_repository import render_front_models

    serving = config.serving(max_batch_size=BuildSpec.load(spec_path).limits.max_batch_size)  # as the build renders it
    written = render_front_models(serving, build_dir / REPOSITORY_DIR)
    if written and (build_dir / MANIFEST_NAME).is_file():  # --verify-cache checks them against the manifest
        refresh_manifest(build_dir, [p.relative_to(build_dir).as_posix() for p in written])


def prepare(config: DeployConfig) -> Prepared:
    """Build (or reuse) and render; decide how Triton is launched."""
    build_dir, reused = None, False
    try:
        config.engine_cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DeployError(f"engine cache {config.engine_cache} cannot be created: {exc.strerror}") from None
    if config.spec is not None:
        if not config.spec.is_file():
            raise DeployError(f"build spec {config.spec} not found (mount it into the container?)")
        build_dir, reused = build_or_reuse(config.spec, config)
        check_engines_servable(build_dir)
        _build_front_models(config.spec, build_dir, config)
        repository = build_dir / REPOSITORY_DIR
    elif config.source is not None:
        repository = _source_repository(config)
    else:
        repository = _default_repository(config)
    world_size, models = launch_world_size(repository, config.world_size)
    if world_size > 1 and shutil.which(config.mpirun) is None:
        raise DeployError(f"world size {world_size} needs {config.mpirun!r} (OpenMPI), which is not on PATH")
    return Prepared(repository, build_dir, reused, world_size, models)


def _terminate(signum: int, frame: types.FrameType | None) -> None:
    """SIGTERM before serving runs (building, starting, the OpenAI front starting) is a requested,
    clean stop: status 0, as once serving (SIGINT: 130)."""
    raise SystemExit(0 if signum == signal.SIGTERM else 128 + signum)


def deploy(config: DeployConfig, on_ready: Callable[[Endpoints, Path], None] | None = None) -> int:
    """Prepare, then serve until SIGTERM/SIGINT arrives, under the same supervision as
    ``specbuild serve`` (restarts after a crash, the HTTP guard, the restricted admin APIs).
    SIGTERM while building or starting stops cleanly too (a container's PID 1 has no default
    handler)."""
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        prepared = prepare(config)
        logger.info("serving %s (%s; Triton processes: %d)", prepared.repository,
                    "cached build" if prepared.reused else "prepared now", prepared.world_size)

        def make_server(server_config: ServerConfig) -> TritonServer:
            if prepared.world_size == 1:
                return TritonServer(server_config)
            return MpiTritonServer(server_config, prepared.world_size, prepared.trtllm_models, config.mpirun)

        serve = ServeConfig(source=prepared.repository, server=replace(config.server, model_repository=prepared.repository),
                            openai=config.openai, max_body_bytes=config.max_body_bytes)
        return serve_forever(serve, on_ready, make_server)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["BuildMode", "DeployConfig", "DeployError", "MpiTritonServer", "Prepared", "build_or_reuse", "cache_key",
           "check_engines_servable", "deploy", "deployment_runtimes", "fingerprint", "launch_world_size",
           "mpi_command", "planned_world_size", "prepare", "tensorrtllm_models"]
