"""``specbuild demo``: the whole path once, end to end.

Prepare the default deployment (:mod:`builder.ops.default_deployment`: the reference target
SmolLM2-135M-Instruct, ``auto`` with the packaged EAGLE-3 drafter merged with n-gram lookup, the
best exact configuration measured for it; n-gram lookup alone where the drafter is not there),
render its Triton model repository, start a real Triton server on loopback, send one streaming
gRPC request, collect the answer and its acceptance statistics, send the same request with
speculation off (plain decoding on the same server), and stop the server. The two speeds and
their ratio are one measurement each, on whatever else the machine is doing: a demonstration,
not a benchmark (``specbuild bench`` measures side by side, repeated).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from builder.ops.local_run import DEFAULT_PROMPT
from builder.stages.model_repository import render_model_repository
from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, RemoteResult, generate
from triton_backend.serving.launch.triton_server import Endpoints, ServerConfig, TritonServer, TritonSource
from triton_backend.serving.interface import ServingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    deployment_file: Path | None = None  # None: the default deployment (builder.ops.default_deployment)
    request: GenerateRequest = field(default_factory=lambda: GenerateRequest(
        prompt=DEFAULT_PROMPT, max_tokens=64, chat=True, stream=True))
    protocol: ClientProtocol = ClientProtocol.GRPC
    source: TritonSource = TritonSource.AUTO
    startup_timeout_s: float = 300.0
    compare_plain: bool = True  # then send the same request with speculation off

    def serving(self) -> ServingConfig:
        """Only the models the demo sends to (every stub loads torch: fewer start sooner): the
        decoupled model, and the unary one only for a non-streaming request."""
        return ServingConfig(trtllm_models=None, unary_model_name=None if self.request.stream else "specdec_unary",
                             unary_instance_count=1)


def tokens_per_s(result: RemoteResult) -> float:
    """Output tokens over the request's whole latency (what the client saw)."""
    tokens = int(result.stats.get("num_output_tokens", 0) or 0)
    return tokens / result.latency_s if result.latency_s > 0 else 0.0


def acceptance(result: RemoteResult) -> str:
    """A request's acceptance statistics in one phrase (what its drafters proposed and the target kept)."""
    s = result.stats
    tokens, passes = int(s.get("num_output_tokens", 0) or 0), int(s.get("target_passes", 0) or 0)
    per_pass = f"{tokens / passes:.2f}" if passes else "n/a"
    drafted = int(s.get("total_draft_tokens", 0) or 0)
    line = f"{tokens} tokens in {passes} target passes ({per_pass} per pass)"
    if drafted:
        line += (f", acceptance {float(s.get('acceptance_rate', 0.0)):.2f} "
                 f"({s.get('total_accepted_draft_tokens', 0)} of {drafted} drafted tokens accepted)")
    else:
        line += ", nothing drafted"
    if s.get("fallback"):
        line += ", fell back to plain decoding"
    return line


@dataclass(frozen=True)
class DemoResult:
    result: RemoteResult
    endpoints: Endpoints
    deployment_json: str
    plain: RemoteResult | None = None  # the same request, speculation off
    drafters: str = ""  # what the deployment drafts with (default_deployment.describe_drafters)

    def comparison(self) -> str:
        """Which drafter ran, its acceptance, both speeds and their ratio, labelled as the single
        measurement they are."""
        lines = [f"drafter: {self.drafters}; served as method={self.result.stats.get('speculation_method', '?')}",
                 f"speculative: {acceptance(self.result)}: {tokens_per_s(self.result):.1f} tok/s"]
        if self.plain is None:
            return "\n".join(lines)
        spec, plain = tokens_per_s(self.result), tokens_per_s(self.plain)
        ratio = f"{spec / plain:.2f}x" if plain > 0 else "n/a"
        same = "identical" if self.plain.text == self.result.text else "DIFFERENT"
        lines += [f"plain decoding, same request, same server: {acceptance(self.plain)}: {plain:.1f} tok/s",
                  f"speed-up {ratio} over plain (one measurement each; text {same}; controlled figures: "
                  "docs/benchmarks.md)"]
        return "\n".join(lines)


def run_demo(config: DemoConfig, on_text: Callable[[str], None] | None = None,
             on_answer: Callable[[RemoteResult], None] | None = None) -> DemoResult:
    """``on_text`` gets each streamed piece, ``on_answer`` the answer once it is complete (before
    the plain request is sent)."""
    from builder.ops.default_deployment import default_deployment, describe_drafters
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.serving.service import load_deployment

    if config.deployment_file is not None:
        deployment = load_deployment(config.deployment_file)
        logger.info("deployment %s: %s", config.deployment_file, describe_drafters(deployment))
    else:
        deployment = default_deployment()  # logs what it drafts with
        ensure_reference_model(deployment.target)  # fetch + convert once, before Triton loads it
    with tempfile.TemporaryDirectory(prefix="specbuild-demo-") as work:
        repository = render_model_repository(deployment, Path(work) / "model_repo", config.serving())
        server_config = ServerConfig(repository, source=config.source, startup_timeout_s=config.startup_timeout_s,
                                     exit_timeout_s=10, log_file=Path(work) / "tritonserver.log")
        with TritonServer(server_config) as server:
            endpoints = server.endpoints
            assert endpoints is not None
            url = endpoints.grpc_url if config.protocol is ClientProtocol.GRPC else endpoints.http_url
            logger.info("Triton ready: %s", " | ".join(endpoints.describe().splitlines()))
            client = ClientConfig(url, config.protocol)
            result = generate(client, config.request, on_text)
            if on_answer is not None:
                on_answer(result)
            plain = None
            if config.compare_plain:
                logger.info("the same request with speculation off (plain decoding)")
                plain = generate(client, replace(config.request, speculation="off"))
    return DemoResult(result, endpoints, deployment.to_json(), plain, describe_drafters(deployment))


__all__ = ["DemoConfig", "DemoResult", "acceptance", "run_demo", "tokens_per_s"]
