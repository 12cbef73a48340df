"""Flags (and ``SPECBUILD_*`` environment variables) of ``specbuild deploy``.

Every flag ``--some-name`` may instead come from the variable ``SPECBUILD_SOME_NAME``; a flag
given on the command line wins. The Docker images set these variables (see docker/README.md);
a container is configured with ``-e``/``environment:`` only. The settings are parsed into one
:class:`builder.ops.deploy.DeployConfig` and :func:`builder.ops.deploy.deploy` runs it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from builder.ops.deploy import BuildMode, DeployConfig, DeployError, default_engine_cache
from triton_backend.serving.front.http_guard import DEFAULT_MAX_BODY_BYTES
from triton_backend.serving.front.openai.app import OpenAIConfig
from triton_backend.serving.launch.triton_server import (DEFAULT_ADMIN_HEADER, Endpoints, InferenceKey, RestrictedApi, ServerConfig,
                                      TritonSource)
from triton_backend.core.errors import SpecbuildError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _bool(text: str) -> bool:
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise ValueError(f"expected one of {_TRUE + _FALSE[1:]}")


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise ValueError("expected a port in 1..65535")
    return port


def _seconds(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("expected a whole number of seconds >= 1")
    return value


def _world_size(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else int(text)


def _choice(values: list[str]) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in values:
            raise ValueError(f"expected one of {values}")
        return text

    return convert


@dataclass(frozen=True)
class Setting:
    name: str  # flag --name, variable SPECBUILD_NAME (dashes -> underscores, upper case)
    convert: Callable[[str], Any]
    default: str | None  # as text, converted like a given value; None: unset
    help: str
    flag_only: bool = False  # a switch (store_true) on the command line

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def env(self) -> str:
        return "SPECBUILD_" + self.name.replace("-", "_").upper()

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


SETTINGS = (
    Setting("spec", Path, None, "build spec file (.yaml, .toml, .json): build or reuse its engines, then serve"),
    Setting("source", Path, None, "serve this model repository, build folder or deployment JSON as is"),
    Setting("engine-cache", Path, None, "builds keyed by spec hash live here (default $SPECBUILD_CACHE_DIR/deployments)"),
    Setting("build-mode", _choice([m.value for m in BuildMode]), BuildMode.FULL.value,
            "full: quantize + checkpoints + engines (when trtllm-build is on PATH); torch-only: weights + repository"),
    Setting("calibration-device", str, "cpu", "where modelopt calibrates during a full build (cpu, cuda)"),
    Setting("build-threads", int, "1", "torch threads while building"),
    Setting("rebuild", _bool, "false", "build again even when a cached build has the same key", flag_only=True),
    Setting("verify-cache", _bool, "false", "re-hash a cached build against its manifest before reusing it", flag_only=True),
    Setting("host", str, "127.0.0.1", "address Triton binds (the images set 0.0.0.0)"),
    Setting("http-port", _port, "8000", "Triton HTTP port"),
    Setting("grpc-port", _port, "8001", "Triton gRPC port"),
    Setting("metrics-port", _port, "8002", "Triton metrics port"),
    Setting("triton", _choice([s.value for s in TritonSource]), TritonSource.AUTO.value,
            "tritonserver on PATH (NVIDIA's image), the one nvidia-pytriton bundles, or auto (PATH first)"),
    Setting("world-size", _world_size, "auto", "Triton MPI ranks: auto (the plan's TP x PP when the repository has "
            "TensorRT-LLM models, else 1) or a number"),
    Setting("mpirun", str, "mpirun", "the mpirun of a multi-rank launch"),
    Setting("startup-timeout", float, "600", "seconds Triton may take to become ready"),
    Setting("exit-timeout", _seconds, "30", "on SIGTERM, seconds Triton lets in-flight requests finish (Kubernetes: within "
            "terminationGracePeriodSeconds)"),
    Setting("log-verbose", int, "0", "Triton --log-verbose level"),
    Setting("openai-port", _port, None, "also serve the OpenAI-compatible API on this port (docs/openai.md)"),
    Setting("api-key", str, None, "the OpenAI API's /v1 routes need 'Authorization: Bearer KEY'"),
    Setting("served-model-name", str, None, "the model id OpenAI clients send (default: the target's name)"),
    Setting("decoupled-mode", _bool, "false", "ensemble / tensorrt_llm / tensorrt_llm_bls decoupled (streaming; "
            "Triton's infer refused) or not (infer; NVIDIA's quick-start default false)"),
    Setting("exclude-input-in-output", _bool, "true", "tensorrt_llm's parameter: output_ids without the prompt "
            "when a request does not say (false: the prompt first, for client-side draft-target orchestration)"),
    Setting("max-body-bytes", int, str(DEFAULT_MAX_BODY_BYTES),
            "the HTTP guard on the HTTP port refuses larger request bodies with 413 (Triton's HTTP then listens "
            "on an internal loopback port); 0: no guard (docs/security.md)"),
    Setting("admin-key", str, None, "open Triton's admin APIs (model repository, logging, statistics, shared memory, "
            "trace) to requests carrying this key in the admin header; without one they are closed to every client"),
    Setting("admin-header", str, DEFAULT_ADMIN_HEADER, "HTTP header of the admin key (gRPC metadata: "
            "triton-grpc-protocol-<header>)"),
    Setting("open-admin-apis", _bool, "false", "leave the admin APIs open to anyone (Triton's default)", flag_only=True),
    Setting("prepare-only", _bool, "false", "build or reuse, render, print the repository and exit", flag_only=True),
)

_WHAT_TO_SERVE = ("spec", "source")  # one or the other


def add_deploy_arguments(p: argparse.ArgumentParser) -> None:
    for s in SETTINGS:
        text = f"{s.help} (env {s.env}" + (f"; default {s.default})" if s.default not in (None, "false") else ")")
        if s.flag_only:
            p.add_argument(s.flag, dest=s.dest, action="store_const", const="true", default=None, help=text)
        else:
            p.add_argument(s.flag, dest=s.dest, default=None, metavar=s.dest.upper(), help=text)


def resolve_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Each setting: the flag, else the environment variable, else the default, converted.
    A value that does not convert raises :class:`DeployError` naming where it came from."""
    environ = dict(os.environ if environ is None else environ)
    if any(getattr(args, name, None) is not None for name in _WHAT_TO_SERVE):  # a flag replaces both variables
        environ = {k: v for k, v in environ.items() if k not in {f"SPECBUILD_{n.upper()}" for n in _WHAT_TO_SERVE}}
    values: dict[str, Any] = {}
    for s in SETTINGS:
        flag_value = getattr(args, s.dest, None)
        env_value = environ.get(s.env)
        if flag_value is not None:
            text, origin = flag_value, s.flag
        elif env_value is not None and env_value.strip() != "":
            text, origin = env_value, s.env
        else:
            text, origin = s.default, "default"
        try:
            values[s.dest] = None if text is None else s.convert(text)
        except ValueError as exc:
            raise DeployError(f"{origin}={text!r}: {exc}") from None
    return values


