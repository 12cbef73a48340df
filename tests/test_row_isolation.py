"""One request's failure stays its own (issue 44): a batch that mixes plain requests with one
that fails (a guide the grammar engine refuses when compiled, a guide that gives up mid-output,
a drafter that raises) fails that request alone, with a typed error, and every other request's
output equals the same request decoded alone. Tiny random Llamas over the reference tokenizer."""

from __future__ import annotations

import json
import time

import pytest

from conftest import tiny_llama
from test_scheduler import Collector, submit_all
from triton_backend.batching.batch_round import PlannedRow, isolated
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.core.config import (DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig,
                                        SpeculationMode)
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.core.errors import InvalidRequestError
from triton_backend.core.grammar import GuideLimitError
from triton_backend.core.guide import Guide, GuideType
from triton_backend.core.guide_cache import GuideBudget, GuideCache, GuideRefusedError
from triton_backend.engines.torch.model_loading import make_torch_engine
from triton_backend.speculation.drafters.ngram import NgramDrafter, NgramSession
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

# a JSON object of 600 optional properties: llguidance refuses its first row (2,407 items, max 2,000)
MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
REF_LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# the same object behind a 30-character string: compiles and passes the probe, fails mid-output
LATE_FAILURE = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                "properties": {"a": {"type": "string", "minLength": 30, "maxLength": 30}, "b": MANY_OPTIONAL}}
TRIGGER = 4242  # a prompt holding this token makes the broken drafter raise


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from triton_backend.core.reference_model import ensure_reference_model

    return AutoTokenizer.from_pretrained(ensure_reference_model())


class _BrokenSession:
    """An n-gram session that raises when the request's tokens hold :data:`TRIGGER`."""

    def __init__(self, inner: NgramSession) -> None:
        self.inner = inner

    def propose(self, tokens, k, processor, rng):
        if TRIGGER in tokens:
            raise RuntimeError("drafter broke on this request")
        return self.inner.propose(tokens, k, processor, rng)

    def release(self) -> None:
        self.inner.release()


class BrokenNgram(NgramDrafter):
    def new_session(self):
        return _BrokenSession(super().new_session())


@pytest.fixture(scope="module")
def decoder(tokenizer):
    target = make_torch_engine(tiny_llama(3, vocab=len(tokenizer), hidden=32, max_positions=256), name="iso",
                               runtime=RuntimeConfig(), eos_token_ids=[tokenizer.eos_token_id])
    return SpeculativeDecoder(target, tokenizer, drafters={SpeculationMode.NGRAM: BrokenNgram()})


def _spec(method: str = "ngram") -> SpeculationConfig:
    return SpeculationConfig(method=method, draft_length=DraftLengthConfig(num_draft_tokens=3, forced_tokens=8),
                             fallback=FallbackConfig(enabled=False))


def _plain(tokenizer, n: int) -> list[tuple[list[int], SamplingParams, SpeculationConfig]]:
    text = "the cat sat on the mat and the cat sat on the hat; "
    out = []
    for i in range(n):
        sampling = i % 2 == 1
        params = SamplingParams(max_tokens=24 + i, temperature=0.8 if sampling else 0.0,
                                seed=11 + i if sampling else None, ignore_eos=True)
        out.append((tokenizer.encode(text * (1 + i % 3), add_special_tokens=False)[i:], params,
                    _spec("ngram" if i % 3 else "off")))
    return out


def _guided(schema: dict, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, guide=Guide(GuideType.JSON_SCHEMA, json.dumps(schema)))


def _run_mixed(decoder, plain, bad, *, guides: GuideCache | None = None) -> tuple[list[Collector], list[Collector]]:
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4), guides=guides or GuideCache())
    try:
        good = submit_all(scheduler, plain[:2])
        failing = []
        for prompt, params, spec in bad:
            client = Collector()
            try:
                scheduler.submit(prompt, params, spec, client)
            except InvalidRequestError as exc:  # refused at submit (a cached refusal)
                client.on_error(exc)
            failing.append(client)
        good += submit_all(scheduler, plain[2:])
        for client in good + failing:
            assert client.done.wait(120), "a request never finished"
        return good, failing
    finally:
        scheduler.shutdown()


