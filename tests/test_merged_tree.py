"""``auto``'s merged draft trees: the n-gram match as one branch of the EAGLE drafter's tree.

The merge (shared prefix deduplicated, the rest of the match a branch of its own); the
multi-draft rule with the match tried first as a point-mass draft (statistically exact; two
plausible wrong rules are caught); the merged row option the gain rule sizes; and the loop:
greedy auto with merged rounds token for token the plain output, alone and batched, seeded
sampling batched equal to alone, a paused drafter never merged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy import stats as scipy_stats

from test_auto_source import PROMPTS, _auto, _decoder
from test_scheduler import assert_mixed_batch_matches_alone
from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.core.sampling import sample
from triton_backend.speculation.auto_source import AutoSource, DraftSource
from triton_backend.speculation.drafters.protocol import DraftProposal
from triton_backend.speculation.drafters.eagle_tree import draw_without_replacement
from triton_backend.speculation.merged_tree import lookup_accepted, merge_lookup, merged_option
from triton_backend.speculation.round_plan import RowOption
from triton_backend.speculation.tree_plan import TreeRecord
from triton_backend.speculation.tree_verify import TreeVerifyResult, verify_tree_multidraft

pytestmark = pytest.mark.usefixtures("default_pass_costs")


def test_merge_shares_the_common_prefix_and_hangs_the_rest_below():
    # drafter: root children 5 (rank 0), 6 (rank 1); 5's children 7 (rank 0), 8 (rank 1)
    q = torch.full((4, 10), 0.1)
    tree = DraftProposal([5, 6, 7, 8], q, [-1, -1, 0, 0], [0, 1, 0, 1])
    merged = merge_lookup(tree, [5, 8, 2, 3])
    assert merged.tokens == [5, 6, 7, 8, 2, 3]
    assert merged.parents == [-1, -1, 0, 0, 3, 4]
    assert merged.ranks == [0, 1, 0, 1, -1, -1]
    assert merged.lookup == [True, False, False, True, True, True]
    assert merged.probs.shape == (6, 10) and float(merged.probs[4:].abs().sum()) == 0.0
    disjoint = merge_lookup(tree, [9])  # nothing shared: a branch from the root
    assert disjoint.parents[-1] == -1 and disjoint.lookup == [False] * 4 + [True]
    alone = merge_lookup(DraftProposal([]), [1, 2])  # no drafter tree (its first round): the chain
    assert (alone.tokens, alone.parents, alone.ranks, alone.probs) == ([1, 2], [-1, 0], [-1, -1], None)
    assert lookup_accepted([0, 3, 4], merged.lookup) == 3 and lookup_accepted([1], merged.lookup) == 0


def test_merged_record_counts_the_drafter_nodes_and_the_match_apart():
    parents, ranks, lookup = [-1, -1, 0, 0, 3, 4], [0, 1, 0, 1, -1, -1], [True, False, False, True, True, True]
    record = TreeRecord.of(parents, ranks, [0, 3, 4], lookup)
    assert (record.chain_drafted, record.chain_accepted) == (2, 1)  # the drafter's first choices: 5, 7
    assert record.accepted_nodes == 2  # nodes 0 and 3 are the drafter's; the match-only node 4 is not
    assert (record.lookup_drafted, record.lookup_accepted, record.path_length) == (4, 3, 3)


# -- the rule ------------------------------------------------------------------------------------

VOCAB = 5


def _tables(seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    soft = lambda *shape: torch.softmax(torch.randn(*shape, generator=g) * 1.5, -1)  # noqa: E731
    return soft(VOCAB), soft(VOCAB, VOCAB), soft(VOCAB), soft(VOCAB, VOCAB)  # p0, p(.|a), q0, q(.|a)


def _no_residual_rule(rows, tokens, parents, probs, g, lookup, drawn):
    """Wrong: the match's child tried first, but the drafter's children then checked against
    the unchanged ``p`` (the match's rejection forgotten)."""
    return _first_row(rows, tokens, parents, probs, g, lookup, drawn, residual=False)


def _drafter_q_rule(rows, tokens, parents, probs, g, lookup, drawn):
    """Wrong: the match's child checked as if the drafter had drawn it (``min(1, p/q)``)."""
    return _first_row(rows, tokens, parents, probs, g, lookup, drawn, residual=True, point_q=False)


def _first_row(rows, tokens, parents, probs, g, lookup, drawn, residual: bool, point_q: bool = True):
    """The root row only (enough for the first committed token), under a variant of the rule."""
    p = rows(0)
    kids = [i for i, par in enumerate(parents) if par < 0]
    q = probs[next(c for c in kids if drawn[c])].float()
    for c in [c for c in kids if lookup[c]]:
        x = tokens[c]
        bar = float(q[x]) if not point_q else 1.0
        if float(torch.rand(1, generator=g)) * bar < float(p[x]):
            return TreeVerifyResult((c,), -1)
        if residual:
            p = p.clone()
            p[x] = 0.0
            p = p / p.sum()
    for c in [c for c in kids if drawn[c]]:
        x = tokens[c]
        if float(q[x]) > 0 and float(torch.rand(1, generator=g)) * float(q[x]) < float(p[x]):
            return TreeVerifyResult((c,), -1)
        r = torch.clamp(p - q, min=0.0)
        p = r / r.sum() if float(r.sum()) > 0 else p
        q = q.clone()
        q[x] = 0.0
        q = q / q.sum()
    return TreeVerifyResult((), sample(p, g))


def _joint_of_first_two(rule, n: int, seed: int) -> torch.Tensor:
    """Counts of the first two committed tokens when a merged tree -- the drafter's 3-wide,
    2-deep tree drawn from q plus a fixed match ``[1, 3]`` (shared with the drafter's node
    when it drew 1) -- is verified by ``rule`` (missing tokens from ``p`` as the next round would)."""
    p0, p1, q0, q1 = _tables()
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    merged_rows = 0
    for _ in range(n):
        first = draw_without_replacement(q0, 3, g)
        second = draw_without_replacement(q1[first[0]], 2, g)
        tree = DraftProposal(first + second, torch.stack([q0] * 3 + [q1[first[0]]] * 2), [-1, -1, -1, 0, 0],
                             [0, 1, 2, 0, 1])
        merged = merge_lookup(tree, [1, 3])
        merged_rows += 1 in first
        tokens = merged.tokens
        rows = lambda i: p0 if i == 0 else p1[tokens[i - 1]]  # noqa: E731
        drawn = [r >= 0 for r in merged.ranks]
        r = rule(rows, tokens, merged.parents, merged.probs, g, merged.lookup, drawn)
        seq = [tokens[i] for i in r.path] + ([r.next_token] if r.next_token >= 0 else [])
        if len(seq) == 1:
            seq.append(int(torch.multinomial(p1[seq[0]], 1, generator=g)))
        counts[seq[0], seq[1]] += 1
    assert merged_rows > n // 4  # the shared-node case is well covered
    return counts


def test_match_first_rule_preserves_the_target_distribution_and_wrong_rules_fail():
    p0, p1, _, _ = _tables()
    n = 20000
    expected = ((p0[:, None] * p1).flatten() * n).numpy()
    exact = _joint_of_first_two(verify_tree_multidraft, n, 0)
    assert scipy_stats.chisquare(exact.flatten().numpy(), expected).pvalue > 1e-3
    for wrong in (_no_residual_rule, _drafter_q_rule):
        counts = _joint_of_first_two(wrong, n, 0)
        assert scipy_stats.chisquare(counts.flatten().numpy(), expected).pvalue < 1e-6, wrong.__name__  # teeth


def test_a_match_the_target_always_takes_is_always_accepted():
    p0, p1, q0, q1 = _tables()
    point = torch.zeros(VOCAB)
    point[2] = 1.0
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        first = draw_without_replacement(q0, 2, g)
        merged = merge_lookup(DraftProposal(first, torch.stack([q0, q0]), [-1, -1], [0, 1]), [2])
        r = verify_tree_multidraft(lambda i: point if i == 0 else p1[0], merged.tokens, merged.parents, merged.probs, g,
                                   merged.lookup, [x >= 0 for x in merged.ranks])
        assert [merged.tokens[i] for i in r.path] == [2]


# -- sizing --------------------------------------------------------------------------------------


def test_merged_option_interleaves_best_first_and_costs_the_drafter_nodes():
    model = RowOption((0.6, 0.3, 0.2), 0.1, draft_costs=(0.0, 0.1, 0.2, 0.25))
    merged = merged_option([0.5, 0.4], model, [1, 1, 2], overlap=1.0, max_nodes=4)
    # drafter node values: 0.6 * (1 - 0.5) = 0.3, 0.3 * 0.5 = 0.15, 0.2 * (1 - 0.4) = 0.12 (kept non-increasing)
    assert merged.from_lookup == (True, True, False, False)
    assert merged.option.prefix_probs == pytest.approx((0.5, 0.4, 0.3, 0.15))
    assert merged.option.draft_costs == (0.0, 0.0, 0.0, 0.1, 0.2)
    assert merged.split(3) == (2, 1) and merged.model_gain(4) == pytest.approx(0.45)
    assert merged_option([], model, [1, 1, 2], 1.0, 8).split(3) == (0, 3)


# -- the loop ------------------------------------------------------------------------------------


@pytest.fixture
def merged_rounds(monkeypatch) -> dict[DraftSource, int]:
    """Counts the rounds each source drafted with the drafter (a spy on the real choice)."""
    counts = {s: 0 for s in DraftSource}
    real = AutoSource.model_round

    def counted(self):
        counts[self.source] += 1
        real(self)

    monkeypatch.setattr(AutoSource, "model_round", counted)
    return counts


def _merging(merge: bool = True, prior: float = 0.7) -> SpeculationConfig:
    spec = _auto(prior=prior)
    return dataclasses.replace(spec, eagle=dataclasses.replace(spec.eagle, merge_lookup=merge))


def test_auto_with_merged_trees_greedy_identical_to_plain(merged_rounds):
    decoder = _decoder(SpeculationMode.EAGLE)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, params, SpeculationConfig(method="off"))
        assert decoder.generate(prompt, params, _merging()).token_ids == plain.token_ids, prompt
    assert merged_rounds[DraftSource.MERGED] > 0, merged_rounds
    before = merged_rounds[DraftSource.MERGED]
    for prompt in PROMPTS:  # merging off: never a merged round
        decoder.generate(prompt, params, _merging(merge=False))
    assert merged_rounds[DraftSource.MERGED] == before


