"""The batch scheduler on tiny random Llamas (HF-wrapped engine): every request's output
identical to the same request alone through ``SpeculativeDecoder.stream`` (greedy and seeded
sampling; n-gram, draft model, Medusa, EAGLE, plain; per-request and load-aware draft lengths),
join/leave mid-batch, chunked prefill, cancellation freeing the slot, a full queue refused
at once."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import tiny_engine
from test_eagle import _random_drafter as _random_eagle
from test_medusa_tree import random_heads
from triton_backend.core.config import DraftLengthConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.drafters.medusa import MedusaDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.drafters.medusa_model import MedusaCheckpoint
from triton_backend.batching.admission import QueueFullError
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig


class Collector:
    """A client: collects chunks; can cancel itself after some chunks."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.chunks: list = []
        self.error: BaseException | None = None
        self.was_cancelled = False
        self.cancel_after = cancel_after
        self.done = threading.Event()

    def on_chunk(self, chunk) -> None:
        self.chunks.append(chunk)
        if chunk.finished:
            self.done.set()

    def on_error(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()

    def cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.chunks) >= self.cancel_after

    def on_cancelled(self) -> None:
        self.was_cancelled = True
        self.done.set()

    def tokens(self) -> list[int]:
        assert self.done.wait(120), "request never finished"
        assert self.error is None, self.error
        assert self.chunks and self.chunks[-1].finished
        return [t for c in self.chunks for t in c.token_ids]


def tiny_decoder_with_every_drafter() -> SpeculativeDecoder:
    """A tiny random target with n-gram, draft-model, Medusa and EAGLE drafters (also used by
    test_penalties)."""
    target = tiny_engine(0, vocab=32)
    drafters = {
        SpeculationMode.NGRAM: NgramDrafter(1, 3),
        SpeculationMode.DRAFT: DraftModelDrafter(tiny_engine(1, vocab=32), target=target),
        SpeculationMode.MEDUSA: MedusaDrafter(MedusaCheckpoint(random_heads(32, 32)), target),
        SpeculationMode.EAGLE: _random_eagle(target),
    }
    return SpeculativeDecoder(target, None, drafters=drafters,
                              speculation=SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=3)))


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    return tiny_decoder_with_every_drafter()


PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9, 9, 8, 9, 9, 8], [2, 4, 6, 8, 10, 12, 2, 4], [3], [7, 1, 7, 1, 7]]
MODES = ["ngram", "draft", "medusa", "off", "auto", "eagle", "draft"]


def _requests(n: int) -> list[tuple[list[int], SamplingParams, SpeculationConfig]]:
    out = []
    for i in range(n):
        sampling = i % 3 == 2
        params = SamplingParams(max_tokens=12 + i, temperature=0.9 if sampling else 0.0, top_k=8 if sampling else 0,
                                seed=100 + i if sampling else None, ignore_eos=True)
        out.append((PROMPTS[i % len(PROMPTS)], params, SpeculationConfig(method=MODES[i % len(MODES)],
                                                                         draft_length=DraftLengthConfig(num_draft_tokens=3))))
    return out


def _alone(decoder, requests) -> list[list[int]]:
    return [decoder.generate(p, params, spec).token_ids for p, params, spec in requests]


def submit_all(scheduler: BatchScheduler, requests) -> list[Collector]:
    """Submit every ``(prompt, params, spec)`` at once; one collector per request, in order."""
    clients = [Collector() for _ in requests]
    for (prompt, params, spec), client in zip(requests, clients):
        scheduler.submit(prompt, params, spec, client)
    return clients


def assert_mixed_batch_matches_alone(decoder, prompts, spec: SpeculationConfig, policy: str, *, base_tokens: int,
                                     base_seed: int) -> None:
    """Each prompt twice, greedy and seeded sampling alternating, lengths growing from
    ``base_tokens``: the scheduler's outputs (4 rows a pass) equal each request decoded alone."""
    requests = []
    for i, prompt in enumerate(list(prompts) * 2):
        sampling = i % 2 == 1
        params = SamplingParams(max_tokens=base_tokens + i, temperature=0.9 if sampling else 0.0,
                                seed=base_seed + i if sampling else None, ignore_eos=True)
        requests.append((prompt, params, spec))
    expected = [decoder.generate(p, params, s).token_ids for p, params, s in requests]
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4, policy=policy))
    try:
        assert [c.tokens() for c in submit_all(scheduler, requests)] == expected
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("policy", ["per_request", "load_aware"])
def test_batched_outputs_identical_to_each_request_alone(decoder, policy) -> None:
    requests = _requests(12)
    expected = _alone(decoder, requests)
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=5, policy=policy))
    try:
        clients = [Collector() for _ in requests]
        for (prompt, params, spec), client in zip(requests[:6], clients[:6]):
            scheduler.submit(prompt, params, spec, client)
        clients[0].tokens()  # later requests join a batch already running
        for (prompt, params, spec), client in zip(requests[6:], clients[6:]):
            scheduler.submit(prompt, params, spec, client)
        assert [c.tokens() for c in clients] == expected
        assert scheduler.rounds < sum(len(e) for e in expected)  # rows really shared passes
        assert scheduler.load() == (0, 0)
    finally:
        scheduler.shutdown()