def config_from_settings(v: dict[str, Any]) -> DeployConfig:
    server = ServerConfig(model_repository=Path("."), host=v["host"], http_port=v["http_port"], grpc_port=v["grpc_port"],
                          metrics_port=v["metrics_port"], source=TritonSource(v["triton"]),
                          startup_timeout_s=v["startup_timeout"], exit_timeout_s=v["exit_timeout"],
                          log_verbose=v["log_verbose"],
                          restricted=RestrictedApi.from_settings(v["admin_key"], v["admin_header"], v["open_admin_apis"]),
                          api_key=InferenceKey(v["api_key"]) if v["api_key"] else None)
    return DeployConfig(max_body_bytes=v["max_body_bytes"] or None, spec=v["spec"], source=v["source"],
                        engine_cache=v["engine_cache"] or default_engine_cache(),
                        build_mode=BuildMode(v["build_mode"]), calibration_device=v["calibration_device"],
                        build_threads=v["build_threads"], rebuild=v["rebuild"], verify_cache=v["verify_cache"],
                        server=server, world_size=v["world_size"], mpirun=v["mpirun"], openai=_openai(v),
                        decoupled_mode=v["decoupled_mode"], exclude_input_in_output=v["exclude_input_in_output"])


def _openai(v: dict[str, Any]) -> OpenAIConfig | None:
    if v["openai_port"] is None:
        if v["served_model_name"] is not None:
            raise DeployError("served-model-name needs openai-port")
        return None
    return OpenAIConfig(host=v["host"], port=v["openai_port"], api_key=v["api_key"],
                        served_model_name=v["served_model_name"])


def cmd_deploy(args: argparse.Namespace) -> int:
    from builder.ops.deploy import deploy, prepare

    settings = resolve_settings(args)
    config = config_from_settings(settings)
    if settings["prepare_only"]:
        prepared = prepare(config)
        print(prepared.repository)
        return 0

    def ready(endpoints: Endpoints, repository: Path) -> None:
        print(f"Triton is serving {repository}\n{endpoints.describe()}", flush=True)

    return deploy(config, ready)


def register(sub: Any) -> None:
    p = sub.add_parser("deploy", help="build (or reuse, keyed by spec hash) and serve: the Docker images' entrypoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_deploy_arguments(p)
    p.set_defaults(func=cmd_deploy)


def main(argv: list[str] | None = None) -> int:
    """``python -m builder.cli.deploy``: the same command without the rest of the CLI (the
    container entrypoint starts in about half a second instead of importing torch)."""
    parser = argparse.ArgumentParser(prog="specbuild deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_deploy_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return cmd_deploy(args)
    except SpecbuildError as exc:
        print(f"specbuild deploy: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
