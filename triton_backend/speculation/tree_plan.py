"""How big a draft tree pays: the gain rule's view of an EAGLE tree (depth, top-k, nodes).

A tree's expected committed tokens are ``1 + sum`` over its nodes of the probability that the
node is on the accepted path. The tree keeps its ``n`` likeliest candidates by the drafter's
own scores (:mod:`~triton_backend.speculation.drafters.eagle_tree`), and which candidates those
are does not depend on ``n``: the ``i``-th likeliest is in every tree of ``n >= i`` nodes. So
the model is a table, best first: ``BEST_FIRST[i]``, how often the ``i``-th likeliest node of a
depth <= 4, top-4 tree is on the path the target accepts (measured teacher-forced on held-out
``tune`` prompts, ``scripts/analysis/eagle_best_first.py``), and ``BEST_FIRST_DEPTH[i]``, its
mean depth. A request scales the table by how its drafter does: ``rho = a / BEST_FIRST[0]``
(``a``: its measured acceptance of the drafter's first choice, the chain estimate of
:class:`~triton_backend.speculation.policy.GainPolicy`: where the drafter does worse than the
table's, every node is worth less, and a request that stops paying pauses; each node's value
at most 1 and never above the one before),
and by ``kappa``, the request's accepted nodes over the nodes the table expected in its tree
rounds (a drafter unlike the one measured, text it does better on, or a shallower tree, is
corrected there; :class:`TreeCalibration`). ``BEST_FIRST_DEPTH`` gives each node a depth for
``auto``'s merged trees. Scaling each node by ``rho ** depth`` instead (its path needs that
many acceptances) measured worse: a dip in the request's estimate shrank trees to one or two
nodes for tens of rounds (held-out ``tune`` prompts, 2026-11-26).

A tree of ``n`` nodes is grown ``min(max_depth, n)`` levels deep and ``min(top_k, n)`` wide
(the ``n`` best candidates of the full tree are all in it), costing a verify pass over ``n + 1``
tokens (the measured pass-cost table: on the row kernel up to 12 tokens share one sweep of the
weights, so 11 nodes cost little more than 8) plus one drafter step per level, a level of ``k``
nodes costing ``1 + ROW_SLOPE * (k - 1)`` single-node steps.

The option handed to :func:`~triton_backend.speculation.round_plan.plan_round` lists the node
probabilities (best first) as its per-draft values and the tree's cost at each size, so the
one planner that sizes chains sizes trees: a lone request drafts the size whose tokens per
unit of cost are best, a loaded batch (where every extra verify token costs more) fewer
nodes, a chain, or none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from triton_backend.speculation.drafters.eagle_tree import TreeShape
from triton_backend.speculation.merged_tree import lookup_accepted
from triton_backend.speculation.round_plan import RowOption

# the EAGLE-3 reference drafter (artifacts/smollm2-135m-eagle3) on the tune prompts, teacher-forced at
# every position of the target's greedy output, trees of depth <= 4 and top 4
# (scripts/analysis/eagle_best_first.py; the tail made non-increasing)
BEST_FIRST: tuple[float, ...] = (0.557, 0.323, 0.197, 0.142, 0.088, 0.08, 0.058, 0.046, 0.034, 0.034, 0.03, 0.023,
                                 0.021, 0.019, 0.015, 0.015)
BEST_FIRST_DEPTH: tuple[float, ...] = (1.0, 1.8, 2.4, 2.7, 2.5, 2.6, 2.7, 2.8, 2.8, 2.8, 2.9, 2.9, 2.9, 2.9, 3.0, 2.9)
# a drafter step over k tree nodes costs 1 + ROW_SLOPE * (k - 1) single-node steps (scripts/analysis/eagle_tree_priors.py,
# row kernel, one thread: 1.05 at k = 2, 1.42 at k = 4; 2.9 at k = 8, past tree_top_k's default)
ROW_SLOPE = 0.15


@dataclass(frozen=True)
class TreeRecord:
    """What a tree round teaches: the drafter's first-choice chain in the tree (its length and
    how much of it was accepted: what a chain would have done) and how many of the drafter's
    nodes the accepted path holds (``accepted_nodes``). A merged tree (``auto``,
    :mod:`~triton_backend.speculation.merged_tree`) counts the drafter's nodes only (rank >= 0)
    there, and adds the match's tokens drafted and accepted and the path's length."""

    chain_drafted: int
    chain_accepted: int
    accepted_nodes: int
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
        if lookup is None:
            return cls(drafted, min(accepted, drafted), own)
        return cls(drafted, min(accepted, drafted), own, sum(lookup), lookup_accepted(path, lookup), len(path))


class TreeCalibration:
    """``kappa``: the drafter nodes a request's tree rounds had accepted over the nodes the
    model expected of them, from decaying sums with ``strength`` rounds' worth of a ratio of 1."""

    def __init__(self, strength: float = 4.0, decay: float = 0.9) -> None:
        self.strength, self.decay = strength, decay
        self.accepted = 0.0
        self.expected = 0.0

    def record(self, accepted: int, expected: float) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.expected = self.expected * self.decay + expected

    def factor(self) -> float:
        prior = self.strength * BEST_FIRST[0]  # ``strength`` rounds of a one-node tree that did as the model said
        return (prior + self.accepted) / (prior + self.expected)


