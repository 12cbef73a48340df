"""The cross-request n-gram source: the suffix index (against brute force, its token budget,
one writer beside readers, its cost per lookup), the session's choice between its own text and
the index, the opt-in config, and exactness: greedy output token-identical to plain decoding,
alone and batched in the scheduler with every row sharing one index."""

from __future__ import annotations

import random
import statistics
import threading
import time

import pytest

from conftest import tiny_engine
from test_scheduler import Collector
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.core.config import (CrossRequestConfig, CrossRequestContinuation, DraftLengthConfig, NgramConfig,
                                        SamplingParams, SpeculationConfig, SpeculationMode)
from triton_backend.core.errors import ConfigError
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.drafters.suffix_index import (QUEUE_DEPTH, CrossRequestIndex, SuffixAutomaton,
                                                              cross_request_index)
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.match_policy import MatchLengthPolicy
from triton_backend.speculation.policy import GainSettings


def _occurrences(docs: list[list[int]], s: list[int]) -> int:
    return sum(1 for d in docs for j in range(len(d) - len(s) + 1) if d[j:j + len(s)] == s)


def test_automaton_matches_brute_force_longest_suffix_and_counts() -> None:
    rng = random.Random(0)
    for _ in range(300):
        docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 25))] for _ in range(rng.randrange(1, 5))]
        sam = SuffixAutomaton()
        for i, doc in enumerate(docs):
            sam.add(doc, -1 - i)
        query = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        state, matched = sam.match(query)
        best = max(n for n in range(len(query) + 1) if n == 0 or _occurrences(docs, query[len(query) - n:]))
        assert matched == best  # never across two documents: separators are unique
        if matched:
            assert sam.count[state] == _occurrences(docs, query[len(query) - matched:])


def test_continuation_frequent_or_recent_and_stops_at_a_document_end() -> None:
    frequent, recent = CrossRequestIndex(1000, frequent=True), CrossRequestIndex(1000, frequent=False)
    for index in (frequent, recent):
        for doc in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [7, 1, 2, 3, 9]):
            index.add(doc)
    hit = frequent.lookup([8, 1, 2, 3], 4)
    assert hit is not None and hit.length == 3 and hit.continuation == [4, 5] and hit.occurrences == 3
    hit = recent.lookup([8, 1, 2, 3], 4)
    assert hit is not None and hit.continuation == [9]  # the latest request's follower; its document ends there
    assert frequent.lookup([5], 3) is None  # below min_match (2)
    assert frequent.lookup([4, 5], 3) is None  # every occurrence ends its document: nothing to draft


def test_token_budget_drops_the_oldest_requests() -> None:
    index = CrossRequestIndex(max_tokens=200, generations=4)
    docs = [[1000 * i + j for j in range(30)] for i in range(20)]
    for doc in docs:
        index.add(doc)
        assert index.size <= 200
    assert index.lookup(docs[0][:5], 4) is None  # the oldest request is gone
    hit = index.lookup(docs[-1][:5], 4)
    assert hit is not None and hit.continuation == docs[-1][5:9]


def test_one_writer_beside_readers_never_breaks_a_lookup() -> None:
    index = CrossRequestIndex(max_tokens=4000, generations=4)
    rng = random.Random(1)
    docs = [[rng.randrange(50) for _ in range(80)] for _ in range(100)]
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                for doc in docs[:10]:
                    hit = index.lookup(doc[:40], 8)
                    assert hit is None or (hit.length >= 2 and 1 <= len(hit.continuation) <= 8)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for thread in readers:
        thread.start()
    for doc in docs:
        index.add(doc)
    done.set()
    for thread in readers:
        thread.join()
    assert not errors and index.size <= 4000


def test_a_writer_that_falls_behind_drops_requests_and_never_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    index = CrossRequestIndex(1000)
    gate, add = threading.Event(), index.add

    def slow_add(document: list[int]) -> None:
        gate.wait(10)
        add(document)

    monkeypatch.setattr(index, "add", slow_add)
    start = time.perf_counter()
    for i in range(QUEUE_DEPTH + 5):
        index.submit([i, i + 1, i + 2])
    assert time.perf_counter() - start < 1.0 and index.stats["dropped"] >= 4
    gate.set()
    index.flush()
    assert index.lookup([0, 1], 1) is not None and 0 < index.size <= 1000


def test_a_lookup_costs_well_under_a_millisecond() -> None:
    rng = random.Random(2)
    index = CrossRequestIndex(max_tokens=32768)
    docs = [[rng.randrange(3000) for _ in range(500)] for _ in range(64)]
    for doc in docs:
        index.add(doc)
    queries = [docs[-1][:200], [rng.randrange(3000) for _ in range(200)]]  # a long match, and none
    timings = []
    for _ in range(100):
        for query in queries:
            start = time.perf_counter()
            index.lookup(query, 8)
            timings.append(time.perf_counter() - start)
    assert statistics.median(timings) < 1e-3


