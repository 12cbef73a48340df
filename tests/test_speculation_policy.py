"""The gain rule: pass-cost model, acceptance estimates, the per-round and per-batch plans,
and the controller on scripted acceptance sequences."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SpeculationConfig
from triton_backend.speculation.controller import SpeculationController
from triton_backend.speculation.pass_cost import measure_pass_cost_model
from triton_backend.speculation.match_policy import MatchLengthPolicy
from triton_backend.speculation.cost_model import PassCostModel, current_cost_model
from triton_backend.speculation.policy import AcceptanceEstimate, DrafterKind, GainPolicy, GainSettings
from triton_backend.speculation.round_plan import RowOption, plan_round, prefix_probabilities

# a cost table where extra tokens get dearer as the batch grows (a GPU-like roofline: one row
# is memory-bound, many rows are compute-bound)
LOADED = PassCostModel({1: {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2},
                        8: {1: 1.6, 2: 2.6, 4: 4.6, 8: 8.6}}, "test")
FLAT = PassCostModel({1: {1: 1.0, 16: 1.1}}, "test")


def test_cost_model_interpolates_and_extrapolates():
    model = PassCostModel.default()
    assert model.pass_cost([1]) == 1.0
    assert model.pass_cost([4]) == pytest.approx(1.33)
    assert 1.33 < model.pass_cost([6]) < 1.35  # between measured points
    assert model.pass_cost([32]) == pytest.approx(2.1 * 2)  # past the table: proportional to the tokens
    assert model.pass_cost([1] * 32) == pytest.approx(3.41 * 2)  # past the rows: proportional to the rows
    four, eight = model.pass_cost([1] * 4), model.pass_cost([1] * 8)
    assert four < model.pass_cost([1] * 6) < eight
    assert model.pass_cost([]) == 0.0


def test_cost_model_from_measurements_normalises_to_the_step():
    model = PassCostModel.from_measurements({(1, 1): 0.02, (1, 4): 0.03, (2, 1): 0.025})
    assert model.pass_cost([1]) == 1.0 and model.pass_cost([4]) == pytest.approx(1.5)
    assert model.pass_cost([1, 1]) == pytest.approx(1.25)
    assert PassCostModel.from_json(json.loads(json.dumps(model.to_json()))) == model
    with pytest.raises(ValueError, match="1-row 1-token"):
        PassCostModel.from_measurements({(2, 1): 0.1})


def test_a_measured_curve_never_falls_with_more_tokens():
    """A dip in a measured curve is timing noise (a pass never costs less for carrying more
    tokens): the cell takes the value before it; the one-token step stays the unit."""
    seconds = {(1, 1): 1.0, (1, 2): 0.95, (1, 4): 1.2, (1, 6): 1.1, (1, 8): 1.25, (1, 12): 1.3, (2, 1): 1.1, (2, 4): 1.0}
    model = PassCostModel.from_measurements(seconds)
    assert model.table[1] == pytest.approx({1: 1.0, 2: 1.0, 4: 1.2, 6: 1.2, 8: 1.25, 12: 1.3})
    assert model.table[2] == pytest.approx({1: 1.1, 4: 1.1})


def _option(p: float, k: int, draft_cost: float = 0.0) -> RowOption:
    return RowOption(tuple(prefix_probabilities([p] * k)), draft_cost)


def test_plan_picks_the_length_that_pays_and_plain_when_none_does():
    assert plan_round([_option(0.9, 8)], FLAT)[0] == 8  # long drafts are nearly free on a flat table
    assert plan_round([_option(0.0, 8)], FLAT)[0] == 0  # zero expected gain: never draft
    default = PassCostModel.default()
    assert plan_round([_option(0.05, 8)], default)[0] == 0  # below break-even
    assert plan_round([_option(0.9, 12)], default)[0] == 7  # 8 tokens fill one packed GEMM; 9 cost a second
    assert plan_round([_option(0.5, 4, draft_cost=0.5)], default)[0] == 0  # a costly draft at 0.5 cannot pay


def test_plan_with_one_row_is_the_single_request_decision():
    settings = GainSettings(prior=(0.55, 0.55))
    for draft_cost in (0.0, 0.1, 0.3):
        policy = GainPolicy(DrafterKind.DRAFT, 6, draft_cost, settings, PassCostModel.default())
        assert policy.next_draft_length() == plan_round([policy.current_option()], PassCostModel.default())[0]


def test_a_larger_batch_lowers_the_draft_length():
    row = _option(0.7, 8)
    alone = plan_round([row], LOADED)[0]
    batched = plan_round([row] * 8, LOADED)
    assert alone >= 4 and all(k < alone for k in batched)
    # a row that accepts everything still drafts in the batch; a hopeless one does not
    mixed = plan_round([_option(0.98, 8)] + [_option(0.02, 8)] * 7, LOADED)
    assert mixed[0] > 0 and mixed[1:] == [0] * 7


def test_gain_policy_stops_within_a_few_rounds_and_never_at_zero_gain():
    policy = GainPolicy(DrafterKind.DRAFT, 4, 0.1, GainSettings(probe_interval=1000), PassCostModel.default())
    rounds = 0
    while (k := policy.next_draft_length()) > 0:  # a cold request speculates from the prior at once
        policy.record(k, 0)
        rounds += 1
        assert rounds <= 3
    assert rounds >= 1 and policy.paused
    hopeless = GainPolicy(DrafterKind.DRAFT, 4, 0.0, GainSettings(prior=(0.0, 0.0), probe_interval=1), PassCostModel.default())
    assert all(hopeless.next_draft_length() == 0 for _ in range(200))  # probes too: the prior says it cannot pay


def test_a_model_drafters_estimate_follows_a_low_acceptance_below_its_prior_floor():
    """Evidence decays, so with a fixed prior weight the estimate of a drafter accepting 8 %
    would settle near 0.17 (the prior 0.6 at weight 2 against at most 10 decayed rounds) and
    keep it drafting at a loss; the prior's weight fades too, so the estimate reaches ~0.1.
    N-gram match buckets keep their prior's full weight."""
    def settle(kind: DrafterKind) -> float:
        policy = GainPolicy(kind, 1, 0.1, GainSettings(prior=(0.6, 0.6)), PassCostModel.default())
        seen = []
        for i in range(200):
            policy.record(1, 1 if i % 12 == 0 else 0)  # 1 in 12 accepted
            seen.append(policy.estimate.conditional()[0])
        return sum(seen[100:]) / 100  # the settled mean

    assert settle(DrafterKind.DRAFT) < 0.125
    assert settle(DrafterKind.NGRAM) > 0.155
    # where drafting pays the faded prior changes nothing: the evidence carries the estimate
    policy = GainPolicy(DrafterKind.DRAFT, 1, 0.1, GainSettings(prior=(0.6, 0.6)), PassCostModel.default())
    for _ in range(200):
        policy.record(1, 1)
    assert policy.estimate.conditional()[0] > 0.9


