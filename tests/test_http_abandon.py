"""HTTP clients that give up stop costing work (issue 44), against a REAL Triton server behind
the HTTP guard: Triton 2.51's HTTP frontend does not tell a model that its client left, so the
guard names each generate request and cancels it through the models' cancellation channel
(triton_backend/serving/front/http_guard.py). Without that, the 16 abandoned 2048-token requests below ran to
their ends and a fresh request waited behind them (16.8 s in issue 44's probe)."""

from __future__ import annotations

import json
import threading

import pytest
from reliability_fixtures import MODEL, delta, post, reliable_triton, wait_idle  # noqa: F401 (fixtures)

from triton_backend.serving.front.http_guard import GuardConfig, HttpGuard

pytestmark = pytest.mark.slow

CANCELLED = f'specdec_requests_total{{model="{MODEL}",outcome="cancelled"}}'
LONG = {"text_input": "Tell me a long story.", "max_tokens": 2048, "ignore_eos": True}


def test_abandoned_http_generate_requests_are_cancelled_and_a_fresh_one_is_served(reliable_triton) -> None:  # noqa: F811
    before = wait_idle(reliable_triton)
    answers: list[tuple[int, bytes, float]] = []
    with HttpGuard(GuardConfig(), reliable_triton.endpoints.http_url,
                   server_pid=lambda: reliable_triton.server.pid) as guard:
        base = f"http://127.0.0.1:{guard.port}"

        def abandon(model: str) -> None:  # the client closes its connection after 3 s
            answers.append(post(f"{base}/v2/models/{model}/generate", json.dumps(LONG).encode(),
                                {"Content-Type": "application/json"}, timeout_s=3.0))

        threads = [threading.Thread(target=abandon, args=(model,)) for model in ["ensemble", MODEL] * 8]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        gave_up = [a for a in answers if a[0] == 0]  # timed out: nothing answered
        assert len(answers) == 16 and len(gave_up) >= 8, answers
        assert all(a in gave_up or a[0] == 503 for a in answers), answers  # the rest refused as overloaded
        after = wait_idle(reliable_triton, timeout_s=30)  # nothing runs on for the clients that left
        assert guard.cancelled == len(gave_up)
        assert delta(after, before, CANCELLED) == len(gave_up)
        status, body, took = post(f"{base}/v2/models/ensemble/generate",
                                  json.dumps({"text_input": "Hi", "max_tokens": 4}).encode(),
                                  {"Content-Type": "application/json"}, timeout_s=60)
    assert status == 200 and json.loads(body)["text_output"] and took < 30, (status, body, took)
