"""``auto``: per round, the n-gram match or the model drafter (EAGLE, draft model, Medusa),
whichever is expected to commit more tokens per unit of pass cost. Exactness does not depend on
the choice: greedy output equals plain decoding token for token (tiny llamas, every model
drafter, alone and batched; the real reference model with its EAGLE drafter), and seeded
sampling follows the target's exact distribution (total-variation bound)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import tiny_engine
from test_eagle import _exact_joint, _random_drafter
from test_medusa_tree import random_heads
from test_scheduler import assert_mixed_batch_matches_alone
from triton_backend.core.config import (DraftLengthConfig, EagleConfig, FallbackConfig, SamplingParams, SpeculationConfig,
                                        SpeculationMode)
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.speculation.auto_source import AutoSource, DraftSource
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.eagle import EagleDrafter
from triton_backend.speculation.drafters.medusa import MedusaDrafter
from triton_backend.speculation.drafters.medusa_model import MedusaCheckpoint
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.loop import SpeculativeDecoder

pytestmark = pytest.mark.usefixtures("default_pass_costs")

REFERENCE_DRAFTER = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m-eagle"
# repetitive prompts (lookup finds matches) and one without repeats
PROMPTS = ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 3, 9, 7, 3, 9, 7, 3], [4, 8, 15, 16, 23, 30])


@pytest.fixture
def sources(monkeypatch) -> dict[DraftSource, int]:
    """Counts the rounds each source drafted (a spy on the real choice)."""
    counts = {DraftSource.NGRAM: 0, DraftSource.MODEL: 0}
    real, real_model = AutoSource.propose, AutoSource.model_round

    def counted(self, tokens, k, processor, generator, tree):
        proposal = real(self, tokens, k, processor, generator, tree)
        if k > 0 and proposal is not None:
            counts[DraftSource.NGRAM] += 1
        return proposal

    def model(self):  # every model round, whether it proposes through propose (chains) or not (EAGLE trees)
        counts[DraftSource.MODEL] += 1
        real_model(self)

    monkeypatch.setattr(AutoSource, "propose", counted)
    monkeypatch.setattr(AutoSource, "model_round", model)
    return counts


def _model_drafter(kind: SpeculationMode, target):
    if kind is SpeculationMode.EAGLE:
        drafter = _random_drafter(target, seed=3)
    elif kind is SpeculationMode.DRAFT:
        drafter = DraftModelDrafter(tiny_engine(1, vocab=32), target=target)
    else:
        drafter = MedusaDrafter(MedusaCheckpoint(random_heads(32, 32)), target)
    drafter.relative_cost = 0.02  # as cheap as a real drafter is against a real target
    return drafter


def _decoder(kind: SpeculationMode) -> SpeculativeDecoder:
    target = tiny_engine(0, vocab=32)
    return SpeculativeDecoder(target, None, drafters={kind: _model_drafter(kind, target),
                                                      SpeculationMode.NGRAM: NgramDrafter(1, 3)})


def _auto(k: int = 3, prior: float = 0.9, tree: bool = True) -> SpeculationConfig:
    return SpeculationConfig(method="auto", draft_length=DraftLengthConfig(num_draft_tokens=k),
                             fallback=FallbackConfig(prior_acceptance=prior, probe_interval=2), eagle=EagleConfig(tree=tree))


@pytest.mark.parametrize("kind", [SpeculationMode.EAGLE, SpeculationMode.DRAFT, SpeculationMode.MEDUSA])
def test_auto_greedy_identical_to_plain_and_uses_both_sources(kind, sources):
    decoder = _decoder(kind)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        auto = decoder.generate(prompt, params, _auto())
        assert auto.token_ids == plain.token_ids, prompt
        assert auto.stats.method == kind.value
    assert sources[DraftSource.NGRAM] > 0 and sources[DraftSource.MODEL] > 0, sources


def test_auto_without_ngram_deployed_is_the_model_drafter(sources):
    target = tiny_engine(0, vocab=32)
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.EAGLE: _model_drafter(SpeculationMode.EAGLE,
                                                                                                 target)})
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    auto = decoder.generate(PROMPTS[0], params, _auto())
    assert auto.token_ids == decoder.generate(PROMPTS[0], params, SpeculationConfig(method="off")).token_ids
    assert sources == {DraftSource.NGRAM: 0, DraftSource.MODEL: 0}  # no AutoSource at all


def _auto_sampling_tv(n: int) -> tuple[float, set]:
    """Total variation between auto's samples of the next 2 tokens and the target's exact joint
    distribution, and the outcomes sampled."""
    target = tiny_engine(10, vocab=8)
    drafter = _random_drafter(target, scale=0.5)
    drafter.relative_cost = 0.02
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.EAGLE: drafter,
                                                         SpeculationMode.NGRAM: NgramDrafter(1, 3)})
    params = dict(temperature=1.0)
    prompt = [1, 2, 1, 3, 1, 2]
    exact = _exact_joint(target, prompt, 2, LogitsProcessor(**params))
    counts: dict = {}
    for seed in range(n):
        # EAGLE chains: a tree (more expected tokens per unit of cost) would win every round here
        result = decoder.generate(prompt, SamplingParams(max_tokens=3, seed=seed, **params), _auto(k=2, tree=False))
        key = tuple(result.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in set(exact) | set(counts))
    return tv, set(counts) - set(exact)


def test_auto_sampling_matches_target_distribution(sources, monkeypatch):
    """Samples through auto rounds (n-gram and EAGLE drafts, chosen per round) follow the
    target's exact joint distribution; a control that keeps every n-gram draft must fail."""
    tv, impossible = _auto_sampling_tv(1500)
    assert sources[DraftSource.NGRAM] > 100 and sources[DraftSource.MODEL] > 100, sources
    assert tv < 0.08, tv  # sampling noise at n=1500 over <=64 outcomes is ~0.05
    assert not impossible

    import triton_backend.speculation.run_state as run_state
    from triton_backend.core.sampling import sample
    from triton_backend.speculation.verify import VerifyResult

    exact_rule = run_state.verify_rejection

    def keep_lookup_drafts(target_probs, drafts, draft_probs, generator):
        if draft_probs is not None:
            return exact_rule(target_probs, drafts, draft_probs, generator)
        k = len(drafts)
        return VerifyResult(k, k, sample(target_probs[k], generator))

    monkeypatch.setattr(run_state, "verify_rejection", keep_lookup_drafts)
    assert _auto_sampling_tv(400)[0] > 0.12  # the test can tell a biased rule