def test_gain_policy_probes_and_resumes_when_acceptance_returns():
    policy = GainPolicy(DrafterKind.DRAFT, 4, 0.1, GainSettings(probe_interval=8), PassCostModel.default())
    trace = []
    accept_all = False
    for step in range(300):
        if step == 120:
            accept_all = True  # the text turns predictable (a copy segment)
        k = policy.next_draft_length()
        trace.append(k)
        if k:
            policy.record(k, k if accept_all else 0)
    before, after = trace[20:120], trace[140:]
    assert 0 < sum(1 for k in before if k) <= 12  # paused, with sparse probes (backing off)
    assert min(after) >= 3  # resumed and stays on
    resumed_at = next(i for i in range(120, 300) if trace[i] >= 3)
    assert resumed_at - 120 <= 70  # picked up within a probe interval or two


def test_paused_drafter_has_no_per_token_upkeep(monkeypatch):
    """A paused model drafter re-decides only every ``paused_recheck`` plain steps and at its
    probes: in between, a round's decision (and whether the next may draft) is O(1)."""
    import triton_backend.speculation.policy as policy_module

    calls = []
    real = policy_module.plan_round
    monkeypatch.setattr(policy_module, "plan_round", lambda *a, **k: calls.append(1) or real(*a, **k))
    settings = GainSettings(probe_interval=64, max_probe_interval=64, paused_recheck=8)
    policy = GainPolicy(DrafterKind.DRAFT, 4, 0.25, settings, PassCostModel.default())
    for _ in range(10):
        policy.record(3, 0)
    assert policy.next_draft_length() == 0 and policy.paused
    calls.clear()
    ks = []
    for _ in range(200):
        ks.append(policy.next_draft_length())
        policy.may_draft_next()
        if ks[-1]:
            policy.record(ks[-1], 0)
    probes = sum(1 for k in ks if k)
    assert probes <= 4
    # every 8th step a recheck (one decision, and may_draft_next's one), plus the probes' extra
    assert len(calls) <= 2 * (200 // 8 + 1) + 3 * probes, len(calls)
    # the lazily applied age is the one a per-step age gives: the estimate drifts the same way
    eager = GainPolicy(DrafterKind.DRAFT, 4, 0.25, dataclasses.replace(settings, paused_recheck=1),
                       PassCostModel.default())
    lazy = GainPolicy(DrafterKind.DRAFT, 4, 0.25, settings, PassCostModel.default())
    for p in (eager, lazy):
        for _ in range(10):
            p.record(3, 0)
        for _ in range(5):
            p.next_draft_length()
    assert lazy.current_option().prefix_probs == pytest.approx(eager.current_option().prefix_probs)


def test_match_length_policy_follows_the_match_and_its_history():
    picky = MatchLengthPolicy(8, GainSettings(), PassCostModel.default(), priors={1: (0.05, 0.3), 8: (0.9, 0.8)})
    assert picky.draft_length(1, 8) == 0 and picky.draft_length(9, 8) == 7  # the match's bucket decides
    policy = MatchLengthPolicy(8, GainSettings(probe_interval=1000), PassCostModel.default())
    assert policy.draft_length(12, 8) > 0  # a long match pays from the prior
    assert policy.draft_length(12, 2) <= 2  # never more than the continuation
    rounds = 0
    while (k := policy.draft_length(12, 8)) > 0:  # long matches stop paying in this request
        policy.record(k, 0)
        rounds += 1
        assert rounds <= 10  # a strong prior (long matches copy well) takes a few more failures; each costs ~0.35 steps
    assert policy.draft_length(20, 8) > 0  # a longer match (another bucket) is judged on its own
    short = MatchLengthPolicy(8, GainSettings(), PassCostModel.default(), priors={1: (0.3, 0.3), 4: (0.3, 0.3)})
    assert short.bucket(1) == 1 and short.bucket(3) == 1 and short.bucket(9) == 4


def test_a_repeated_short_match_is_judged_apart_from_a_unique_one():
    policy = MatchLengthPolicy(8, GainSettings(probe_interval=1000), PassCostModel.default())
    assert policy.key(1, 1) == (1, False, False) and policy.key(1, 4) == (1, True, False)
    assert policy.key(12, 4) == (10, False, False)  # long matches are not split
    assert policy.key(1, 4, cross=True) == (1, True, True)  # a cross-request match: buckets of its own
    assert policy.draft_length(1, 8, occurrences=5) == 0  # a common token: no bet from the prior
    assert policy.draft_length(1, 8, occurrences=1) > 0  # a unique one pays on the cheap default table
    while (k := policy.draft_length(1, 8, occurrences=1)) > 0:  # unique one-token matches fail in this request
        policy.record(k, 0)
    assert policy.draft_length(2, 8, occurrences=1) > 0  # a two-token match is judged on its own


def test_pooled_later_positions_learn_past_the_drafted_length():
    """Drafts of 7 that keep being accepted in full: the n-gram estimate trusts positions 8..15
    too (pooled), so a table where 16 tokens cost about as much as two 8-token passes less
    than that picks the long draft; per-position estimates never learn past 7."""
    model = PassCostModel({1: {1: 1.0, 2: 1.75, 8: 1.78, 9: 3.0, 16: 2.94}})
    for pooled, want_long in ((True, True), (False, False)):
        estimate = AcceptanceEstimate(15, (0.9, 0.85), pooled=pooled)
        for _ in range(12):
            estimate.record(7, 7)
        option = RowOption(tuple(prefix_probabilities(estimate.conditional())))
        k = plan_round([option], model)[0]
        assert (k > 7) is want_long, (pooled, k)


def test_controller_under_the_gain_rule_pauses_and_records_no_permanent_fallback():
    c = SpeculationController(SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=4)), draft_cost=0.2)
    assert c.cost_model == PassCostModel.default()  # given none: the default table
    assert c.next_draft_length() > 0
    triggered = [c.record(c.next_draft_length() or 1, 0) for _ in range(3)]
    assert not any(triggered) and c.next_draft_length() == 0 and c.fallen_back
    fixed = SpeculationController(SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=4),
                                                    fallback=FallbackConfig(enabled=False)), draft_cost=0.9)
    assert fixed.next_draft_length() == 4  # fallback off: always draft


