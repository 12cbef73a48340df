"""What one unauthenticated client can do (issue 26), against a REAL Triton server behind the
HTTP guard (:mod:`triton_backend.serving.front.http_guard`): the short CI form. The long form with figures:
``python scripts/reliability.py`` (benchmarks/results/reliability.md).

- a large form-encoded generate body (Triton 2.51 segfaults on >= ~4.5 MB) is refused with a
  typed 413 before Triton sees it; with a bound above it, the guard's content-type rewrite
  still keeps it off Triton's crashing path (typed 400); the server keeps serving;
- a chunked body with no length, a compressed body, the restricted admin APIs: typed 4xx;
- ``generate_stream`` (server-sent events) streams through the guard;
- a crowd on a front model (``ensemble``, ``tensorrt_llm_bls``) is refused beyond its bound at
  once with 503; abandoned clients of front models free their slots; oversized lists and
  integers get typed 400s at once.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from reliability_fixtures import (  # noqa: F401 (fixtures)
    BIG, MODEL, delta, infer_input, post, reliable_triton, stream_request, wait_idle,
)

from triton_backend.serving.front.http_guard import GuardConfig, HttpGuard, api_group
from triton_backend.serving.launch.triton_server import RestrictedApi

pytestmark = pytest.mark.slow

KEY = RestrictedApi("k" * 24)
CANCELLED = f'specdec_requests_total{{model="{MODEL}",outcome="cancelled"}}'


def typed(body: bytes) -> str:
    answer = json.loads(body)
    assert isinstance(answer["error"], str) and answer["error"]
    return answer.get("code", "")


@pytest.fixture(scope="module")
def guard(reliable_triton):  # noqa: F811
    with HttpGuard(GuardConfig(restricted=KEY), reliable_triton.endpoints.http_url) as running:
        yield running


def generate_ok(base: str) -> None:
    status, body, _ = post(f"{base}/v2/models/ensemble/generate",
                           json.dumps({"text_input": "Hi", "max_tokens": 2}).encode())
    assert status == 200 and json.loads(body)["text_output"], body


def test_api_groups_follow_tritons_routes() -> None:
    assert api_group("/v2/repository/index") == "model-repository"
    assert api_group("/v2/repository/models/specdec/load") == "model-repository"
    assert api_group("/v2/logging") == "logging"
    assert api_group("/v2/models/stats") == api_group("/v2/models/specdec/versions/1/stats") == "statistics"
    assert api_group("/v2/systemsharedmemory/region/x/register") == "shared-memory"
    assert api_group("/v2/cudasharedmemory/status") == "shared-memory"
    assert api_group("/v2/trace/setting") == api_group("/v2/models/m/trace/setting") == "trace"
    assert api_group("/v2/models/ensemble/generate_stream") == "inference"
    assert api_group("/v2/models/m/versions/1/infer") == "inference"
    assert api_group("/v2/health/ready") == api_group("/v2/models/m/ready") == "health"
    assert api_group("/v2/models/m") == api_group("/v2") == "metadata"
    assert api_group("/v2/models/m/config") == "model-config"
    assert api_group("/metrics") is None


def test_a_large_form_encoded_generate_body_is_refused_before_triton(guard, reliable_triton) -> None:  # noqa: F811
    base = f"http://127.0.0.1:{guard.port}"
    status, body, took = post(f"{base}/v2/models/ensemble/generate", BIG)
    assert status == 413 and typed(body) == "request_too_large" and took < 5
    chunked = post(f"{base}/v2/models/preprocessing/generate", iter([BIG[:1 << 20], BIG[:1 << 20], BIG[:1 << 16]]),
                   {"Content-Type": "application/x-www-form-urlencoded", "Transfer-Encoding": "chunked"})
    assert chunked[0] == 413 and typed(chunked[1]) == "request_too_large"
    status, body, _ = post(f"{base}/v2/models/ensemble/generate", b"\x1f\x8b" + b"\0" * 64,
                           {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert status == 415 and typed(body) == "unsupported_encoding"
    assert reliable_triton.server.running
    generate_ok(base)


def test_above_the_bound_the_content_type_rewrite_still_keeps_triton_up(reliable_triton) -> None:  # noqa: F811
    """The second line of defence: a guard configured with a bound above the crash size sends
    the form-encoded body on as JSON, which Triton parses and refuses with a typed 400."""
    with HttpGuard(GuardConfig(max_body_bytes=8 << 20), reliable_triton.endpoints.http_url) as wide:
        base = f"http://127.0.0.1:{wide.port}"
        status, body, _ = post(f"{base}/v2/models/ensemble/generate", BIG)
        assert status == 400, body[:300]
        assert reliable_triton.server.running
        generate_ok(base)


def test_admin_apis_answer_only_the_key(guard) -> None:
    base = f"http://127.0.0.1:{guard.port}"
    for path, body in (("/v2/logging", json.dumps({"log_verbose_level": 1}).encode()),
                       ("/v2/repository/index", b"{}"), ("/v2/models/stats", None),
                       ("/v2/systemsharedmemory/status", None)):
        status, answer, _ = post(base + path, body)
        assert status == 403 and typed(answer) == "forbidden", (path, status, answer)
    status, answer, _ = post(f"{base}/v2/repository/index", b"{}", {KEY.header: KEY.key})
    assert status == 200 and any(m["name"] == "specdec" for m in json.loads(answer))
    assert post(f"{base}/v2/health/ready", None)[0] == 200


def test_generate_stream_streams_through_the_guard(guard) -> None:
    # specdec: decoupled whatever decoupled_mode says
    request = urllib.request.Request(f"http://127.0.0.1:{guard.port}/v2/models/specdec/generate_stream",
                                     data=json.dumps({"text_input": "What is ML?", "max_tokens": 6,
                                                      "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers.get("Content-Type", "").startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in reply if line.startswith(b"data: ")]
    assert len(events) >= 2 and events[-1].get("finish_reason") == "length"
    assert sum(1 for e in events if "text_output" in e) >= 2


# -- crowds, abandoned clients, oversized lists and integers (the reliability server: 8 batch
# slots + 8 queue places on specdec; tensorrt_llm_bls: 2 instances x 8 + 8 queued) ---------------
def crowd(base: str, model: str, count: int) -> list[tuple[int, bytes, float]]:
    answers: list[tuple[int, bytes, float]] = []
    body = json.dumps({"text_input": "Count to ten.", "max_tokens": 8, "ignore_eos": True}).encode()

    def one() -> None:
        answers.append(post(f"{base}/v2/models/{model}/generate", body, {"Content-Type": "application/json"}))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return answers


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_crowd_on_a_front_model_is_refused_beyond_the_bounds_at_once(guard, reliable_triton, model) -> None:  # noqa: F811
    answers = crowd(f"http://127.0.0.1:{guard.port}", model, 48)
    served = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    assert len(answers) == 48 and served and refused, [a[0] for a in answers]
    assert all(status == 503 for status, _, _ in refused), {a[0]: a[1][:200] for a in refused}
    assert all(took < 5 for _, _, took in refused), sorted(a[2] for a in refused)
    assert all(json.loads(body)["text_output"] for _, body, _ in served)
    wait_idle(reliable_triton, timeout_s=60)


def test_abandoned_clients_of_front_models_free_their_slots(reliable_triton) -> None:  # noqa: F811
    """gRPC clients of ensemble / tensorrt_llm_bls that give up: the work behind them stops
    (specdec counts each as cancelled) and a fresh request is served at once."""
    before = wait_idle(reliable_triton)
    request = [infer_input("text_input", np.array([[b"Tell me a long story."]], dtype=object), "BYTES"),
               infer_input("max_tokens", np.array([[2048]], dtype=np.int32), "INT32"),
               infer_input("ignore_eos", np.array([[True]]), "BOOL")]
    streamed = request + [infer_input("stream", np.array([[True]]), "BOOL")]
    outcomes: list = []
    jobs = [("ensemble", streamed)] * 12 + [("tensorrt_llm_bls", request)] * 4  # the batch (8) and the queue full
    threads = [threading.Thread(target=lambda m=m, t=t: outcomes.append(
        stream_request(reliable_triton.endpoints.grpc_url, t, cancel_after_s=3.0, model=m))) for m, t in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    gave_up = [o for o in outcomes if o.cancelled and o.error is None]
    assert len(outcomes) == len(jobs) and len(gave_up) >= 8, outcomes
    assert all(o in gave_up or "server overloaded" in (o.error or "") for o in outcomes)
    after = wait_idle(reliable_triton, timeout_s=30)  # every slot free again: nothing runs on for the gone
    # each counted once as cancelled, unless specdec refused it as overloaded before the client gave up
    assert 8 <= delta(after, before, CANCELLED) <= len(gave_up)
    started = time.monotonic()
    fresh = stream_request(reliable_triton.endpoints.grpc_url, request[:1] + [
        infer_input("max_tokens", np.array([[4]], dtype=np.int32), "INT32")], model="ensemble")
    assert fresh.final and fresh.error is None and time.monotonic() - started < 30


def test_oversized_lists_and_integers_get_typed_errors_at_once(guard, reliable_triton) -> None:  # noqa: F811
    base = f"http://127.0.0.1:{guard.port}/v2/models/ensemble/generate"
    for body, code, words in (({"text_input": "Hi", "max_tokens": 2**32 + 5}, "invalid_request", "INT32"),
                              ({"text_input": "Hi", "max_tokens": 10**9}, None, "over the maximum"),
                              ({"text_input": "Hi", "max_tokens": 4, "stop_words": [f"w{i}" for i in range(100_000)]},
                               None, "over the limit of 32")):
        status, answer, took = post(base, json.dumps(body).encode(), {"Content-Type": "application/json"})
        assert status == 400 and words in json.loads(answer)["error"] and took < 5, (status, answer[:300], took)
        assert code is None or typed(answer) == code
    started = time.monotonic()  # gRPC passes no guard: the model refuses a huge prompt before tokenizing it
    outcome = stream_request(reliable_triton.endpoints.grpc_url, [
        infer_input("text_input", np.array([[b"x" * (8 << 20)]], dtype=object), "BYTES")], model="ensemble")
    # refused on its bytes, before it is even decoded (the character limit comes after)
    assert outcome.error and "bytes, over the limit" in outcome.error and time.monotonic() - started < 10
    generate_ok(f"http://127.0.0.1:{guard.port}")
