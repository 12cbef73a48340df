"""N-gram lookup (incremental index) and the speculation controller: fixed k, the threshold
rule's window, the gain rule on scripted acceptance sequences, the per-match n-gram decision."""

from __future__ import annotations

import random

import pytest

from triton_backend.core.config import DraftLengthConfig, FallbackConfig, FallbackRule, SpeculationConfig, SpeculationMode
from triton_backend.speculation.controller import SpeculationController, controller_for, expected_tokens_per_round
from triton_backend.speculation.drafters.ngram import NgramDrafter, NgramIndex, find_ngram_continuation
from triton_backend.speculation.policy import DrafterKind


pytestmark = pytest.mark.usefixtures("default_pass_costs")  # the scripted sequences assume the default table


def test_ngram_prefers_longest_and_most_recent_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix (2, 3) last seen before the end at index 5-6 -> continues with 7, 8
    assert find_ngram_continuation(tokens, 2, 1, 3) == [7, 8]
    # suffix (5, 2, 3) never occurred before -> falls back to n=2
    assert find_ngram_continuation(tokens, 10, 3, 3) == []


def test_ngram_edge_cases():
    assert find_ngram_continuation([4], 3, 1, 3) == []
    assert find_ngram_continuation([4, 4], 3, 1, 3) == [4, 4, 4]  # the run repeats
    assert find_ngram_continuation([1, 2, 3], 0, 1, 3) == []
    assert find_ngram_continuation([1, 2, 3, 4], 3, 1, 2) == []


def test_expected_tokens_formula():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)


def test_fixed_draft_length():
    c = SpeculationController(SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=5),
                                                fallback=FallbackConfig(enabled=False)), draft_cost=0.1)
    assert c.next_draft_length() == 5
    threshold = SpeculationController(SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=5),
                                                        fallback=FallbackConfig(rule="threshold")), draft_cost=0.1)
    assert threshold.next_draft_length() == 5 and threshold.config.fallback.rule is FallbackRule.THRESHOLD


def test_adaptive_draft_length_follows_acceptance():
    cfg = SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=8, adaptive=True),
                            fallback=FallbackConfig(enabled=False))
    c = SpeculationController(cfg, draft_cost=0.05)
    for _ in range(20):
        c.record(c.next_draft_length(), c.next_draft_length())  # everything accepted
    high = c.next_draft_length()
    for _ in range(30):
        c.record(4, 0)
    low = c.next_draft_length()
    assert high == 8 and low == cfg.draft_length.min_draft_tokens


def test_threshold_rule_triggers_within_window_and_is_sticky():
    cfg = SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=4), fallback=FallbackConfig(window=40,
                                                                                                        min_drafted=20, threshold=0.5))
    assert cfg.fallback.rule is FallbackRule.THRESHOLD  # setting a threshold selects the rule
    c = SpeculationController(cfg, draft_cost=0.1)
    triggered_at = None
    for round_ in range(20):
        if c.record(4, 1):  # 25% acceptance
            triggered_at = round_
            break
    assert triggered_at == 4  # 20 drafted tokens seen
    assert c.fallen_back and c.next_draft_length() == 0
    assert c.record(4, 4) is False  # no second trigger


def test_threshold_rule_defaults_to_the_seed_articles_window():
    cfg = SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=4),
                            fallback=FallbackConfig(rule="threshold"))
    assert (cfg.fallback.window, cfg.fallback.min_drafted) == (200, 50)
    c = SpeculationController(cfg, draft_cost=0.0)
    assert not any(c.record(4, 2) for _ in range(100))  # exactly 0.5: keeps speculating
    low = SpeculationController(cfg, draft_cost=0.0)
    fired = [low.record(4, 1) for _ in range(20)]
    assert fired.index(True) == 12  # 52 drafted tokens >= 50, acceptance 0.25 < 0.5


def test_no_fallback_when_acceptance_is_good_or_disabled():
    good = SpeculationController(SpeculationConfig(fallback=FallbackConfig(min_drafted=8, window=16,
                                                                           rule="threshold")), 0.1)
    for _ in range(50):
        assert not good.record(4, 3)
    off = SpeculationController(SpeculationConfig(fallback=FallbackConfig(enabled=False, min_drafted=8, window=16)),
                                0.1)
    for _ in range(50):
        assert not off.record(4, 0)
    assert not off.fallen_back and off.next_draft_length() == 4


def test_empty_rounds_do_not_count():
    c = SpeculationController(SpeculationConfig(fallback=FallbackConfig(min_drafted=1, window=4)), 0.0)
    assert not c.record(0, 0)
    assert c.window_acceptance() is None


