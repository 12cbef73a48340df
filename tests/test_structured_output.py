"""Structured output (guided decoding) with exact speculation.

Greedy: constrained speculative output (n-gram drafts, grammar-forced drafts, both) equals plain
constrained decoding token for token, and both equal an independent step-by-step reference that
masks each logits row with llguidance directly; the output parses. Tiny random Llamas over the
reference tokenizer (fast) and the real reference model (slow). Bad guides are typed errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from triton_fixtures import local_decoder, triton  # noqa: F401 (fixtures)
from triton_backend.core.config import (DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig,
                                        SpeculationMode)
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.core.errors import InvalidRequestError
from triton_backend.core.grammar import compile_guide, grammar_text, ll_tokenizer
from triton_backend.core.guide import Guide, GuideType
from triton_backend.engines.torch.model_loading import make_torch_engine
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
GUIDES = [
    Guide(GuideType.JSON_SCHEMA, json.dumps(PERSON)),
    Guide(GuideType.REGEX, r"[a-z]{1,5}-[0-9]{2,3}"),
    Guide(GuideType.EBNF_GRAMMAR, 'root ::= "yes" | "no" | "maybe " [0-9]'),
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from triton_backend.core.reference_model import ensure_reference_model

    return AutoTokenizer.from_pretrained(ensure_reference_model())


@pytest.fixture(scope="module")
def tiny_engines(tokenizer):
    """Tiny random Llamas over the reference vocabulary, ending at its EOS token."""
    return [make_torch_engine(tiny_llama(seed, vocab=len(tokenizer), hidden=32, max_positions=256), name=f"g{seed}",
                              runtime=RuntimeConfig(), eos_token_ids=[tokenizer.eos_token_id]) for seed in (3, 4)]


def spec(method: str, forced: int) -> SpeculationConfig:
    return SpeculationConfig(method=method, draft_length=DraftLengthConfig(num_draft_tokens=4, forced_tokens=forced),
                             fallback=FallbackConfig(enabled=False))


def reference_greedy(engine, tokenizer, guide: Guide, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Plain constrained greedy decoding, written out: one row per step, masked by llguidance."""
    from llguidance import LLMatcher

    matcher = LLMatcher(ll_tokenizer(tokenizer, engine.vocab_size, sorted(engine.eos_token_ids)), grammar_text(guide))
    session = engine.new_session()
    out: list[int] = []
    try:
        for _ in range(max_tokens):
            logits = session.logits(prompt_ids + out, 1)[0].float()
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[: logits.shape[0]].astype(bool))
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(token)
            if token in engine.eos_token_ids:
                break
            assert matcher.consume_token(token), matcher.get_error()
    finally:
        session.release()
    return out


def check_parses(guide: Guide, text: str) -> None:
    if guide.type is GuideType.JSON_SCHEMA:
        value = json.loads(text)
        assert set(value) == {"name", "age", "ok"} and 0 <= value["age"] <= 99 and isinstance(value["ok"], bool)
    elif guide.type is GuideType.REGEX:
        assert re.fullmatch(guide.text, text), text
    else:
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


@pytest.mark.parametrize("guide", GUIDES, ids=lambda g: g.type.value)
def test_tiny_speculative_equals_plain_constrained(tiny_engines, tokenizer, guide):
    prompt = tokenizer.encode('{"name": "ab", "age": 12, "ok": true} cd-123 yes {"name": "ab", "age": 1', add_special_tokens=False)
    for engine in tiny_engines:
        decoder = SpeculativeDecoder(engine, tokenizer, drafters={SpeculationMode.NGRAM: NgramDrafter()})
        want = reference_greedy(engine, tokenizer, guide, prompt, 48)
        params = SamplingParams(max_tokens=48, guide=guide)
        runs = {(m, f): decoder.generate(prompt, params, spec(m, f)) for m in ("off", "ngram") for f in (0, 16)}
        for key, result in runs.items():
            assert result.token_ids == [t for t in want if t not in engine.eos_token_ids], key
        plain = runs[("off", 0)]
        if plain.finish_reason.value == "eos":
            check_parses(guide, plain.text)
        assert runs[("off", 16)].stats.target_passes <= plain.stats.target_passes


