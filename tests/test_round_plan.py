"""speculation/round_plan.py: the one place a round's draft is decided (auto's source, a batch
with rows decided elsewhere), and speculation/cost_model.py: pass costs recorded per target engine."""

from __future__ import annotations

import gc

from triton_backend.speculation.cost_model import MEASURED, PassCostModel, current_cost_model
from triton_backend.speculation.round_plan import (DraftSource, RowOption, choose_source, plan_batch, plan_round,
                                                   prefix_probabilities, rate_of)

FLAT = PassCostModel({1: {1: 1.0, 16: 1.1}}, "flat")  # verifying is nearly free
DEAR = PassCostModel({1: {1: 1.0, 2: 2.0, 8: 8.0}}, "dear")  # verifying costs as much as decoding


def _option(acceptance: float, k: int, draft_cost: float = 0.0) -> RowOption:
    return RowOption(tuple(prefix_probabilities([acceptance] * k)), draft_cost)


class _Merged:
    """A merged tree's option whose split puts ``share`` of its nodes on the match."""

    def __init__(self, option: RowOption, share: int) -> None:
        self.option, self.share = option, share

    def split(self, k: int) -> tuple[int, int]:
        return min(self.share, k), max(0, k - self.share)


def test_no_match_leaves_the_round_to_the_model_drafter():
    choice = choose_source(None, 0, _option(0.9, 4, 0.1), FLAT, 0.03)
    assert choice.source is DraftSource.MODEL and choice.option is None


def test_a_paused_model_drafter_leaves_a_paying_match_to_draft():
    match = _option(0.9, 6)
    choice = choose_source(match, 5, None, FLAT, 0.03)
    assert (choice.source, choice.k, choice.option) == (DraftSource.NGRAM, 5, match)
    assert choose_source(match, 0, None, FLAT, 0.03).source is DraftSource.MODEL  # a match that does not pay


def test_the_better_source_drafts_and_a_tie_goes_to_the_match():
    weak, strong = _option(0.3, 4), _option(0.95, 4)
    assert choose_source(strong, 4, weak, FLAT, 0.03).source is DraftSource.NGRAM
    assert choose_source(weak, 1, strong, FLAT, 0.03).source is DraftSource.MODEL
    same = _option(0.8, 4)
    k = plan_round([same], FLAT, 0.03)[0]
    assert choose_source(same, k, same, FLAT, 0.03).source is DraftSource.NGRAM


def test_a_merged_tree_must_beat_both_and_hold_both_sources():
    match, model = _option(0.6, 4), _option(0.6, 4, 0.05)
    better = _option(0.97, 8, 0.01)
    choice = choose_source(match, 4, model, FLAT, 0.03, lambda: _Merged(better, 2))
    assert choice.source is DraftSource.MERGED and choice.merged is not None and choice.k > 2
    # a "merged" tree whose nodes would all be the match's is not a merged round
    assert choose_source(match, 4, model, FLAT, 0.03, lambda: _Merged(better, 16)).source is not DraftSource.MERGED
    # nothing pays on a dear table: no source drafts
    assert choose_source(match, 0, model, DEAR, 0.03, lambda: _Merged(model, 2)).source is DraftSource.MODEL


def test_a_batch_keeps_the_rows_decided_elsewhere():
    rows = [_option(0.9, 8), _option(0.9, 8), RowOption(prefix_probs=(0.0,) * 3)]
    ks = plan_batch(rows, [0, 0, 3], [0, 1], FLAT, 0.03)
    assert ks[2] == 3 and ks[:2] == plan_round(rows, FLAT, 0.03)[:2] and ks[0] > 0
    assert rate_of(rows[0], ks[0], FLAT) > rate_of(rows[0], 0, FLAT)


def test_pass_costs_are_recorded_per_engine_and_forgotten_with_it():
    class Engine:
        pass

    a, b = Engine(), Engine()
    model = PassCostModel({1: {1: 1.0, 2: 1.5}}, "measured:a")
    MEASURED.record(a, model)
    assert current_cost_model(a) is model
    assert current_cost_model(b) == current_cost_model() == PassCostModel.default()
    held = len(MEASURED.snapshot())
    del a
    gc.collect()
    assert len(MEASURED.snapshot()) == held - 1
