"""The load-aware planner against measured rounds: whatever the pass-cost table says, the
regime whose rounds commit the most tokens per second is the one that runs (the others only
as probes), per batch size; and through the real scheduler (tiny random Llamas) outputs stay
those of each request alone while every regime is tried."""

from __future__ import annotations

import pytest

from test_scheduler import _alone, _requests, submit_all, tiny_decoder_with_every_drafter
from triton_backend.batching.plan import BatchPolicy, DraftPlanner, Regime, RegimeChooser
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.speculation.cost_model import PassCostModel
from triton_backend.speculation.round_plan import RowOption, plan_round


def _run(chooser: RegimeChooser, rows: int, rounds: int, rate: dict[Regime, float]) -> list[Regime]:
    """``rounds`` rounds whose measured tokens/s under each regime is ``rate``."""
    chosen = []
    for _ in range(rounds):
        regime = chooser.choose(rows)
        chooser.record(rows, regime, tokens=round(rate[regime]), seconds=1.0)
        chosen.append(regime)
    return chosen


@pytest.mark.parametrize("best", list(Regime))
def test_the_measured_best_regime_runs_and_the_others_only_as_probes(best) -> None:
    chooser = RegimeChooser(probe_every=12, warmup=2)
    rate = {r: 100.0 for r in Regime}
    rate[best] = 140.0
    chosen = _run(chooser, 16, 240, rate)
    assert chosen[0] is Regime.PLAIN  # a bucket starts plain
    assert all(r in chosen[:12 + 2] for r in Regime)  # each measured by the first probes
    assert chosen[:2 * 12 + 2].count(best) >= 2  # the best one warmup times soon after
    steady = chosen[30:]
    assert steady.count(best) / len(steady) >= 0.9
    # what the probes cost: at most a few % of the best regime's rate
    achieved = sum(rate[r] for r in steady) / len(steady)
    assert achieved / rate[best] >= 0.97


def test_plain_stays_the_incumbent_unless_a_regime_clearly_beats_it() -> None:
    """A speculating regime runs as the best only once measured ``switch_margin`` faster than
    plain: a regime about as fast as plain (one lucky round is the same thing) is only probed."""
    chooser = RegimeChooser(probe_every=8, switch_margin=0.05)
    rate = {Regime.PLAIN: 100.0, Regime.PLAN: 103.0, Regime.OWN: 60.0, Regime.FULL: 60.0}
    chosen = _run(chooser, 8, 200, rate)
    assert chosen.count(Regime.PLAN) <= 200 // 8 + 1
    rate[Regime.PLAN] = 120.0
    after = _run(chooser, 8, 40, rate)
    assert after[-20:].count(Regime.PLAN) >= 18


def test_a_larger_batch_starts_from_what_a_smaller_one_learned() -> None:
    """Speculation pays less as the batch grows: regimes that kept losing at 4 rows are not
    re-tried at once at 8 rows; they wait the interval they reached at 4."""
    chooser = RegimeChooser(probe_every=16, max_probe_every=256)
    rate = {Regime.PLAIN: 100.0, Regime.PLAN: 60.0, Regime.OWN: 50.0, Regime.FULL: 50.0}
    _run(chooser, 4, 600, rate)
    learned = chooser.probe_intervals(4)
    assert learned["plan"] >= 128 and learned["own"] >= 128
    assert chooser.probe_intervals(8) == learned
    chosen = _run(chooser, 8, 100, rate)
    assert chosen == [Regime.PLAIN] * 100


def test_a_regime_that_turns_worse_is_dropped_and_buckets_are_separate() -> None:
    chooser = RegimeChooser(probe_every=6, warmup=1)
    rate = {Regime.PLAN: 150.0, Regime.OWN: 120.0, Regime.FULL: 90.0, Regime.PLAIN: 100.0}
    assert _run(chooser, 16, 30, rate)[-5:].count(Regime.PLAN) >= 4
    rate[Regime.PLAN] = 50.0  # the batch changed: the plan's rounds now commit less than plain ones
    assert _run(chooser, 16, 60, rate)[-10:].count(Regime.OWN) >= 8
    assert chooser.bucket(16) == chooser.bucket(9) != chooser.bucket(8)
    assert chooser.rates(4) == {}  # nothing measured at 3-4 rows yet