def test_unconstrained_request_unchanged(tiny_engines, tokenizer):
    """No guide: no grammar state, no masks; the output is plain decoding's."""
    engine = tiny_engines[0]
    decoder = SpeculativeDecoder(engine, tokenizer, drafters={SpeculationMode.NGRAM: NgramDrafter()})
    prompt = tokenizer.encode("a b c a b c a b", add_special_tokens=False)
    plain = decoder.generate(prompt, SamplingParams(max_tokens=24), spec("off", 16))
    fast = decoder.generate(prompt, SamplingParams(max_tokens=24), spec("ngram", 16))
    assert plain.token_ids == fast.token_ids
    from triton_backend.speculation.run_state import RunState

    run = RunState(engine, tokenizer, prompt, SamplingParams(max_tokens=8), spec("ngram", 16), SpeculationMode.OFF, None)
    assert run.guide is None and run.processor.guide is None and run.processor.history is None


@pytest.mark.parametrize("guide_type,text,needle", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", '{"type": "no-such-type"}', "invalid json_schema guide"),
    ("regex", "[a-z", "invalid regex guide"),
    ("ebnf_grammar", "root ::= (", "EBNF"),
    ("yaml", "a: b", "unknown guided_decoding_guide_type"),
    ("regex", "", "needs a guided_decoding_guide"),
])
def test_bad_guides_are_typed_errors(tiny_engines, tokenizer, guide_type, text, needle):
    engine = tiny_engines[0]
    decoder = SpeculativeDecoder(engine, tokenizer)
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        decoder.generate([1, 2, 3], SamplingParams(max_tokens=4, guide=Guide.from_inputs(guide_type, text)))


def test_guide_inputs_and_forced_tokens(tokenizer):
    assert Guide.from_inputs(None, None) is None
    with pytest.raises(InvalidRequestError):
        Guide.from_inputs(None, '{"type": "object"}')
    assert Guide.from_inputs("JSON", None) == Guide(GuideType.JSON, "")
    matcher = compile_guide(Guide(GuideType.JSON_SCHEMA, json.dumps(PERSON)), tokenizer, vocab=len(tokenizer),
                            eos_token_ids=[tokenizer.eos_token_id], prompt_len=2)
    forced = matcher.forced(16)
    assert tokenizer.decode(forced) == '{"name":'  # the key and its separator are forced
    mask = matcher.allowed()
    assert mask is not None and bool(mask[forced[0]]) and int(mask.sum()) == 1
    matcher.sync([7, 7] + forced)  # the prompt is skipped
    assert matcher.consumed == len(forced)
    assert matcher.allowed([tokenizer.convert_tokens_to_ids("}")]) is None  # a refused draft: row left alone


@pytest.mark.slow
def test_reference_model_json_schema_speculative_equals_plain(reference, tokenizer):
    engine, tok = reference
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
    guide = Guide(GuideType.JSON_SCHEMA, json.dumps(schema))
    decoder = SpeculativeDecoder(engine, tok, drafters={SpeculationMode.NGRAM: NgramDrafter()})
    for text in ("Extract as JSON: Alice Smith is 33 years old and lives in Paris.",
                 "Give JSON for Bob, who is 41 and lives in Berlin."):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
        want = reference_greedy(engine, tok, guide, prompt, 40)
        plain = decoder.generate(prompt, SamplingParams(max_tokens=40, guide=guide), spec("off", 0))
        fast = decoder.generate(prompt, SamplingParams(max_tokens=40, guide=guide), spec("ngram", 16))
        assert plain.token_ids == fast.token_ids == [t for t in want if t not in engine.eos_token_ids]
        assert set(json.loads(plain.text)) == {"name", "age", "city"}
        assert fast.stats.target_passes < plain.stats.target_passes


