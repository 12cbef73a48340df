"""The full draft-then-verify loop on tiny random Llamas: KV rollback, draft == target,
greedy exactness, and the statistical exactness of sampling through the whole loop."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import tiny_engine
from triton_backend.core.config import (
    DraftLengthConfig, FallbackConfig, FinishReason, SamplingParams, SpeculationConfig, SpeculationMode,
)
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.core.errors import ContextLengthError, InvalidRequestError, VocabMismatchError
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.core.sampling import LogitsProcessor

NO_FALLBACK = dict(fallback=FallbackConfig(enabled=False))


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_engine(0), tiny_engine(1)
    decoder = SpeculativeDecoder(target, None, drafters={
        SpeculationMode.DRAFT: DraftModelDrafter(draft, target=target),
        SpeculationMode.NGRAM: NgramDrafter(1, 3),
    })
    return target, draft, decoder


def test_kv_rollback_matches_fresh_forward(pair):
    target, _, _ = pair
    session = target.new_session()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.vocab_size, (6,), generator=g).tolist()
    for _ in range(25):  # rounds of "verify k drafts, accept some, reject the rest"
        k = int(torch.randint(1, 6, (1,), generator=g))
        drafts = torch.randint(0, target.vocab_size, (k,), generator=g).tolist()
        session.logits(tokens + drafts, k + 1)
        accepted = int(torch.randint(0, k + 1, (1,), generator=g))
        tokens = tokens + drafts[:accepted] + [int(torch.randint(0, target.vocab_size, (1,), generator=g))]
    cached = session.logits(tokens, 3)
    with torch.inference_mode():
        fresh = target.model(torch.tensor([tokens])).logits[0, -3:]
    assert torch.allclose(cached, fresh, atol=1e-4, rtol=1e-4)
    assert session.cached_length == len(tokens)


def test_rollback_to_zero_resets(pair):
    target, _, _ = pair
    session = target.new_session()
    a = session.logits([1, 2, 3], 3)
    b = session.logits([4, 2, 3], 3)  # nothing in common: the cache must restart
    with torch.inference_mode():
        fresh = target.model(torch.tensor([[4, 2, 3]])).logits[0]
    assert torch.allclose(b, fresh, atol=1e-5) and not torch.allclose(a, b)


@pytest.mark.parametrize("mode,k", list(itertools.product(["draft", "ngram"], [1, 3, 6])))
def test_greedy_identical_to_plain(pair, mode, k):
    _, _, decoder = pair
    params = SamplingParams(max_tokens=40)
    for prompt in ([1, 2, 3], [5, 5, 5, 5], [7, 1, 9, 1, 7, 1]):
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        spec = decoder.generate(prompt, params, SpeculationConfig(method=mode,
                                                                  draft_length=DraftLengthConfig(num_draft_tokens=k), **NO_FALLBACK))
        assert spec.token_ids == plain.token_ids
        assert plain.stats.target_passes == 40


def test_draft_equal_to_target_accepts_all():
    target = tiny_engine(0)
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.DRAFT: DraftModelDrafter(tiny_engine(0), target=target)})
    for params in (SamplingParams(max_tokens=31), SamplingParams(max_tokens=31, temperature=0.8, seed=3)):
        # a draft as dear as the target never pays under the gain rule: force drafting
        spec = decoder.generate([3, 4], params, SpeculationConfig(method="draft",
                                                                  draft_length=DraftLengthConfig(num_draft_tokens=5), **NO_FALLBACK))
        plain = decoder.generate([3, 4], params, SpeculationConfig(method="off"))
        assert spec.stats.acceptance_rate == 1.0 and spec.stats.drafted_tokens > 0
        assert spec.stats.target_passes == 31 // 6 + (31 % 6 > 0)
        if params.greedy:
            assert spec.token_ids == plain.token_ids


def test_sampling_is_seeded(pair):
    _, _, decoder = pair
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234)
    spec = SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=3))
    assert decoder.generate([1, 2], params, spec).token_ids == decoder.generate([1, 2], params, spec).token_ids


def _exact_joint(target, prompt, horizon, processor):
    """The target's exact distribution over the next ``horizon`` tokens (by enumeration)."""
    vocab = target.vocab_size
    dist = {(): 1.0}
    for _ in range(horizon):
        nxt = {}
        for seq, mass in dist.items():
            with torch.inference_mode():
                logits = target.model(torch.tensor([list(prompt) + list(seq)])).logits[0, -1:]
            probs = processor.probs(logits)[0]
            for tok in range(vocab):
                if probs[tok] > 0:
                    nxt[seq + (tok,)] = mass * float(probs[tok])
        dist = nxt
    return dist