def test_a_regime_that_keeps_losing_is_probed_ever_less_and_found_again_once_it_wins() -> None:
    chooser = RegimeChooser(probe_every=16, max_probe_every=256, backoff_margin=0.1)
    rate = {Regime.PLAIN: 100.0, Regime.PLAN: 60.0, Regime.OWN: 50.0, Regime.FULL: 50.0}
    chosen = _run(chooser, 8, 18, rate)  # plain, then each other regime's first probe after 16 rounds
    assert chosen[:15] == [Regime.PLAIN] * 15
    # doubled, or spaced by what the probe cost (0.4 and 0.5 of a round at 1 % overhead)
    assert chooser.probe_intervals(8) == {"plan": 40, "own": 50, "full": 50, "plain": 16}
    chosen += _run(chooser, 8, 1024 - 18, rate)
    # fixed probing every 16 rounds would run each loser ~64 times; backing off: 16, 32, .., 256
    assert chosen.count(Regime.PLAN) <= 9 and chosen.count(Regime.OWN) <= 9 and chosen.count(Regime.FULL) <= 9
    assert sum(rate[r] for r in chosen) / len(chosen) >= 0.99 * rate[Regime.PLAIN]
    assert chooser.probe_intervals(8) == {"plan": 256, "own": 256, "full": 256, "plain": 16}
    rate[Regime.OWN] = 200.0  # the batch changed: the rows' own drafts now pay
    after = _run(chooser, 8, 256 + 64, rate)
    found = after.index(Regime.OWN)
    assert found <= 256
    assert after[found:].count(Regime.OWN) / len(after[found:]) >= 0.9
    assert chooser.probe_intervals(8)["own"] == 16


def test_a_regime_close_to_the_best_keeps_being_probed_every_probe_every_rounds() -> None:
    chooser = RegimeChooser(probe_every=16, backoff_margin=0.1)
    rate = {Regime.PLAIN: 100.0, Regime.PLAN: 95.0, Regime.OWN: 40.0, Regime.FULL: 40.0}
    chosen = _run(chooser, 8, 512, rate)
    assert 512 // 16 - 2 <= chosen.count(Regime.PLAN) <= 512 // 16 + 2
    assert chooser.probe_intervals(8)["plan"] == 16 and chooser.probe_intervals(8)["own"] == 256


def test_the_pass_cost_plan_alone_can_lose_to_plain_when_the_table_is_wrong() -> None:
    """Why the planner measures: a table that prices one extra token per row at 16 rows as
    almost free picks drafts for every row; a pass that actually costs twice a plain one
    then commits fewer tokens per second than plain rounds. The chooser follows the measurement."""
    optimistic = PassCostModel({1: {1: 1.0, 8: 1.7}, 16: {1: 3.4, 5: 3.6}})
    rows = [RowOption(prefix_probs=(0.5, 0.25, 0.12, 0.06))] * 16
    ks = plan_round(rows, optimistic, 0.03)
    assert sum(k > 0 for k in ks) >= 12  # drafts for (nearly) every row
    tokens_plan = sum(r.expected_tokens(k) for r, k in zip(rows, ks))
    true_cost = {Regime.PLAN: 3.4 * 2.0, Regime.OWN: 3.4 * 2.0, Regime.FULL: 3.4 * 2.0, Regime.PLAIN: 3.4}
    rate = {Regime.PLAN: tokens_plan / true_cost[Regime.PLAN], Regime.OWN: tokens_plan / true_cost[Regime.OWN],
            Regime.FULL: tokens_plan / true_cost[Regime.FULL], Regime.PLAIN: 16 / true_cost[Regime.PLAIN]}
    assert rate[Regime.PLAIN] > rate[Regime.PLAN]
    chosen = _run(RegimeChooser(), 16, 120, {r: 100 * v for r, v in rate.items()})
    assert chosen[6:].count(Regime.PLAIN) / len(chosen[6:]) >= 0.9


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RegimeChooser(probe_every=1)
    with pytest.raises(ValueError):
        RegimeChooser(decay=1.0)
    with pytest.raises(ValueError):
        RegimeChooser(probe_every=16, max_probe_every=8)


