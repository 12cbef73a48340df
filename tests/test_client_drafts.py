"""Client-supplied drafts (tensorrt_llm's ``draft_input_ids`` / ``draft_logits``): the batch
scheduler verifies them in the request's first round (greedy: the longest prefix equal to the
target's argmax, then the target's own tokens); the output is the target's alone, whatever
the drafts; bad drafts are refused by name. Tiny random Llamas: fast, no server."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_engine
from test_scheduler import Collector
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.core.config import SamplingParams, SpeculationConfig
from triton_backend.core.errors import InvalidRequestError
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.serving.service import parse_request
from triton_backend.speculation.drafters.client import ClientDraft, ClientDraftSession
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

VOCAB = 32
PROMPT = [1, 2, 3, 4, 1, 2]


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    from triton_backend.core.config import SpeculationMode

    return SpeculativeDecoder(tiny_engine(0, vocab=VOCAB), None, drafters={SpeculationMode.NGRAM: NgramDrafter(1, 3)},
                              speculation=SpeculationConfig(method="ngram"))


def _run(decoder, drafts: list[int], max_tokens: int, scheduler: BatchScheduler) -> Collector:
    client = Collector()
    scheduler.submit(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True), decoder.speculation, client,
                     ClientDraft(tuple(drafts)))
    client.tokens()
    return client


@pytest.mark.parametrize("policy", ["load_aware", "per_request"])
def test_client_drafts_are_verified_and_the_output_is_the_targets(decoder, policy) -> None:
    plain = decoder.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True),
                             SpeculationConfig(method="off")).token_ids
    wrong = (plain[3] + 1) % VOCAB
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=4, policy=policy))
    try:
        cases = [(plain[:4], 4), (plain[:3] + [wrong], 3), ([wrong], 0), ([(plain[0] + 1) % VOCAB] * 5, 0)]
        for drafts, accepted in cases:
            client = _run(decoder, drafts, len(drafts) + 1, scheduler)  # as the e2e draft-target client asks
            assert client.tokens() == plain[:len(drafts) + 1], drafts
            stats = client.chunks[-1].stats
            assert (stats.drafted_tokens, stats.accepted_tokens, stats.method) == (len(drafts), accepted, "client")
        longer = _run(decoder, plain[:2], 8, scheduler)  # then plain decoding up to max_tokens
        assert longer.tokens() == plain and longer.chunks[-1].stats.drafted_tokens == 2
    finally:
        scheduler.shutdown()


def test_draft_logits_give_q_processed_like_the_target() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    processor = LogitsProcessor.from_params(SamplingParams(temperature=0.7, top_k=10))
    drafts = [int(t) for t in logits.argmax(-1)]
    session = ClientDraftSession(ClientDraft(tuple(drafts), logits.numpy()), prompt_len=2)
    assert session.propose([5, 6, 7], 3, processor, None).tokens == []  # not right after the prompt
    proposal = session.propose([5, 6], 3, processor, None)
    assert proposal.tokens == drafts and torch.allclose(proposal.probs, processor.probs(logits))
    assert session.pending == 0 and session.propose([5, 6], 3, processor, None).tokens == []  # once
    impossible = logits.clone()
    impossible[0, drafts[0]] = -1e9  # q gives the draft no probability: it was not drawn from q
    fallback = ClientDraftSession(ClientDraft(tuple(drafts), impossible.numpy()), 2).propose([5, 6], 3, processor, None)
    assert fallback.tokens == drafts and fallback.probs is None  # verified one-hot (exact for any draft)


def _arrays(**values) -> dict[str, np.ndarray]:
    return {name: np.asarray(value)[None] for name, value in values.items()}


def test_bad_client_drafts_are_refused_by_name() -> None:
    spec = SpeculationConfig()
    base = dict(input_ids=np.array([1, 2, 3], np.int32), input_lengths=np.array([3], np.int32),
                request_output_len=np.array([4], np.int32))
    ok = parse_request(_arrays(**base, draft_input_ids=np.array([4, 5], np.int32),
                               draft_logits=np.zeros((2, VOCAB), np.float32)), spec)
    assert ok.client_draft.tokens == (4, 5) and ok.client_draft.logits.shape == (2, VOCAB)
    assert parse_request(_arrays(**base, draft_input_ids=np.zeros((0,), np.int32)), spec).client_draft is None
    bad = [(dict(draft_input_ids=np.array([4, 5], np.int32), draft_logits=np.zeros((3, VOCAB), np.float32)),
            "draft_logits"),
           (dict(draft_input_ids=np.array([-4], np.int32)), "draft_input_ids"),
           (dict(draft_input_ids=np.array([4], np.int32), draft_acceptance_threshold=np.array([0.5], np.float32)),
            "draft_acceptance_threshold")]
    for extra, name in bad:
        with pytest.raises(InvalidRequestError, match=name):
            parse_request(_arrays(**base, **extra), spec)
    with pytest.raises(InvalidRequestError, match="draft_input_ids"):
        parse_request(_arrays(text_input=np.array([b"hi"], object), draft_input_ids=np.array([4], np.int32)), spec)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        ClientDraft((4, VOCAB)).check_vocab(VOCAB)
