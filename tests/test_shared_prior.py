"""The deployment-wide prior of a model drafter: requests start from the acceptance measured over
earlier requests (a drafter that does not pay here is not tried at every request), the evidence
fades so a poor drafter is tried again later, seeded sampling requests keep the type's prior, and
output stays exact."""

from __future__ import annotations

import pytest

from conftest import tiny_engine
from test_eagle import _random_drafter
from triton_backend.core.config import DraftLengthConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.controller import controller_for
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.cost_model import PassCostModel
from triton_backend.speculation.policy import PRIOR_ACCEPTANCE, DrafterKind, GainPolicy, GainSettings
from triton_backend.speculation.shared_prior import SharedAcceptance

pytestmark = pytest.mark.usefixtures("default_pass_costs")


def test_requests_start_from_what_earlier_requests_measured_and_the_evidence_fades():
    shared = SharedAcceptance(PRIOR_ACCEPTANCE[DrafterKind.DRAFT])
    settings = GainSettings()
    first = GainPolicy(DrafterKind.DRAFT, 4, 0.2, settings, PassCostModel.default(), shared=shared)
    assert first.next_draft_length() > 0  # the type's prior: a cold deployment tries its drafter
    for _ in range(30):  # this drafter's drafts are never accepted here
        first.record(2, 0)
    later = GainPolicy(DrafterKind.DRAFT, 4, 0.2, settings, PassCostModel.default(), shared=shared)
    assert later.estimate.prior[0] < 0.15
    assert all(later.next_draft_length() == 0 for _ in range(64))  # no warm-up loss, no probes
    for _ in range(60):  # requests that never draft: the evidence fades back to the type's prior
        shared.prior()
    assert shared.prior()[0] == pytest.approx(PRIOR_ACCEPTANCE[DrafterKind.DRAFT][0], abs=0.05)
    explicit = GainPolicy(DrafterKind.DRAFT, 4, 0.2, GainSettings(prior=(0.9, 0.9)), PassCostModel.default(),
                          shared=shared)
    assert explicit.estimate.prior == (0.9, 0.9)  # a configured prior is the user's


def test_seeded_sampling_keeps_the_type_prior_and_outputs_stay_exact():
    target = tiny_engine(0)
    drafter = _random_drafter(target, seed=3)
    drafter.relative_cost = 0.05
    spec = SpeculationConfig(method="eagle", draft_length=DraftLengthConfig(num_draft_tokens=3))
    greedy_ctrl = controller_for(spec, SpeculationMode.EAGLE, drafter, learned_prior=True)
    seeded_ctrl = controller_for(spec, SpeculationMode.EAGLE, drafter, learned_prior=False)
    assert greedy_ctrl.policy.shared is not None and seeded_ctrl.policy.shared is None
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.EAGLE: drafter})
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = decoder.generate([3, 1, 4, 1, 5], greedy, SpeculationConfig(method="off")).token_ids
    for _ in range(3):  # later requests start from what earlier ones measured: output unchanged
        assert decoder.generate([3, 1, 4, 1, 5], greedy, spec).token_ids == plain
    seeded = SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)
    runs = {tuple(decoder.generate([2, 7, 1, 8], seeded, spec).token_ids) for _ in range(3)}
    assert len(runs) == 1  # a seeded request's output does not depend on the requests before it