def test_session_drafts_from_its_own_text_first_and_from_the_index_when_longer() -> None:
    index = CrossRequestIndex(1000)
    index.add([10, 11, 12, 13, 14, 15, 16])
    session = NgramDrafter(1, 3, index).new_session()
    own = session.peek([1, 2, 3, 1, 2], 4)  # its own text: (1, 2) -> 3
    assert own is not None and not own.cross and own.continuation[0] == 3
    cross = session.peek([1, 2, 3, 1, 2, 9, 11, 12, 13], 3)  # own match: (12, 13)? none; index: 11 12 13 -> 14 15 16
    assert cross is not None and cross.cross and cross.length == 3 and cross.continuation == [14, 15, 16]
    session.release()
    index.flush()
    assert index.lookup([2, 3, 1, 2, 9], 2) is not None  # released: the request's tokens are indexed
    private = NgramDrafter(1, 3, index).new_session()
    private.private()
    assert private.peek([0, 11, 12, 13], 3) is None  # a seeded sampling request drafts from its own text only


def test_the_policy_learns_each_source_apart() -> None:
    policy = MatchLengthPolicy(8, GainSettings())
    own, cross = policy.policy_for(4), policy.policy_for(4, cross=True)
    assert own is not cross and policy.key(4, cross=True) == (4, False, True)
    assert policy.draft_length(4, 8, cross=True) > 0
    policy.record(4, 3)
    assert policy.source_totals[True] == [4, 3, 1] and policy.source_totals[False] == [0, 0, 0]


def test_config_is_opt_in_typed_and_checked() -> None:
    assert not SpeculationConfig().ngram.cross_request.enabled
    assert cross_request_index(CrossRequestConfig()) is None
    spec = SpeculationConfig.from_dict({"ngram": {"cross_request": {"enabled": True, "max_tokens": 4096,
                                                                    "continuation": "recent"}}})
    cross = spec.ngram.cross_request
    assert cross.enabled and cross.max_tokens == 4096 and cross.continuation is CrossRequestContinuation.RECENT
    index = cross_request_index(cross)
    assert index is not None and index.max_tokens == 4096 and not index.frequent
    for bad in ({"enabled": "yes"}, {"max_tokens": 10}, {"min_match": 0}, {"continuation": "random"}, {"nonsense": 1}):
        with pytest.raises(ConfigError):
            SpeculationConfig.from_dict({"ngram": {"cross_request": bad}})
    with pytest.raises(ConfigError):
        NgramConfig(cross_request={"enabled": True})  # type: ignore[arg-type]


PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [1, 2, 3, 4, 5], [9, 9, 8], [6, 7, 8], [1, 2, 3, 4, 5]]


def _decoders() -> tuple[SpeculativeDecoder, CrossRequestIndex]:
    target = tiny_engine(0, vocab=32)
    index = CrossRequestIndex(2000)
    spec = SpeculationConfig(method=SpeculationMode.NGRAM, draft_length=DraftLengthConfig(num_draft_tokens=4))
    return SpeculativeDecoder(target, None, drafters={SpeculationMode.NGRAM: NgramDrafter(1, 3, index)},
                              speculation=spec), index


def _params(i: int) -> SamplingParams:
    sampling = i % 3 == 2
    return SamplingParams(max_tokens=24, temperature=0.8 if sampling else 0.0, seed=7 + i if sampling else None,
                          ignore_eos=True)


def test_outputs_equal_plain_decoding_alone_and_batched_sharing_one_index() -> None:
    """Greedy: token for token plain decoding. Seeded sampling: the same output whatever the
    index holds (it drafts from its own text only), alone or batched."""
    decoder, index = _decoders()
    off = SpeculationConfig(method=SpeculationMode.OFF)
    plain = [decoder.generate(p, _params(i), off).token_ids for i, p in enumerate(PROMPTS)]
    alone = []
    for i, prompt in enumerate(PROMPTS):  # the index fills as they run
        alone.append(decoder.generate(prompt, _params(i)).token_ids)
        index.flush()
    greedy = [i for i in range(len(PROMPTS)) if _params(i).temperature == 0]
    assert [alone[i] for i in greedy] == [plain[i] for i in greedy]
    assert index.stats["rounds"] > 0 and index.stats["accepted"] > 0  # the index really drafted, and was right
    index.clear()
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=3, policy="load_aware"))
    try:
        for _ in range(2):  # the second wave drafts from the first's text
            clients = [Collector() for _ in PROMPTS]
            for i, (prompt, client) in enumerate(zip(PROMPTS, clients)):
                scheduler.submit(prompt, _params(i), decoder.speculation, client)
            assert [c.tokens() for c in clients] == alone
            index.flush()
    finally:
        scheduler.shutdown()
    assert index.stats["rounds"] > 0
