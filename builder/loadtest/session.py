"""A whole load-test session: start Triton on loopback, compute the in-process references,
run the load (:func:`builder.loadtest.streams.run_load`), then optionally SIGTERM the server while
every stream has a request in flight and see it finish them and exit. With ``openai``, concurrent
streams through the OpenAI front (:mod:`builder.loadtest.openai_streams`) run between the two.

``scripts/load_test.py`` is its command line; the results go to a JSON file and a short
markdown summary.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.loadtest.openai_streams import OpenAILoadConfig, run_openai_load
from builder.loadtest.streams import Answer, LoadConfig, LoadReport, Template, make_templates, metrics, run_load, send
from builder.stages.model_repository import render_model_repository
from triton_backend.serving.launch.triton_server import ServerConfig, TritonServer
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    serving: ServingConfig = field(default_factory=lambda: ServingConfig(max_concurrency=8, default_max_tokens=16))
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    sigterm: bool = True  # end with SIGTERM while every stream has a request in flight
    openai: OpenAILoadConfig | None = None  # then streams through /v1/chat/completions (None: none)
    exit_timeout_s: int = 120


@dataclass
class SigtermReport:
    in_flight_at_signal: float = 0.0
    exit_code: int | None = None
    exit_after_s: float = 0.0
    finished_exactly: int = 0
    errors: list[str] = field(default_factory=list)
    wrong: int = 0

    @property
    def clean(self) -> bool:
        return self.exit_code == 0 and self.wrong == 0 and not self.errors


def sigterm_under_load(server: TritonServer, templates: list[Template], streams: int, model: str) -> SigtermReport:
    """One request per stream; SIGTERM once they are all in flight; Triton must finish them and exit."""
    assert server.endpoints is not None
    endpoints, report = server.endpoints, SigtermReport()
    valid = [t for t in templates if t.expected_text is not None]
    answers: dict[int, Answer | Exception] = {}

    def client(i: int) -> None:
        try:
            answers[i] = send(endpoints.grpc_url, model, valid[i % len(valid)].request, 600)
        except Exception as exc:  # recorded below
            answers[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    gauge = f'specdec_requests_in_flight{{model="{model}"}}'
    deadline = time.monotonic() + 120
    while metrics(endpoints.metrics_url).get(gauge, 0.0) < streams and time.monotonic() < deadline:
        time.sleep(0.05)
    report.in_flight_at_signal = metrics(endpoints.metrics_url).get(gauge, 0.0)
    started = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        report.exit_code = server.wait(timeout=server.config.exit_timeout_s + 30)
    except Exception:  # it did not exit: recorded as exit_code None
        report.exit_code = None
    report.exit_after_s = round(time.monotonic() - started, 2)
    for t in threads:
        t.join(timeout=60)
    for i in range(streams):
        answer = answers.get(i)
        if not isinstance(answer, Answer) or answer.error is not None:
            report.errors.append(str(answer if not isinstance(answer, Answer) else answer.error)[:200])
        elif answer.text == valid[i % len(valid)].expected_text:
            report.finished_exactly += 1
        else:
            report.wrong += 1
    return report


def run_session(config: SessionConfig) -> dict[str, Any]:
    """The load test's results (``passed``: the load and, if asked, the SIGTERM phase passed)."""
    decoder = build_decoder(config.deployment)
    logger.info("computing the in-process references of %d templates", config.load.templates)
    templates = make_templates(decoder, config.load, config.serving)
    with tempfile.TemporaryDirectory(prefix="specbuild-load-") as work:
        repository = render_model_repository(config.deployment, Path(work) / "model_repo", config.serving)
        server = TritonServer(ServerConfig(repository, exit_timeout_s=config.exit_timeout_s,
                                           log_file=Path(work) / "tritonserver.log"))
        with server:
            assert server.endpoints is not None and server.pid is not None
            logger.info("load: %d streams for %.0fs", config.load.streams, config.load.duration_s)
            load = run_load(server.endpoints, server.pid, templates, config.load, config.serving.model_name)
            openai = _openai_load(server, repository, config) if config.openai is not None else None
            sigterm = (sigterm_under_load(server, templates, config.load.streams, config.serving.model_name)
                       if config.sigterm else None)
    results: dict[str, Any] = {"load": load.summary(), "serving": {"max_concurrency": config.serving.max_concurrency},
                               "templates": len(templates)}
    if openai is not None:
        results["openai"] = openai.summary()
    if sigterm is not None:
        results["sigterm"] = {**sigterm.__dict__, "clean": sigterm.clean, "exit_timeout_s": config.exit_timeout_s}
    results["passed"] = load.passed and (sigterm is None or sigterm.clean) and (openai is None or openai.passed)
    return results