class ScriptedChooser(RegimeChooser):
    """Cycles through the regimes (every one runs on the real scheduler)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Regime] = []

    def choose(self, rows: int) -> Regime:
        regime = list(Regime)[len(self.seen) % len(Regime)]
        self.seen.append(regime)
        return regime


def test_every_regime_keeps_outputs_identical_to_each_request_alone() -> None:
    decoder = tiny_decoder_with_every_drafter()
    requests = _requests(10)
    expected = _alone(decoder, requests)
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=5, policy="load_aware"))
    chooser = ScriptedChooser()
    scheduler.planner = DraftPlanner(BatchPolicy.LOAD_AWARE, chooser=chooser)
    try:
        assert [c.tokens() for c in submit_all(scheduler, requests)] == expected
    finally:
        scheduler.shutdown()
    assert set(chooser.seen) == set(Regime)


class FixedChooser(RegimeChooser):
    def __init__(self, regime: Regime) -> None:
        super().__init__()
        self.regime = regime

    def choose(self, rows: int) -> Regime:
        return self.regime


def test_the_plan_sizes_ngram_drafts_by_each_rows_match() -> None:
    """Under the pass-cost plan an n-gram row offers the match its next proposal would use: a
    row without one is a free plain row, a row whose text repeats a long stretch gets drafts,
    and its session then drafts exactly the planned length (recorded in that match's bucket)."""
    from triton_backend.batching.batch_round import BatchSequence, PlannedRow, propose_per_row
    from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode

    decoder = tiny_decoder_with_every_drafter()
    mode, drafter = decoder.resolve(SpeculationMode.NGRAM)
    spec = SpeculationConfig(method="ngram")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    repeated = list(range(3, 23)) + list(range(3, 20))  # the suffix 3..19 occurred before, then 20, 21, 22, 3, ..
    fresh = [5, 9, 2, 30, 17, 11]  # no earlier occurrence of any suffix
    seqs = [BatchSequence(decoder.target, decoder.tokenizer, p, params, spec, mode, drafter, started=0.0)
            for p in (repeated, fresh)]
    cheap = PassCostModel({1: {1: 1.0, 8: 1.1}, 2: {1: 1.02, 8: 1.2}})
    planner = DraftPlanner(BatchPolicy.LOAD_AWARE, cost_model=cheap, chooser=FixedChooser(Regime.PLAN))
    assert seqs[1].row_option().max_k == 0
    ks = planner.plan(seqs)
    assert ks[0] >= 2 and ks[1] == 0
    rows = [PlannedRow(seq, k) for seq, k in zip(seqs, ks)]
    propose_per_row(rows)
    assert rows[0].proposal.tokens == [20, 21, 22, 3, 4, 5, 6, 7, 8][:ks[0]]  # exactly the planned length
    assert len(rows[1].proposal) == 0


def test_a_probe_that_runs_long_is_spaced_out_by_what_it_costs() -> None:
    """At a large batch a probe that drafts for every row can take several plain rounds' time
    for fewer tokens per second: such probes are spaced so they cost at most ~1 % of the time."""
    chooser = RegimeChooser(probe_every=16, max_probe_every=1024, probe_overhead=0.01)
    seconds = {Regime.PLAIN: 1.0, Regime.PLAN: 1.5, Regime.OWN: 4.0, Regime.FULL: 4.0}
    rate = {Regime.PLAIN: 100.0, Regime.PLAN: 80.0, Regime.OWN: 50.0, Regime.FULL: 50.0}
    spent = {r: 0.0 for r in Regime}
    for _ in range(4000):
        regime = chooser.choose(8)
        chooser.record(8, regime, tokens=round(rate[regime] * seconds[regime]), seconds=seconds[regime])
        spent[regime] += seconds[regime]
    # OWN's probe loses 4 x 0.5 = 2 plain rounds: probed at most every 200 rounds
    assert chooser.probe_intervals(8)["own"] >= 200 and chooser.probe_intervals(8)["plan"] >= 30
    total = sum(spent.values())
    achieved = sum(rate[r] * spent[r] for r in Regime) / total
    assert achieved >= 0.98 * rate[Regime.PLAIN]


def test_rounds_that_carry_a_prompt_are_not_measured() -> None:
    """A request that joins mid-batch with a prompt that fits the round's budget rides in a
    planned row: that round runs several plain rounds long whatever the regime, so the chooser
    must not take it as a measurement of the regime that ran it (a plain round polluted so
    made speculating regimes look better at high load)."""
    from triton_backend.core.config import DraftLengthConfig, SamplingParams, SpeculationConfig

    decoder = tiny_decoder_with_every_drafter()
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=3, policy="load_aware"))
    last_pass = {"prompt": False}
    forward = scheduler.target.forward

    def watched(rows):  # noqa: ANN001, ANN202
        last_pass["prompt"] = any(len(r.tokens) > 4 for r in rows)  # k = 3: a decode row has at most 4 tokens
        return forward(rows)

    class Watching(RegimeChooser):
        measured: list[bool] = []  # per recorded round: whether its pass carried a prompt

        def record(self, rows: int, regime: Regime, tokens: int, seconds: float) -> None:
            self.measured.append(last_pass["prompt"])
            super().record(rows, regime, tokens, seconds)

    scheduler.target.forward = watched
    chooser = Watching()
    scheduler.planner = DraftPlanner(BatchPolicy.LOAD_AWARE, chooser=chooser)
    spec = SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=3))
    requests = [(list(range(i, i + 12)), SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True), spec)
                for i in range(1, 8)]
    try:
        outputs = [c.tokens() for c in submit_all(scheduler, requests)]
    finally:
        scheduler.shutdown()
    assert all(len(o) == 8 + 4 * i for o, i in zip(outputs, range(1, 8)))
    assert len(chooser.measured) >= 10 and not any(chooser.measured)


