"""Exactness under the gain rule (the default): whatever the per-round decision drafts,
greedy output equals plain decoding token for token and sampling follows the target's
distribution (tiny random Llamas, and greedy on the real reference model)."""

from __future__ import annotations

import pytest

from conftest import tiny_engine
from test_loop_tiny import _exact_joint
from triton_backend.core.config import (
    DraftLengthConfig, FallbackConfig, FallbackRule, SamplingParams, SpeculationConfig, SpeculationMode,
)
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.core.sampling import LogitsProcessor

PROMPTS = ([1, 2, 3], [5, 5, 5, 5], [7, 1, 9, 1, 7, 1, 9, 1, 7])


@pytest.fixture(scope="module")
def decoder():
    target, draft = tiny_engine(0), tiny_engine(1)
    return SpeculativeDecoder(target, None, drafters={
        # declared cheap so the gain rule drafts with it (a random draft as large as the target never pays)
        SpeculationMode.DRAFT: DraftModelDrafter(draft, target=target, relative_cost=0.05),
        SpeculationMode.NGRAM: NgramDrafter(1, 3),
    })


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_gain_rule_greedy_is_identical_to_plain(decoder, mode):
    drafted = 0
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, SamplingParams(max_tokens=48), SpeculationConfig(method="off"))
        spec = SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=6),
                                 fallback=FallbackConfig(prior_acceptance=0.9))
        assert spec.fallback.rule is FallbackRule.GAIN
        result = decoder.generate(prompt, SamplingParams(max_tokens=48), spec)
        assert result.token_ids == plain.token_ids, prompt
        drafted += result.stats.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("mode,params", [("draft", dict(temperature=0.7, top_k=5)), ("ngram", dict(temperature=1.0))])
def test_gain_rule_sampling_matches_target_distribution(mode, params):
    vocab = 8
    target, draft = tiny_engine(10, vocab=vocab), tiny_engine(20, vocab=vocab, sharpness=1.0)
    dec = SpeculativeDecoder(target, None, drafters={
        SpeculationMode.DRAFT: DraftModelDrafter(draft, target=target, relative_cost=0.05),
        SpeculationMode.NGRAM: NgramDrafter(1, 1),
    })
    prompt = [1, 2, 1, 3, 1]
    exact = _exact_joint(target, prompt, 2, LogitsProcessor(**params))
    n = 2000
    counts: dict[tuple[int, ...], int] = {}
    spec = SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=2),
                             fallback=FallbackConfig(prior_acceptance=0.8))
    drafted = 0
    for seed in range(n):
        result = dec.generate(prompt, SamplingParams(max_tokens=2, seed=seed, **params), spec)
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        drafted += result.stats.drafted_tokens
    assert drafted > 0
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in set(exact) | set(counts))
    assert tv < 0.07, tv  # sampling noise at n=2000 over <=64 outcomes is ~0.04
    assert all(s in exact for s in counts)


@pytest.mark.slow
def test_gain_rule_on_the_reference_model_is_exact_and_drafts_where_text_repeats(reference):
    target, tokenizer = reference
    dec = SpeculativeDecoder(target, tokenizer, drafters={SpeculationMode.NGRAM: NgramDrafter(1, 3)})
    text = ("Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, melons, "
            "peaches, apricots, figs, dates.")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = dec.generate(prompt, params, SpeculationConfig(method="off"))
    result = dec.generate(prompt, params, SpeculationConfig(method="ngram",
                                                            draft_length=DraftLengthConfig(num_draft_tokens=8)))
    assert result.token_ids == plain.token_ids
    stats = result.stats
    assert stats.accepted_tokens > 10  # the copy was drafted and accepted
    assert stats.target_passes < plain.stats.target_passes
