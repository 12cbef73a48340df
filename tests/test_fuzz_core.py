"""Property-based fuzzing of the core's Python API: SamplingParams, SpeculationConfig,
RuntimeConfig and DeploymentConfig with values of any type, the logits processor with any
finite temperature, and SpeculativeDecoder (tiny random Llamas, draft + n-gram drafters)
with any prompt, sampling parameters and speculation settings.

Every call either works (and the answer is right: greedy output identical to plain
decoding, streamed chunks adding up to the result, token counts within bounds) or raises a
typed :class:`~triton_backend.core.errors.SpecbuildError` with a short message. Nothing else.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_engine
from triton_backend.core.config import (DraftLengthConfig, FallbackConfig, FinishReason, SamplingParams,
                                        SpeculationConfig, SpeculationMode)
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.core.errors import InvalidRequestError, SpecbuildError
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.core.sampling import LogitsProcessor

EXAMPLES = int(os.environ.get("SPECBUILD_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VOCAB = 32

# any value a caller might pass, of any type
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.binary(max_size=4), st.lists(st.integers(-3, 40), max_size=3),
    st.lists(st.lists(st.integers(-3, 40), max_size=3), max_size=2), st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _assert_typed(exc: BaseException) -> None:
    assert isinstance(exc, SpecbuildError), f"{type(exc).__name__} instead of a typed error: {exc}"
    message = str(exc)
    assert message and len(message) < 400 and "\n" not in message and "Traceback" not in message, message


def _build(factory: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return factory(**kwargs)
    except Exception as exc:  # the property: only typed errors
        _assert_typed(exc)
        return None


@FUZZ
@given(st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                                        "stop_token_ids", "ignore_eos"]), ANY))
def test_sampling_params_accept_or_raise_a_typed_error(kwargs: dict[str, Any]) -> None:
    params = _build(SamplingParams, kwargs)
    if params is not None:
        assert params.max_tokens >= 1 and params.temperature >= 0 and 0 < params.top_p <= 1
        assert all(isinstance(s, str) and s for s in params.stop)


CROSS_REQUEST = st.fixed_dictionaries({}, optional={  # ngram.cross_request
    name: st.one_of(ANY, st.sampled_from(["frequent", "recent", 64, 4096]))
    for name in ("enabled", "max_tokens", "min_match", "continuation", "nonsense")})
SECTION = st.one_of(ANY, st.fixed_dictionaries({}, optional={
    name: st.one_of(ANY, st.sampled_from(["gain", "threshold", "exact", "typical"]), CROSS_REQUEST)
    for name in ("num_draft_tokens", "min_draft_tokens", "adaptive", "enabled", "rule", "threshold", "window",
                 "min_n", "max_n", "cross_request", "tree_acceptance", "typical_alpha", "tree", "max_tree_nodes",
                 "tree_top_k", "nonsense")}))


@FUZZ
@given(st.dictionaries(st.sampled_from(["method", "draft_length", "fallback", "ngram", "medusa",  # the nested spelling
                                        "mode", "num_draft_tokens", "adaptive", "min_draft_tokens",  # the flat one
                                        "fallback_window", "fallback_threshold", "fallback_min_drafted",
                                        "ngram_min", "ngram_max", "verify_cost_per_token", "tree_acceptance",
                                        "typical_threshold", "typical_alpha"]),
                       st.one_of(SECTION, st.sampled_from(["auto", "draft", "ngram", "off", "medusa", "exact"]))))
def test_speculation_config_accepts_or_raises_a_typed_error(data: dict[str, Any]) -> None:
    config = _build(SpeculationConfig.from_dict, {"data": data})
    if config is not None:
        assert isinstance(config.method, SpeculationMode) and 0 <= config.draft_length.num_draft_tokens <= 64


@FUZZ
@given(st.dictionaries(st.sampled_from(["device", "dtype", "num_threads", "packed_gemm_rows"]), ANY))
def test_runtime_config_accepts_or_raises_a_typed_error(kwargs: dict[str, Any]) -> None:
    _build(RuntimeConfig, kwargs)


@FUZZ
@given(st.dictionaries(st.sampled_from(["target", "draft", "draft_layers", "ngram", "medusa", "medusa_choices",
                                        "runtime", "speculation", "bogus"]),
                       st.one_of(ANY, st.fixed_dictionaries({}, optional={"dtype": ANY, "num_threads": ANY, "packed_gemm_rows": ANY}),
                                 st.fixed_dictionaries({}, optional={"mode": ANY, "num_draft_tokens": ANY,
                                                                     "nonsense": ANY}))))
def test_deployment_from_dict_accepts_or_raises_a_typed_error(data: dict[str, Any]) -> None:
    _build(DeploymentConfig.from_dict, {"data": data})


@FUZZ
@given(temperature=st.one_of(st.floats(min_value=0, exclude_min=True, allow_infinity=False, allow_subnormal=True),
                             st.sampled_from([1e-45, 1e-38, 1e-12, 3.4e38])),
       top_k=st.integers(0, 40),
       top_p=st.one_of(st.floats(min_value=0, max_value=1, exclude_min=True), st.just(5e-324)),
       seed=st.integers(0, 2**32))
def test_logits_processor_gives_a_distribution_for_any_temperature(temperature: float, top_k: int, top_p: float,
                                                                   seed: int) -> None:
    """Regression: a subnormal temperature made every logit +-inf and the softmax NaN; a top_p that
    is 0 in float32 dropped every token."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(seed)) * 8
    probs = LogitsProcessor(temperature, top_k, top_p).probs(logits)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-4)
    if temperature < 1e30:  # (beyond, the scaled logits tie and any of them may count as the most likely)
        assert (probs[torch.arange(3), logits.argmax(-1)] > 0).all()  # the most likely token is never dropped


