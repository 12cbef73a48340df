"""Command-line flags of ``specbuild serve``, ``specbuild generate`` and ``specbuild demo``.

Each command parses its flags into one typed config and calls one library function:
:func:`builder.ops.serve.serve_forever`, :func:`builder.ops.triton_client.generate`,
:func:`builder.ops.demo.run_demo`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, RemoteResult
from triton_backend.serving.front.http_guard import DEFAULT_MAX_BODY_BYTES
from triton_backend.serving.launch.triton_server import (DEFAULT_ADMIN_HEADER, Endpoints, InferenceKey, RestrictedApi, ServerConfig,
                                      TritonSource)
from triton_backend.core.errors import ConfigError
from triton_backend.serving.interface import ServingConfig

if TYPE_CHECKING:
    from triton_backend.serving.front.openai.app import OpenAIConfig

DEFAULT_PORTS = {ClientProtocol.GRPC: 8001, ClientProtocol.HTTP: 8000}


def _add_request_flags(p: argparse.ArgumentParser, *, prompt_default: str | None) -> None:
    p.add_argument("--prompt", default=prompt_default, required=prompt_default is None)
    p.add_argument("--max-tokens", type=int, default=None, help="default: the server's (64)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--end-id", type=int, default=None, help="an extra end token id")
    p.add_argument("--speculation", default=None, help="auto, draft, ngram or off (default: the deployment's)")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="send the prompt as is (default: the model's chat template)")
    p.add_argument("--protocol", choices=[m.value for m in ClientProtocol], default=ClientProtocol.GRPC.value)


def _request(a: argparse.Namespace, stream: bool) -> GenerateRequest:
    return GenerateRequest(prompt=a.prompt, max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                           top_p=a.top_p, seed=a.seed, stop=tuple(a.stop), end_id=a.end_id, speculation=a.speculation,
                           num_draft_tokens=a.num_draft_tokens, chat=not a.raw, stream=stream)


def _print_piece(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _print_result(result: RemoteResult, streamed: bool, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps({"text": result.text, "stats": result.stats, "latency_s": result.latency_s,
                          "time_to_first_chunk_s": result.time_to_first_chunk_s}, indent=2))
        return
    print("\n" if streamed else result.text + "\n")
    print(result.summary())


# -- serve ------------------------------------------------------------------------------------
def openai_config(a: argparse.Namespace) -> "OpenAIConfig | None":
    """The OpenAI front's settings from ``--openai-*`` / ``--api-key`` (``None`` without ``--openai-port``)."""
    from triton_backend.serving.front.openai.app import OpenAIConfig

    if a.openai_port is None:
        if a.served_model_name is not None:
            raise ConfigError("--served-model-name needs --openai-port")
        return None
    return OpenAIConfig(host=a.openai_host or a.host, port=a.openai_port, api_key=api_key(a),
                        served_model_name=a.served_model_name, max_body_bytes=a.openai_max_body,
                        prefix_cache_scope=a.openai_prefix_cache_scope)


