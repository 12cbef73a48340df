"""The response pattern the Triton sink keeps (triton_backend.response_fence), in plain Python:
error responses never overlap another request's answer, each request's final flag goes out
exactly once, nothing but the final flag after a cancellation, new requests wait while an
error is held. The real-server side is tests/test_abrupt_clients.py."""

from __future__ import annotations

import threading
import time

import pytest

from triton_backend.response_fence import FencedSender, ResponseFence


class Wire:
    """What a response sender saw, in order: (request, payload or 'FINAL-FLAG', final)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object, bool]] = []
        self.lock = threading.Lock()

    def sender(self, fence: ResponseFence, name: str, cancelled: threading.Event | None = None,
               fail_send: bool = False) -> FencedSender:
        def send(response: object, final: bool) -> None:
            if fail_send:
                raise ConnectionError("client gone")
            with self.lock:
                self.sent.append((name, response, final))

        def send_final() -> None:
            with self.lock:
                self.sent.append((name, "FINAL-FLAG", True))

        flag = cancelled or threading.Event()
        return FencedSender(fence, send, send_final, flag.is_set)


def test_an_error_waits_until_the_other_requests_have_sent_their_final_response() -> None:
    fence, wire = ResponseFence(), Wire()
    a, b = wire.sender(fence, "a"), wire.sender(fence, "b")
    a.respond("a1", final=False)
    b.fail("b-error")
    assert wire.sent == [("a", "a1", False)]  # held: a is still answering
    a.respond("a2", final=False)
    a.respond("a-last", final=True)
    assert wire.sent == [("a", "a1", False), ("a", "a2", False), ("a", "a-last", True), ("b", "b-error", True)]
    assert fence.active == 0 and fence.errors_held == 1


def test_an_error_alone_goes_out_at_once_and_two_errors_do_not_wait_for_each_other() -> None:
    fence, wire = ResponseFence(), Wire()
    wire.sender(fence, "a").fail("a-error")
    assert wire.sent == [("a", "a-error", True)]
    b, c, d = wire.sender(fence, "b"), wire.sender(fence, "c"), wire.sender(fence, "d")
    b.fail("b-error")
    c.fail("c-error")
    assert [s[0] for s in wire.sent] == ["a"]  # d is still running
    d.close()  # d cancelled: its final flag, then both held errors
    assert wire.sent[1:] == [("d", "FINAL-FLAG", True), ("b", "b-error", True), ("c", "c-error", True)]
    assert fence.active == 0


def test_the_final_flag_goes_out_exactly_once_and_nothing_follows_it() -> None:
    fence, wire = ResponseFence(), Wire()
    a = wire.sender(fence, "a")
    a.respond("last", final=True)
    a.respond("late", final=False)
    a.respond("late-final", final=True)
    a.fail("late-error")
    a.close()
    assert wire.sent == [("a", "last", True)]
    assert a.done and fence.active == 0


def test_after_a_cancellation_only_the_final_flag_is_sent() -> None:
    fence, wire, cancelled = ResponseFence(), Wire(), threading.Event()
    a = wire.sender(fence, "a", cancelled)
    a.respond("before", final=False)
    cancelled.set()
    a.respond("after", final=False)
    a.respond("after-final", final=True)
    assert wire.sent == [("a", "before", False), ("a", "FINAL-FLAG", True)]
    b = wire.sender(fence, "b", cancelled)
    b.fail("error-after-cancel")
    assert wire.sent[-1] == ("b", "FINAL-FLAG", True)


def test_a_new_request_waits_while_an_error_is_held_and_a_failing_send_still_releases_it() -> None:
    fence, wire = ResponseFence(), Wire()
    a = wire.sender(fence, "a", fail_send=True)  # its client is gone: sending raises
    wire.sender(fence, "b").fail("b-error")
    admitted = threading.Event()

    def newcomer() -> None:
        wire.sender(fence, "c")
        admitted.set()

    thread = threading.Thread(target=newcomer, daemon=True)
    thread.start()
    assert not admitted.wait(0.3), "a new request must wait while an error is held back"
    with pytest.raises(ConnectionError):
        a.respond("a-last", final=True)
    assert admitted.wait(5)
    assert ("b", "b-error", True) in wire.sent and fence.active == 1  # c


def test_many_threads_many_requests_every_request_ends_once_and_errors_never_overlap() -> None:
    fence, wire = ResponseFence(), Wire()
    errors_sent_while_busy = []

    def run(i: int) -> None:
        s = wire.sender(fence, f"r{i}")
        if i % 3 == 0:
            s.fail(f"e{i}")
            return
        for k in range(5):
            s.respond(f"r{i}-{k}", final=False)
            time.sleep(0.001)
        s.respond(f"r{i}-last", final=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    finals = [s[0] for s in wire.sent if s[2]]
    assert sorted(finals) == sorted(f"r{i}" for i in range(30))  # each exactly once
    open_requests: set[str] = set()
    for name, payload, final in wire.sent:  # an error only when no other request is mid-answer
        if isinstance(payload, str) and payload.startswith("e"):
            if open_requests - {name}:
                errors_sent_while_busy.append((payload, sorted(open_requests)))
        elif not final:
            open_requests.add(name)
        else:
            open_requests.discard(name)
    assert errors_sent_while_busy == []
    assert fence.active == 0


def test_held_errors_go_out_when_a_request_never_ends() -> None:
    fence, wire = ResponseFence(admit_wait_s=0.2), Wire()
    wire.sender(fence, "stuck")  # never answers
    wire.sender(fence, "b").fail("b-error")
    assert wire.sent == []
    wire.sender(fence, "c")  # waits 0.2 s, then the held error goes out
    assert wire.sent == [("b", "b-error", True)]
    assert fence.active == 2  # stuck and c