def _openai_load(server: TritonServer, repository: Path, config: SessionConfig) -> Any:
    from triton_backend.serving.front.openai.app import OpenAIConfig
    from builder.ops.serve import start_openai_front

    assert server.endpoints is not None and config.openai is not None
    front = start_openai_front(OpenAIConfig(api_key=config.openai.api_key), server.endpoints, repository,
                               config.serving.model_name)
    try:
        logger.info("OpenAI load: %d streams x %d requests", config.openai.streams, config.openai.rounds)
        return run_openai_load(front.url, front.config.model_id(front.backend), config.openai)
    finally:
        front.stop()


def markdown(results: dict[str, Any]) -> str:
    load = results["load"]
    memory = load["memory"]
    lines = [
        f"- {load['config']['streams']} concurrent gRPC streams for {load['duration_s']:.0f} s "
        f"(server max_concurrency {results['serving']['max_concurrency']}), {results['templates']} request templates",
        f"- requests: {load['requests']} ({load['succeeded']} answered, {load['refused_as_expected']} refused as "
        f"expected); mismatches: {len(load['mismatches'])}; unexpected errors: {len(load['unexpected_errors'])}",
        f"- tokens: {load['tokens']} ({load['tokens_per_s']} tokens/s, {load['requests_per_s']} requests/s); "
        f"latency p50 {load['latency_p50_s']} s, p95 {load['latency_p95_s']} s, max {load['latency_max_s']} s",
        f"- server RSS after warm-up: first third {memory.get('first_third_mib')} MiB, last third "
        f"{memory.get('last_third_mib')} MiB, max {memory.get('max_mib')} MiB, growth {memory.get('growth_mib')} MiB "
        f"({'flat' if memory.get('flat') else 'NOT flat'})",
        "- metrics (server delta = clients' sum): " + ", ".join(
            f"{_short(name)}{'' if a == b else ' MISMATCH'} {a:g}={b:g}"
            for name, (a, b) in load["metric_checks"].items()),
    ]
    if "openai" in results:
        o = results["openai"]
        lines.append(f"- OpenAI /v1/chat/completions streams: {o['requests']} requests, {o['succeeded']} answered, "
                     f"{len(o['mismatches'])} differing from the request alone, {len(o['errors'])} errors "
                     f"({o['tokens_per_s']} tokens/s)")
    if "sigterm" in results:
        s = results["sigterm"]
        lines.append(f"- SIGTERM with {s['in_flight_at_signal']:g} requests in flight: exit code {s['exit_code']} "
                     f"after "
                     f"{s['exit_after_s']} s (exit timeout {s['exit_timeout_s']} s); {s['finished_exactly']} finished "
                     f"exactly, {s['wrong']} wrong, {len(s['errors'])} errors")
    lines.append(f"- passed: {results['passed']}")
    return "\n".join(lines)


def _short(metric: str) -> str:
    """``specdec_x_total{method="ngram",model="specdec"}`` -> ``x_total{method="ngram"}``."""
    name = metric.removeprefix("specdec_")
    name = re.sub(r'model="[^"]*",?', "", name).replace(",}", "}")
    return name.replace("{}", "")


def write(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    from builder.report_paths import portable

    out.write_text(json.dumps(portable(results), indent=1, default=str) + "\n")


__all__ = ["LoadReport", "SessionConfig", "SigtermReport", "markdown", "run_session", "sigterm_under_load", "write"]
