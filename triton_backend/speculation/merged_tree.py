"""``auto``'s merged round: the n-gram match's continuation as one branch of the EAGLE drafter's
tree, verified in the one target pass.

Building the tree (:func:`merge_lookup`): the match's tokens are walked down the drafter's
tree from the root; while a child holds the next token the two sources share that node (it is
marked as the match's), and the rest of the continuation hangs below the last shared node as
new nodes (rank ``-1``: the drafter did not draw them). Verification tries the match's child
first at each row as a point-mass draft, then the drafter's children with their ``q``
(:func:`~triton_backend.speculation.tree_verify.verify_tree_multidraft`); greedy rows follow the
target's argmax down the tree as for any tree.

Sizing (:func:`merged_option`): the expected committed tokens of a merged tree of ``k`` nodes.
With ``A_d`` the probability that the match's first ``d`` tokens are accepted and ``b`` the
probability the drafter's tree model gives one of its nodes at depth ``d``, a match node adds
``A_d`` and a drafter node ``b * (1 - A_d) * overlap`` -- the tokens it adds where the match
stopped before its depth (were the sources independent, ``overlap`` would be 1; it is measured
per request from merged rounds, :class:`OverlapEstimate`). Both lists are merged best first into
one :class:`~triton_backend.speculation.policy.RowOption` whose ``k``-th prefix is ``k``
nodes: so many of the match's, so many of the drafter's best (the tree it drafts of that size);
the drafter's cost is its tree's. The one planner that sizes chains and trees picks ``k``:
match only, drafter only, both, or a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from triton_backend.speculation.drafters.protocol import DraftProposal
from triton_backend.speculation.round_plan import RowOption


def merge_lookup(tree: DraftProposal, chain: Sequence[int]) -> DraftProposal:
    """``tree`` (the drafter's: parents, ranks, and ``probs`` when it sampled) with ``chain``
    (the match's continuation) merged in as one branch from the root; ``lookup`` marks the
    branch's nodes. An empty tree gives the chain alone."""
    tokens = list(tree.tokens)
    parents = list(tree.parents) if tree.parents is not None else list(range(-1, len(tokens) - 1))
    ranks = list(tree.ranks) if tree.ranks is not None else [0] * len(tokens)
    lookup = [False] * len(tokens)
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {}).setdefault(t, i)
    node, added = -1, 0
    for token in chain:
        shared = children.get(node, {}).get(int(token)) if added == 0 else None
        if shared is None:  # past the shared prefix: the match's own nodes
            tokens.append(int(token))
            parents.append(node)
            ranks.append(-1)
            lookup.append(True)
            node, added = len(tokens) - 1, added + 1
        else:
            lookup[shared] = True
            node = shared
    probs = tree.probs
    if probs is not None and added:
        probs = torch.cat([probs, torch.zeros(added, probs.shape[1], dtype=probs.dtype)])  # match-only rows: unused
    return DraftProposal(tokens, probs, parents, ranks, lookup)


def lookup_accepted(path: Sequence[int], lookup: Sequence[bool]) -> int:
    """How many of the match's tokens the accepted ``path`` kept (its leading match nodes)."""
    n = 0
    while n < len(path) and lookup[path[n]]:
        n += 1
    return n


class OverlapEstimate:
    """How much a drafter's nodes add beside a match, relative to what independent sources
    would add: decayed sums of the tokens merged rounds accepted past the match's and of what the
    model expected them to add, with ``strength`` pseudo-rounds of ``prior``."""

    def __init__(self, prior: float = 1.0, strength: float = 2.0, decay: float = 0.9) -> None:
        self.prior, self.strength, self.decay = prior, strength, decay
        self.gained = 0.0
        self.expected = 0.0

    @property
    def factor(self) -> float:
        return max(0.0, min(1.5, (self.strength * self.prior + self.gained) / (self.strength + self.expected)))

    def record(self, gained: int, expected: float) -> None:
        self.gained = self.decay * self.gained + gained
        self.expected = self.decay * self.expected + expected


@dataclass(frozen=True)
class MergedOption:
    """A merged round's row option, and which source each of its ``k`` nodes comes from."""

    option: RowOption
    from_lookup: tuple[bool, ...]  # entry j: the (j+1)-th node is the match's (else the drafter's next best)

    def split(self, k: int) -> tuple[int, int]:
        """The match tokens and drafter nodes of the first ``k`` entries."""
        ngram = sum(self.from_lookup[:k])
        return ngram, min(k, len(self.from_lookup)) - ngram

    def model_gain(self, k: int) -> float:
        """The tokens the drafter's nodes of the first ``k`` entries are expected to add."""
        return sum(v for v, m in zip(self.option.prefix_probs[:k], self.from_lookup[:k]) if not m)


def merged_option(lookup: Sequence[float], model: RowOption, model_depths: Sequence[int], overlap: float,
                  max_nodes: int) -> MergedOption:
    """The row option of merged trees (see the module docstring). ``lookup``: ``A_d`` of the
    match's tokens; ``model``: the drafter's tree option (node probabilities best first, its
    cost per size); ``model_depths``: each of those nodes' depth; at most ``max_nodes`` nodes."""
    lookup = [min(1.0, max(0.0, a)) for a in lookup]
    values, last = [], float("inf")
    for prob, depth in zip(model.prefix_probs, model_depths):
        reach = lookup[depth - 1] if depth - 1 < len(lookup) else 0.0
        last = min(last, prob * (1.0 - reach) * overlap)  # non-increasing: a size's nodes are its best
        values.append(last)
    entries: list[tuple[float, bool]] = []
    i = j = 0
    while len(entries) < max_nodes and (i < len(lookup) or j < len(values)):
        if j >= len(values) or (i < len(lookup) and lookup[i] >= values[j]):
            entries.append((lookup[i], True))
            i += 1
        else:
            entries.append((values[j], False))
            j += 1
    from_lookup = tuple(m for _, m in entries)
    costs, drafted = [0.0], 0
    for m in from_lookup:
        drafted += 0 if m else 1
        costs.append(model.drafting(drafted))
    return MergedOption(RowOption(tuple(v for v, _ in entries), model.draft_cost, draft_costs=tuple(costs)), from_lookup)


__all__ = ["MergedOption", "OverlapEstimate", "lookup_accepted", "merge_lookup", "merged_option"]
