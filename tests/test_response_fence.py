"""One request's response pattern (triton_backend.serving.triton.response_fence), in plain Python: responses
one at a time, the final flag exactly once and nothing after it, nothing but the final flag
after a cancellation. The real-server side is tests/test_abrupt_clients.py."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from triton_backend.serving.triton.response_fence import FencedSender


class Wire:
    """What a response sender saw, in order: (payload or 'FINAL-FLAG', final)."""

    def __init__(self, fail_send: bool = False) -> None:
        self.sent: list[tuple[object, bool]] = []
        self.cancelled = threading.Event()
        self.fail_send = fail_send
        self.in_send = 0
        self.overlaps = 0

    def send(self, response: object, final: bool) -> None:
        self.in_send += 1
        self.overlaps += self.in_send > 1
        time.sleep(0.0005)
        self.in_send -= 1
        if self.fail_send:
            raise ConnectionError("client gone")
        self.sent.append((response, final))

    def send_final(self) -> None:
        self.sent.append(("FINAL-FLAG", True))

    def sender(self) -> FencedSender:
        return FencedSender(self.send, self.send_final, self.cancelled.is_set)


def test_the_final_response_goes_out_exactly_once_and_nothing_follows_it() -> None:
    wire = Wire()
    s = wire.sender()
    s.respond("a", final=False)
    s.respond("last", final=True)
    s.respond("late", final=False)
    s.respond("late-final", final=True)
    s.fail("late-error")
    s.close()
    assert wire.sent == [("a", False), ("last", True)] and s.done


def test_an_error_response_is_final_and_ends_the_request() -> None:
    wire = Wire()
    s = wire.sender()
    s.fail("error")
    s.respond("late", final=True)
    assert wire.sent == [("error", True)]


def test_after_a_cancellation_only_the_final_flag_is_sent() -> None:
    wire = Wire()
    s = wire.sender()
    s.respond("before", final=False)
    wire.cancelled.set()
    s.respond("after", final=False)
    s.respond("after-final", final=True)
    s.close()
    assert wire.sent == [("before", False), ("FINAL-FLAG", True)]
    other = wire.sender()
    other.fail("error-after-cancel")
    assert wire.sent[-1] == ("FINAL-FLAG", True)


def test_close_sends_the_final_flag_once() -> None:
    wire = Wire()
    s = wire.sender()
    s.close()
    s.close()
    s.respond("late", final=True)
    assert wire.sent == [("FINAL-FLAG", True)]


def test_a_failing_send_or_probe_still_ends_the_request_once() -> None:
    wire = Wire(fail_send=True)
    s = wire.sender()
    with pytest.raises(ConnectionError):
        s.respond("last", final=True)
    assert s.done
    s.fail("late")  # dropped, does not raise again

    def broken_probe() -> bool:
        raise RuntimeError("stub gone")

    ok = Wire()
    t = FencedSender(ok.send, ok.send_final, broken_probe)
    t.respond("x", final=True)
    assert ok.sent == [("x", True)]


def test_threads_sending_for_one_request_never_overlap_and_one_final_wins() -> None:
    wire = Wire()
    s = wire.sender()

    def run(i: int) -> None:
        for k in range(20):
            s.respond(f"{i}-{k}", final=False)
        s.respond(f"{i}-last", final=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert wire.overlaps == 0
    assert [final for _, final in wire.sent].count(True) == 1 and wire.sent[-1][1]


# -- the Triton sink: one cancellation query per response ---------------------------------------
class FakeTritonRequest:
    """Triton's side of one decoupled request: what its response sender saw, and how often
    the model asked whether it is cancelled (each ask is a round trip to the server)."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.sent: list[tuple[object, int]] = []
        self.asked = 0
        self.cancel_after = cancel_after

    def get_response_sender(self) -> "FakeTritonRequest":
        return self

    def send(self, response: object = "FINAL-FLAG", flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after


@pytest.fixture
def pb_utils(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A stand-in for Triton's ``triton_python_backend_utils`` (only importable inside Triton)."""

    class TritonError:
        INTERNAL, INVALID_ARG, UNAVAILABLE = 13, 3, 14

        def __init__(self, message: str, code: int = 13) -> None:
            self.message = message

    module = types.SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, TritonError=TritonError,
        Tensor=lambda name, array: (name, array),
        InferenceResponse=lambda output_tensors=(), error=None: error.message if error else dict(output_tensors))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module


def _stream_through_pump(request: FakeTritonRequest, partials: int) -> None:
    """``partials`` partial chunks and a final one, through the service's response pump."""
    from builder.ops.triton_client import GenerateRequest
    from triton_backend.core.config import SpeculationConfig
    from triton_backend.speculation.commit import GenerationChunk
    from triton_backend.serving.response_pump import ResponsePump
    from triton_backend.serving.service import NullObserver, _Responder, parse_request
    from triton_backend.serving.triton.io import TritonResponseSink

    parsed = parse_request(GenerateRequest(prompt="p", stream=True).arrays(), SpeculationConfig(), 8)
    pump = ResponsePump(poll_interval_s=60)
    try:
        handle = pump.wrap(_Responder(parsed, TritonResponseSink(request), NullObserver(), time.perf_counter()))
        for i in range(partials):
            handle.on_chunk(GenerationChunk([i], f"t{i}"))
            deadline = time.monotonic() + 10
            while pump._queue and time.monotonic() < deadline:  # one at a time: no merging
                time.sleep(0.001)
        handle.on_chunk(GenerationChunk([99], "end", finished=True))
    finally:
        pump.close()


def test_each_streamed_response_asks_triton_once_whether_the_request_is_cancelled(pb_utils) -> None:
    request = FakeTritonRequest()
    _stream_through_pump(request, partials=4)
    assert [flags for _, flags in request.sent] == [0, 0, 0, 0, 1]
    assert request.asked == 5


def test_a_cancelled_stream_gets_nothing_more_and_ends_with_the_final_flag_alone(pb_utils) -> None:
    request = FakeTritonRequest(cancel_after=2)
    _stream_through_pump(request, partials=4)
    assert [flags for _, flags in request.sent] == [0, 0, 1] and request.sent[-1][0] == "FINAL-FLAG"
    assert request.asked == 3  # once per response until the cancellation was seen


def test_an_error_after_a_cancellation_sends_only_the_final_flag(pb_utils) -> None:
    from triton_backend.serving.triton.io import TritonResponseSink

    request = FakeTritonRequest(cancel_after=0)
    TritonResponseSink(request).fail(RuntimeError("late"))
    assert request.sent == [("FINAL-FLAG", 1)]
