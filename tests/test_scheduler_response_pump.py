"""The response pump: clients' calls leave the scheduler thread in order, partial chunks
merge while the pump is behind (same tokens and text), cancellation is read from a polled
flag, a failing client becomes a cancelled request, round metrics are published by flush
(before a request's last response). And through the real scheduler (tiny random Llama):
outputs through the pump equal each request alone."""

from __future__ import annotations

import threading
from collections import deque
import time

import pytest

from test_scheduler import Collector, _alone, _requests, tiny_decoder_with_every_drafter
from triton_backend.speculation.commit import GenerationChunk
from triton_backend.serving.response_pump import ResponsePump, merge_chunks
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.serving.triton.metrics import RoundTally


class SlowClient(Collector):
    """A client whose calls block until released (a busy server process)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.threads: set[str] = set()
        self.cancel_flag = False
        self.polls = 0

    def on_chunk(self, chunk) -> None:
        self.threads.add(threading.current_thread().name)
        self.gate.wait(10)
        super().on_chunk(chunk)

    def cancelled(self) -> bool:
        self.polls += 1
        return self.cancel_flag


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_merge_chunks_keeps_tokens_text_and_log_probs() -> None:
    merged = merge_chunks(GenerationChunk([1, 2], "ab", log_probs=[-0.1, -0.2]), GenerationChunk([3], "c", log_probs=[-0.3]))
    assert merged == GenerationChunk([1, 2, 3], "abc", log_probs=[-0.1, -0.2, -0.3])
    assert merge_chunks(GenerationChunk([1], "a"), GenerationChunk([], "")).log_probs is None
    with pytest.raises(ValueError):
        merge_chunks(GenerationChunk([1], "a"), GenerationChunk([2], "b", finished=True))


def test_calls_run_on_the_pump_in_order_and_partial_chunks_merge_while_it_is_behind() -> None:
    pump = ResponsePump(poll_interval_s=10)
    client = SlowClient()
    handle = pump.wrap(client)
    try:
        handle.on_chunk(GenerationChunk([1], "a"))  # taken at once; blocks the pump on the gate
        _wait(lambda: client.threads)
        for i in range(2, 6):  # queued behind it: merged into one
            handle.on_chunk(GenerationChunk([i], chr(ord("a") + i - 1)))
        handle.on_chunk(GenerationChunk([6], "f", finished=True))
        assert not client.chunks  # nothing delivered on the caller's thread
        client.gate.set()
        assert client.tokens() == [1, 2, 3, 4, 5, 6]
        assert "".join(c.text for c in client.chunks) == "abcdef"
        assert len(client.chunks) == 3 and client.chunks[-1].finished and pump.merged == 3
        assert client.threads == {"specdec-responses"}
    finally:
        pump.close()


def test_cancellation_is_a_polled_flag_and_a_failing_client_counts_as_cancelled() -> None:
    pump = ResponsePump(poll_interval_s=0.01)
    client = SlowClient()
    client.gate.set()
    handle = pump.wrap(client)
    try:
        polls = client.polls
        assert handle.cancelled() is False and client.polls == polls  # the caller never asks the client
        client.cancel_flag = True
        _wait(handle.cancelled)

        class Gone(Collector):
            def on_chunk(self, chunk) -> None:
                raise ConnectionError("client went away")

        broken = pump.wrap(Gone())
        broken.on_chunk(GenerationChunk([1], "a"))
        _wait(broken.cancelled)
    finally:
        pump.close()


class CountingRounds:
    def __init__(self) -> None:
        self.tally = RoundTally()
        self.published = RoundTally()
        self.flushes = 0

    def round_done(self, batch_size: int, speculating_rows: int, draft_tokens: int, queued: int) -> None:
        self.tally.add(batch_size, speculating_rows, draft_tokens, queued)

    def flush(self) -> None:
        self.flushes += 1
        self.published = RoundTally(**vars(self.tally))


def test_round_metrics_are_flushed_before_a_last_response() -> None:
    rounds = CountingRounds()
    pump = ResponsePump(poll_interval_s=10, flush=rounds.flush, flush_interval_s=60)
    seen: list[int] = []

    class Client(Collector):
        def on_chunk(self, chunk) -> None:
            seen.append(rounds.published.rounds)
            super().on_chunk(chunk)

    client = Client()
    handle = pump.wrap(client)
    try:
        for _ in range(3):
            rounds.round_done(4, 1, 2, 0)
        handle.on_chunk(GenerationChunk([7], "x", finished=True))
        client.tokens()
        assert seen == [3] and rounds.published.rows == 12
    finally:
        pump.close()


@pytest.mark.parametrize("policy", ["per_request", "load_aware"])
def test_scheduler_through_the_pump_equals_each_request_alone(policy) -> None:
    decoder = tiny_decoder_with_every_drafter()
    requests = _requests(8)
    expected = _alone(decoder, requests)
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4, policy=policy))
    pump = ResponsePump(poll_interval_s=0.01)
    try:
        clients = [Collector() for _ in requests]
        for (prompt, params, spec), client in zip(requests, clients):
            scheduler.submit(prompt, params, spec, pump.wrap(client))
        assert [c.tokens() for c in clients] == expected
    finally:
        scheduler.shutdown()
        pump.close()


def test_nothing_reaches_a_cancelled_client_and_its_last_chunk_ends_it_as_cancelled() -> None:
    pump = ResponsePump(poll_interval_s=10)
    client = Collector(cancel_after=2)
    handle = pump.wrap(client)
    try:
        for i in range(4):
            handle.on_chunk(GenerationChunk([i], str(i)))
            _wait(lambda: pump._queue == deque())  # one at a time: no merging
        handle.on_chunk(GenerationChunk([9], "9", finished=True))
        assert client.done.wait(10)
        assert [c.token_ids for c in client.chunks] == [[0], [1]] and client.was_cancelled
        assert handle.cancelled()
    finally:
        pump.close()
