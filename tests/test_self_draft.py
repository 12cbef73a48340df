"""The target as its own draft (``self_draft``: the loaded target's weights quantized at load,
optionally fewer layers): its config and errors; on a tiny random Llama, greedy speculative output
equal to plain float32 decoding alone and batched, with the draft sharing the target's embedding
and holding int8/int4 linears; its cost measured against the target's step; on the real reference
model (slow), the deployment built from ``self_draft`` equal to plain float32 decoding. Sampling
through a draft model (exact rejection sampling, whatever the drafter) is covered statistically by
tests/test_loop_tiny.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.core.config import (DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig,
                                        SpeculationMode)
from triton_backend.core.runtime_config import DraftContext, RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ConfigError
from triton_backend.deployment.deployment_config import DeploymentConfig, SelfDraftConfig
from triton_backend.deployment.self_draft import estimated_cost, self_draft_engine, self_drafter
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch.model_loading import make_torch_engine
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

from test_scheduler import submit_all

needs_kernels = pytest.mark.skipif(row_gemm_module.cpu_isa() is None, reason="the CPU kernels need x86-64 with AVX2 + FMA")
RUNTIME = RuntimeConfig(max_batch_size=4, max_seq_len=96)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9, 9, 8, 9, 9, 8], [3]]


def test_config_reads_and_refuses_bad_values():
    config = DeploymentConfig.from_dict({"self_draft": {"precision": "int4", "layers": [3, 0, 1]}})
    assert config.self_draft == SelfDraftConfig(precision=WeightPrecision.INT4, layers=(0, 1, 3))
    assert DeploymentConfig.from_dict({"self_draft": {}}).self_draft.precision is WeightPrecision.INT8
    tuned = DeploymentConfig.from_dict({"self_draft": {"context": "committed", "stop_below": 0.25}}).self_draft
    assert tuned.context is DraftContext.COMMITTED and tuned.stop_below == 0.25
    assert DeploymentConfig.from_dict(json_round_trip(DeploymentConfig(self_draft=tuned))).self_draft == tuned
    assert DeploymentConfig.from_dict(json_round_trip(config)) == config
    bad = [({"self_draft": {"precision": "int3"}}, "precision"),
           ({"self_draft": {"layers": [1, 2]}}, "layer 0"),
           ({"self_draft": {"layers": []}}, "non-empty"),
           ({"self_draft": {"layers": [0, -1]}}, "layer indices"),
           ({"self_draft": {"depth": 3}}, "unknown"),
           ({"self_draft": {"context": "target"}}, "context must be one of"),
           ({"self_draft": {"stop_below": 1.0}}, "stop_below"),
           ({"self_draft": {"stop_below": "high"}}, "stop_below"),
           ({"self_draft": {}, "draft_layers": [0, 1]}, "one draft"),
           ({"self_draft": {}, "draft": "smollm2-135m-instruct"}, "one draft"),
           ({"self_draft": {}, "runtime": {"weights": "int8"}}, "target itself"),
           ({"self_draft": {"precision": "float32"}}, "target itself")]
    for data, message in bad:
        with pytest.raises(ConfigError, match=message):
            DeploymentConfig.from_dict(data)
    # a quantized target with a cheaper self draft, or the same precision over fewer layers, is fine
    DeploymentConfig.from_dict({"self_draft": {"precision": "int4"}, "runtime": {"weights": "int8"}})
    DeploymentConfig.from_dict({"self_draft": {"layers": [0, 1]}, "runtime": {"weights": "int8"}})


def json_round_trip(config: DeploymentConfig) -> dict:
    import json

    return json.loads(config.to_json())


def _tiny_pair(precision: WeightPrecision, layers: tuple[int, ...] | None = None, target_weights=WeightPrecision.FLOAT32):
    model = tiny_llama(0, vocab=32, layers=4, hidden=64)  # int4: groups of 64
    draft = self_draft_engine(model, RUNTIME, SelfDraftConfig(precision=precision, layers=layers), name="tiny",
                              eos_token_ids=[])
    target = make_torch_engine(model, name="tiny", runtime=RuntimeConfig(max_batch_size=4, max_seq_len=96,
                                                                         weights=target_weights), eos_token_ids=[])
    return target, draft


def _draft_row_starts(engine) -> list[int]:
    """Record the start of every row ``engine`` runs (what the draft computes itself)."""
    starts: list[int] = []
    forward = engine.forward

    def recording(rows):
        starts.extend(r.start for r in rows)
        return forward(rows)

    engine.forward = recording
    return starts


@needs_kernels
@pytest.mark.parametrize("precision,layers,context,stop", [
    (WeightPrecision.INT8, None, "draft", 0.0), (WeightPrecision.INT8, None, "prompt", 0.0),
    (WeightPrecision.INT8, None, "committed", 0.5), (WeightPrecision.INT4, (0, 2, 3), "prompt", 0.5)])
def test_greedy_self_draft_equals_plain_alone_and_batched(precision, layers, context, stop):
    """Whatever the draft's context (its own prefill, or the target's keys and values copied, layer
    by layer for a layer-skip draft) and its confidence stop, greedy output is plain decoding's; a
    draft taking the prompt from the target never runs a prompt position itself."""
    target, draft = _tiny_pair(precision, layers)
    assert draft.weights is precision and target.weights is WeightPrecision.FLOAT32
    assert draft.forward_impl.embed.data_ptr() == target.forward_impl.embed.data_ptr()  # shared, not copied
    assert draft.forward_impl.shape.num_layers == (4 if layers is None else len(layers))
    config = SelfDraftConfig(precision=precision, layers=layers, context=context, stop_below=stop)
    drafter = self_drafter(draft, target, config, measure=False)
    assert (drafter.context is None) == (context == "draft") and drafter.stop_below == stop
    starts = _draft_row_starts(draft)
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.DRAFT: drafter})
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    spec = SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=4),
                             fallback=FallbackConfig(enabled=False))
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in PROMPTS]
    drafted = accepted = 0
    for prompt, expected in zip(PROMPTS, plain):
        result = decoder.generate(prompt, params, spec)
        assert result.token_ids == expected
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
        assert context == "draft" or min(starts) >= len(prompt), "the draft ran the prompt itself"
        starts.clear()
    assert drafted > 0 and accepted > 0
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4))
    try:
        clients = submit_all(scheduler, [(p, params, spec) for p in PROMPTS])
        assert [c.tokens() for c in clients] == plain
    finally:
        scheduler.shutdown()
    assert starts and (context == "draft" or min(starts) >= min(len(p) for p in PROMPTS))


@needs_kernels
def test_self_draft_from_the_target_context_keeps_seeded_sampling_batched_as_alone():
    """Seeded sampling and greedy requests mixed in a batch, the draft taking the prompt from the
    target and stopping on doubtful tokens: each request's output is what it gives alone."""
    from test_scheduler import assert_mixed_batch_matches_alone

    target, draft = _tiny_pair(WeightPrecision.INT8)
    drafter = self_drafter(draft, target, SelfDraftConfig(context="prompt", stop_below=0.3), measure=False)
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.DRAFT: drafter})
    spec = SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=4),
                             fallback=FallbackConfig(enabled=False))
    assert_mixed_batch_matches_alone(decoder, PROMPTS[:3], spec, "per_request", base_tokens=10, base_seed=7)