def test_the_given_cost_model_decides():
    spec = SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=8), fallback=FallbackConfig(prior_acceptance=0.6))
    linear = PassCostModel({1: {1: 1.0, 2: 2.0, 8: 8.0}}, "linear")  # verifying is as dear as decoding
    assert SpeculationController(spec, draft_cost=0.05, cost_model=linear).next_draft_length() == 0
    assert SpeculationController(spec, draft_cost=0.05).next_draft_length() > 0


class ScriptedEngine:
    """A stand-in for a batched engine (the contract of engines/batch.py): a pass sleeps in
    proportion to a scripted cost, so measurement must recover that cost table."""

    name = "scripted"
    vocab_size = 100
    hidden_size = 8
    max_context = 256
    num_slots = 4
    eos_token_ids = frozenset()

    def __init__(self, step_s: float = 0.02) -> None:
        self.step_s = step_s
        self.free = list(range(self.num_slots))
        self.passes = 0

    def allocate(self) -> int:
        from triton_backend.engines.batch import SlotsExhaustedError

        if not self.free:
            raise SlotsExhaustedError("no slot")
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        if slot not in self.free:
            self.free.append(slot)

    def forward(self, rows):
        self.passes += 1
        tokens = sum(len(r.tokens) for r in rows)
        time.sleep(self.step_s * (1.0 + 0.1 * (tokens - 1) + 0.3 * (len(rows) - 1)))
        return [None] * len(rows)


