"""The stop's drain (triton_backend/serving/launch/triton_drain.py) reading a Prometheus endpoint, and the HTTP
guard's cancellation id (triton_backend/serving/front/http_guard.with_cancel_id). Against a real Triton:
tests/test_triton_server.py (an idle stop), tests/test_faults.py (a stop past its deadline),
tests/test_http_abandon.py (abandoned HTTP clients)."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from triton_backend.serving.front.http_guard import with_cancel_id
from triton_backend.serving.launch.triton_drain import IDLE_POLLS, Drain, Verdict, in_flight
from triton_backend.serving.triton.io import CANCEL_ID_PARAM

METRICS = """# HELP specdec_requests_in_flight Requests being generated now
# TYPE specdec_requests_in_flight gauge
specdec_requests_in_flight{{model="specdec"}} {busy}
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{{model="ensemble",version="1"}} {pending}
nv_inference_pending_request_count{{model="specdec",version="1"}} 0
nv_inference_count{{model="specdec",version="1"}} 17
"""


def test_in_flight_sums_the_serving_gauges_and_tritons_pending_requests() -> None:
    assert in_flight(METRICS.format(busy=0, pending=0)) == 0
    assert in_flight(METRICS.format(busy=3, pending=2)) == 5
    assert in_flight(METRICS.format(busy="2.000000", pending=0)) == 2
    # no in-flight gauge (another runtime): nothing to judge by, even with Triton's own series
    assert in_flight('nv_inference_pending_request_count{model="x",version="1"} 0\n') is None
    assert in_flight("") is None


@pytest.fixture
def metrics_server():
    """A Prometheus endpoint whose text the test changes."""
    state = {"text": METRICS.format(busy=1, pending=0)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = state["text"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", state
    server.shutdown()
    server.server_close()


def test_the_drain_waits_for_in_flight_requests_then_says_drained(metrics_server) -> None:
    url, state = metrics_server
    guard_busy = {"n": 0}
    drain = Drain(url, deadline_s=60, busy=lambda: guard_busy["n"])
    assert drain.poll() is Verdict.WAIT and drain.last_in_flight == 1
    state["text"] = METRICS.format(busy=0, pending=0)
    guard_busy["n"] = 1  # the guard still writes an answer
    assert drain.poll() is Verdict.WAIT
    guard_busy["n"] = 0
    verdicts = [drain.poll() for _ in range(IDLE_POLLS)]  # idle in IDLE_POLLS polls in a row
    assert verdicts[-1] is Verdict.DRAINED and all(v is Verdict.WAIT for v in verdicts[:-1])


def test_the_drain_is_overdue_past_its_deadline_and_unknown_without_metrics(metrics_server) -> None:
    url, _ = metrics_server
    drain = Drain(url, deadline_s=0.05)
    time.sleep(0.1)
    assert drain.poll() is Verdict.OVERDUE
    nobody = Drain("http://127.0.0.1:9/metrics", deadline_s=60)  # nothing listens: left to exit on its own
    assert nobody.poll() is Verdict.UNKNOWN
    nobody.started -= 61
    assert nobody.poll() is Verdict.OVERDUE


def test_generate_bodies_get_a_fresh_cancellation_id_and_keep_their_bytes() -> None:
    body = b'{"text_input": "Hi \\u00e9", "max_tokens": 4, "temperature": 1e-45}'
    tagged, cancel_id = with_cancel_id("/v2/models/ensemble/generate", body)
    assert cancel_id is not None and len(cancel_id) == 32
    assert json.loads(tagged) == {CANCEL_ID_PARAM: cancel_id, **json.loads(body)}
    assert tagged.endswith(body[1:])  # the client's own bytes, as they came
    again = with_cancel_id("/v2/models/specdec/generate_stream", b"  {}")
    assert json.loads(again[0]) == {CANCEL_ID_PARAM: again[1]} and again[1] != cancel_id
    for path, raw in (("/v2/models/ensemble/infer", body), ("/v2/models/ensemble/generate", b"[1, 2]"),
                      ("/v2/models/ensemble/generate", b"{not json"),
                      ("/v2/models/ensemble/generate", json.dumps({CANCEL_ID_PARAM: "x"}).encode())):
        assert with_cancel_id(path, raw) == (raw, None)