def test_hf_wrapped_target_batches_exactly() -> None:
    """A target the slot engine does not run (the HF-wrapped engine): same outputs batched."""
    from test_hf_batched import hf_engine

    target = hf_engine(0)
    drafters = {SpeculationMode.NGRAM: NgramDrafter(1, 3),
                SpeculationMode.MEDUSA: MedusaDrafter(MedusaCheckpoint(random_heads(32, 32)), target)}
    hf = SpeculativeDecoder(target, None, drafters=drafters,
                            speculation=SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=3)))
    requests = [r for r in _requests(8) if r[2].method.value in ("ngram", "medusa", "off")]
    expected = _alone(hf, requests)
    scheduler = BatchScheduler(hf, SchedulerConfig(max_batch_size=4))
    try:
        assert type(scheduler.target).__name__ == "HFBatchedEngine"
        assert [c.tokens() for c in submit_all(scheduler, requests)] == expected
    finally:
        scheduler.shutdown()


def test_chunked_prefill_matches_alone(decoder) -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    spec = SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=3))
    expected = decoder.generate(prompt, params, spec).token_ids
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=2, prefill_chunk_tokens=5))
    try:
        long, short = Collector(), Collector()
        scheduler.submit(prompt, params, spec, long)
        scheduler.submit([5, 6, 7], params, spec, short)
        assert long.tokens() == expected
        assert short.tokens() == decoder.generate([5, 6, 7], params, spec).token_ids
    finally:
        scheduler.shutdown()


def test_cancellation_frees_the_slot_and_a_full_queue_is_refused_at_once(decoder) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = SpeculationConfig(method="off")
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=1, max_queue_size=1))
    try:
        first, second = Collector(cancel_after=2), Collector()
        scheduler.submit([1, 2, 3], params, spec, first)
        deadline = time.monotonic() + 30
        while scheduler.load() != (1, 0) and time.monotonic() < deadline:  # the first one took the slot
            time.sleep(0.001)
        scheduler.submit([4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True), spec, second)
        started = time.perf_counter()
        with pytest.raises(QueueFullError, match="overloaded"):  # one slot busy, one request queued
            scheduler.submit([7], params, spec, Collector())
        assert time.perf_counter() - started < 1.0
        assert first.done.wait(60) and first.was_cancelled and len(first.chunks) == 2
        assert len(second.tokens()) == 5  # it got the freed slot
        assert scheduler.load() == (0, 0)
    finally:
        scheduler.shutdown()


def test_unknown_mode_is_refused_at_submit(decoder) -> None:
    bare = SpeculativeDecoder(decoder.target, None)
    scheduler = BatchScheduler(bare, SchedulerConfig(max_batch_size=1))
    try:
        with pytest.raises(Exception, match="not available"):
            scheduler.submit([1], SamplingParams(max_tokens=2), SpeculationConfig(method="ngram"), Collector())
    finally:
        scheduler.shutdown()


def test_a_prompt_prefix_another_sequence_holds_is_shared_not_prefilled_and_outputs_stay_exact() -> None:
    """Requests whose prompts start like an active one's (a chat template's system prompt) copy
    that sequence's keys and values: outputs equal each request alone, in every mode (EAGLE
    prefills its own: its drafter needs the prompt's features)."""
    decoder = tiny_decoder_with_every_drafter()
    system = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    first = (system + [3, 2], SamplingParams(max_tokens=60, ignore_eos=True), SpeculationConfig(method="off"))
    later = [(system + tail, params, SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=3)))
             for tail, mode, params in [([1, 1], "off", SamplingParams(max_tokens=14, ignore_eos=True)),
                                        ([2], "ngram", SamplingParams(max_tokens=12, ignore_eos=True)),
                                        ([4, 4, 4], "medusa", SamplingParams(max_tokens=13, ignore_eos=True)),
                                        ([6], "draft", SamplingParams(max_tokens=12, temperature=0.9, top_k=8, seed=7,
                                                                      ignore_eos=True)),
                                        ([8, 8], "eagle", SamplingParams(max_tokens=12, ignore_eos=True))]]
    expected = _alone(decoder, [first, *later])
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=6))
    try:
        leader = submit_all(scheduler, [first])[0]
        deadline = time.monotonic() + 60
        while not leader.chunks and time.monotonic() < deadline:  # prefilled and decoding
            time.sleep(0.001)
        clients = submit_all(scheduler, later)
        assert [c.tokens() for c in [leader, *clients]] == expected
    finally:
        scheduler.shutdown()
    assert scheduler.shared_prefix_tokens == 4 * len(system)  # all but EAGLE
