"""One request's response pattern (triton_backend.response_fence), in plain Python: responses
one at a time, the final flag exactly once and nothing after it, nothing but the final flag
after a cancellation. The real-server side is tests/test_abrupt_clients.py."""

from __future__ import annotations

import threading
import time

import pytest

from triton_backend.response_fence import FencedSender


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