def test_one_lucky_probe_does_not_make_a_losing_regime_the_best() -> None:
    """A probe's round is weighed with the regime's earlier probes: drafts that happened to be
    all accepted in one round (or a plain round slowed by a busy machine) do not flip the choice."""
    chooser = RegimeChooser(probe_every=8, max_probe_every=8)
    rate = {Regime.PLAIN: 100.0, Regime.PLAN: 60.0, Regime.OWN: 60.0, Regime.FULL: 60.0}
    _run(chooser, 8, 200, rate)
    rate[Regime.OWN] = 130.0  # one lucky round
    while (regime := chooser.choose(8)) is not Regime.OWN:
        chooser.record(8, regime, tokens=round(rate[regime]), seconds=1.0)
    chooser.record(8, Regime.OWN, tokens=130, seconds=1.0)
    rate[Regime.OWN] = 60.0
    assert Regime.OWN not in _run(chooser, 8, 7, rate)
    # a regime that keeps measuring better does take over within a few probes
    rate[Regime.OWN] = 130.0
    assert _run(chooser, 8, 40, rate)[-8:].count(Regime.OWN) >= 5  # the other three probed every 8 rounds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_rounds_cost_little_where_plain_is_best(seed) -> None:
    """Rounds as noisy as a shared VM's (time 15 % from round to round; drafts accepted by
    chance): where plain is best, the probes and wrong picks cost at most a few percent."""
    import random

    rng = random.Random(seed)
    shape = {Regime.PLAIN: (16, 0.0, 0.100), Regime.PLAN: (16.2, 0.5, 0.105), Regime.OWN: (21, 4.0, 0.16),
             Regime.FULL: (22, 4.5, 0.17)}
    chooser = RegimeChooser()
    tokens = seconds = 0.0
    for _ in range(600):
        regime = chooser.choose(16)
        mean, sd, round_s = shape[regime]
        t = max(16, round(rng.gauss(mean, sd)))
        s = round_s * max(0.5, rng.gauss(1.0, 0.15))
        chooser.record(16, regime, t, s)
        tokens, seconds = tokens + t, seconds + s
    assert tokens / seconds >= 0.97 * 16 / 0.100