def test_guides_the_engine_refuses_fail_alone_before_joining_the_batch(decoder, tokenizer):
    plain = _plain(tokenizer, 5)
    expected = [decoder.generate(p, params, s).token_ids for p, params, s in plain]
    prompt = tokenizer.encode("Answer in JSON:", add_special_tokens=False)
    bad = [(prompt, _guided(MANY_OPTIONAL), _spec()), (prompt, _guided(REF_LOOP), _spec())]
    started = time.perf_counter()
    good, failing = _run_mixed(decoder, plain, bad)
    assert [c.tokens() for c in good] == expected
    assert all(isinstance(c.error, GuideRefusedError) for c in failing), [c.error for c in failing]
    assert "more alternatives at one point" in str(failing[0].error)
    assert "no output satisfies it" in str(failing[1].error)
    assert time.perf_counter() - started < 60


def test_a_guide_that_gives_up_mid_output_fails_its_row_alone(decoder, tokenizer):
    plain = _plain(tokenizer, 4)
    expected = [decoder.generate(p, params, s).token_ids for p, params, s in plain]
    prompt = tokenizer.encode("Answer in JSON:", add_special_tokens=False)
    guides = GuideCache()
    late = Guide(GuideType.JSON_SCHEMA, json.dumps(LATE_FAILURE))
    guides.compile(late, tokenizer, vocab=decoder.target.vocab_size, eos_token_ids=[tokenizer.eos_token_id])  # probe passes
    good, failing = _run_mixed(decoder, plain, [(prompt, _guided(LATE_FAILURE, 80), _spec())], guides=guides)
    assert [c.tokens() for c in good] == expected
    assert isinstance(failing[0].error, GuideLimitError), failing[0].error
    assert failing[0].chunks, "the guided request should have streamed some output before failing"


def test_a_drafter_that_raises_fails_its_row_alone(decoder, tokenizer):
    plain = _plain(tokenizer, 4)
    expected = [decoder.generate(p, params, s).token_ids for p, params, s in plain]
    broken = ([TRIGGER] + plain[1][0], SamplingParams(max_tokens=16, ignore_eos=True), _spec("ngram"))
    good, failing = _run_mixed(decoder, plain, [broken])
    assert [c.tokens() for c in good] == expected
    assert isinstance(failing[0].error, RuntimeError) and "drafter broke" in str(failing[0].error)


def test_isolated_runs_a_failed_batched_step_again_row_by_row():
    rows = [PlannedRow(seq=None, k=1) for _ in range(4)]  # type: ignore[arg-type]
    seen: list[int] = []

    def step(some):
        if any(r is rows[2] for r in some):
            raise ValueError("row 2 is bad")
        seen.extend(next(i for i, row in enumerate(rows) if row is r) for r in some)

    isolated(rows, step, "a step")
    assert seen == [0, 1, 3]
    assert [r.error is not None for r in rows] == [False, False, True, False]


def test_a_slow_guide_is_refused_within_its_budget_and_the_refusal_is_cached(decoder, tokenizer):
    guides = GuideCache(GuideBudget(max_compile_s=0.05))
    slow = Guide(GuideType.JSON_SCHEMA, json.dumps({"type": "object", "properties": {
        f"k{i}": {"type": "integer"} for i in range(1500)}}))
    started = time.perf_counter()
    with pytest.raises(GuideRefusedError, match="did not compile within"):
        guides.compile(slow, tokenizer, vocab=decoder.target.vocab_size, eos_token_ids=[tokenizer.eos_token_id])
    assert time.perf_counter() - started < 2.0
    deadline = time.perf_counter() + 30
    while time.perf_counter() < deadline:  # the compile ends in the background; its refusal is kept
        future = guides.prepare(slow, tokenizer, vocab=decoder.target.vocab_size, eos_token_ids=[tokenizer.eos_token_id])
        if future.done():
            break
        time.sleep(0.05)
    assert isinstance(future.exception(), GuideRefusedError)
    ok, guides = Guide(GuideType.REGEX, "[a-z]{3}"), GuideCache()
    first = guides.compile(ok, tokenizer, vocab=decoder.target.vocab_size, eos_token_ids=[tokenizer.eos_token_id])
    assert guides.compile(ok, tokenizer, vocab=decoder.target.vocab_size,
                          eos_token_ids=[tokenizer.eos_token_id]) is first  # cached by guide