def test_measure_recovers_the_cost_curve_and_caches_it(tmp_path, monkeypatch):
    import triton_backend.speculation.pass_cost as pass_cost

    monkeypatch.setattr(pass_cost, "machine_busy", lambda cores=None: None)  # a quiet machine (CI's may not be)
    engine = ScriptedEngine()
    model = measure_pass_cost_model(engine, settings="test", cache_dir=tmp_path, budget_s=3.0)
    assert sorted(engine.free) == [0, 1, 2, 3]  # scratch slots given back
    assert model.pass_cost([4]) == pytest.approx(1.3, rel=0.3)
    assert model.pass_cost([1, 1]) == pytest.approx(1.4, rel=0.3)
    assert model.source == "measured:scripted"
    cached = list((tmp_path / "pass_cost").glob("*.json"))
    assert len(cached) == 1
    passes = engine.passes
    again = measure_pass_cost_model(engine, settings="test", cache_dir=tmp_path)
    assert engine.passes == passes and again.table == model.table  # read from the cache, no passes
    # keyed by runtime settings; a budget too short for the one-row curve: the default table, not cached
    assert measure_pass_cost_model(engine, settings="other runtime", cache_dir=tmp_path, budget_s=0.05) == PassCostModel.default()
    assert len(list((tmp_path / "pass_cost").glob("*.json"))) == 1
    slow = ScriptedEngine()
    slow.forward = lambda rows, real=slow.forward: (time.sleep(0.01 * slow.passes), real(rows))[1]  # ever slower: busy
    assert measure_pass_cost_model(slow, settings="busy", cache_dir=tmp_path, budget_s=3.0) == PassCostModel.default()