@dataclass(frozen=True)
class ModelNode:
    prob: float
    depth: int


def best_nodes(first_acceptance: float, max_nodes: int, max_depth: int, kappa: float = 1.0) -> list[ModelNode]:
    """The ``max_nodes`` likeliest nodes of a tree at most ``max_depth`` deep, best first: the
    table scaled by ``rho = first_acceptance / BEST_FIRST[0]`` and by ``kappa`` (each at most 1)."""
    rho = max(0.0, first_acceptance) / BEST_FIRST[0]
    out: list[ModelNode] = []
    for i in range(max_nodes):
        base = BEST_FIRST[min(i, len(BEST_FIRST) - 1)]
        depth = BEST_FIRST_DEPTH[min(i, len(BEST_FIRST_DEPTH) - 1)]
        prob = min(1.0, base * rho * kappa)
        if out:
            prob = min(prob, out[-1].prob)
        out.append(ModelNode(prob, max(1, min(max_depth, i + 1, round(depth)))))
    return out


class TreeModel:
    """One request's tree sizing (see the module docstring): ``max_nodes``, ``top_k`` and
    ``max_depth`` bound the trees it proposes."""

    def __init__(self, max_nodes: int, top_k: int, max_depth: int, calibration: TreeCalibration | None = None) -> None:
        self.max_nodes, self.top_k, self.max_depth = max_nodes, top_k, max_depth
        self.calibration = calibration or TreeCalibration()
        self._expected = 0.0  # what the last shaped tree's nodes were expected to carry

    def nodes(self, conditional: Sequence[float]) -> list[ModelNode]:
        if not conditional or self.max_depth < 1:
            return []
        return best_nodes(conditional[0], self.max_nodes, self.max_depth, self.calibration.factor())

    def option(self, conditional: Sequence[float], draft_cost: float) -> RowOption:
        """The row option of trees of ``1 .. max_nodes`` nodes (the best first)."""
        nodes = self.nodes(conditional)
        costs = [0.0] + [draft_cost * self.levels_cost(n) for n in range(1, len(nodes) + 1)]
        return RowOption(tuple(n.prob for n in nodes), draft_cost, draft_costs=tuple(costs))

    def shape(self, conditional: Sequence[float], n: int) -> TreeShape | None:
        """The shape of the best ``n`` nodes' tree (None for ``n`` <= 0)."""
        n = min(n, self.max_nodes)
        if n <= 0 or self.max_depth < 1:
            return None
        base = best_nodes(conditional[0], n, self.max_depth) if conditional else []
        self._expected = sum(x.prob for x in base)  # before kappa: kappa is what the rounds add to this
        return TreeShape(min(self.max_depth, n), min(self.top_k, n), n)

    def levels_cost(self, n: int) -> float:
        """Drafter steps of a tree of ``n`` nodes, in single-node steps: the first level is the
        feed step (as a chain's), each later level expands up to ``top_k`` nodes at once."""
        depth, width = min(self.max_depth, n), min(self.top_k, n)
        return 1.0 + (depth - 1) * (1.0 + ROW_SLOPE * (width - 1))

    def record(self, record: TreeRecord) -> None:
        if self._expected > 0:
            self.calibration.record(record.accepted_nodes, self._expected)
            self._expected = 0.0


__all__ = ["BEST_FIRST", "BEST_FIRST_DEPTH", "ModelNode", "ROW_SLOPE", "TreeCalibration", "TreeModel", "TreeRecord", "best_nodes"]