def test_batched_rows_keep_their_own_grammar_state(tiny_engines, tokenizer):
    """Guided and unguided rows (plain, n-gram, draft model; greedy and seeded sampling) in one
    batch: each row's output equals the same request decoded alone."""
    from test_scheduler import submit_all

    from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
    from triton_backend.speculation.drafters.draft_model import DraftModelDrafter

    target, draft = tiny_engines
    decoder = SpeculativeDecoder(target, tokenizer, drafters={SpeculationMode.NGRAM: NgramDrafter(),
                                                              SpeculationMode.DRAFT: DraftModelDrafter(draft, target=target)})
    prompt = tokenizer.encode('{"name": "ab", "age": 12, "ok": true} cd-123 yes', add_special_tokens=False)
    requests = []
    for i, (guide, method) in enumerate([(GUIDES[0], "ngram"), (GUIDES[1], "draft"), (None, "ngram"), (GUIDES[2], "off"),
                                         (GUIDES[0], "draft"), (GUIDES[1], "ngram"), (None, "draft")]):
        sampling = i % 3 == 1
        params = SamplingParams(max_tokens=30, guide=guide, temperature=0.8 if sampling else 0.0,
                                seed=7 + i if sampling else None)
        requests.append((prompt[i:], params, spec(method, 16)))
    expected = [decoder.generate(p, params, s).token_ids for p, params, s in requests]
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4))
    try:
        assert [c.tokens() for c in submit_all(scheduler, requests)] == expected
    finally:
        scheduler.shutdown()


def _exact_constrained(engine, tokenizer, guide: Guide, prompt: list[int], temperature: float) -> dict[tuple[int, ...], float]:
    """The constrained target's exact distribution over whole outputs (a grammar with few of them):
    every path through the allowed tokens, each row masked then softened by ``temperature``."""
    from llguidance import LLMatcher

    matcher = LLMatcher(ll_tokenizer(tokenizer, engine.vocab_size, sorted(engine.eos_token_ids)), grammar_text(guide))
    eos = next(iter(engine.eos_token_ids))
    out: dict[tuple[int, ...], float] = {}
    session = engine.new_session()

    def walk(path: list[int], prob: float) -> None:
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: engine.vocab_size].astype(bool))
        logits = session.logits(prompt + path, 1)[0].float().masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(logits / temperature, dim=-1)
        for token in allowed.nonzero().flatten().tolist():
            if token == eos:
                out[tuple(path)] = out.get(tuple(path), 0.0) + prob * float(probs[token])
                continue
            assert matcher.consume_token(token)
            walk(path + [token], prob * float(probs[token]))
            matcher.rollback(1)

    try:
        walk([], 1.0)
    finally:
        session.release()
    return out


def test_sampling_follows_the_constrained_target_distribution(tokenizer):
    """Seeded speculative sampling (a masked draft model's q, forced drafts) against the exact
    constrained distribution over every output the grammar allows: total variation below 0.08,
    while the same counts are further than that from the distribution at another temperature."""
    from triton_backend.speculation.drafters.draft_model import DraftModelDrafter

    def engine(seed):
        return make_torch_engine(tiny_llama(seed, vocab=len(tokenizer), hidden=32, sharpness=0.2), name=f"s{seed}",
                                 runtime=RuntimeConfig(), eos_token_ids=[tokenizer.eos_token_id])

    target, draft = engine(5), engine(6)
    guide = Guide(GuideType.EBNF_GRAMMAR, 'root ::= "x=" [ab] [ab] ";"')
    prompt = tokenizer.encode("x=ab; x=", add_special_tokens=False)
    exact = _exact_constrained(target, tokenizer, guide, prompt, 1.0)
    assert len(exact) > 4 and abs(sum(exact.values()) - 1.0) < 1e-4
    decoder = SpeculativeDecoder(target, tokenizer, drafters={SpeculationMode.DRAFT: DraftModelDrafter(draft, target=target)})
    n, counts, accepted = 600, {}, 0
    for seed in range(n):
        result = decoder.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=seed, guide=guide),
                                  spec("draft", 16))
        key = tuple(result.token_ids)
        assert key in exact, tokenizer.decode(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += result.stats.accepted_tokens
    def tv(dist):
        return 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in dist.items())

    assert tv(exact) < 0.08, (tv(exact), exact, counts)
    assert tv(_exact_constrained(target, tokenizer, guide, prompt, 0.5)) > 0.08  # the test can tell
    assert accepted > 0  # drafts were really verified