@pytest.mark.parametrize("kind", [SpeculationMode.EAGLE, SpeculationMode.DRAFT])
@pytest.mark.parametrize("policy", ["per_request", "load_aware"])
def test_auto_batched_identical_to_alone(kind, policy, sources):
    """Auto rows in the batch scheduler (EAGLE rows; draft-model rows, whose drafter runs batched
    across rows) give what each request gives alone, greedy and seeded sampling."""
    assert_mixed_batch_matches_alone(_decoder(kind), PROMPTS, _auto(), policy, base_tokens=16, base_seed=50)
    assert sources[DraftSource.NGRAM] > 0 and sources[DraftSource.MODEL] > 0, sources


@pytest.mark.slow
def test_reference_auto_greedy_identical_to_plain(reference, reference_prompts):
    """The real SmolLM2-135M-Instruct with its committed EAGLE drafter and n-gram lookup, auto:
    token for token the target's greedy output."""
    engine, tokenizer = reference
    decoder = SpeculativeDecoder(engine, tokenizer, drafters={
        SpeculationMode.EAGLE: EagleDrafter.from_file(str(REFERENCE_DRAFTER), engine),
        SpeculationMode.NGRAM: NgramDrafter(1, 3)})
    params = SamplingParams(max_tokens=32)
    drafted = 0
    for prompt in reference_prompts[:2]:
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        auto = decoder.generate(prompt, params, SpeculationConfig(method="auto"))
        assert auto.token_ids == plain.token_ids
        drafted += auto.stats.drafted_tokens
    assert drafted > 0
