"""How big a draft tree pays: the gain rule's view of an EAGLE tree (depth, top-k, nodes).

A tree's expected committed tokens are ``1 + sum`` over its nodes of the probability that the
node is on the accepted path. The model of that probability: a node at depth ``j`` holding
its parent's ``r``-th choice is accepted, once its parent is, with probability
``a_j * s_r`` -- ``a_j`` the request's measured acceptance of the drafter's first choice at
depth ``j`` (the chain estimate of :class:`~triton_backend.speculation.policy.GainPolicy`) and
``s_r`` how often the ``r``-th choice is accepted relative to the first
(:class:`SiblingEstimate`, measured in this request's tree rounds, from a prior). A node's
probability is the product along its path, so the best ``n`` nodes of the model tree are found
best-first; they fix the tree's depth and top-k, and its cost: a verify pass over ``n + 1``
tokens (the measured pass-cost table) plus one drafter step per level, a level of ``k`` nodes
costing ``1 + ROW_SLOPE * (k - 1)`` single-node steps.

The option handed to :func:`~triton_backend.speculation.policy.plan_round` lists these node
probabilities (best first) as its per-draft values and the tree's cost at each size, so the
one planner that sizes chains sizes trees: a lone request drafts the size whose tokens per
unit of cost are best, a loaded batch (where every extra verify token costs more) fewer
nodes, a chain, or none.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from triton_backend.speculation.drafters.eagle_tree import TreeShape
from triton_backend.speculation.merged_tree import lookup_accepted
from triton_backend.speculation.policy import RowOption

# the reference drafter on the tune prompts, teacher-forced (scripts/analysis/eagle_tree_priors.py):
# its r-th choice is the target's next token at 0.237, 0.080, 0.042, 0.021, 0.028, 0.019, 0.019,
# 0.014 of positions; relative to its first choice (rounded, the tail smoothed):
SIBLING_PRIOR: tuple[float, ...] = (1.0, 0.34, 0.18, 0.1, 0.1, 0.08, 0.08, 0.06)
FIRST_CHOICE_PRIOR = 0.25
# a drafter step over k tree nodes costs 1 + ROW_SLOPE * (k - 1) single-node steps (the same
# script, row kernel, one thread: 1.05 at k = 2, 1.42 at k = 4; 2.9 at k = 8, past tree_top_k's default)
ROW_SLOPE = 0.15


@dataclass(frozen=True)
class TreeRecord:
    """What a tree round teaches: the drafter's first-choice chain in the tree (its length and
    how much of it was accepted: what a chain would have done) and, per node the verifier
    reached that had children, ``(children, accepted rank or -1)``. A merged tree (``auto``,
    :mod:`~triton_backend.speculation.merged_tree`) counts the drafter's nodes only (rank >= 0)
    there, and adds the match's tokens drafted and accepted and the path's length."""

    chain_drafted: int
    chain_accepted: int
    visits: tuple[tuple[int, int], ...]
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    path_length: int = 0

    @classmethod
    def of(cls, parents: Sequence[int], ranks: Sequence[int], path: Sequence[int],
           lookup: Sequence[bool] | None = None) -> "TreeRecord":
        """The record of a verified tree (``path``: the accepted nodes, root to leaf)."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            if ranks[i] >= 0:  # the drafter's nodes
                children.setdefault(p, []).append(i)
        drafted, node = 0, -1
        while True:
            first = next((c for c in children.get(node, []) if ranks[c] == 0), None)
            if first is None:
                break
            drafted, node = drafted + 1, first
        accepted = next((i for i, n in enumerate(path) if ranks[n] != 0), len(path))
        own = next((i for i, n in enumerate(path) if ranks[n] < 0), len(path))  # the path among the drafter's nodes
        visits = []
        for i, node in enumerate([-1, *path[:own]]):
            if children.get(node):
                visits.append((len(children[node]), ranks[path[i]] if i < own else -1))
        if lookup is None:
            return cls(drafted, min(accepted, drafted), tuple(visits))
        return cls(drafted, min(accepted, drafted), tuple(visits), sum(lookup), lookup_accepted(path, lookup), len(path))


