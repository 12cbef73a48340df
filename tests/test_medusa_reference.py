"""Medusa on the real reference model (SmolLM2-135M-Instruct) with the committed trained
heads: greedy output token-identical to plain decoding, the tree pass against per-path
forwards, trained heads beating untrained ones on held-out acceptance, sampling modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from triton_backend.core.config import FallbackConfig, MedusaConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.drafters.medusa import MedusaDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.drafters.medusa_model import MedusaCheckpoint, MedusaHeads, load_medusa
from triton_backend.core.tree import path_to

pytestmark = pytest.mark.slow

HEADS = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m-medusa" / "heads.safetensors"
HELD_OUT = ["Tell me something surprising about glaciers.", "How would you teach magnetism to a beginner?",
            "Write an email inviting your team to a lunch on Friday."]
NO_FALLBACK = SpeculationConfig(method="medusa", fallback=FallbackConfig(enabled=False))


@pytest.fixture(scope="module")
def decoders(reference):
    engine, tokenizer = reference
    trained = MedusaDrafter(load_medusa(HEADS), engine)
    checkpoint = load_medusa(HEADS)
    untrained = MedusaDrafter(MedusaCheckpoint(MedusaHeads(checkpoint.info), checkpoint.candidate_vocab), engine)
    make = lambda d: SpeculativeDecoder(engine, tokenizer, drafters={SpeculationMode.MEDUSA: d})  # noqa: E731
    return make(trained), make(untrained)


def _chat(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)


def test_medusa_greedy_is_token_identical_to_plain(decoders, reference_prompts):
    trained, _ = decoders
    params = SamplingParams(max_tokens=40)
    accepted = 0
    for prompt in reference_prompts[1:4]:
        plain = trained.generate(prompt, params, SpeculationConfig(method="off"))
        tree = trained.generate(prompt, params, NO_FALLBACK)
        assert tree.token_ids == plain.token_ids, prompt
        assert tree.text == plain.text
        assert tree.stats.target_passes < plain.stats.target_passes
        accepted += tree.stats.accepted_tokens
    assert accepted > 0


def test_tree_pass_matches_per_path_forward_on_the_real_model(reference):
    engine, tokenizer = reference
    committed = tokenizer.encode("The capital of France is", add_special_tokens=False)
    parents = [-1, -1, 0, 0, 2, 1]
    tree_tokens = tokenizer.encode(" Paris, a city known", add_special_tokens=False)[:1] * 2 + [11, 28, 253, 30]
    logits, _ = engine.new_session().tree_logits(committed, tree_tokens, parents)
    for node in range(-1, len(parents)):
        seq = committed + [tree_tokens[j] for j in path_to(node, parents)]
        ref = engine.new_session().logits(seq, 1)[0]
        assert torch.allclose(logits[node + 1], ref, atol=2e-4), node
        assert int(logits[node + 1].argmax()) == int(ref.argmax())


def test_trained_heads_beat_untrained_heads(decoders, reference):
    _, tokenizer = reference
    trained, untrained = decoders
    params = SamplingParams(max_tokens=32)
    rates, per_pass = [], []
    for decoder in (trained, untrained):
        drafted = accepted = passes = 0
        for prompt in HELD_OUT[:2]:
            stats = decoder.generate(_chat(tokenizer, prompt), params, NO_FALLBACK).stats
            drafted += stats.drafted_tokens
            accepted += stats.accepted_tokens
            passes += stats.target_passes
        rates.append(accepted / drafted)
        per_pass.append(2 * params.max_tokens / passes)
    assert rates[0] > rates[1] + 0.08 and rates[0] > 0.12, rates
    assert per_pass[0] > per_pass[1] + 0.2, per_pass


def test_sampling_modes_run_and_are_seeded(decoders, reference_prompts):
    trained, _ = decoders
    params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=5)
    for acceptance in ("exact", "typical"):
        spec = SpeculationConfig(method="medusa", fallback=FallbackConfig(enabled=False),
                                 medusa=MedusaConfig(tree_acceptance=acceptance))
        a = trained.generate(reference_prompts[0], params, spec)
        b = trained.generate(reference_prompts[0], params, spec)
        assert a.token_ids == b.token_ids and 0 < len(a.token_ids) <= 12
        assert a.stats.drafted_tokens > 0
