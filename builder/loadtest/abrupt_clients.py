"""Abrupt gRPC clients against a real, supervised Triton server: does the server stay up?

One session is NVIDIA's decoupled-gRPC client pattern at its worst: a fresh process opens
a gRPC stream to the decoupled model (optionally in Triton's ``triton_grpc_error`` mode,
where the stream closes on the first error), sends several requests on it - valid ones
(streamed or not, a few tokens) mixed with invalid ones (rejected by our backend, or by
Triton itself for a wrong data type) - and vanishes without closing the stream: on its
first error, after a random time (``os._exit``), or SIGKILLed by the driver at a random
point. Sessions run ``parallel`` at a time; the server runs under
:class:`~triton_backend.serving.launch.triton_supervisor.TritonSupervisor`, so an abort is counted (a restart)
and the run goes on. At the end a few valid requests must succeed.

Children are forked from the driver, which never opens a gRPC channel itself before all
sessions are done (gRPC does not survive a fork with live channels).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from triton_backend.serving.launch.triton_server import Endpoints, ServerConfig
from triton_backend.serving.launch.triton_supervisor import RestartPolicy, TritonSupervisor

logger = logging.getLogger(__name__)

PROMPTS = ("Write a haiku about the ocean.", "What is the capital of France?",
           "Repeat exactly: alpha beta gamma delta epsilon.", "def fibonacci(n):\n")


@dataclass(frozen=True)
class AbruptConfig:
    sessions: int = 2000
    parallel: int = 8  # sessions at once
    min_requests: int = 2  # per session (one stream)
    max_requests: int = 8
    invalid_fraction: float = 0.4  # of requests; 3 in 4 of these are rejected by our backend, 1 by Triton
    max_tokens: int = 24
    grpc_error_mode_fraction: float = 0.0  # sessions sending the triton_grpc_error header
    kill_fraction: float = 0.4  # sessions SIGKILLed by the driver at a random time
    max_life_s: float = 1.5  # a session lives at most about this long
    final_checks: int = 4  # valid requests that must succeed at the end
    seed: int = 0
    model: str = "specdec"


@dataclass
class AbruptResult:
    sessions: int = 0
    aborts: int = 0  # server exits (each one restarted by the supervisor, or the run stopped)
    abort_reasons: list[str] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)  # crash -> ready again, per abort
    final_checks_ok: int = 0
    final_checks: int = 0
    final_check_errors: list[str] = field(default_factory=list)
    killed_sessions: int = 0
    duration_s: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def aborts_per_1000(self) -> float:
        return 1000.0 * self.aborts / max(1, self.sessions)

    @property
    def passed(self) -> bool:
        return self.aborts == 0 and self.final_checks_ok == self.final_checks

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(aborts_per_1000=self.aborts_per_1000, passed=self.passed)
        return out


# -- one session (runs in a forked child) ----------------------------------------------------
def _inputs(rng: random.Random, config: AbruptConfig) -> list[Any]:
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: Any, wire: str) -> Any:
        arr = np.array([[value]], dtype=object if wire == "BYTES" else None)
        if wire == "INT32":
            arr = arr.astype(np.int32)
        elif wire == "FP32":
            arr = arr.astype(np.float32)
        out = grpcclient.InferInput(name, list(arr.shape), wire)
        out.set_data_from_numpy(arr)
        return out

    prompt = rng.choice(PROMPTS).encode()
    roll = rng.random()
    if roll < config.invalid_fraction * 0.75:  # rejected by our backend: an error response
        bad = rng.choice([("max_tokens", -1, "INT32"), ("text_input", b"", "BYTES"), ("top_p", 7.0, "FP32")])
        ins = [tensor("text_input", prompt, "BYTES")] if bad[0] != "text_input" else []
        return ins + [tensor(*bad)]
    if roll < config.invalid_fraction:  # rejected by Triton: max_tokens is INT32
        return [tensor("text_input", prompt, "BYTES"), tensor("max_tokens", 3.0, "FP32")]
    return [tensor("text_input", prompt, "BYTES"), tensor("max_tokens", rng.randint(1, config.max_tokens), "INT32"),
            tensor("stream", rng.random() < 0.7, "BOOL")]


def run_session(url: str, config: AbruptConfig, seed: int) -> None:  # pragma: no cover - forked child
    """Send a stream of mixed requests, then vanish without closing it (never returns)."""
    try:
        import tritonclient.grpc as grpcclient

        rng = random.Random(seed)
        failed = threading.Event()
        client = grpcclient.InferenceServerClient(url)
        headers = {"triton_grpc_error": "true"} if rng.random() < config.grpc_error_mode_fraction else None
        client.start_stream(callback=lambda result, error: error is not None and failed.set(), headers=headers)
        for i in range(rng.randint(config.min_requests, config.max_requests)):
            if failed.is_set():
                break  # the client stops on its first error
            client.async_stream_infer(config.model, _inputs(rng, config), request_id=f"{seed}-{i}")
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.05)
        failed.wait(rng.random() * config.max_life_s)
    except BaseException:  # a stream closed under us is part of the pattern
        pass
    os._exit(0)


# -- the driver -----------------------------------------------------------------------------
@dataclass
class _Running:
    proc: Any
    started: float
    kill_at: float | None  # SIGKILL it then (None: it exits on its own)


def _run_sessions(url: str, config: AbruptConfig, result: AbruptResult) -> None:
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(config.seed)
    running: list[_Running] = []
    started = 0
    while started < config.sessions or running:
        while len(running) < config.parallel and started < config.sessions:
            proc = ctx.Process(target=run_session, args=(url, config, rng.randrange(2**31)), daemon=True)
            proc.start()
            now = time.monotonic()
            kill = rng.random() < config.kill_fraction
            running.append(_Running(proc, now, now + rng.random() * config.max_life_s if kill else None))
            started += 1
        now = time.monotonic()
        for item in list(running):
            if item.proc.exitcode is None:
                if item.kill_at is not None and now >= item.kill_at:
                    result.killed_sessions += 1
                elif now - item.started < config.max_life_s + 30:
                    continue
                os.kill(item.proc.pid, signal.SIGKILL)  # its time came (or it hung)
            item.proc.join(timeout=5)
            running.remove(item)
            result.sessions += 1
        time.sleep(0.005)


def _final_checks(endpoints: Endpoints, config: AbruptConfig, result: AbruptResult) -> None:
    from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, generate

    result.final_checks = config.final_checks
    for i in range(config.final_checks):
        request = GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=4, stream=i % 2 == 0, chat=True)
        began = time.monotonic()
        try:
            answer = generate(ClientConfig(endpoints.grpc_url, ClientProtocol.GRPC, model_name=config.model), request)
        except Exception as exc:  # reported, and the run fails
            result.final_check_errors.append(f"{request}: {type(exc).__name__}: {exc}")
            continue
        if answer.stats.get("finish_reason") and answer.stats.get("num_output_tokens", 0) > 0:
            result.final_checks_ok += 1
        else:
            result.final_check_errors.append(f"{request}: no tokens in {answer.stats}")
        logger.info("final check %d answered in %.1fs", i, time.monotonic() - began)


def run_abrupt_clients(server: ServerConfig, config: AbruptConfig, policy: RestartPolicy | None = None) -> AbruptResult:
    """Start a supervised Triton on ``server``, run the sessions, check it still answers."""
    policy = policy or RestartPolicy(max_fast_failures=1000, fast_failure_s=1.0, backoff_initial_s=0.5)
    supervisor = TritonSupervisor(server, policy=policy)
    result = AbruptResult(config=asdict(config))
    endpoints = supervisor.start()
    watcher = threading.Thread(target=supervisor.run, name="supervisor", daemon=True)
    watcher.start()
    began = time.monotonic()
    try:
        _run_sessions(endpoints.grpc_url, config, result)
        result.duration_s = time.monotonic() - began
        _wait_until_up(supervisor, timeout_s=300)
        _final_checks(endpoints, config, result)
    finally:
        supervisor.stop()
        watcher.join(timeout=60)
    result.aborts = supervisor.restarts + (not watcher.is_alive() and supervisor.gave_up)
    result.abort_reasons = list(supervisor.exit_reasons)
    result.recovery_s = list(supervisor.recovery_s)
    return result


def _wait_until_up(supervisor: TritonSupervisor, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server = supervisor.server
        if server is not None and server.running and server.ready():
            return
        time.sleep(0.2)


def markdown(result: AbruptResult) -> str:
    c = result.config
    lines = ["| sessions | parallel | requests/session | invalid | grpc-error mode | SIGKILLed | aborts | "
             "aborts per 1,000 | final checks | duration |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| {result.sessions} | {c['parallel']} | {c['min_requests']}-{c['max_requests']} | "
             f"{c['invalid_fraction']:.0%} | {c['grpc_error_mode_fraction']:.0%} of sessions | "
             f"{result.killed_sessions} | {result.aborts} | {result.aborts_per_1000:.2f} | "
             f"{result.final_checks_ok}/{result.final_checks} | {result.duration_s:.0f} s |"]
    for reason, seconds in zip(result.abort_reasons, result.recovery_s):
        lines.append(f"- abort: {reason}; back in {seconds:.1f} s")
    return "\n".join(lines)


__all__ = ["AbruptConfig", "AbruptResult", "markdown", "run_abrupt_clients", "run_session"]

