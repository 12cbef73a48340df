"""EAGLE's cheap paths: the drafter's layer and head on the target's row kernel (draft quality
only: the same products, rounded by another kernel), greedy drafts as the argmax over the
candidate vocabulary, and the batch scheduler's EAGLE rows verified from the pass's one
LM-head product. Outputs stay plain decoding's (greedy), alone and batched, drafting or
paused by the gain rule."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_engine
from test_eagle import _decoder, _random_drafter
from test_eagle_serving import FIXED, PROMPTS, ProposalLog, _scheduled, assert_drafts_from_scratch
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.speculation.drafters.eagle import EagleDrafter, target_kernel
from triton_backend.speculation.drafters.eagle_model import EagleCheckpoint, EagleNet


def _kernel_target():
    target = tiny_engine(0)
    if target_kernel(target) is None:
        pytest.skip("the row kernel does not run on this machine (the drafter keeps torch's kernels)")
    return target


def test_drafter_layer_and_head_run_on_the_target_kernel():
    target = _kernel_target()
    vocab = torch.arange(1, target.vocab_size, 3)
    drafter = _random_drafter(target, seed=3, vocab=vocab)
    assert drafter.kernel_name == target_kernel(target).name
    reference = EagleNet(drafter.info)  # torch's F.linear, the same weights (state_dict names unchanged)
    reference.load_state_dict(drafter.net.state_dict(), strict=True)
    features = torch.randn(2, 5, drafter.info.hidden_size)
    embeds = drafter.embed[torch.randint(0, target.vocab_size, (2, 5))]
    starts = torch.tensor([0, 0])
    ours = drafter.net(features, embeds, starts, drafter.new_cache(2, 8))
    theirs = reference.eval()(features, embeds, starts, drafter.new_cache(2, 8))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    checkpoint = EagleCheckpoint(reference, vocab)  # the caller's net keeps torch's layers (a net in training, say)
    assert EagleDrafter(checkpoint, target).net is not reference
    assert isinstance(reference.fc, torch.nn.Linear)
    small = drafter._small_logits(features[:, -1])  # [2, candidates]
    torch.testing.assert_close(small, features[:, -1] @ drafter.head.t(), rtol=1e-4, atol=1e-4)
    # greedy drafts: the candidates' argmax, the token the full-vocabulary row's argmax names
    assert torch.equal(drafter._greedy(small), drafter._expand(small).argmax(-1))


def _head_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every separate LM-head call on the slot engine (the pass's own product is not one)."""
    calls: list[int] = []
    head = LlamaEngine.head_logits

    def spy(engine: LlamaEngine, hidden: torch.Tensor) -> torch.Tensor:
        calls.append(int(hidden.shape[0]))
        return head(engine, hidden)

    monkeypatch.setattr(LlamaEngine, "head_logits", spy)
    return calls


def test_scheduler_rows_verify_from_the_pass_head(monkeypatch):
    """Only a request's first round (the prompt's features, which the drafter lacks) calls the
    head on its own; every later row's logits come from the pass. Drafts and output unchanged."""
    target = tiny_engine(0)
    drafter = _random_drafter(target, seed=5, scale=0.15)
    decoder = _decoder(target, drafter)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in PROMPTS]
    log = ProposalLog(monkeypatch)
    calls = _head_calls(monkeypatch)
    assert _scheduled(decoder, PROMPTS, params, FIXED, batch=2) == plain
    assert calls == [1] * len(PROMPTS), calls  # the first round has no drafts: its last committed token's row
    assert_drafts_from_scratch(log, drafter, target.model, list(zip(PROMPTS, plain)))


@pytest.mark.parametrize("prior", [0.0, 0.95], ids=["paused", "drafting"])
def test_gain_rule_outputs_equal_plain_alone_and_batched(monkeypatch, default_pass_costs, prior):
    """Under the gain rule, a request it keeps paused (prior 0: no draft ever pays) and one it
    lets draft give plain decoding's tokens alone and in the scheduler; a paused request's
    batched rows make no head call past its first round."""
    target = tiny_engine(0)
    drafter = _random_drafter(target, seed=5, scale=0.15)
    decoder = _decoder(target, drafter)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    spec = SpeculationConfig(method="eagle", draft_length=DraftLengthConfig(num_draft_tokens=3),
                             fallback=FallbackConfig(prior_acceptance=prior))
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in PROMPTS]
    alone = [decoder.generate(p, params, spec) for p in PROMPTS]
    assert [r.token_ids for r in alone] == plain
    drafted = sum(r.stats.drafted_tokens for r in alone)
    assert (drafted == 0) if prior == 0.0 else (drafted > 0)
    calls = _head_calls(monkeypatch)
    assert _scheduled(decoder, PROMPTS, params, spec, batch=2) == plain
    if prior == 0.0:
        assert calls == [1] * len(PROMPTS), calls
