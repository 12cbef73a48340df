"""Faults against a REAL Triton server: clients that vanish mid-stream, requests cancelled
through Triton, SIGTERM in the middle of a load, a client that never closes its stream, and
model repositories whose weight file is corrupt or missing."""

from __future__ import annotations

import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from reliability_fixtures import (  # noqa: F401 (fixtures)
    DEPLOYMENT, MODEL, SERVING, assert_client_safe, delta, infer_input, reliable_decoder, reliable_triton,
    stream_request, wait_idle,
)

from builder.loadtest.streams import LoadConfig, Template, expected_template, make_templates, process_tree, send
from builder.stages.model_repository import render_model_repository
from builder.ops.triton_client import GenerateRequest
from triton_backend.serving.launch.triton_server import ServerConfig, ServerError, TritonServer, free_port
from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.torch.model_loading import load_model
from triton_backend.core.reference_model import ensure_reference_model

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
CANCELLED = f'specdec_requests_total{{model="{MODEL}",outcome="cancelled"}}'
SUCCESS = f'specdec_requests_total{{model="{MODEL}",outcome="success"}}'
ENDLESS = GenerateRequest(prompt="Tell me a long story about a dragon.", max_tokens=2048, stream=True,
                          ignore_eos=True)

# a client in its own process: starts an endless streamed request, reports the first block, then waits to be killed
CLIENT = """
import queue, sys, time
import numpy as np
import tritonclient.grpc as g
replies = queue.Queue()
client = g.InferenceServerClient(sys.argv[1])
client.start_stream(callback=lambda result, error: replies.put((result, error)))
def tensor(name, array, wire):
    t = g.InferInput(name, list(array.shape), wire); t.set_data_from_numpy(array); return t
client.async_stream_infer("specdec", [
    tensor("text_input", np.array([[b"Tell me a long story about a dragon."]], dtype=object), "BYTES"),
    tensor("max_tokens", np.array([[2048]], dtype=np.int32), "INT32"),
    tensor("stream", np.array([[True]]), "BOOL"), tensor("ignore_eos", np.array([[True]]), "BOOL")])
result, error = replies.get(timeout=300)
print("error" if error is not None else "streaming", flush=True)
time.sleep(600)
"""


def tensors_of(request: GenerateRequest) -> list[grpcclient.InferInput]:
    wire = {"text_input": "BYTES", "stop_words": "BYTES", "speculation": "BYTES", "max_tokens": "INT32",
            "top_k": "INT32", "end_id": "INT32", "num_draft_tokens": "INT32", "temperature": "FP32", "top_p": "FP32",
            "random_seed": "UINT64", "stream": "BOOL", "apply_chat_template": "BOOL", "ignore_eos": "BOOL"}
    return [infer_input(name, array, wire[name]) for name, array in request.arrays().items()]


def expected_text(decoder, request: GenerateRequest) -> str:
    return expected_template(decoder, request, SERVING).expected_text


def assert_still_serves(triton, decoder) -> None:
    request = GenerateRequest(prompt="What is the capital of France?", max_tokens=4, chat=True)
    started = time.monotonic()
    outcome = stream_request(triton.endpoints.grpc_url, tensors_of(request), timeout_s=120)
    assert outcome.final and outcome.error is None
    assert outcome.text == expected_text(decoder, request)
    assert time.monotonic() - started < 120


def test_clients_that_vanish_mid_stream_free_their_slots(reliable_triton, reliable_decoder) -> None:
    """As many clients as the model runs at once start endless streams and are SIGKILLed: each
    request is cancelled at its next block, and the next request is served as usual."""
    before = wait_idle(reliable_triton)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    clients = [subprocess.Popen([sys.executable, "-c", CLIENT, reliable_triton.endpoints.grpc_url],
                                stdout=subprocess.PIPE, text=True, env=env) for _ in range(SERVING.max_concurrency)]
    try:
        assert [_first_line(c, timeout_s=120) for c in clients] == ["streaming"] * len(clients)
    finally:
        for c in clients:
            c.kill()
            c.wait()
    after = wait_idle(reliable_triton, timeout_s=60)
    assert delta(after, before, CANCELLED) == len(clients)
    assert_still_serves(reliable_triton, reliable_decoder)


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The process's first stdout line, or '' if none comes in time (a client that never started)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().strip() if ready else ""


def test_requests_cancelled_through_triton_end_and_are_counted(reliable_triton, reliable_decoder) -> None:
    before = wait_idle(reliable_triton)
    # generous: the first block (prefill included) must arrive before the cancel, even on a loaded machine
    streamed = stream_request(reliable_triton.endpoints.grpc_url, tensors_of(ENDLESS), cancel_after_s=10.0)
    assert streamed.cancelled and streamed.responses and streamed.error is None
    unary = stream_request(reliable_triton.endpoints.grpc_url, tensors_of(replace(ENDLESS, stream=False)),
                           cancel_after_s=1.0)
    assert unary.cancelled and not unary.responses
    after = wait_idle(reliable_triton, timeout_s=60)
    assert delta(after, before, CANCELLED) == 2 and delta(after, before, SUCCESS) == 0
    assert_still_serves(reliable_triton, reliable_decoder)


def _start(tmp_path: Path, name: str, deployment=DEPLOYMENT, exit_timeout_s: int = 30) -> TritonServer:
    repository = render_model_repository(deployment, tmp_path / name, replace(SERVING, unary_model_name=None))
    return TritonServer(ServerConfig(repository, exit_timeout_s=exit_timeout_s, log_file=tmp_path / f"{name}.log"))


