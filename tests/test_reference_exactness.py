"""Exactness on the REAL reference model (SmolLM2-135M-Instruct, float32).

Greedy speculative output must equal plain target decoding token for token, for every
drafter and draft length; the draft is a real model sharing the tokenizer (a
self-speculative draft made of most of the target's layers, so rounds mix accepted and
rejected tokens)."""

from __future__ import annotations

import pytest
import torch

from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.engines.torch.model_loading import layer_skip_draft, make_torch_engine

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
# drop two late layers: close enough to the target to accept often, different enough to reject
DRAFT_LAYERS = [i for i in range(30) if i not in (20, 27)]
POOR_DRAFT_LAYERS = list(range(4))


def _draft_engine(target: TorchEngine, layers: list[int]) -> TorchEngine:
    return make_torch_engine(layer_skip_draft(target.model, layers), name=f"skip{len(layers)}",
                             eos_token_ids=sorted(target.eos_token_ids))


@pytest.fixture(scope="module")
def decoder(reference):
    target, tokenizer = reference
    return SpeculativeDecoder(target, tokenizer, drafters={
        SpeculationMode.DRAFT: DraftModelDrafter(_draft_engine(target, DRAFT_LAYERS), target=target,
                                                 target_tokenizer=tokenizer, draft_tokenizer=tokenizer),
        SpeculationMode.NGRAM: NgramDrafter(1, 3),
    })


@pytest.fixture(scope="module")
def plain_outputs(decoder, reference_prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in reference_prompts]


def test_plain_matches_transformers_generate(reference, reference_prompts, plain_outputs):
    """Our plain path is the target's own greedy decoding (checked against HF generate)."""
    target, tokenizer = reference
    for prompt, ours in list(zip(reference_prompts, plain_outputs))[:2]:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.inference_mode():
            out = target.model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                        pad_token_id=0, attention_mask=torch.ones_like(ids))
        assert out[0, ids.shape[1]:].tolist() == ours[:16]


@pytest.mark.parametrize("mode", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculation_is_token_identical(decoder, reference_prompts, plain_outputs, mode, k):
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    spec = SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=k),
                             fallback=FallbackConfig(enabled=False))
    accepted = drafted = 0
    for prompt, plain in zip(reference_prompts, plain_outputs):
        result = decoder.generate(prompt, params, spec)
        assert result.token_ids == plain, f"diverged on {prompt!r}"
        accepted += result.stats.accepted_tokens
        drafted += result.stats.drafted_tokens
    assert drafted > 0 and 0 < accepted < drafted  # both accepted and rejected tokens were exercised


def test_draft_equal_to_target_accepts_everything(reference, reference_prompts, plain_outputs):
    target, tokenizer = reference
    same = SpeculativeDecoder(target, tokenizer, drafters={
        SpeculationMode.DRAFT: DraftModelDrafter(target, target=target, target_tokenizer=tokenizer, draft_tokenizer=tokenizer)})
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt, plain in list(zip(reference_prompts, plain_outputs))[:2]:
        result = same.generate(prompt, params, SpeculationConfig(method="draft",
                                                                 draft_length=DraftLengthConfig(num_draft_tokens=4), fallback=FallbackConfig(enabled=False)))
        assert result.token_ids == plain[:24]
        assert result.stats.acceptance_rate == 1.0 and result.stats.target_passes == 5


def test_poor_draft_falls_back_and_stays_exact(reference, reference_prompts, plain_outputs):
    target, tokenizer = reference
    poor = SpeculativeDecoder(target, tokenizer, drafters={
        SpeculationMode.DRAFT: DraftModelDrafter(_draft_engine(target, POOR_DRAFT_LAYERS), target=target)})
    spec = SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=4),
                             fallback=FallbackConfig(window=200, min_drafted=40, rule="threshold"))
    result = poor.generate(reference_prompts[0], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), spec)
    assert result.token_ids == plain_outputs[0]
    stats = result.stats
    assert stats.fallback and stats.fallback_at_token is not None
    assert stats.drafted_tokens <= 200  # decided within the window
    assert stats.drafted_tokens >= 40  # not before enough evidence
    assert stats.target_passes > stats.speculative_rounds  # plain steps followed the switch


def test_real_kv_rollback_matches_fresh_forward(reference, reference_prompts):
    target, tokenizer = reference
    tokens = tokenizer.encode(reference_prompts[1], add_special_tokens=False)
    session = target.new_session()
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        k = int(torch.randint(1, 8, (1,), generator=g))
        drafts = torch.randint(0, target.vocab_size, (k,), generator=g).tolist()
        session.logits(tokens + drafts, k + 1)
        accepted = int(torch.randint(0, k + 1, (1,), generator=g))
        tokens = tokens + drafts[:accepted] + [int(torch.randint(0, target.vocab_size, (1,), generator=g))]
    cached = session.logits(tokens, 2)
    with torch.inference_mode():
        fresh = target.model(torch.tensor([tokens])).logits[0, -2:]
    assert torch.allclose(cached, fresh, atol=1e-3, rtol=1e-4)


def test_real_prompt_errors(decoder, reference):
    from triton_backend.core.errors import ContextLengthError, InvalidRequestError, VocabMismatchError

    target, tokenizer = reference
    with pytest.raises(InvalidRequestError, match="empty"):
        decoder.generate("", SamplingParams())
    with pytest.raises(ContextLengthError, match="context"):
        decoder.generate([1] * (target.max_context + 1), SamplingParams())

    class OtherTokenizer:
        def get_vocab(self):
            vocab = dict(tokenizer.get_vocab())
            vocab["<extra>"] = vocab.pop(next(iter(vocab)))
            return vocab

    with pytest.raises(VocabMismatchError, match="tokenizer"):
        DraftModelDrafter(target, target=target, target_tokenizer=tokenizer, draft_tokenizer=OtherTokenizer())
