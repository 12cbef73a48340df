"""N-gram lookup and the speculation controller (draft length, fallback window)."""

from __future__ import annotations

import pytest

from triton_backend.config import SpeculationConfig
from triton_backend.controller import SpeculationController, expected_tokens_per_round
from triton_backend.drafters.ngram import find_ngram_continuation


def test_ngram_prefers_longest_and_most_recent_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix (2, 3) last seen before the end at index 5-6 -> continues with 7, 8
    assert find_ngram_continuation(tokens, 2, 1, 3) == [7, 8]
    # suffix (5, 2, 3) never occurred before -> falls back to n=2
    assert find_ngram_continuation(tokens, 10, 3, 3) == []


def test_ngram_edge_cases():
    assert find_ngram_continuation([4], 3, 1, 3) == []
    assert find_ngram_continuation([4, 4], 3, 1, 3) == [4]
    assert find_ngram_continuation([1, 2, 3], 0, 1, 3) == []
    assert find_ngram_continuation([1, 2, 3, 4], 3, 1, 2) == []


def test_expected_tokens_formula():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)


def test_fixed_draft_length():
    c = SpeculationController(SpeculationConfig(num_draft_tokens=5), draft_cost=0.1)
    assert c.next_draft_length() == 5


def test_adaptive_draft_length_follows_acceptance():
    cfg = SpeculationConfig(num_draft_tokens=8, adaptive=True, fallback=False)
    c = SpeculationController(cfg, draft_cost=0.05)
    for _ in range(20):
        c.record(c.next_draft_length(), c.next_draft_length())  # everything accepted
    high = c.next_draft_length()
    for _ in range(30):
        c.record(4, 0)
    low = c.next_draft_length()
    assert high == 8 and low == cfg.min_draft_tokens


def test_fallback_triggers_within_window_and_is_sticky():
    cfg = SpeculationConfig(num_draft_tokens=4, fallback_window=40, fallback_min_drafted=20, fallback_threshold=0.5)
    c = SpeculationController(cfg, draft_cost=0.1)
    triggered_at = None
    for round_ in range(20):
        if c.record(4, 1):  # 25% acceptance
            triggered_at = round_
            break
    assert triggered_at == 4  # 20 drafted tokens seen
    assert c.fallen_back and c.next_draft_length() == 0
    assert c.record(4, 4) is False  # no second trigger


def test_no_fallback_when_acceptance_is_good_or_disabled():
    good = SpeculationController(SpeculationConfig(fallback_min_drafted=8, fallback_window=16), 0.1)
    for _ in range(50):
        assert not good.record(4, 3)
    off = SpeculationController(SpeculationConfig(fallback=False, fallback_min_drafted=8, fallback_window=16), 0.1)
    for _ in range(50):
        assert not off.record(4, 0)
    assert not off.fallen_back


def test_empty_rounds_do_not_count():
    c = SpeculationController(SpeculationConfig(fallback_min_drafted=1, fallback_window=4), 0.0)
    assert not c.record(0, 0)
    assert c.window_acceptance() is None


def _run_rounds(controller: SpeculationController, rounds: list[tuple[int, int]]) -> bool:
    return any(controller.record(d, a) for d, a in rounds)


def test_break_even_fallback_keeps_a_free_drafter_that_pays_and_drops_a_costly_one():
    cfg = SpeculationConfig(num_draft_tokens=8, fallback_window=64, fallback_min_drafted=32)
    # a copy-like pattern: every third round copies 8 tokens, the others miss -> 13/3 tokens per 3 rounds
    bursty = [(8, 8), (8, 0), (8, 0)] * 10
    free = SpeculationController(cfg, draft_cost=0.0)
    assert not _run_rounds(free, bursty)
    assert free.window_gain() > 1.0
    costly = SpeculationController(cfg, draft_cost=0.3)  # the same outcomes from a draft costing 0.3 steps a token
    assert _run_rounds(costly, bursty) and costly.fallen_back
    assert costly.window_gain() < 1.0


def test_break_even_fallback_for_a_free_drafter_that_never_matches():
    cfg = SpeculationConfig(num_draft_tokens=4, fallback_window=40, fallback_min_drafted=20)
    c = SpeculationController(cfg, draft_cost=0.0)
    assert _run_rounds(c, [(4, 0)] * 20) and c.fallen_back  # 1 token per 1.24 steps


def test_explicit_threshold_overrides_break_even():
    cfg = SpeculationConfig(num_draft_tokens=8, fallback_window=64, fallback_min_drafted=32, fallback_threshold=0.5)
    c = SpeculationController(cfg, draft_cost=0.0)
    assert _run_rounds(c, [(8, 8), (8, 0), (8, 0)] * 10)  # pays, but acceptance 1/3 < 0.5


def test_adaptive_controller_drops_a_draft_that_cannot_pay_within_a_few_rounds():
    cfg = SpeculationConfig(num_draft_tokens=4, adaptive=True)
    costly = SpeculationController(cfg, draft_cost=0.3)
    rounds = 0
    while costly.next_draft_length() > 0:
        costly.record(costly.next_draft_length(), 0)
        rounds += 1
        assert rounds < 10
    assert costly.fallen_back and rounds >= 1
    free = SpeculationController(cfg, draft_cost=0.0)  # n-gram: 0.3 acceptance still pays
    for _ in range(30):
        k = free.next_draft_length()
        assert k > 0
        free.record(k, round(0.3 * k))
    assert not free.fallen_back
    never = SpeculationController(SpeculationConfig(num_draft_tokens=4, adaptive=True, fallback=False), draft_cost=0.3)
    for _ in range(30):
        never.record(never.next_draft_length(), 0)
    assert never.next_draft_length() >= 1 and not never.fallen_back