def test_sigterm_mid_load_finishes_in_flight_requests_and_exits_cleanly(tmp_path: Path, reliable_decoder) -> None:
    config = LoadConfig(templates=SERVING.max_concurrency, min_tokens=8, max_tokens=12, invalid_every=0)
    templates = make_templates(reliable_decoder, config, SERVING)
    server = _start(tmp_path, "sigterm_repo")
    endpoints = server.start()
    answers: dict[int, object] = {}

    def client(i: int, template: Template) -> None:
        answers[i] = send(endpoints.grpc_url, MODEL, template.request, 120)

    threads = [threading.Thread(target=client, args=(i, t)) for i, t in enumerate(templates)]
    try:
        for t in threads:
            t.start()
        _wait_for_in_flight(endpoints.metrics_url, len(templates))
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=server.config.exit_timeout_s + 10)
        took = time.monotonic() - started
        for t in threads:
            t.join(timeout=30)
    finally:
        server.stop()
    assert code == 0 and took < server.config.exit_timeout_s, (code, took)
    for i, template in enumerate(templates):  # every request in flight at SIGTERM was finished, exactly
        assert answers[i].error is None and answers[i].text == template.expected_text, (i, answers[i])


def _wait_for_in_flight(metrics_url: str, count: int, timeout_s: float = 120) -> None:
    from builder.loadtest.streams import metrics

    gauge = f'specdec_requests_in_flight{{model="{MODEL}"}}'
    deadline = time.monotonic() + timeout_s
    while metrics(metrics_url).get(gauge, 0.0) < count:
        assert time.monotonic() < deadline, "the requests never got in flight"
        time.sleep(0.05)


def test_a_request_in_flight_past_the_deadline_cannot_keep_specbuild_serve_up(tmp_path: Path) -> None:
    """SIGTERM drains in-flight requests up to a deadline (triton_backend/serving/launch/triton_drain.py): an endless
    request is still in flight at ``--exit-timeout`` + the grace period, so `specbuild serve` ends
    Triton by force then (status 1), while another client holds an idle gRPC stream open (Triton
    2.51 alone would never exit then). Nothing of the server is left: processes, shared memory."""
    grpc_port, exit_timeout = free_port(), 3
    proc = subprocess.Popen([sys.executable, "-m", "builder.cli.main", "serve", "--grpc-port", str(grpc_port),
                             "--exit-timeout", str(exit_timeout), "--log-file", str(tmp_path / "log.txt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    endless = None
    try:
        _read_until(proc, "gRPC")
        tree = process_tree(proc.pid)
        endless = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{grpc_port}"], stdout=subprocess.PIPE,
                                   text=True)
        assert endless.stdout.readline().strip() == "streaming"
        replies: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            client.start_stream(callback=lambda result, error: replies.put((result, error)))
            client.async_stream_infer(MODEL, tensors_of(GenerateRequest(prompt="Hi", max_tokens=2)),
                                      enable_empty_final_response=True)
            result, error = replies.get(timeout=120)
            assert error is None  # the request is done; the stream stays open, idle
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=exit_timeout + 10 + 30)
            took = time.monotonic() - started
            client.stop_stream(cancel_requests=True)
        err = proc.stderr.read()
    finally:
        for p in (proc, endless):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert code == 1 and took < exit_timeout + 10 + 20, (code, took)
    # ended by force at the deadline, or (Triton 2.51 can abort in its own shutdown first) by its own abort:
    # either way status 1 and a log line saying the request in flight was cut off
    forced = "did not finish within" in err and "1 request(s) in flight" in err
    aborted = "while stopping (1 request(s) in flight, cut off)" in err
    assert (forced or aborted) and "Traceback" not in err, err[-2000:]
    assert not [p for p in tree if Path(f"/proc/{p}").exists() and p != proc.pid], "Triton processes left running"
    assert not list(Path("/dev/shm").glob(f"specbuild_{proc.pid}_*")), "shared memory left behind"


def _read_until(proc: subprocess.Popen, marker: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"specbuild serve ended before printing {marker!r}"
        if line.startswith(marker):
            return
    raise AssertionError(f"no {marker!r} line within {timeout_s}s")


def _model_copy(folder: Path, weights: bytes | None) -> Path:
    """The reference model's folder with its weight file replaced (``None``: left out)."""
    source = ensure_reference_model(DEPLOYMENT.target)
    folder.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors" and not item.name.startswith("."):
            (folder / item.name).symlink_to(item)
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


def _truncated_weights() -> bytes:
    with open(ensure_reference_model(DEPLOYMENT.target) / "model.safetensors", "rb") as f:
        return f.read(1 << 20)  # an intact header, most of the tensors missing


def test_a_repository_with_a_truncated_weight_file_fails_to_load_naming_the_file(tmp_path: Path) -> None:
    model = _model_copy(tmp_path / "model", _truncated_weights())
    server = _start(tmp_path, "corrupt_repo", replace(DEPLOYMENT, target=str(model)), exit_timeout_s=5)
    with pytest.raises(ServerError) as info:
        server.start()
    message = str(info.value)
    assert f"weight file {model / 'model.safetensors'} is corrupt or truncated" in message, message
    assert not server.running


@pytest.mark.parametrize("case", ["missing", "garbage", "truncated", "missing shard"])
def test_load_model_names_the_bad_weight_file(tmp_path: Path, case: str) -> None:
    weights = {"missing": None, "garbage": b"\x00" * 64, "truncated": _truncated_weights(), "missing shard": None}
    model = _model_copy(tmp_path / "model", weights[case])
    if case == "missing shard":
        (model / "model.safetensors.index.json").write_text(
            '{"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(ModelLoadError) as info:
        load_model(str(model))
    message = str(info.value)
    assert_client_safe(message)
    bad = "model-00001-of-00002.safetensors" if case == "missing shard" else "model.safetensors"
    assert f"weight file {model / bad} is " + ("missing" if "missing" in case else "corrupt or truncated") in message