def api_key(a: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$SPECBUILD_API_KEY``, else ``None`` (inference open)."""
    from triton_backend.serving.front.openai.app import API_KEY_ENV

    return a.api_key if a.api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def add_openai_flags(p: argparse.ArgumentParser) -> None:
    from triton_backend.serving.front.openai.app import API_KEY_ENV

    g = p.add_argument_group("OpenAI-compatible API (docs/openai.md)")
    g.add_argument("--openai-port", type=int, default=None,
                   help="also serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) on this "
                        "port, in front of the same Triton server (0 = a free port)")
    g.add_argument("--openai-host", default=None, help="address the OpenAI API binds (default: --host)")
    g.add_argument("--api-key", default=None,
                   help=f"every inference port needs the key (default: ${API_KEY_ENV} if set, else open): the "
                        "OpenAI /v1 routes and Triton's HTTP infer/generate (through the guard too) take "
                        "'Authorization: Bearer KEY'; Triton's gRPC takes the metadata "
                        "'triton-grpc-protocol-authorization: Bearer KEY'. Health, metadata and metrics stay open "
                        "(docs/security.md)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target's name)")
    g.add_argument("--openai-max-body", type=int, default=4 * 1024 * 1024, help="largest request body, bytes")
    g.add_argument("--openai-prefix-cache-scope", choices=("shared", "user"), default="shared",
                   help="user: each request's 'user' field is its prefix-cache namespace, so end users share no "
                        "cached keys and values and learn nothing from a first token's time about each other's "
                        "prompts (docs/prefix-caching.md); shared: one cache for all")


def _cmd_serve(a: argparse.Namespace) -> int:
    from builder.ops.serve import RestartPolicy, ServeConfig, find_deployment, prepare_repository, serve_forever

    serving = ServingConfig(max_concurrency=a.max_concurrency, instance_count=a.instance_count,
                            unary_instance_count=a.max_concurrency, max_batch_size=a.max_batch_size,
                            max_queue_size=a.max_queue_size, batch_policy=a.batch_policy,
                            decoupled_mode=a.decoupled_mode == "true",
                            exclude_input_in_output=a.exclude_input_in_output != "false",
                            ensemble_mode=a.ensemble or "forward")
    server = ServerConfig(model_repository=Path("."), host=a.host, http_port=a.http_port, grpc_port=a.grpc_port,
                          metrics_port=a.metrics_port, source=TritonSource(a.triton),
                          startup_timeout_s=a.startup_timeout, exit_timeout_s=a.exit_timeout, log_verbose=a.log_verbose,
                          log_file=a.log_file, restricted=RestrictedApi.from_settings(
                              a.admin_key or os.environ.get("SPECBUILD_ADMIN_KEY"), a.admin_header, a.open_admin_apis),
                          api_key=InferenceKey(api_key(a)) if api_key(a) else None)
    rendering = (a.decoupled_mode, a.exclude_input_in_output, a.ensemble)
    if rendering != (None, None, None) and a.source is not None and find_deployment(a.source) is None:
        raise ConfigError("--decoupled-mode / --exclude-input-in-output / --ensemble apply to a repository serve "
                          "renders; this model repository is served as rendered (render it again with --render-only "
                          "...)")
    restart = RestartPolicy(max_fast_failures=a.restart_limit, fast_failure_s=a.restart_window)
    config = ServeConfig(source=a.source, server=server, serving=serving, repository_dir=a.repository_dir,
                         restart=restart, openai=openai_config(a), max_body_bytes=a.max_body_bytes or None)
    if a.render_only:
        if a.repository_dir is None:
            raise ConfigError("--render-only needs --repository-dir")
        print(prepare_repository(config)[0])
        return 0

    def ready(endpoints: Endpoints, repository: Path) -> None:
        print(f"Triton is serving {repository}\n{endpoints.describe()}\n"
              f"try: specbuild generate --url {endpoints.grpc_url} --stream --prompt 'Hello'", flush=True)

    code = serve_forever(config, ready)
    # Triton, its stubs, the guard and the OpenAI front are stopped and reaped: skip the interpreter's
    # teardown, which unloads torch & co (every specbuild command imports them) and took 0.5-7 s of a
    # stop on the loaded 2-core machine, during which a supervisor sees serve still running
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="start Triton Inference Server on a deployment or model repository")
    p.add_argument("source", nargs="?", type=Path, default=None,
                   help="a model repository, a folder with model_repo/ or deployment.json, or a deployment JSON "
                        "file (default: the reference target, auto with the packaged EAGLE-3 drafter merged with "
                        "n-gram lookup; n-gram lookup alone where the drafter is absent)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--http-port", type=int, default=None, help="default: a free port")
    p.add_argument("--grpc-port", type=int, default=None, help="default: a free port")
    p.add_argument("--metrics-port", type=int, default=None, help="default: a free port")
    p.add_argument("--triton", choices=[s.value for s in TritonSource], default=TritonSource.AUTO.value,
                   help="tritonserver on PATH, the one nvidia-pytriton bundles, or auto (PATH first)")
    p.add_argument("--max-concurrency", type=int, default=4,
                   help="requests run at once per instance by a runtime that batches itself (TensorRT-LLM)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests in one instance's in-flight batch (torch)")
    p.add_argument("--max-queue-size", type=int, default=64, help="requests waiting for a batch slot; more are refused")
    p.add_argument("--batch-policy", choices=("load_aware", "per_request"), default="load_aware",
                   help="who picks draft lengths each round: the batch's pass-cost plan, or each request alone")
    p.add_argument("--decoupled-mode", choices=("false", "true"), default=None,
                   help="tensorrtllm_backend's switch for ensemble / tensorrt_llm / tensorrt_llm_bls: false (NVIDIA's "
                        "default) answers Triton's infer, true streams (gRPC streaming, generate_stream); specdec "
                        "always streams. Applies when serve renders the repository (default false)")
    p.add_argument("--exclude-input-in-output", choices=("false", "true"), default=None,
                   help="tensorrt_llm's parameter: what output_ids hold when a request leaves exclude_input_in_output "
                        "out: the new tokens only (true, the default, as NVIDIA's setups) or the prompt first (false: "
                        "client-side draft-target orchestration, e2e_grpc_speculative_decoding_client.py)")
    p.add_argument("--ensemble", choices=("forward", "pipeline"), default=None,
                   help="forward (default): ensemble hands the text request to specdec (chat templates, text stop "
                        "strings, guides); pipeline: NVIDIA's layout, a Triton ensemble of preprocessing -> "
                        "tensorrt_llm -> postprocessing, each counting every ensemble request (r25.05's "
                        "base_metrics_verification_tests.py). Applies when serve renders the repository")
    p.add_argument("--instance-count", type=int, default=1, help="model instances (each loads the models)")
    p.add_argument("--repository-dir", type=Path, default=None, help="render the repository here (kept)")
    p.add_argument("--render-only", action="store_true", help="render the repository and exit")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--exit-timeout", type=int, default=30,
                   help="seconds Triton waits for in-flight requests after SIGTERM (then it is stopped)")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--log-file", type=Path, default=None)
    p.add_argument("--restart-limit", type=int, default=5,
                   help="restart Triton after a crash; give up after this many restarts in a row that never became "
                        "ready (a crash of a ready server never counts: a client may have caused it); 0 = never restart")
    p.add_argument("--restart-window", type=float, default=60.0,
                   help="seconds: crashes within this long of a start double the wait before the next restart")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="the HTTP guard on the HTTP port refuses larger request bodies with 413 (Triton's own HTTP "
                        "then listens on an internal loopback port); 0: no guard, Triton's HTTP on the HTTP port "
                        "(docs/security.md)")
    p.add_argument("--admin-key", default=None,
                   help="open Triton's admin APIs (model repository, logging, statistics, shared memory, trace) to "
                        "requests carrying this key in --admin-header (env SPECBUILD_ADMIN_KEY); without a key "
                        "they are closed to every client")
    p.add_argument("--admin-header", default=DEFAULT_ADMIN_HEADER,
                   help="HTTP header of the admin key (gRPC metadata: triton-grpc-protocol-<header>)")
    p.add_argument("--open-admin-apis", action="store_true", help="leave the admin APIs open to anyone (Triton's default)")
    add_openai_flags(p)
    p.set_defaults(func=_cmd_serve)


# -- generate ---------------------------------------------------------------------------------
def _cmd_generate(a: argparse.Namespace) -> int:
    from builder.ops.triton_client import generate

    protocol = ClientProtocol(a.protocol)
    url = a.url or f"127.0.0.1:{DEFAULT_PORTS[protocol]}"
    config = ClientConfig(url=url, protocol=protocol, model_name=a.model, unary_model_name=a.unary_model)
    streamed = a.stream and not a.json
    result = generate(config, _request(a, a.stream), _print_piece if streamed else None)
    _print_result(result, streamed, a.json)
    return 0


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="send a request to a running server and print text + acceptance stats")
    _add_request_flags(p, prompt_default=None)
    p.add_argument("--url", default=None, help="host:port (default: 127.0.0.1:8001 gRPC, :8000 HTTP)")
    p.add_argument("--stream", action="store_true", help="stream verified blocks as they are accepted")
    p.add_argument("--model", default="specdec", help="the decoupled (streaming) model")
    p.add_argument("--unary-model", default="specdec_unary", help="the non-decoupled entry point")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_generate)


# -- demo -------------------------------------------------------------------------------------
def _cmd_demo(a: argparse.Namespace) -> int:
    from builder.ops.demo import DemoConfig, run_demo

    config = DemoConfig(deployment_file=a.deployment, request=_request(a, not a.no_stream),
                        protocol=ClientProtocol(a.protocol), source=TritonSource(a.triton),
                        compare_plain=not a.no_compare)
    print(f"prompt: {a.prompt}\n", flush=True)
    demo = run_demo(config, None if a.no_stream else _print_piece,
                    lambda answer: (_print_result(answer, not a.no_stream), sys.stdout.flush()))
    print(demo.comparison())
    return 0


def _add_demo(sub: Any) -> None:
    from builder.ops.local_run import DEFAULT_PROMPT

    p = sub.add_parser("demo", help="end to end: prepare the default deployment, start Triton, send a request, "
                                    "print the answer, the drafter that ran and its acceptance statistics, send it "
                                    "again with speculation off and print both speeds, stop Triton")
    _add_request_flags(p, prompt_default=DEFAULT_PROMPT)
    p.set_defaults(max_tokens=64)
    p.add_argument("--deployment", type=Path, default=None,
                   help="a deployment JSON file (default: the reference target, auto with the packaged EAGLE-3 "
                        "drafter + n-gram lookup)")
    p.add_argument("--no-stream", action="store_true", help="one unary request instead of streaming")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the second request (the same one with speculation off) and the speed comparison")
    p.add_argument("--triton", choices=[s.value for s in TritonSource], default=TritonSource.AUTO.value)
    p.set_defaults(func=_cmd_demo)


def register(sub: Any) -> None:
    """Add ``serve``, ``generate`` and ``demo`` to the ``specbuild`` subcommands."""
    _add_serve(sub)
    _add_generate(sub)
    _add_demo(sub)
