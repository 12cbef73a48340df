"""N-gram lookup on repeating text: an occurrence that overlaps the suffix it matches continues
periodically past the end of the sequence (a repetition of period p drafts k tokens, not p),
and greedy output stays identical to plain decoding whether those drafts are accepted or not."""

from __future__ import annotations

from conftest import tiny_engine
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.core.config import SpeculationMode

PERIODIC_PROMPTS = ([3, 4, 3, 4, 3, 4], [6, 6, 6, 6], [2, 7, 9, 2, 7, 9, 2, 7], [1, 5, 8, 1, 5, 8, 1, 5, 8, 1])


def test_a_repetition_drafts_the_whole_length():
    session = NgramDrafter(1, 3).new_session()
    proposal = session.propose([3, 4, 3, 4, 3, 4], 7, None, None)  # no policy: the whole continuation
    assert proposal.tokens == [3, 4, 3, 4, 3, 4, 3]
    proposal = session.propose([3, 4, 3, 4, 3, 4, 3, 4, 1, 3, 4], 5, None, None)  # the latest occurrence is not the run
    assert proposal.tokens == [1, 3, 4, 1, 3]


def test_periodic_drafts_keep_greedy_output_identical_to_plain():
    decoder = SpeculativeDecoder(tiny_engine(0), None, drafters={SpeculationMode.NGRAM: NgramDrafter(1, 3)})
    drafted = 0
    for prompt in PERIODIC_PROMPTS:
        params = SamplingParams(max_tokens=40)
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        for k in (3, 8):  # always draft k (no fallback): the periodic drafts are verified whatever they cost
            spec = SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=k),
                                     fallback=FallbackConfig(enabled=False))
            result = decoder.generate(prompt, params, spec)
            assert result.token_ids == plain.token_ids, (prompt, k)
            drafted += result.stats.drafted_tokens
    assert drafted > 0
