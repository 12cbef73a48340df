"""What one unauthenticated client can do (issue 26), against a REAL Triton server behind the
HTTP guard (:mod:`builder.ops.http_guard`): the short CI form. The long form with figures:
``python scripts/reliability.py`` (benchmarks/results/reliability.md).

- a large form-encoded generate body (Triton 2.51 segfaults on >= ~4.5 MB) is refused with a
  typed 413 before Triton sees it; with a bound above it, the guard's content-type rewrite
  still keeps it off Triton's crashing path (typed 400); the server keeps serving;
- a chunked body with no length, a compressed body, the restricted admin APIs: typed 4xx;
- ``generate_stream`` (server-sent events) streams through the guard.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from reliability_fixtures import reliable_triton  # noqa: F401 (fixture)

from builder.ops.http_guard import GuardConfig, HttpGuard, api_group
from builder.ops.triton_server import RestrictedApi

pytestmark = pytest.mark.slow

KEY = RestrictedApi("k" * 24)
BIG = json.dumps({"text_input": "x" * 6_000_000, "max_tokens": 4}).encode()


def post(url: str, body: bytes | None, headers: dict[str, str] | None = None,
         timeout_s: float = 120) -> tuple[int, bytes, float]:
    """(status, body, seconds); a form-encoded POST unless headers say otherwise (urllib's default)."""
    request = urllib.request.Request(url, data=body, headers=headers or {})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, reply.read(), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.monotonic() - started


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
    request = urllib.request.Request(f"http://127.0.0.1:{guard.port}/v2/models/ensemble/generate_stream",
                                     data=json.dumps({"text_input": "What is ML?", "max_tokens": 6,
                                                      "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers.get("Content-Type", "").startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in reply if line.startswith(b"data: ")]
    assert len(events) >= 2 and events[-1].get("finish_reason") == "length"
    assert sum(1 for e in events if "text_output" in e) >= 2
