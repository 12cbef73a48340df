"""Prefix caching in the batch scheduler (triton_backend/batching/prefix_cache.py): a finished
request's keys and values serve later requests sharing its prefix. On tiny random Llamas
(slot engine): outputs with the cache equal each request decoded alone (greedy and seeded
sampling; plain, n-gram, draft model, Medusa, EAGLE), alone and batched; a follow-up turn
adopts the slot; eviction takes the least recently used entry and never a running request's
slot; namespaces keep tenants apart; the cache can be turned off."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import ServingSink, tiny_llama
from test_scheduler import Collector, tiny_decoder_with_every_drafter
from triton_backend.batching.prefix_cache import CachedPrefix, DrafterContext, PrefixCache, shared_length
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.core.config import DraftLengthConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.core.errors import InvalidRequestError
from triton_backend.engines.torch.model_loading import make_torch_engine
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

SYSTEM = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


@pytest.fixture(scope="module")
def decoder():
    return tiny_decoder_with_every_drafter()


def spec(mode: str) -> SpeculationConfig:
    return SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=3))


GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=14, temperature=0.9, top_k=8, seed=11, ignore_eos=True)


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def run_one(scheduler: BatchScheduler, prompt, params, mode: str, namespace: str = "") -> list[int]:
    """One request through the scheduler; returns once its slot is back (in the cache or free)."""
    client = Collector()
    scheduler.submit(prompt, params, spec(mode), client, namespace=namespace)
    tokens = client.tokens()
    wait_until(lambda: scheduler.load() == (0, 0) and scheduler.target.cache.slots_in_use == len(scheduler.prefix_cache),
               "the finished request's slot never reached the cache")
    return tokens


def test_shared_length_and_the_cache_order() -> None:
    long = list(range(700))
    assert shared_length(long, long[:600] + [1]) == 600 and shared_length(long, long) == 700
    assert shared_length([1, 2], [3]) == 0 and shared_length([], [1]) == 0
    cache = PrefixCache(min_tokens=4)
    assert not cache.retain(CachedPrefix(0, [1, 2, 3]))  # too short to keep a slot for
    for slot, tokens in enumerate([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9], [7, 7, 7, 7]]):
        assert cache.retain(CachedPrefix(slot, tokens))
    with pytest.raises(ValueError, match="past"):
        cache.retain(CachedPrefix(5, [1, 2, 3, 4], drafter=DrafterContext(2, torch.zeros(3, 8))))
    context = DrafterContext(3, torch.zeros(4, 8))  # pairs 0..2, features 3..6
    assert context.end == 7 and context.reusable(10, 9) == (3, 7) and context.reusable(6, 5) == (3, 5)
    assert context.reusable(3, 9) == (2, 2)  # pair 2 needs token 3: only pairs 0..1, and no feature after them
    assert cache.longest([1, 2, 3, 4, 9, 9, 9]) == (cache.entries()[1], 6)
    cache.touch(0)
    assert cache.slots() == [1, 2, 0]  # least recently used first
    assert cache.evict(keep=1) == 2 and cache.evict() == 1 and cache.slots() == [0]
    assert cache.evict(keep=0) is None and cache.stats.evictions == 2
    assert cache.take(0).slot == 0 and len(cache) == 0


def test_follow_up_turns_adopt_the_finished_slot_and_stay_exact(decoder) -> None:
    """Turn 2 extends turn 1's prompt and answer: it adopts turn 1's slot and prefills only its new
    tokens; outputs equal each request alone, greedy and seeded, in every mode (EAGLE resumes its
    drafter's context from the slot's row of the drafter cache)."""
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=3))
    try:
        for i, (mode, params) in enumerate([("off", GREEDY), ("ngram", SEEDED), ("draft", GREEDY), ("medusa", SEEDED),
                                            ("eagle", GREEDY), ("eagle", SEEDED), ("auto", GREEDY)]):
            first = SYSTEM + [i + 1, 2]
            answer = run_one(scheduler, first, params, mode)
            assert answer == decoder.generate(first, params, spec(mode)).token_ids
            follow = first + answer + [3, i + 4, 4]
            before = scheduler.prefix_cache_stats().reused_tokens
            adopted = scheduler.prefix_cache_stats().adopted
            assert run_one(scheduler, follow, params, mode) == decoder.generate(follow, params, spec(mode)).token_ids, mode
            reused = scheduler.prefix_cache_stats().reused_tokens - before
            assert reused >= len(first) + len(answer) - 3, (mode, reused)  # EAGLE: its drafter's pairs end earlier
            assert scheduler.prefix_cache_stats().adopted == adopted + 1
    finally:
        scheduler.shutdown()
    stats = scheduler.prefix_cache_stats()
    assert stats.hits >= 7 and 0 < stats.hit_rate <= 1


def test_batched_requests_sharing_a_finished_prefix_copy_it_and_stay_exact(decoder) -> None:
    """A finished request's entry serves several requests at once (copied: each extends only part
    of it, so the entry stays for the next), batched with a request that shares nothing."""
    requests = [(SYSTEM + tail, params, spec(mode)) for tail, mode, params in
                [([1, 1], "off", GREEDY), ([2], "ngram", SEEDED), ([4, 4, 4], "medusa", GREEDY),
                 ([6], "draft", SEEDED), ([8, 8], "eagle", GREEDY), ([3, 9], "auto", SEEDED)]]
    requests.append(([11, 12, 13, 14, 15], GREEDY, spec("ngram")))
    expected = [decoder.generate(p, params, s).token_ids for p, params, s in requests]
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=8))
    try:
        run_one(scheduler, SYSTEM + [7, 7, 7], GREEDY, "eagle")  # the entry, with its drafter's context
        clients = [Collector() for _ in requests]
        for (prompt, params, s), client in zip(requests, clients):
            scheduler.submit(prompt, params, s, client)
        assert [c.tokens() for c in clients] == expected
    finally:
        scheduler.shutdown()
    stats = scheduler.prefix_cache_stats()
    assert stats.hits >= 6 and stats.adopted == 0
    assert stats.reused_tokens >= 6 * (len(SYSTEM) - 1)


def test_eviction_takes_the_least_recently_used_entry_never_a_running_slot() -> None:
    """Two slots: a long request runs in one while short ones come and go through the other,
    each evicting the entry before it. The long one's output stays exact (its slot untouched);
    an entry used by a later request becomes the most recently used. (Expected outputs first: a
    request alone takes a slot of the same engine.)"""
    decoder = few_slots(2)
    long_prompt = [9, 8, 7, 6, 5, 4, 3, 2]
    long_params = SamplingParams(max_tokens=480, ignore_eos=True)
    shorts = [[20 + i, 21, 22, 23, 24, 25] for i in range(4)]
    expected = [decoder.generate(p, GREEDY, spec("ngram")).token_ids for p in shorts]
    expected_long = decoder.generate(long_prompt, long_params, spec("off")).token_ids
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=2))
    try:
        runner = Collector()
        scheduler.submit(long_prompt, long_params, spec("off"), runner)
        wait_until(lambda: runner.chunks, "the long request never started")
        assert [run_one_beside(scheduler, p, GREEDY, "ngram") for p in shorts] == expected
        assert runner.tokens() == expected_long
        assert scheduler.prefix_cache_stats().evictions >= 3
    finally:
        scheduler.shutdown()
    # LRU order with three slots: A, B, C cached; D shares A's start and needs a slot: B goes (the
    # least recently used but A, D's source); D copies A's start (A is used: C is the oldest now)
    # and joins the cache when done; E shares nothing: C goes.
    decoder = few_slots(3)
    a, b, c = SYSTEM + [1], [3, 3, 4, 4, 5, 5], [6, 5, 6, 5, 6, 5]
    d = SYSTEM[:10] + [2, 2]
    expected_d = decoder.generate(d, GREEDY, spec("off")).token_ids
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=3))
    try:
        for prompt in (a, b, c):
            run_one(scheduler, prompt, GREEDY, "off")
        cache = scheduler.prefix_cache
        first = [e.tokens[:len(p)] for e, p in zip(reversed(cache.entries()), (a, b, c))]
        assert first == [a, b, c]
        assert run_one(scheduler, d, GREEDY, "off") == expected_d
        assert [e.tokens[:6] for e in reversed(cache.entries())] == [c, a[:6], d[:6]]
        run_one(scheduler, [12, 13, 14, 15, 16], GREEDY, "off")
        assert [e.tokens[:5] for e in reversed(cache.entries())] == [a[:5], d[:5], [12, 13, 14, 15, 16]]
    finally:
        scheduler.shutdown()


def few_slots(slots: int) -> SpeculativeDecoder:
    """The test's tiny target (n-gram lookup only) on an engine of ``slots`` KV-cache slots (the
    cache holds what the running requests leave)."""
    engine = make_torch_engine(tiny_llama(0, vocab=32, max_positions=512), name="tiny0",
                               runtime=RuntimeConfig(max_batch_size=slots), eos_token_ids=[])
    return SpeculativeDecoder(engine, None, drafters={SpeculationMode.NGRAM: NgramDrafter(1, 3)})


def run_one_beside(scheduler: BatchScheduler, prompt, params, mode: str) -> list[int]:
    """One request while another keeps running: returns once its slot is in the cache."""
    before = scheduler.prefix_cache_stats().lookups
    client = Collector()
    scheduler.submit(prompt, params, spec(mode), client)
    tokens = client.tokens()
    wait_until(lambda: scheduler.prefix_cache_stats().lookups == before + 1
               and any(e.tokens[:len(prompt)] == prompt for e in scheduler.prefix_cache.entries()),
               "the short request's slot never reached the cache")
    return tokens


def test_namespaces_keep_tenants_apart_and_the_cache_can_be_off(decoder) -> None:
    prompt = SYSTEM + [4, 2]
    follow = prompt + [1, 2, 3]
    expected = decoder.generate(follow, GREEDY, spec("off")).token_ids
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4))
    try:
        run_one(scheduler, prompt, GREEDY, "off", namespace="tenant-a")
        assert run_one(scheduler, follow, GREEDY, "off", namespace="tenant-b") == expected
        assert scheduler.prefix_cache_stats().hits == 0  # tenant b sees nothing of tenant a's
        assert run_one(scheduler, follow, GREEDY, "off", namespace="tenant-a") == expected
        assert scheduler.prefix_cache_stats().hits == 1
        with pytest.raises(InvalidRequestError, match="namespace"):
            scheduler.submit(prompt, GREEDY, spec("off"), Collector(), namespace=3)
    finally:
        scheduler.shutdown()
    off = BatchScheduler(decoder, SchedulerConfig(max_batch_size=2, prefix_cache=False))
    try:
        assert off.prefix_cache is None
        for _ in range(2):
            client = Collector()
            off.submit(follow, GREEDY, spec("off"), client)
            assert client.tokens() == expected
        wait_until(lambda: off.target.cache.slots_in_use == 0, "a slot stayed taken with the cache off")
        assert off.prefix_cache_stats().lookups == 0
    finally:
        off.shutdown()
    with pytest.raises(InvalidRequestError, match="prefix_cache"):
        SchedulerConfig(prefix_cache="yes")


class _Metric:
    def __init__(self, **_: object) -> None:
        self.value = 0.0

    def increment(self, n: float) -> None:
        self.value += n

    def set(self, n: float) -> None:
        self.value = n

    def observe(self, n: float) -> None:
        self.value += n


class _Family:
    """pb_utils.MetricFamily's surface: families register themselves in ``made``."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict[str, "_Family"] = {}

    def __init__(self, name: str, *_: object) -> None:
        self.name, self.metrics = name, []
        self.made[name] = self

    def Metric(self, **kwargs: object) -> _Metric:  # noqa: N802 - pb_utils' name
        self.metrics.append(_Metric(**kwargs))
        return self.metrics[-1]


