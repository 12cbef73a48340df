"""The front models' cancel watch (serving/triton/forward_model.CancelWatch) never asks Triton
about a request after ``remove`` returned: that is when the final response goes out and Triton
may free the request's response factory (asking then crashed Triton 2.51's server in
``TRITONBACKEND_ResponseFactoryIsCancelled``). The real path: tests/test_abuse.py's crowds on
the front models of a real server."""

from __future__ import annotations

import random
import sys
import threading
import time
import types

import pytest


@pytest.fixture
def forward_model(monkeypatch: pytest.MonkeyPatch):
    """The module, with a stand-in for ``triton_python_backend_utils`` (only importable inside Triton)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils",
                        types.SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=1))
    monkeypatch.delitem(sys.modules, "triton_backend.serving.triton.forward_model", raising=False)
    import triton_backend.serving.triton.forward_model as module

    monkeypatch.setattr(module, "CANCEL_POLL_S", 0.0005)
    return module


class Request:
    """Stands in for a Triton request: asking it after its final response is the fault."""

    def __init__(self, cancelled: bool = False) -> None:
        self.finished = False
        self.asked_after_finish = 0
        self.asked = 0
        self._cancelled = cancelled

    def parameters(self) -> str:
        return "{}"  # no id from the HTTP guard

    def is_cancelled(self) -> bool:
        if self.finished:
            self.asked_after_finish += 1
        self.asked += 1
        time.sleep(0.0003)  # a round trip to the server
        if self.finished:
            self.asked_after_finish += 1
        return self._cancelled


def test_no_request_is_asked_about_after_it_was_removed(forward_model):
    watch = forward_model.CancelWatch("specdec")
    rng = random.Random(0)
    requests = []
    try:
        def serve(count: int) -> None:
            for _ in range(count):
                request = Request()
                forward_id = watch.add(request)
                time.sleep(rng.random() * 0.003)
                assert watch.remove(forward_id) is False
                request.finished = True  # the final response went out
                requests.append(request)

        threads = [threading.Thread(target=serve, args=(60,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        watch.close()
    assert len(requests) == 240 and sum(r.asked for r in requests) > 0  # the watch did ask while they ran
    assert sum(r.asked_after_finish for r in requests) == 0


def test_a_cancelled_request_is_reported_once(forward_model, monkeypatch):
    watch = forward_model.CancelWatch("specdec")
    sent: list[str] = []
    monkeypatch.setattr(watch, "_cancel_child", sent.append)
    try:
        forward_id = watch.add(Request(cancelled=True))
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.02)  # more polls: still reported once
        assert sent == [forward_id] and watch.remove(forward_id) is True
    finally:
        watch.close()