@pytest.mark.parametrize(
    "params,mode",
    [
        (dict(temperature=1.0), "draft"),
        (dict(temperature=0.7, top_k=5), "draft"),
        (dict(temperature=1.3, top_p=0.8), "draft"),
        (dict(temperature=1.0), "ngram"),
    ],
)
def test_sampling_matches_target_distribution(params, mode):
    """Whole-loop statistical exactness: speculative samples of the next 2 tokens follow the
    target's exact joint distribution (total variation bound, fixed seeds)."""
    vocab = 8
    target, draft = tiny_engine(10, vocab=vocab), tiny_engine(20, vocab=vocab, sharpness=1.0)
    decoder = SpeculativeDecoder(target, None, drafters={
        SpeculationMode.DRAFT: DraftModelDrafter(draft, target=target),
        SpeculationMode.NGRAM: NgramDrafter(1, 1),
    })
    prompt = [1, 2, 1, 3, 1]  # n-gram lookup proposes after "1"
    exact = _exact_joint(target, prompt, 2, LogitsProcessor(**params))
    n = 3000
    counts: dict[tuple[int, ...], int] = {}
    spec = SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=2),
                             fallback=FallbackConfig(enabled=False))
    drafted = 0
    for seed in range(n):
        result = decoder.generate(prompt, SamplingParams(max_tokens=2, seed=seed, **params), spec)
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        drafted += result.stats.drafted_tokens
    assert drafted > 0  # speculation really happened
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in keys)
    assert tv < 0.06, tv  # sampling noise at n=3000 over <=64 outcomes is ~0.03-0.04
    assert all(s in exact for s in counts), "sampled a sequence the target forbids"


def test_sampling_with_a_confidence_stop_matches_target_distribution():
    """A draft that stops a round after a token it gave a top-1 probability below ``stop_below``
    (its proposal length then depends on its own ``q``): three sampled tokens still follow the
    target's distribution, the first two jointly and the third's marginal (total variation)."""
    vocab = 8
    target, draft = tiny_engine(10, vocab=vocab), tiny_engine(20, vocab=vocab, sharpness=1.0)
    drafter = DraftModelDrafter(draft, target=target, stop_below=0.35)
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.DRAFT: drafter})
    prompt = [1, 2, 1, 3, 1]
    processor = LogitsProcessor(temperature=1.0)
    exact = _exact_joint(target, prompt, 3, processor)
    spec = SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=2), **NO_FALLBACK)
    n = 3000
    pairs: dict[tuple[int, ...], int] = {}
    thirds: dict[int, int] = {}
    rounds = drafted = 0
    for seed in range(n):
        result = decoder.generate(prompt, SamplingParams(max_tokens=3, seed=seed, temperature=1.0), spec)
        out = tuple(result.token_ids)
        pairs[out[:2]] = pairs.get(out[:2], 0) + 1
        thirds[out[2]] = thirds.get(out[2], 0) + 1
        rounds += result.stats.speculative_rounds
        drafted += result.stats.drafted_tokens
    assert 0 < drafted < 2 * rounds  # drafting happened, and some rounds stopped after one token
    exact_pairs: dict[tuple[int, ...], float] = {}
    exact_thirds: dict[int, float] = {}
    for seq, mass in exact.items():
        exact_pairs[seq[:2]] = exact_pairs.get(seq[:2], 0.0) + mass
        exact_thirds[seq[2]] = exact_thirds.get(seq[2], 0.0) + mass
    for counts, want in ((pairs, exact_pairs), (thirds, exact_thirds)):
        tv = 0.5 * sum(abs(counts.get(s, 0) / n - want.get(s, 0.0)) for s in set(counts) | set(want))
        assert tv < 0.06, tv


