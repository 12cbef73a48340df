"""``auto``: per round, the n-gram match or the model drafter (EAGLE, draft model, the target's
int8 self draft, Medusa; ``auto_drafter`` picks when several are deployed), whichever is expected
to commit more tokens per unit of pass cost. Exactness does not depend on the choice: greedy
output equals plain decoding token for token (tiny llamas, every model drafter, alone and
batched; the real reference model with its EAGLE drafter), and seeded sampling follows the
target's exact distribution (total-variation bound). A self draft taking its context from the
target copies it only in the rounds it drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import tiny_engine, tiny_llama
from test_eagle import _exact_joint, _random_drafter
from test_medusa_tree import random_heads
from test_scheduler import assert_mixed_batch_matches_alone
from triton_backend.core.config import (DraftLengthConfig, EagleConfig, FallbackConfig, SamplingParams,
                                        SpeculationConfig, SpeculationMode)
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ConfigError
from triton_backend.deployment.deployment_config import DeploymentConfig, SelfDraftConfig
from triton_backend.deployment.self_draft import self_draft_engine, self_drafter
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.model_loading import make_torch_engine
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.speculation.auto_source import AutoSource, DraftSource
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.eagle import EagleDrafter
from triton_backend.speculation.drafters.medusa import MedusaDrafter
from triton_backend.speculation.drafters.medusa_model import MedusaCheckpoint
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

pytestmark = pytest.mark.usefixtures("default_pass_costs")

needs_kernels = pytest.mark.skipif(row_gemm_module.cpu_isa() is None, reason="the CPU kernels need x86-64 with AVX2 + FMA")
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


def _sampling_decoder(kind: SpeculationMode) -> SpeculativeDecoder:
    """A vocabulary-8 target with n-gram lookup and ``kind``: a random EAGLE drafter, or (DRAFT)
    the target's own int8 self draft taking its context from the target's cache."""
    if kind is SpeculationMode.EAGLE:
        target = tiny_engine(10, vocab=8)
        drafter = _random_drafter(target, scale=0.5)
    else:
        target, drafter = _self_draft(tiny_llama(10, vocab=8, sharpness=1.0))
    drafter.relative_cost = 0.02
    return SpeculativeDecoder(target, None, drafters={kind: drafter, SpeculationMode.NGRAM: NgramDrafter(1, 3)})


def _auto_sampling_tv(n: int, kind: SpeculationMode = SpeculationMode.EAGLE) -> tuple[float, set]:
    """Total variation between auto's samples of 2 tokens and the target's exact joint
    distribution of them, and the outcomes sampled: the next 2 tokens; with the self draft, the
    2 after the first (the draft takes the prompt from the target's cache: the prompt's pass is a
    plain step, its next round drafts both)."""
    decoder = _sampling_decoder(kind)
    skip = 0 if kind is SpeculationMode.EAGLE else 1
    params = dict(temperature=1.0)
    prompt = [1, 2, 1, 3, 1, 2]
    exact: dict = {}
    for seq, mass in _exact_joint(decoder.target, prompt, skip + 2, LogitsProcessor(**params)).items():
        exact[seq[skip:]] = exact.get(seq[skip:], 0.0) + mass  # the first ``skip`` tokens marginalised out
    counts: dict = {}
    for seed in range(n):
        # EAGLE chains: a tree (more expected tokens per unit of cost) would win every round here
        result = decoder.generate(prompt, SamplingParams(max_tokens=skip + 3, seed=seed, **params),
                                  _auto(k=2, tree=False))
        key = tuple(result.token_ids[skip:skip + 2])
        counts[key] = counts.get(key, 0) + 1
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in set(exact) | set(counts))
    return tv, set(counts) - set(exact)


@pytest.mark.parametrize("kind", [SpeculationMode.EAGLE,
                                  pytest.param(SpeculationMode.DRAFT, marks=needs_kernels, id="self-int8")])
def test_auto_sampling_matches_target_distribution(kind, sources, monkeypatch):
    """Samples through auto rounds (n-gram and model drafts, chosen per round: EAGLE, or the int8
    self draft catching up on the target's cache after lookup rounds) follow the target's exact
    joint distribution; a control that keeps every n-gram draft must fail."""
    tv, impossible = _auto_sampling_tv(1500, kind)
    assert sources[DraftSource.NGRAM] > 100 and sources[DraftSource.MODEL] > 100, sources
    assert tv < 0.08, tv  # sampling noise at n=1500 over <=64 outcomes is ~0.05
    assert not impossible
    if kind is not SpeculationMode.EAGLE:
        return  # the control below is the same rule for any model drafter

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


def _self_draft(model) -> tuple[LlamaEngine, DraftModelDrafter]:
    """A float32 slot engine over ``model`` and its int8 self draft taking the committed tokens'
    keys and values from the target's cache."""
    runtime = RuntimeConfig(max_batch_size=4, max_seq_len=96)
    config = SelfDraftConfig(precision=WeightPrecision.INT8, context="committed")
    draft = self_draft_engine(model, runtime, config, name="tiny", eos_token_ids=[])
    target = make_torch_engine(model, name="tiny", runtime=runtime, eos_token_ids=[])
    return target, self_drafter(draft, target, config, measure=False)


def _self_draft_decoder() -> SpeculativeDecoder:
    target, drafter = _self_draft(tiny_llama(0, vocab=32, layers=4, hidden=64))
    drafter.relative_cost = 0.05
    return SpeculativeDecoder(target, None, drafters={SpeculationMode.DRAFT: drafter,
                                                      SpeculationMode.NGRAM: NgramDrafter(1, 3)})


@needs_kernels
def test_auto_with_a_self_draft_is_exact_and_catches_up_only_when_it_drafts(sources, monkeypatch):
    """``auto`` with the int8 self draft (context from the target's cache) beside n-gram lookup:
    greedy output is plain decoding's; the draft copies the target's keys and values only in the
    rounds it drafts (none in lookup rounds), each committed position at most once, so its catch-up
    after lookup rounds is one copy of what was committed since; it never runs a prompt position."""
    decoder = _self_draft_decoder()
    draft = decoder.drafters[SpeculationMode.DRAFT].engine
    copies: list[tuple[int, int]] = []
    starts: list[int] = []
    real_copy, real_forward = LlamaEngine.copy_kv_from, draft.forward

    def copy(self, source, source_slot, slot, start, end, layers=None):
        copies.append((start, end))
        real_copy(self, source, source_slot, slot, start, end, layers)

    def forward(rows):
        starts.extend(r.start for r in rows)
        return real_forward(rows)

    monkeypatch.setattr(LlamaEngine, "copy_kv_from", copy)
    monkeypatch.setattr(draft, "forward", forward)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    caught_up = 0
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        before = dict(sources)
        copies.clear()
        auto = decoder.generate(prompt, params, _auto(k=4))
        assert auto.token_ids == plain.token_ids, prompt
        assert auto.stats.method == "draft"
        model_rounds = sources[DraftSource.MODEL] - before[DraftSource.MODEL]
        assert len(copies) <= model_rounds, (copies, model_rounds)
        assert all(a < b for a, b in copies) and all(b <= a for (_, b), (a, _) in zip(copies, copies[1:])), copies
        assert min(starts) >= len(prompt), "the self draft ran the prompt itself"
        caught_up = max([caught_up] + [b - a for a, b in copies[1:]])
        starts.clear()
    assert sources[DraftSource.NGRAM] > 0 and sources[DraftSource.MODEL] > 0, sources
    assert caught_up > 1  # some catch-up copied several rounds' positions at once (lookup rounds before it)


@needs_kernels
@pytest.mark.parametrize("policy", ["per_request", "load_aware"])
def test_auto_with_a_self_draft_batched_identical_to_alone(policy, sources):
    """Auto rows with the self draft in the batch scheduler (the draft batched across rows, taking
    each row's context from its target slot), greedy and seeded sampling: as each request alone."""
    assert_mixed_batch_matches_alone(_self_draft_decoder(), PROMPTS, _auto(k=4), policy, base_tokens=16, base_seed=70)
    assert sources[DraftSource.NGRAM] > 0 and sources[DraftSource.MODEL] > 0, sources


def test_auto_drafter_picks_the_model_drafter_auto_pairs_with_lookup():
    """With EAGLE and a draft model deployed, ``auto`` drafts with EAGLE unless ``auto_drafter``
    (the deployment's or the request's) names the draft model; a non-model drafter or one the
    deployment lacks is a ConfigError."""
    target = tiny_engine(0, vocab=32)
    drafters = {SpeculationMode.EAGLE: _model_drafter(SpeculationMode.EAGLE, target),
                SpeculationMode.DRAFT: _model_drafter(SpeculationMode.DRAFT, target),
                SpeculationMode.NGRAM: NgramDrafter(1, 3)}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = SpeculativeDecoder(target, None, drafters=drafters).generate(PROMPTS[0], params, SpeculationConfig(method="off"))
    for deployed, requested, method in ((None, None, "eagle"), (None, "draft", "draft"), ("draft", None, "draft"),
                                        ("draft", "eagle", "eagle")):
        decoder = SpeculativeDecoder(target, None, drafters=drafters,
                                     speculation=SpeculationConfig(auto_drafter=deployed))
        result = decoder.generate(PROMPTS[0], params, SpeculationConfig(method="auto", auto_drafter=requested))
        assert result.stats.method == method and result.token_ids == plain.token_ids
    assert SpeculationConfig.from_dict({"auto_drafter": "draft"}).auto_drafter is SpeculationMode.DRAFT
    for bad, message in (("ngram", "must be one of"), ("auto", "must be one of"), ("eagle2", "unknown speculation mode")):
        with pytest.raises(ConfigError, match=message):
            SpeculationConfig.from_dict({"auto_drafter": bad})
    assert DeploymentConfig.from_dict({"self_draft": {}, "speculation": {"auto_drafter": "draft"}}).model_drafters() == [
        SpeculationMode.DRAFT]
    with pytest.raises(ConfigError, match="'eagle' is not deployed"):
        DeploymentConfig.from_dict({"self_draft": {}, "speculation": {"auto_drafter": "eagle"}})


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