class _PbUtils:
    """The one name of Triton's pb_utils that TritonMetrics uses (the stub exists only inside Triton)."""

    MetricFamily = _Family


def test_prefix_lookups_reach_the_prometheus_counters(decoder) -> None:
    """The scheduler tells the Triton metrics where each admitted prompt came from; a flush
    publishes hits, lookups and reused tokens (specdec_prefix_cache_*_total). (Checked once
    against a real Triton too: two equal chat requests, lookups 2, hits 1, 42 of 86 tokens reused.)"""
    from triton_backend.serving.triton.metrics import TritonMetrics
    from triton_backend.serving.triton.trtllm_metrics import Observers

    _Family.made.clear()
    metrics = TritonMetrics(_PbUtils(), "specdec")
    # as the served model wires it: its observers in one (specdec_model.py)
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=2), observer=Observers(metrics))
    try:
        prompt = SYSTEM + [1, 1]
        answer = run_one(scheduler, prompt, GREEDY, "off")
        run_one(scheduler, prompt + answer + [2], GREEDY, "off")
    finally:
        scheduler.shutdown()
    metrics.flush()
    value = {name: sum(m.value for m in f.metrics) for name, f in _Family.made.items()}
    stats = scheduler.prefix_cache_stats()
    assert value["specdec_prefix_cache_lookups_total"] == stats.lookups == 2
    assert value["specdec_prefix_cache_hits_total"] == stats.hits == 1
    assert value["specdec_prefix_cache_reused_tokens_total"] == stats.reused_tokens >= len(prompt)
    assert value["specdec_prefix_cache_prompt_tokens_total"] == stats.prompt_tokens


