"""Penalties, min_tokens, bad words and log probabilities (TensorRT-LLM's sampling inputs):
hand-built logits against the documented rules, an independent slow reference for plain
decoding, greedy speculation (n-gram, draft model, Medusa, EAGLE; alone and batched) equal
to it token for token, and sampling through speculation following the target's penalised
distribution (total variation, fixed seeds)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_engine
from test_scheduler import submit_all, tiny_decoder_with_every_drafter
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.core.errors import InvalidRequestError
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig

NEG = float("-inf")


def _processor(prompt: list[int], **kwargs) -> tuple[LogitsProcessor, list[int]]:
    end_ids = kwargs.pop("end_ids", ())
    params = SamplingParams(**kwargs)
    return LogitsProcessor.from_params(params, prompt_len=len(prompt), end_ids=end_ids), list(prompt)


# -- hand-built logits ------------------------------------------------------------------------
def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    proc, prompt = _processor([0, 1], repetition_penalty=2.0)
    logits = torch.tensor([[4.0, -4.0, 4.0, -4.0]])
    out = proc.scores(logits, proc.rows(prompt, [[]]))
    assert out.tolist() == [[2.0, -8.0, 4.0, -4.0]]  # prompt tokens count for repetition
    out = proc.scores(logits, proc.rows(prompt, [[3]]))  # a draft before the row counts too
    assert out.tolist() == [[2.0, -8.0, 4.0, -8.0]]


def test_presence_and_frequency_count_output_tokens_only():
    proc, tokens = _processor([2, 2], presence_penalty=0.5, frequency_penalty=1.0)
    tokens += [1, 1, 3]  # committed output: token 1 twice, token 3 once
    logits = torch.zeros(1, 4)
    out = proc.scores(logits, proc.rows(tokens, [[]]))
    assert out.tolist() == [[0.0, -2.5, 0.0, -1.5]]  # token 2 only in the prompt: no penalty
    out = proc.scores(logits, proc.rows(tokens, [[0, 1]]))
    assert out.tolist() == [[-1.5, -3.5, 0.0, -1.5]]


def test_history_is_incremental_and_rows_see_only_their_drafts():
    proc, tokens = _processor([5], frequency_penalty=1.0)
    logits = torch.zeros(3, 6)
    rows = proc.chain_rows(tokens, [1, 1])
    out = proc.scores(logits, rows)
    assert out[:, 1].tolist() == [0.0, -1.0, -2.0]
    tokens += [1]  # one committed: the next round starts from it
    out = proc.scores(logits[:1], proc.rows(tokens, [[]]))
    assert out[0, 1] == -1.0


def test_min_tokens_masks_end_ids_until_reached():
    proc, tokens = _processor([0], min_tokens=2, end_ids=[3])
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0]] * 3)
    out = proc.scores(logits, proc.chain_rows(tokens, [1, 2]))
    assert out[:, 3].tolist() == [NEG, NEG, 9.0]  # rows after 0, 1, 2 generated tokens
    assert proc.argmax(logits, proc.chain_rows(tokens, [1, 2])).tolist() == [0, 0, 3]


def test_bad_words_mask_the_last_token_after_their_prefix():
    params = SamplingParams(bad_token_ids=((4,), (1, 2, 3)))
    proc = LogitsProcessor.from_params(params, prompt_len=1)
    logits = torch.zeros(4, 8)
    out = proc.scores(logits, proc.rows([0, 1], [[], [2], [2, 2], [7]]))
    assert out[:, 4].tolist() == [NEG] * 4  # one-token bad word: always
    assert out[:, 3].tolist() == [0.0, NEG, 0.0, 0.0]  # prefix (1, 2) spans committed + draft


def test_neutral_settings_need_no_history_and_change_nothing():
    proc = LogitsProcessor.from_params(SamplingParams(temperature=0.8))
    assert proc.rows([1, 2], [[]]) is None
    logits = torch.randn(2, 7)
    assert torch.equal(proc.probs(logits, None), LogitsProcessor(temperature=0.8).probs(logits))


def test_log_probs_are_of_the_penalised_distribution_before_truncation():
    proc, tokens = _processor([0], temperature=2.0, top_k=1 + 1, repetition_penalty=2.0)
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    got = proc.log_probs(logits, proc.rows(tokens, [[]]), [1])
    want = torch.log_softmax(torch.tensor([1.0, 1.0, 0.0]) / 2.0, -1)[1]
    assert math.isclose(got[0], float(want), rel_tol=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"bad_words": ("",)}, "bad_words"),
    ({"bad_token_ids": ((),)}, "bad word"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


# -- an independent reference: plain decoding, penalties written out per the rules ---------------
def _reference_scores(logits: torch.Tensor, prompt: list[int], out: list[int], p: dict) -> torch.Tensor:
    logits = logits.clone().float()
    for t in set(prompt + out):
        if p.get("repetition_penalty", 1.0) != 1.0:
            r = p["repetition_penalty"]
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
    for t in set(out):
        logits[t] -= p.get("presence_penalty", 0.0) + p.get("frequency_penalty", 0.0) * out.count(t)
    for word in p.get("bad_token_ids", ()):
        if len(word) == 1 or (prompt + out)[-(len(word) - 1):] == list(word[:-1]):
            logits[word[-1]] = NEG
    if len(out) < p.get("min_tokens", 0):
        for t in p.get("_end_ids", ()):
            logits[t] = NEG
    return logits


def _reference_greedy(target, prompt: list[int], n: int, p: dict) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(_reference_scores(logits, prompt, out, p).argmax()))
    return out


PENALTIES = [
    dict(repetition_penalty=1.6),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(repetition_penalty=0.7, bad_token_ids=((18,), (15, 3))),
]


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    return tiny_decoder_with_every_drafter()


PROMPT = [1, 2, 3, 4, 1, 2, 3]


@pytest.mark.parametrize("p", PENALTIES)
def test_greedy_speculation_with_penalties_equals_the_reference(decoder, p):
    want = _reference_greedy(decoder.target, PROMPT, 16, p)
    assert want != _reference_greedy(decoder.target, PROMPT, 16, {})  # the settings matter here
    params = SamplingParams(max_tokens=16, ignore_eos=True, **p)
    drafted = 0
    for mode in ("off", "ngram", "draft", "medusa", "eagle"):
        spec = SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=3),
                                 fallback=FallbackConfig(enabled=False))
        result = decoder.generate(PROMPT, params, spec)
        assert result.token_ids == want, mode
        drafted += result.stats.drafted_tokens
    assert drafted > 0


def test_min_tokens_holds_back_the_end_token(decoder):
    """With the plain output's first token as end_id, min_tokens = 5 gives 5 tokens or more,
    identical to the reference with that token masked for the first 5 positions."""
    first = _reference_greedy(decoder.target, PROMPT, 1, {})[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=((first,),), min_tokens=5)
    want = _reference_greedy(decoder.target, PROMPT, 5, {"min_tokens": 5, "_end_ids": [first]})
    assert first not in want
    for mode in ("off", "ngram", "draft", "medusa"):
        result = decoder.generate(PROMPT, params, SpeculationConfig(method=mode,
                                                                    draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False)))
        assert result.token_ids[:5] == want and len(result.token_ids) >= 5, mode
    plain = decoder.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=((first,),)))
    assert plain.token_ids == []  # without min_tokens it stops at once


def test_batched_with_penalties_equals_each_alone(decoder):
    requests = []
    for i, mode in enumerate(["ngram", "draft", "medusa", "eagle", "off", "draft"]):
        sampling = i % 2 == 1
        params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9 if sampling else 0.0,
                                seed=50 + i if sampling else None, return_log_probs=True, **PENALTIES[i % 3])
        requests.append((PROMPT[i:] or [5], params, SpeculationConfig(method=mode,
                                                                      draft_length=DraftLengthConfig(num_draft_tokens=3))))
    alone = [decoder.generate(p, params, spec) for p, params, spec in requests]
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4))
    try:
        clients = submit_all(scheduler, requests)
        assert [c.tokens() for c in clients] == [r.token_ids for r in alone]
        batched_lp = [[lp for ch in c.chunks for lp in (ch.log_probs or [])] for c in clients]
        for got, want in zip(batched_lp, alone):
            assert len(got) == len(want.token_ids) and all(x <= 0 for x in got)
    finally:
        scheduler.shutdown()


def test_log_probs_streamed_per_token_match_the_reference(decoder):
    p = dict(repetition_penalty=1.4)
    params = SamplingParams(max_tokens=8, ignore_eos=True, return_log_probs=True, **p)
    chunks = list(decoder.stream(PROMPT, params, SpeculationConfig(method="ngram",
                                                                   draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False))))
    tokens = [t for c in chunks for t in c.token_ids]
    log_probs = [x for c in chunks for x in (c.log_probs or [])]
    assert len(log_probs) == len(tokens) == 8
    for i, (token, lp) in enumerate(zip(tokens, log_probs)):
        with torch.inference_mode():
            logits = decoder.target.model(torch.tensor([PROMPT + tokens[:i]])).logits[0, -1]
        want = torch.log_softmax(_reference_scores(logits, PROMPT, tokens[:i], p), -1)[token]
        assert math.isclose(lp, float(want), abs_tol=1e-4)


def test_top_log_probs_are_the_most_likely_of_the_same_distribution():
    proc, tokens = _processor([0], temperature=2.0, repetition_penalty=2.0)
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.5], [0.0, 3.0, 1.0, 2.0]])
    chosen, top = proc.log_probs_and_top(logits, proc.rows(tokens, [[], []]), [2, 1], 2)
    assert chosen == proc.log_probs(logits, proc.rows(tokens, [[], []]), [2, 1])
    want = torch.log_softmax(torch.tensor([1.0, 1.0, 0.0, 1.5]) / 2.0, -1)  # token 0 seen: 2.0 / 2
    assert top[0][0] == (3, 0) or top[0][0] == (3, 1)  # 1.5 first, then a tie of 1.0
    assert top[0][1] == pytest.approx([float(want[3]), float(want[0])], rel=1e-6)
    assert top[1][0] == (1, 3) and top[1][1][0] >= top[1][1][1]
    assert proc.log_probs_and_top(logits, proc.rows(tokens, [[], []]), [2, 1], 0)[1] == []
    with pytest.raises(InvalidRequestError, match="top_log_probs needs return_log_probs"):
        SamplingParams(top_log_probs=2)
    with pytest.raises(InvalidRequestError, match="top_log_probs"):
        SamplingParams(return_log_probs=True, top_log_probs=21)


def test_top_log_probs_streamed_match_the_reference_and_leave_greedy_output_unchanged(decoder):
    spec = SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=3),
                             fallback=FallbackConfig(enabled=False))
    params = SamplingParams(max_tokens=8, ignore_eos=True, return_log_probs=True, top_log_probs=4)
    chunks = list(decoder.stream(PROMPT, params, spec))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == decoder.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), spec).token_ids
    log_probs = [x for c in chunks for x in (c.log_probs or [])]
    top = [x for c in chunks for x in (c.top_log_probs or [])]
    assert len(top) == len(log_probs) == len(tokens) == 8
    for i, (token, lp, (ids, values)) in enumerate(zip(tokens, log_probs, top)):
        with torch.inference_mode():
            logits = decoder.target.model(torch.tensor([PROMPT + tokens[:i]])).logits[0, -1]
        want = torch.topk(torch.log_softmax(logits, -1), 4)
        assert ids[0] == token and math.isclose(values[0], lp, abs_tol=1e-6)  # greedy: the chosen token is first
        assert list(ids) == want.indices.tolist() and values == pytest.approx(want.values.tolist(), abs=1e-4)


# -- statistics: sampling through speculation follows the penalised target ------------------
def _exact_joint(target, prompt, horizon, temperature, p):
    dist = {(): 1.0}
    for _ in range(horizon):
        nxt = {}
        for seq, mass in dist.items():
            with torch.inference_mode():
                logits = target.model(torch.tensor([list(prompt) + list(seq)])).logits[0, -1]
            probs = torch.softmax(_reference_scores(logits, prompt, list(seq), p) / temperature, -1)
            for tok, q in enumerate(probs.tolist()):
                if q > 0:
                    nxt[seq + (tok,)] = mass * q
        dist = nxt
    return dist


@pytest.mark.parametrize("mode,p", [
    ("draft", dict(presence_penalty=1.0, frequency_penalty=1.5)),
    ("ngram", dict(repetition_penalty=3.0, bad_token_ids=((1, 2),))),
])
def test_sampling_with_penalties_matches_the_penalised_target(mode, p):
    vocab = 8
    target, draft = tiny_engine(10, vocab=vocab), tiny_engine(20, vocab=vocab, sharpness=1.0)
    decoder = SpeculativeDecoder(target, None, drafters={
        SpeculationMode.DRAFT: DraftModelDrafter(draft, target=target),
        SpeculationMode.NGRAM: NgramDrafter(1, 1),
    })
    prompt = [1, 2, 1, 3, 1]
    exact = _exact_joint(target, prompt, 2, 1.0, p)
    plain = _exact_joint(target, prompt, 2, 1.0, {})
    assert 0.5 * sum(abs(exact.get(s, 0) - plain.get(s, 0)) for s in set(exact) | set(plain)) > 0.1
    n, counts, drafted = 2000, {}, 0
    spec = SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=2),
                             fallback=FallbackConfig(enabled=False))
    for seed in range(n):
        result = decoder.generate(prompt, SamplingParams(max_tokens=2, seed=seed, temperature=1.0, **p), spec)
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        drafted += result.stats.drafted_tokens
    assert drafted > 0
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in set(exact) | set(counts))
    assert tv < 0.07, tv
    assert all(s in exact for s in counts), "sampled a sequence the penalised target forbids"