class SiblingEstimate:
    """``s_r``: acceptance of the ``r``-th choice relative to the first, pooled over depths,
    from decaying counts with ``strength`` pseudo-observations of the prior."""

    def __init__(self, top_k: int, prior: Sequence[float] = SIBLING_PRIOR, base: float = FIRST_CHOICE_PRIOR,
                 strength: float = 4.0, decay: float = 0.97) -> None:
        self.prior = [base * (prior[r] if r < len(prior) else prior[-1]) for r in range(top_k)]
        self.strength, self.decay = strength, decay
        self.tried = [0.0] * top_k
        self.accepted = [0.0] * top_k

    def record(self, visits: Sequence[tuple[int, int]]) -> None:
        for children, rank in visits:
            self.tried = [t * self.decay for t in self.tried]
            self.accepted = [a * self.decay for a in self.accepted]
            for r in range(min(children, len(self.tried))):
                self.tried[r] += 1.0
                self.accepted[r] += 1.0 if r == rank else 0.0

    def factors(self) -> list[float]:
        rates = [(self.strength * p + a) / (self.strength + t) for p, a, t in zip(self.prior, self.accepted, self.tried)]
        first = max(rates[0], 1e-6)
        return [1.0] + [min(1.0, r / first) for r in rates[1:]]


@dataclass(frozen=True)
class ModelNode:
    prob: float
    depth: int
    rank: int


def best_nodes(depth_acceptance: Sequence[float], siblings: Sequence[float], max_nodes: int) -> list[ModelNode]:
    """The ``max_nodes`` likeliest nodes of the model tree, best first (ancestors first on ties)."""
    if not depth_acceptance:
        return []
    counter = 0
    heap: list[tuple[float, int, int, int]] = []
    for r, s in enumerate(siblings):
        heap.append((-depth_acceptance[0] * s, counter, 1, r))
        counter += 1
    heapq.heapify(heap)
    out: list[ModelNode] = []
    while heap and len(out) < max_nodes:
        neg, _, depth, rank = heapq.heappop(heap)
        out.append(ModelNode(-neg, depth, rank))
        if depth < len(depth_acceptance):
            for r, s in enumerate(siblings):
                heapq.heappush(heap, (neg * depth_acceptance[depth] * s, counter, depth + 1, r))
                counter += 1
    return out


class TreeModel:
    """One request's tree sizing (see the module docstring): ``max_nodes``, ``top_k`` and
    ``max_depth`` bound the trees it proposes."""

    def __init__(self, max_nodes: int, top_k: int, max_depth: int, siblings: SiblingEstimate | None = None) -> None:
        self.max_nodes, self.top_k, self.max_depth = max_nodes, top_k, max_depth
        self.siblings = siblings or SiblingEstimate(top_k)

    def nodes(self, conditional: Sequence[float]) -> list[ModelNode]:
        return best_nodes(list(conditional)[:self.max_depth], self.siblings.factors(), self.max_nodes)

    def option(self, conditional: Sequence[float], draft_cost: float) -> RowOption:
        """The row option of trees of ``1 .. max_nodes`` nodes (the best first)."""
        nodes = self.nodes(conditional)
        costs = [0.0] + [draft_cost * _levels_cost(nodes[:n]) for n in range(1, len(nodes) + 1)]
        return RowOption(tuple(n.prob for n in nodes), draft_cost, draft_costs=tuple(costs))

    def shape(self, conditional: Sequence[float], n: int) -> TreeShape | None:
        """The shape of the best ``n`` nodes' tree (None for ``n`` <= 0)."""
        nodes = self.nodes(conditional)[:n]
        if not nodes:
            return None
        return TreeShape(max(x.depth for x in nodes), max(x.rank for x in nodes) + 1, len(nodes))

    def record(self, record: TreeRecord) -> None:
        self.siblings.record(record.visits)


def _levels_cost(nodes: Sequence[ModelNode]) -> float:
    """Drafter steps of the tree these nodes make, in single-node steps: the first level is
    the feed step (as a chain's), each later level expands up to ``top_k`` nodes at once."""
    depth = max(n.depth for n in nodes)
    width = max(n.rank for n in nodes) + 1
    return 1.0 + (depth - 1) * (1.0 + ROW_SLOPE * (width - 1))


__all__ = ["ModelNode", "ROW_SLOPE", "SIBLING_PRIOR", "SiblingEstimate", "TreeModel", "TreeRecord", "best_nodes"]