def test_a_busy_machine_s_measurement_is_used_but_not_cached(tmp_path, monkeypatch):
    """Measured while other work held the cores (load average above them): this process decides
    from it, the next load measures again instead of keeping a busy machine's costs for good."""
    import triton_backend.speculation.pass_cost as pass_cost

    real = pass_cost.machine_busy
    monkeypatch.setattr(pass_cost, "machine_busy", lambda cores=None: 3.2)
    model = measure_pass_cost_model(ScriptedEngine(), settings="test", cache_dir=tmp_path, budget_s=3.0)
    assert model.source == "measured:scripted" and not list((tmp_path / "pass_cost").glob("*.json"))
    monkeypatch.setattr(pass_cost, "machine_busy", lambda cores=None: None)
    measure_pass_cost_model(ScriptedEngine(), settings="test", cache_dir=tmp_path, budget_s=3.0)
    assert len(list((tmp_path / "pass_cost").glob("*.json"))) == 1
    monkeypatch.setattr(pass_cost.os, "getloadavg", lambda: (5.0, 1.0, 1.0))
    assert real(2) == 5.0
    monkeypatch.setattr(pass_cost.os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    assert real(2) is None and real(1) == 1.2


def test_a_harness_can_ask_for_a_busy_measurement_to_be_cached(tmp_path, monkeypatch):
    """SPECBUILD_CACHE_BUSY_MEASUREMENTS=1 (a server and its in-process reference must decide from
    one table): the busy machine's measurement is cached, and the next load reads it."""
    import triton_backend.speculation.pass_cost as pass_cost

    monkeypatch.setattr(pass_cost, "machine_busy", lambda cores=None: 3.2)
    monkeypatch.setenv(pass_cost.CACHE_BUSY_ENV, "1")
    first = measure_pass_cost_model(ScriptedEngine(), settings="test", cache_dir=tmp_path, budget_s=3.0)
    assert len(list((tmp_path / "pass_cost").glob("*.json"))) == 1
    monkeypatch.delenv(pass_cost.CACHE_BUSY_ENV)
    assert measure_pass_cost_model(ScriptedEngine(), settings="test", cache_dir=tmp_path, budget_s=0.01) == first


def test_measure_on_the_slot_engine_through_the_batched_contract(tmp_path):
    """The real path: a tiny random Llama on the slot engine (engines/llama_engine.py)."""
    from conftest import tiny_engine
    from triton_backend.engines.batch import BatchedEngine
    from triton_backend.engines.torch.llama_engine import LlamaEngine
    from triton_backend.speculation.pass_cost import install_measured_cost_model

    engine = tiny_engine(0)
    assert isinstance(engine, LlamaEngine) and isinstance(engine, BatchedEngine)
    slot = engine.allocate()  # a slot held by a request: measurement works around it and leaves it alone
    try:
        for attempt in range(3):  # a shared machine may be busy for one sub-millisecond measurement
            model = measure_pass_cost_model(engine, settings=f"tiny{attempt}", cache_dir=tmp_path, budget_s=2.0)
            if model.source != "default":
                break
        assert model.source == "measured:tiny0" and model.pass_cost([1]) == 1.0
        assert all(cost > 0 for curve in model.table.values() for cost in curve.values())
        assert model.pass_cost([1] * 8) > model.pass_cost([1])  # eight rows cost more than one
        fresh = engine.allocate()
        assert fresh != slot
        engine.release(fresh)
    finally:
        engine.release(slot)
    installed = install_measured_cost_model(engine, "tiny0", budget_s=0.5, cache_dir=tmp_path)
    # recorded as this engine's: its requests decide from it, other engines keep the default table
    assert installed is not None and current_cost_model(engine) is installed
    assert current_cost_model(tiny_engine(1)) == current_cost_model() == PassCostModel.default()


def test_a_seeded_sampling_request_does_not_depend_on_the_measured_costs():
    """Its draft lengths (hence its random stream and output) come from the request alone: two
    processes (or machines) that measured other pass costs and drafter costs at load give the
    same output for the same seed. Greedy requests may decide differently (their output is
    plain decoding's either way)."""
    from conftest import tiny_engine
    from triton_backend.core.config import SamplingParams, SpeculationMode
    from triton_backend.speculation.drafters.ngram import NgramDrafter
    from triton_backend.speculation.torch_decoder import SpeculativeDecoder
    from triton_backend.speculation.cost_model import MEASURED

    target = tiny_engine(0, vocab=32)
    spec = SpeculationConfig(method=SpeculationMode.NGRAM, draft_length=DraftLengthConfig(num_draft_tokens=4))
    decoder = SpeculativeDecoder(target, None, drafters={SpeculationMode.NGRAM: NgramDrafter(1, 3)}, speculation=spec)
    cheap = PassCostModel({1: {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}}, "cheap")  # verifying is free: always draft
    dear = PassCostModel({1: {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}}, "dear")  # a draft never pays
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    outputs, drafted = [], []
    for model in (cheap, dear):
        MEASURED.record(target, model)  # as a deployment records what it measured for its target at load
        sampled = decoder.generate(prompt, SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True))
        outputs.append(sampled.token_ids)
        greedy = decoder.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        drafted.append(greedy.stats.drafted_tokens)
    assert outputs[0] == outputs[1]
    assert drafted[0] > drafted[1] == 0  # the recorded costs do decide for the others