@needs_kernels
def test_kv_copied_from_the_target_layer_by_layer():
    """A layer-skip draft's cache takes each kept layer's keys and values from that target layer;
    a layer map that does not fit the draft is refused."""
    from triton_backend.engines.batch import BatchRow

    target, draft = _tiny_pair(WeightPrecision.INT8, (0, 2, 3))
    src, dst = target.allocate(), draft.allocate()
    target.forward([BatchRow(src, 0, [1, 2, 3, 4, 5])])
    draft.copy_kv_from(target, src, dst, 1, 4, (0, 2, 3))
    for i, layer in enumerate((0, 2, 3)):
        assert torch.equal(draft.cache.keys[i, dst, :, 1:4], target.cache.keys[layer, src, :, 1:4])
        assert torch.equal(draft.cache.values[i, dst, :, 1:4], target.cache.values[layer, src, :, 1:4])
    with pytest.raises(ValueError, match="cannot take"):
        draft.copy_kv_from(target, src, dst, 0, 4, (0, 1))
    with pytest.raises(ValueError, match="cannot copy positions"):
        draft.copy_kv_from(target, src, dst, 3, 2, (0, 2, 3))


@needs_kernels
def test_self_draft_over_a_quantized_target_and_bad_layers():
    target, draft = _tiny_pair(WeightPrecision.INT4, target_weights=WeightPrecision.INT8)
    assert target.weights is WeightPrecision.INT8 and draft.weights is WeightPrecision.INT4
    with pytest.raises(ConfigError, match="target itself"):
        self_drafter(draft, target, SelfDraftConfig(precision=WeightPrecision.INT8), measure=False)
    with pytest.raises(ConfigError, match=r"lie in \[0, 4\)"):
        self_draft_engine(tiny_llama(0, vocab=32, layers=4, hidden=64), RUNTIME, SelfDraftConfig(layers=(0, 4)), name="tiny",
                          eos_token_ids=[])