def test_clear_errors(pair):
    target, _, decoder = pair
    with pytest.raises(InvalidRequestError, match="empty"):
        decoder.generate([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="out of range"):
        decoder.generate([target.vocab_size + 5], SamplingParams())
    with pytest.raises(ContextLengthError, match="context"):
        decoder.generate([1] * target.max_context, SamplingParams())
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        decoder.generate("text", SamplingParams())
    with pytest.raises(VocabMismatchError, match="vocabulary"):
        DraftModelDrafter(tiny_engine(3, vocab=16), target=target)
    only_ngram = SpeculativeDecoder(target, None, drafters={SpeculationMode.NGRAM: NgramDrafter()})
    with pytest.raises(InvalidRequestError, match="not available"):
        only_ngram.generate([1, 2], SamplingParams(), SpeculationConfig(method="draft"))


def test_generation_stops_at_context(pair):
    target, _, decoder = pair
    prompt = [1] * (target.max_context - 5)
    result = decoder.generate(prompt, SamplingParams(max_tokens=50), SpeculationConfig(method="draft",
                                                                                       draft_length=DraftLengthConfig(num_draft_tokens=4)))
    assert len(result.token_ids) == 5 and result.finish_reason is FinishReason.LENGTH


def test_stop_sequence_inside_accepted_block(pair):
    _, _, decoder = pair
    plain = decoder.generate([1, 2, 3], SamplingParams(max_tokens=30), SpeculationConfig(method="off")).token_ids
    stop = tuple(plain[10:12])
    cut = next(i for i in range(len(plain) - 1) if tuple(plain[i:i + 2]) == stop)
    params = SamplingParams(max_tokens=30, stop_token_ids=(stop,))
    for mode in ("off", "draft", "ngram"):
        chunks = list(decoder.stream([1, 2, 3], params, SpeculationConfig(method=mode,
                                                                          draft_length=DraftLengthConfig(num_draft_tokens=6), **NO_FALLBACK)))
        streamed = [t for c in chunks for t in c.token_ids]
        assert streamed == plain[:cut] and chunks[-1].finish_reason is FinishReason.STOP


def test_stats_are_consistent(pair):
    _, _, decoder = pair
    r = decoder.generate([1, 2, 3], SamplingParams(max_tokens=40), SpeculationConfig(method="draft",
                                                                                     draft_length=DraftLengthConfig(num_draft_tokens=4), **NO_FALLBACK))
    s = r.stats
    assert s.generated_tokens == 40 == len(r.token_ids)
    assert s.generated_tokens == s.accepted_tokens + s.target_passes
    assert sum(s.drafted_per_position) == s.drafted_tokens and sum(s.accepted_per_position) == s.accepted_tokens
    assert 0 <= s.acceptance_rate <= 1 and s.time_to_first_token_s > 0 and s.total_time_s >= s.time_to_first_token_s
    # the target's passes are timed apart from the rest of the round (the draft model's passes are the rest)
    assert 0 < s.target_pass_time_s < s.total_time_s
    d = s.to_dict()
    assert d["acceptance_rate"] == s.acceptance_rate and d["method"] == "draft"


def test_target_pass_time_is_the_sessions_passes_only(pair):
    """What the stats call the target's pass time is the time its session spent in the engine's
    passes: a round's drafting (here a draft model made slow on purpose) falls outside it."""
    import time

    target, draft, _ = pair

    class SlowDrafter(DraftModelDrafter):
        def new_session(self):
            session = super().new_session()
            propose = session.propose

            def slow(*args, **kwargs):
                time.sleep(0.01)
                return propose(*args, **kwargs)

            session.propose = slow
            return session

    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.DRAFT: SlowDrafter(draft, target=target)})
    r = decoder.generate([1, 2, 3], SamplingParams(max_tokens=12), SpeculationConfig(
        method="draft", draft_length=DraftLengthConfig(num_draft_tokens=2), **NO_FALLBACK))
    s = r.stats
    rounds_drafted = s.speculative_rounds
    assert rounds_drafted >= 1
    assert s.total_time_s - s.target_pass_time_s >= 0.01 * rounds_drafted  # the sleeps are outside the passes
    assert s.target_pass_time_s > 0