# -- serving: the two tensorrtllm_backend inputs ------------------------------------------------
def _arrays(**values) -> dict[str, np.ndarray]:
    return {name: np.asarray(value, dtype=object).reshape(1, 1) for name, value in values.items()}


def test_guided_inputs_are_parsed_into_a_typed_guide():
    from triton_backend.serving.service import parse_request

    schema = json.dumps(PERSON)
    parsed = parse_request(_arrays(text_input=b"hi", guided_decoding_guide_type=b"json_schema",
                                   guided_decoding_guide=schema.encode()), SpeculationConfig())
    assert parsed.sampling.guide == Guide(GuideType.JSON_SCHEMA, schema)
    assert parse_request(_arrays(text_input=b"hi"), SpeculationConfig()).sampling.guide is None
    for bad in (dict(guided_decoding_guide_type=b"xml"), dict(guided_decoding_guide=b"[a-z]"),
                dict(guided_decoding_guide_type=b"json_schema", guided_decoding_guide=b"{")):
        with pytest.raises(InvalidRequestError, match="guided_decoding_guide"):
            parse_request(_arrays(text_input=b"hi", **bad), SpeculationConfig())


@pytest.mark.slow
def test_guided_requests_over_triton(triton, local_decoder):
    """ensemble (HTTP generate, streamed too), tensorrt_llm_bls and specdec_unary honour the guide
    as the in-process decoder does; a bad guide is a short error for that request only."""
    from test_trtllm_dropin import _generate
    from triton_fixtures import DEPLOYMENT

    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 20}}}
    prompt = "Answer in JSON. The capital of France is"
    guide = Guide(GuideType.JSON_SCHEMA, json.dumps(schema))
    want = local_decoder.generate(prompt, SamplingParams(max_tokens=24, guide=guide), DEPLOYMENT.speculation)
    assert set(json.loads(want.text)) == {"city"}
    body = {"text_input": prompt, "max_tokens": 24, "guided_decoding_guide_type": "json_schema",
            "guided_decoding_guide": json.dumps(schema)}
    for model in ("ensemble", "tensorrt_llm_bls", "specdec_unary"):
        assert _generate(triton, model, body)[0]["text_output"] == want.text, model
    streamed = _generate(triton, "ensemble", {**body, "stream": True}, stream=True)
    assert "".join(r["text_output"] for r in streamed) == want.text
    bad = _generate(triton, "ensemble", {**body, "guided_decoding_guide": '{"type": "no-such-type"}'})[0]
    assert "invalid json_schema guide" in bad["error"]
    assert _generate(triton, "ensemble", {"text_input": prompt, "max_tokens": 4})[0]["text_output"]  # still serving


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tree_and_eagle_drafters_stay_exact_under_a_guide(tiny_engines, tokenizer, method):
    """Medusa trees and EAGLE chains go through the same per-row grammar masks: greedy output ==
    plain constrained decoding (alone and batched)."""
    from test_eagle import _random_drafter
    from test_medusa_tree import random_heads
    from test_scheduler import submit_all

    from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
    from triton_backend.speculation.drafters.medusa import MedusaDrafter
    from triton_backend.speculation.drafters.medusa_model import MedusaCheckpoint

    target = tiny_engines[0]
    drafter = (MedusaDrafter(MedusaCheckpoint(random_heads(32, len(tokenizer))), target) if method == "medusa"
               else _random_drafter(target))
    decoder = SpeculativeDecoder(target, tokenizer, drafters={SpeculationMode(method): drafter})
    prompt = tokenizer.encode('{"name": "ab", "age": 12, "ok": true} cd-123 yes', add_special_tokens=False)
    requests = [(prompt, SamplingParams(max_tokens=32, guide=g), spec(method, f)) for g in GUIDES[:2] for f in (0, 16)]
    for p, params, s in requests:
        want = reference_greedy(target, tokenizer, params.guide, p, 32)
        assert decoder.generate(p, params, s).token_ids == [t for t in want if t not in target.eos_token_ids]
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4))
    try:
        alone = [decoder.generate(p, params, s).token_ids for p, params, s in requests]
        assert [c.tokens() for c in submit_all(scheduler, requests)] == alone
    finally:
        scheduler.shutdown()