@needs_kernels
def test_draft_cost_is_measured_and_cached(tmp_path, monkeypatch):
    import triton_backend.speculation.pass_cost as pass_cost
    from triton_backend.speculation.pass_cost import measured_step_cost

    monkeypatch.setattr(pass_cost, "machine_busy", lambda cores=None: None)  # a quiet machine: cached

    target, draft = _tiny_pair(WeightPrecision.INT8)
    cost = measured_step_cost(draft, target, cache_dir=tmp_path)
    assert cost is not None and 0 < cost <= 3.0
    assert measured_step_cost(draft, target, cache_dir=tmp_path) == cost  # read back, not measured again
    with pytest.raises(ConfigError, match="do not divide"):  # int4 groups of 64 do not divide a width of 32
        self_draft_engine(tiny_llama(0, vocab=32, layers=2), RUNTIME, SelfDraftConfig(precision="int4"), name="tiny",
                          eos_token_ids=[])
    assert estimated_cost(SelfDraftConfig(layers=(0, 1)), WeightPrecision.FLOAT32, 4) == pytest.approx(0.44 / 2)


@pytest.mark.slow
@needs_kernels
def test_reference_self_draft_deployment_is_exact(reference, reference_prompts):
    """The deployment built from ``self_draft`` (int8 over the float32 target): greedy output equal to
    the float32 target's plain decoding, with most drafted tokens accepted."""
    from triton_backend.deployment.torch_deployment import build_decoder

    target, tokenizer = reference
    plain_decoder = SpeculativeDecoder(target, tokenizer, drafters={})
    decoder = build_decoder(DeploymentConfig(self_draft=SelfDraftConfig(), ngram=False,
                                             runtime=RuntimeConfig(max_batch_size=2, max_seq_len=512)))
    drafter = decoder.drafters[SpeculationMode.DRAFT]
    assert drafter.engine.weights is WeightPrecision.INT8 and 0 < drafter.relative_cost < 1
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    spec = SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=4),
                             fallback=FallbackConfig(enabled=False))
    drafted = accepted = 0
    for prompt in reference_prompts[:3]:
        plain = plain_decoder.generate(prompt, params, SpeculationConfig(method="off")).token_ids
        result = decoder.generate(prompt, params, spec)
        assert result.token_ids == plain, f"diverged on {prompt!r}"
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert accepted > 0.6 * drafted


def test_run_flags_give_the_self_draft():
    import argparse

    from builder.ops.local_run import LocalRunConfig, add_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)

    def deployment(*flags: str) -> DeploymentConfig:
        return LocalRunConfig.from_args(parser.parse_args(list(flags))).deployment

    assert deployment("--draft", "self").self_draft == SelfDraftConfig()
    config = deployment("--draft", "self", "--draft-precision", "int4", "--draft-layers", "0-9")
    assert config.self_draft == SelfDraftConfig(precision=WeightPrecision.INT4, layers=tuple(range(10)))
    assert config.draft is None and config.draft_layers is None
    assert deployment("--draft-layers", "0-3").draft_layers == (0, 1, 2, 3)  # a float layer-skip draft, as before
    with pytest.raises(ConfigError, match="--draft self"):
        deployment("--draft", "some/model", "--draft-precision", "int8")
    with pytest.raises(ConfigError, match="target itself"):
        deployment("--draft", "self", "--weights", "int8")


def test_a_self_draft_starts_from_its_precisions_agreement_not_the_draft_model_default():
    """At ~0.45 of a step per drafted token the draft-model prior (0.6) never drafts, so a deployment
    would never learn that int8 agrees ~97 %: the self draft's own prior is what its controller uses."""
    from triton_backend.core.config import SpeculationConfig, SpeculationMode
    from triton_backend.deployment.self_draft import SELF_DRAFT_PRIOR
    from triton_backend.speculation.controller import controller_for
    from triton_backend.speculation.policy import PRIOR_ACCEPTANCE, DrafterKind

    class Cheap:
        relative_cost = 0.45
        prior_acceptance = (SELF_DRAFT_PRIOR[WeightPrecision.INT8],) * 2

    class Plain:
        relative_cost = 0.45

    config = SpeculationConfig(method=SpeculationMode.DRAFT)
    own = controller_for(config, SpeculationMode.DRAFT, Cheap())
    default = controller_for(config, SpeculationMode.DRAFT, Plain())
    assert own.policy.estimate.prior == (0.9, 0.9)
    assert default.policy.estimate.prior == PRIOR_ACCEPTANCE[DrafterKind.DRAFT]