def test_gain_rule_drops_a_costly_draft_within_a_few_rounds_and_keeps_a_free_one_that_pays():
    cfg = SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=4))
    costly = SpeculationController(cfg, draft_cost=0.3)
    rounds = 0
    while (k := costly.next_draft_length()) > 0:
        costly.record(k, 0)
        rounds += 1
        assert rounds <= 3
    assert costly.fallen_back and rounds >= 1
    free = SpeculationController(cfg, draft_cost=0.0, kind=DrafterKind.DRAFT)  # free drafts: 0.5 acceptance pays
    for _ in range(30):
        k = free.next_draft_length()
        assert k > 0
        free.record(k, k // 2)
    assert not free.fallen_back


def test_gain_rule_is_never_a_permanent_fallback():
    c = SpeculationController(SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=4),
                                                fallback=FallbackConfig(probe_interval=4)), draft_cost=0.1)
    for _ in range(5):
        c.record(c.next_draft_length() or 4, 0)
    ks = []
    for _ in range(60):
        ks.append(c.next_draft_length())
        c.record(ks[-1], 0)  # the probes fail
    assert ks.count(0) > 50 and any(ks)  # paused, with probes (backing off)
    resumed = []
    for _ in range(150):  # the probes pay: speculation resumes and stays on
        k = c.next_draft_length()
        c.record(k, k)
        resumed.append(k)
    assert all(k > 0 for k in resumed[-10:])


def test_ngram_index_is_incremental_and_agrees_with_a_full_scan():
    rng = random.Random(0)
    for trial in range(30):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 80))]
        index = NgramIndex(1, 3)
        for end in range(1, len(tokens) + 1):  # grows like a committed sequence
            index.update(tokens[:end])
            found = index.lookup(4)
            expected = _full_scan(tokens[:end], 4, 1, 3)
            assert (found.continuation if found else []) == expected, (trial, end)
            if found:  # the reported length is the real match length
                m = found.length
                e = _match_end(tokens[:end], 1, 3)
                assert tokens[e - m:e] == tokens[end - m:end]
                assert m == 64 or e - m == 0 or tokens[e - m - 1] != tokens[end - m - 1]
                n = _matched_n(tokens[:end], 1, 3)  # occurrences of the matched n-gram, something after them
                gram = tokens[end - n:end]
                assert found.occurrences == sum(1 for x in range(n, end) if tokens[x - n:x] == gram) >= 1


def test_an_overlapping_match_continues_with_its_period():
    # "x a b a b a b": the suffix (a, b, a... ) last occurred two tokens back; what followed
    # it runs into the suffix itself, so the draft repeats the period (a, b) instead of stopping
    assert find_ngram_continuation([9, 1, 2, 1, 2, 1, 2], 5, 1, 3) == [1, 2, 1, 2, 1]
    assert find_ngram_continuation([9, 4, 4, 4], 6, 1, 3) == [4] * 6  # a run of one token
    assert find_ngram_continuation([1, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [7, 1, 2]  # no overlap: as before
    index = NgramIndex(1, 3)
    index.update([5, 6, 7, 5, 6, 7, 5, 6])
    found = index.lookup(8)
    assert found is not None and found.continuation == [7, 5, 6, 7, 5, 6, 7, 5]


def _full_scan(tokens, k, min_n, max_n):
    """The slow reference: the most recent earlier match of the longest suffix n-gram."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:  # an overlapping occurrence repeats with its period
                extended = list(tokens)
                while len(extended) < end + k:
                    extended.append(extended[len(extended) - (length - end)])
                return extended[end:end + k]
    return []


def _match_end(tokens, min_n, max_n):
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[length - n:]:
                return end
    raise AssertionError("no match")


def test_ngram_session_under_the_gain_rule_sizes_the_draft_by_the_match():
    drafter = NgramDrafter(1, 3)
    session = drafter.new_session()
    controller = controller_for(SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=8)),
                                SpeculationMode.NGRAM, drafter, session)
    assert session.policy is not None and controller.match_policy is session.policy
    copy = list(range(100, 130))
    tokens = [1, 2] + copy + [3, 4] + copy[:12]  # the output is copying the prompt: a 12-token match
    k = controller.next_draft_length()
    assert session.propose(tokens, k, None, None).tokens == copy[12:12 + 7]  # 8 tokens fill one packed GEMM
    unique = [5, 6, 7, 8, 9, 5]  # a one-token match on a token seen once: a bet on the cheap default table
    repeated = [5, 6, 5, 7, 5, 8, 9, 5]  # the same token seen three times: a weak signal, no bet
    assert len(session.propose(repeated, k, None, None).tokens) == 0
    assert len(session.propose(unique, k, None, None).tokens) > 0
    plain_session = drafter.new_session()  # no policy (fallback off): the whole continuation
    assert plain_session.propose(unique, 3, None, None).tokens == [6, 7, 8]


def _matched_n(tokens, min_n, max_n):
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        if any(tokens[end - n:end] == tokens[length - n:] for end in range(length - 1, n - 1, -1)):
            return n
    raise AssertionError("no match")