@pytest.mark.parametrize("policy", ["per_request", "load_aware"])
def test_merged_rows_batched_identical_to_alone(policy, merged_rounds):
    assert_mixed_batch_matches_alone(_decoder(SpeculationMode.EAGLE), PROMPTS, _merging(), policy, base_tokens=20,
                                     base_seed=70)
    assert merged_rounds[DraftSource.MERGED] > 0, merged_rounds


def test_a_paused_drafter_is_never_merged(monkeypatch):
    """A paused model drafter costs nothing: no tree model is asked, the match drafts alone."""
    decoder = _decoder(SpeculationMode.EAGLE)
    seen: list[DraftSource] = []
    real_choose = AutoSource.choose

    def choose(self, tokens):
        self.controller.policy.paused = True
        tree = self.controller.tree
        tree.nodes = lambda *a: pytest.fail("a paused drafter's tree was sized for the choice")
        try:
            out = real_choose(self, tokens)
        finally:
            del tree.nodes  # the drafter's own pause/probe logic still sizes its trees
        seen.append(out[0])
        return out

    monkeypatch.setattr(AutoSource, "choose", choose)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    out = decoder.generate(PROMPTS[0], params, _merging())
    assert out.token_ids == decoder.generate(PROMPTS[0], params, SpeculationConfig(method="off")).token_ids
    assert DraftSource.MERGED not in seen and DraftSource.NGRAM in seen
