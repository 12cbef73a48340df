"""A paused Medusa request costs what plain decoding costs: while the gain rule will not draft in
the next round, rounds take the chain path (no tree pass, no hidden state); the round before a
draft (a probe, or a resume) takes the tree path so the heads have the hidden state they need.
Output stays identical to plain decoding (greedy) and seeded sampling stays reproducible."""

from __future__ import annotations

import pytest

from conftest import tiny_engine
from test_medusa_tree import random_heads
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig
from triton_backend.speculation.drafters.medusa import MedusaDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.drafters.medusa_model import MedusaCheckpoint
from triton_backend.core.config import SpeculationMode

pytestmark = pytest.mark.usefixtures("default_pass_costs")  # pauses and probes as under the default table

PROMPTS = ([1, 2, 3], [5, 5, 5, 5], [7, 1, 9, 1, 7, 1])


class _Spy:
    """Counts the target session's passes by path and the drafter's proposals that had no
    hidden state although a draft was asked for (a lost probe)."""

    def __init__(self, target, drafter) -> None:
        self.tree_passes = self.chain_passes = self.blind_proposals = 0
        spy = self
        make_session, make_drafter_session = target.new_session, drafter.new_session

        def new_session():
            session = make_session()
            tree_hidden, logits = session.tree_hidden, session.logits

            def counted_tree(*a, **k):
                spy.tree_passes += 1
                return tree_hidden(*a, **k)

            def counted_chain(*a, **k):
                spy.chain_passes += 1
                return logits(*a, **k)

            session.tree_hidden, session.logits = counted_tree, counted_chain
            return session

        def new_drafter_session():
            session = make_drafter_session()
            propose = session.propose

            def checked(tokens, k, processor, generator):
                if k > 0 and len(tokens) > spy.first_length and session._length != len(tokens):
                    spy.blind_proposals += 1
                return propose(tokens, k, processor, generator)

            session.propose = checked
            return session

        target.new_session, drafter.new_session = new_session, new_drafter_session
        self.first_length = 0


@pytest.fixture()
def spied():
    target = tiny_engine(0, vocab=32)
    drafter = MedusaDrafter(MedusaCheckpoint(random_heads(32, 32)), target)
    spy = _Spy(target, drafter)
    return SpeculativeDecoder(target, None, drafters={SpeculationMode.MEDUSA: drafter}), spy


def test_a_request_that_never_drafts_takes_only_the_chain_path(spied):
    decoder, spy = spied
    params = SamplingParams(max_tokens=30)
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        spy.tree_passes = spy.chain_passes = 0
        paused = decoder.generate(prompt, params, SpeculationConfig(method="medusa",
                                                                    fallback=FallbackConfig(prior_acceptance=0.0)))
        assert paused.token_ids == plain.token_ids
        assert paused.stats.drafted_tokens == 0
        assert spy.tree_passes == 0 and spy.chain_passes == paused.stats.target_passes


def test_probes_and_resumes_get_the_hidden_state_they_need(spied):
    """A prior that says drafting pays, on random heads that are rarely right: the rule drafts,
    pauses, probes again; every draft it asks for finds the hidden state (no lost probe), the
    paused stretches run on the chain path, and the output is plain decoding's."""
    decoder, spy = spied
    params = SamplingParams(max_tokens=80)
    spec = SpeculationConfig(method="medusa", draft_length=DraftLengthConfig(num_draft_tokens=3),
                             fallback=FallbackConfig(prior_acceptance=0.95, probe_interval=4))
    rounds = chain = 0
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        spy.tree_passes = spy.chain_passes = spy.blind_proposals = 0
        spy.first_length = len(prompt)
        result = decoder.generate(prompt, params, spec)
        assert result.token_ids == plain.token_ids
        assert spy.blind_proposals == 0
        assert spy.tree_passes + spy.chain_passes == result.stats.target_passes
        rounds += result.stats.speculative_rounds
        chain += spy.chain_passes
    assert rounds > len(PROMPTS)  # it drafted past the first rounds (probes)
    assert chain > 0  # and it paused on the chain path in between


def test_paused_sampling_is_seeded(spied):
    decoder, _ = spied
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=5)
    spec = SpeculationConfig(method="medusa", fallback=FallbackConfig(prior_acceptance=0.0))
    a, b = decoder.generate([1, 2], params, spec), decoder.generate([1, 2], params, spec)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