def test_the_served_model_config_turns_the_cache_off() -> None:
    """ServingConfig.prefix_cache travels through config.pbtxt's parameters (rendered only when
    off, so repositories rendered before it still read as on) to the scheduler's config."""
    from triton_backend.core.errors import ConfigError
    from triton_backend.serving.interface import ServingConfig

    assert "prefix_cache" not in ServingConfig().parameters()
    off = ServingConfig(prefix_cache=False).parameters()
    assert off["prefix_cache"] == "false"
    assert ServingConfig.from_parameters("specdec", off).prefix_cache is False
    assert ServingConfig.from_parameters("specdec", ServingConfig().parameters()).prefix_cache is True
    with pytest.raises(ConfigError, match="prefix_cache"):
        ServingConfig.from_parameters("specdec", {**off, "prefix_cache": "maybe"})
    with pytest.raises(ConfigError, match="prefix_cache"):
        ServingConfig(prefix_cache="no")


@pytest.mark.slow
def test_a_follow_up_turn_on_the_reference_model_is_exact(reference) -> None:
    """SmolLM2-135M: a chat's second turn starts from the first turn's slot (prompt and answer)
    and answers exactly what it answers alone (greedy, plain and n-gram)."""
    engine, tokenizer = reference
    decoder = SpeculativeDecoder(engine, tokenizer, drafters={SpeculationMode.NGRAM: NgramDrafter(1, 3)})
    chat = [{"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
            {"role": "user", "content": "Name a planet with rings."}]
    first = decoder.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    params = SamplingParams(max_tokens=16)
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=2))
    try:
        answer = run_one(scheduler, first, params, "off")
        assert answer == decoder.generate(first, params, spec("off")).token_ids
        chat += [{"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                 {"role": "user", "content": "And one without?"}]
        follow = decoder.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        for mode in ("off", "ngram"):
            hits = scheduler.prefix_cache_stats().hits
            assert run_one(scheduler, follow, params, mode) == decoder.generate(follow, params, spec(mode)).token_ids
            assert scheduler.prefix_cache_stats().hits == hits + 1
    finally:
        scheduler.shutdown()
    assert scheduler.prefix_cache_stats().reused_tokens >= 2 * len(first)


def test_drafter_rows_copy_into_a_cache_made_under_inference_mode() -> None:
    """The drafter's passes grow its cache under inference mode; admission copies a shared
    prefix's rows outside it (a running request sharing a prompt, the cache off): the copy must
    not be refused (it was, as 'Inplace update to inference tensor outside InferenceMode')."""
    from triton_backend.batching.prefix_cache import copy_drafter_rows
    from triton_backend.speculation.drafters.eagle_model import EagleKV

    with torch.inference_mode():
        kv = EagleKV(torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5))
    for length in (3, 6):  # within its capacity, then past it (it grows)
        copy_drafter_rows(kv, source=0, destination=2, length=length)
        assert kv.capacity >= length
        assert torch.equal(kv.k[2, :, :length], kv.k[0, :, :length]) and torch.equal(kv.v[2, :, :length], kv.v[0, :, :length])


def _token_request(prompt: list[int], namespace: str | None) -> dict:
    import numpy as np

    arrays = {"input_ids": np.array([prompt], dtype=np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
              "request_output_len": np.array([[6]], np.int32), "ignore_eos": np.array([[True]])}
    if namespace is not None:
        arrays["prefix_cache_namespace"] = np.array([[namespace.encode()]], dtype=np.object_)
    return arrays


def test_the_served_namespace_input_keeps_tenants_apart(decoder) -> None:
    """The serving model's ``prefix_cache_namespace`` input reaches the cache: a request of
    another tenant finds nothing of the first one's, the first tenant's next request does;
    absent is the shared namespace, and an overlong one is a bad request."""
    from triton_backend.serving.interface import ServingConfig
    from triton_backend.serving.service import SpecdecService, parse_request

    prompt = SYSTEM + [4, 2]
    assert parse_request(_token_request(prompt, "tenant-a"), SpeculationConfig()).namespace == "tenant-a"
    assert parse_request(_token_request(prompt, None), SpeculationConfig()).namespace == ""
    with pytest.raises(InvalidRequestError, match="prefix_cache_namespace"):
        parse_request(_token_request(prompt, "x" * 257), SpeculationConfig())
    service = SpecdecService(decoder, ServingConfig(max_batch_size=2), SpeculationConfig())
    scheduler = service.scheduler
    outputs = []
    try:
        for namespace, hits in (("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 1), (None, 1)):
            sink = ServingSink()
            service.submit(_token_request(prompt, namespace), sink)
            assert sink.done.wait(60) and not sink.errors, sink.errors
            outputs.append([int(t) for t in sink.sent[-1]["output_ids"].reshape(-1)])
            wait_until(lambda: scheduler.load() == (0, 0) and
                       scheduler.target.cache.slots_in_use == len(scheduler.prefix_cache), "the slot never reached the cache")
            assert scheduler.prefix_cache_stats().hits == hits, namespace
    finally:
        service.shutdown()
    assert all(o == outputs[0] for o in outputs)