# -- SpeculativeDecoder on tiny models -----------------------------------------------------------
@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    target = tiny_engine(0, vocab=VOCAB)
    return SpeculativeDecoder(target, None, drafters={
        SpeculationMode.DRAFT: DraftModelDrafter(tiny_engine(1, vocab=VOCAB), target=target),
        SpeculationMode.NGRAM: NgramDrafter(1, 3),
    })


PROMPTS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    st.lists(st.integers(-5, VOCAB + 5), max_size=6),  # empty, negative, out of the vocabulary
    st.lists(st.integers(0, VOCAB - 1), min_size=120, max_size=140),  # at / past the 128-token context
    st.text(max_size=5),  # no tokenizer: text is refused
)
SAMPLING = st.builds(
    SamplingParams, max_tokens=st.integers(1, 12),
    # (above MAX_TEMPERATURE, 2, a request is refused: check_sampling_values; the processor alone is fuzzed above)
    temperature=st.one_of(st.just(0.0), st.floats(0.01, 2.0), st.sampled_from([1e-45, 2.0])),
    top_k=st.sampled_from([0, 1, 3, 64]), top_p=st.sampled_from([1.0, 0.9, 0.3]),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop_token_ids=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2).map(tuple), max_size=2),
    ignore_eos=st.booleans(),
)
SPECULATION = st.builds(
    SpeculationConfig, method=st.sampled_from(list(SpeculationMode)),
    draft_length=st.builds(DraftLengthConfig, num_draft_tokens=st.integers(0, 8), adaptive=st.booleans()),
    fallback=st.builds(FallbackConfig, enabled=st.booleans(), window=st.just(8), min_drafted=st.just(4),
                       threshold=st.floats(0, 1)),
)


@FUZZ
@given(prompt=PROMPTS, params=SAMPLING, spec=SPECULATION)
def test_decoder_answers_correctly_or_raises_a_typed_error(decoder: SpeculativeDecoder, prompt: Any,
                                                           params: SamplingParams, spec: SpeculationConfig) -> None:
    try:
        chunks = list(decoder.stream(prompt, params, spec))
    except Exception as exc:
        _assert_typed(exc)
        return
    last = chunks[-1]
    assert last.finished and not any(c.finished for c in chunks[:-1])
    tokens = [t for c in chunks for t in c.token_ids]
    stats = last.stats
    assert stats is not None and stats.generated_tokens == len(tokens) <= params.max_tokens
    assert all(0 <= t < VOCAB for t in tokens)
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    if last.finish_reason is FinishReason.LENGTH:
        assert len(tokens) == min(params.max_tokens, decoder.target.max_context - len(prompt))
    for seq in params.stop_token_ids:  # stop sequences never appear in the output
        assert not any(tuple(tokens[i:i + len(seq)]) == seq for i in range(len(tokens)))
    if params.greedy:  # exact speculation: the target's own greedy output
        plain = decoder.generate(prompt, params, SpeculationConfig(method=SpeculationMode.OFF))
        assert plain.token_ids == tokens
    elif params.seed is not None:  # seeded sampling is reproducible
        again = decoder.generate(prompt, params, spec)
        assert again.token_ids == tokens


def test_a_subnormal_temperature_samples_like_greedy(decoder: SpeculativeDecoder) -> None:
    """Regression (found by the serving fuzz): temperature=1e-45 crashed the verifier with
    'probability tensor contains either inf, nan'; it must behave as (almost) greedy."""
    params = SamplingParams(max_tokens=8, temperature=1e-45, seed=3)
    greedy = decoder.generate([1, 2, 3], SamplingParams(max_tokens=8), SpeculationConfig(method=SpeculationMode.OFF))
    for mode in (SpeculationMode.DRAFT, SpeculationMode.NGRAM, SpeculationMode.OFF):
        assert decoder.generate([1, 2, 3], params, SpeculationConfig(method=mode)).token_ids == greedy.token_ids


def test_decoder_rejects_what_it_cannot_serve(decoder: SpeculativeDecoder) -> None:
    with pytest.raises(InvalidRequestError, match="medusa"):
        decoder.generate([1, 2], SamplingParams(max_tokens=2), SpeculationConfig(method="medusa"))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        decoder.generate("text", SamplingParams(max_tokens=2))
