"""Dynamic draft trees for an EAGLE drafter (EAGLE-2 style, Li et al. 2024b).

After the drafter has fed the target's features (its root feature predicts the token after
the last committed one), the tree grows one depth per drafter step:

1. every frontier node's feature gives a distribution; its ``top_k`` children are its most
   likely tokens (greedy rows) or ``top_k`` tokens sampled without replacement from the
   drafter's processed ``q`` (sampling rows: Gumbel top-k, in draw order);
2. a child's score is its parent's plus the log of the ``r``-th largest probability of the
   parent's distribution (``r``: the child's rank among its siblings). For greedy rows that
   is the child's own log probability (EAGLE-2's cumulative confidence); for sampling rows it
   depends on the rank only, never on which token was drawn, so the tree's shape never
   depends on the values of the draws the verifier's multi-draft rule treats as random
   (:func:`~triton_backend.speculation.tree_verify.verify_tree_multidraft`);
3. the ``top_k`` best children of the new depth become the next frontier: ONE drafter step
   over all of them (each row its own, batched across rows), each node attending to the
   committed entries, its ancestors and itself (:class:`~triton_backend.speculation.drafters.eagle_model.TreeStep`;
   the nodes' cache entries sit after the committed ones and are overwritten next round);
4. after ``depth`` levels the ``nodes`` best of all candidates are kept (ties: the earlier
   node). Scores never rise from parent to child nor from a sibling to the next, so the kept
   set holds every kept node's ancestors and earlier siblings.

The drafter state per node is its cache entry; nothing is recomputed. A chain is the tree
``TreeShape(k, 1, k)``: the same tokens as :meth:`EagleDrafter.draft_chain`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from triton_backend.core.sampling import LogitsProcessor
from triton_backend.speculation.drafters.eagle_model import TreeStep


@dataclass(frozen=True)
class TreeShape:
    """A draft tree's size: ``depth`` levels, ``top_k`` children per expanded node (and nodes
    expanded per level), ``nodes`` kept in the end."""

    depth: int
    top_k: int
    nodes: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.nodes < 1:
            raise ValueError(f"a tree shape needs depth, top_k and nodes >= 1, got {self}")

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        return cls(k, 1, k)

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1


@dataclass
class DraftTree:
    """One row's drafted tree: ``parents`` (``-1``: a child of the last committed token),
    ``ranks`` (a node's place among its siblings, 0: the drafter's first choice) and, for a
    sampling row, ``probs`` ``[n, vocab]``: each node's parent distribution ``q`` (siblings
    share it; the verifier removes rejected siblings from it)."""

    tokens: list[int]
    parents: list[int]
    ranks: list[int]
    probs: torch.Tensor | None = None
    scores: list[float] | None = None  # each node's score: greedy rows, its path's drafter log probability


@dataclass
class _Node:
    token: int
    parent: int  # candidate index, -1 = root
    score: float
    rank: int
    depth: int
    q: int  # index of the parent's distribution in the row's list (sampling rows), else -1
    entry: int = -1  # the drafter cache entry (after the committed ones) once expanded
    ancestors: list[int] = field(default_factory=list)  # cache entries of the expanded ancestors


@dataclass
class _Row:
    shape: TreeShape
    processor: LogitsProcessor
    generator: torch.Generator | None
    committed: int  # drafter positions holding the target's features
    nodes: list[_Node] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)  # sampling: each expanded node's q [vocab]
    entries: int = 0


Logits = Callable[[torch.Tensor], torch.Tensor]  # features [M, H] -> candidate logits [M, C]


def _parent_place(row: _Row, parent: int) -> tuple[float, int, list[int]]:
    """(score, depth of its children, their cache ancestors) of ``parent`` (-1: the root)."""
    if parent < 0:
        return 0.0, 1, []
    node = row.nodes[parent]
    return node.score, node.depth + 1, node.ancestors + [node.entry]


def _greedy_tops(small: torch.Tensor, width: int, vocab: torch.Tensor | None) -> tuple[list[list[int]], list[list[float]]]:
    """The ``width`` likeliest candidates of every row of ``small`` ``[M, C]`` (token ids and log
    probabilities, as lists): one top-k, one log-sum-exp and one copy to Python for all the
    level's greedy nodes (each row's values are those of the row alone)."""
    small = small.float()
    top = torch.topk(small, min(width, small.shape[-1]))  # the log-softmax's order: rank on the logits
    ids = vocab[top.indices] if vocab is not None else top.indices
    return ids.tolist(), (top.values - torch.logsumexp(small, -1, keepdim=True)).tolist()


def _greedy_children(row: _Row, parent: int, ids: list[int], logps: list[float]) -> None:
    """Add ``parent``'s children (its ``top_k`` likeliest tokens and their log probabilities) to a greedy ``row``."""
    base, depth, ancestors = _parent_place(row, parent)
    for r, (token, lp) in enumerate(zip(ids, logps)):
        row.nodes.append(_Node(int(token), parent, base + lp, r, depth, -1, ancestors=ancestors))


def _sampled_children(row: _Row, parent: int, logits: torch.Tensor,
                      expand: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Add ``parent``'s children (``logits`` ``[C]``: its candidate logits) to a sampling ``row``:
    ``top_k`` tokens drawn without replacement from its processed ``q``."""
    k = row.shape.top_k
    base, depth, ancestors = _parent_place(row, parent)
    q = row.processor.probs(expand(logits[None]))[0]  # [vocab]: processed as the target's p (no penalties)
    row.dists.append(q)
    ranked = torch.topk(q, min(k, q.shape[0])).values  # the k largest probabilities, descending
    for r, token in enumerate(draw_without_replacement(q, k, row.generator)):
        row.nodes.append(_Node(int(token), parent, base + math.log(float(ranked[r])), r, depth, len(row.dists) - 1,
                               ancestors=ancestors))


def draw_without_replacement(q: torch.Tensor, k: int, generator: torch.Generator | None) -> list[int]:
    """Up to ``k`` distinct tokens from ``q`` ``[vocab]``, distributed as drawing one after the
    other without replacement (each from ``q`` without the earlier ones, renormalised), in draw
    order (Gumbel top-k: the ``k`` largest ``log q + Gumbel noise``)."""
    u = torch.rand(q.shape[0], generator=generator).clamp_(1e-20, 1.0 - 1e-7)
    keys = torch.log(q) - torch.log(-torch.log(u))
    return torch.topk(keys, min(k, int((q > 0).sum()))).indices.tolist()


def _level_tops(small: torch.Tensor, rows: Sequence[tuple[_Row, int]],
                vocab: torch.Tensor | None) -> dict[int, tuple[list[int], list[float]]]:
    """The children of a level's greedy frontier nodes (``rows``: each row and its frontier's
    size, in the order of ``small``'s rows), batched per ``top_k``: node index -> (ids, log probs)."""
    by_width: dict[int, list[int]] = {}
    at = 0
    for row, size in rows:
        if row.processor.greedy:
            by_width.setdefault(row.shape.top_k, []).extend(range(at, at + size))
        at += size
    out: dict[int, tuple[list[int], list[float]]] = {}
    for width, nodes in by_width.items():
        picked = small if len(nodes) == small.shape[0] else small[nodes]
        ids, logps = _greedy_tops(picked, width, vocab)
        out.update(zip(nodes, zip(ids, logps)))
    return out


def _best(nodes: Sequence[_Node], candidates: Sequence[int], n: int) -> list[int]:
    """The ``n`` best of ``candidates`` by score (ties: the earlier), dropping impossible ones."""
    alive = [i for i in candidates if nodes[i].score > float("-inf")]
    return sorted(alive, key=lambda i: (-nodes[i].score, i))[:n]


def _step_inputs(rows: Sequence[_Row], frontiers: Sequence[list[int]], device: torch.device) -> TreeStep:
    """Place the frontier nodes of every row (padded to the widest) in the drafter's cache. The
    positions, entries and what each node sees are gathered as lists and written in one indexed
    copy each (no per-element tensor write)."""
    width = max(len(f) for f in frontiers)
    for row, frontier in zip(rows, frontiers):
        for i in frontier:
            row.nodes[i].entry = row.committed + row.entries
            row.entries += 1
    end = max(row.committed + row.entries + width for row in rows)
    positions: list[list[int]] = []
    index: list[list[int]] = []
    seen_b: list[int] = []
    seen_t: list[int] = []
    seen_e: list[int] = []  # (row, node, entry) seen beyond the row's committed entries
    for b, (row, frontier) in enumerate(zip(rows, frontiers)):
        row_positions, row_index = [], []
        for t in range(width):
            if t < len(frontier):
                node = row.nodes[frontier[t]]
                row_positions.append(row.committed + node.depth - 1)
                row_index.append(node.entry)
                seen = node.ancestors + [node.entry]
            else:  # padding: an unused entry after the row's own, seeing only itself
                entry = row.committed + row.entries + t
                row_positions.append(entry)
                row_index.append(entry)
                seen = [entry]
            seen_b += [b] * len(seen)
            seen_t += [t] * len(seen)
            seen_e += seen
        positions.append(row_positions)
        index.append(row_index)
    committed = torch.tensor([row.committed for row in rows])
    visible = (torch.arange(end)[None, None, :] < committed[:, None, None]).expand(len(rows), width, end).clone()
    visible[seen_b, seen_t, seen_e] = True
    as_long = lambda v: torch.tensor(v, dtype=torch.long).to(device)  # noqa: E731
    return TreeStep(as_long(positions), as_long(index), visible.to(device))


def _finish(row: _Row) -> DraftTree:
    kept = sorted(_best(row.nodes, range(len(row.nodes)), row.shape.nodes))
    where = {c: i for i, c in enumerate(kept)}
    nodes = [row.nodes[c] for c in kept]
    parents = [-1 if n.parent < 0 else where[n.parent] for n in nodes]
    probs = None
    if not row.processor.greedy and nodes:
        probs = torch.stack([row.dists[n.q] for n in nodes])
    return DraftTree([n.token for n in nodes], parents, [n.rank for n in nodes], probs, [n.score for n in nodes])


Step = Callable[[torch.Tensor, torch.Tensor, TreeStep, list[int]], torch.Tensor]
# (features [B', T, H], tokens [B', T], placement, the rows' indices) -> the drafter's next features [B', T, H]


def grow_trees(roots: torch.Tensor, committed: Sequence[int], shapes: Sequence[TreeShape],
               processors: Sequence[LogitsProcessor], generators: Sequence[torch.Generator | None], *,
               head: Logits, vocab: torch.Tensor | None, expand: Callable[[torch.Tensor], torch.Tensor],
               step: Step) -> list[DraftTree]:
    """One tree per row, grown level by level (see the module docstring). ``roots`` ``[B, H]``:
    each row's feature after its last committed token; ``committed[b]``: the drafter positions
    row ``b`` holds (its tree's cache entries follow them). ``head``: candidate logits of
    features; ``vocab``: candidate -> token ids (None: the whole vocabulary); ``expand``:
    candidate logits -> full-vocabulary logits; ``step``: one drafter pass over tree nodes."""
    if roots.ndim != 2 or not len(committed) == len(shapes) == len(processors) == len(generators) == roots.shape[0]:
        raise ValueError("roots [B, H] and one committed length, shape, processor and generator per row expected")
    rows = [_Row(s, p, g, int(c)) for s, p, g, c in zip(shapes, processors, generators, committed)]
    frontiers: dict[int, list[int]] = {b: [-1] for b in range(len(rows))}  # -1: the root
    features: dict[int, torch.Tensor] = {b: roots[b:b + 1] for b in range(len(rows))}  # [F, H] per row
    for depth in range(1, max(s.depth for s in shapes) + 1):
        active = [b for b in frontiers if rows[b].shape.depth >= depth]
        stacked = torch.cat([features[b] for b in active])  # [sum F, H]: the level's frontier features
        small = head(stacked)  # [sum F, C]: one head call
        offset: dict[int, int] = {}
        tops = _level_tops(small, [(rows[b], len(frontiers[b])) for b in active], vocab)
        created: dict[int, list[int]] = {}
        source: dict[tuple[int, int], int] = {}  # (row, node) -> the frontier position whose feature produced it
        at = 0
        for b in active:
            row, first = rows[b], len(rows[b].nodes)
            offset[b] = at
            for j, parent in enumerate(frontiers[b]):
                before = len(row.nodes)
                if row.processor.greedy:
                    _greedy_children(row, parent, *tops[at + j])
                else:
                    _sampled_children(row, parent, small[at + j], expand)
                source.update({(b, i): j for i in range(before, len(row.nodes))})
            at += len(frontiers[b])
            created[b] = list(range(first, len(row.nodes)))
        nxt = {b: _best(rows[b].nodes, created[b], rows[b].shape.top_k) for b in active if rows[b].shape.depth > depth}
        nxt = {b: f for b, f in nxt.items() if f}
        if not nxt:
            break
        order = list(nxt)
        placement = _step_inputs([rows[b] for b in order], [nxt[b] for b in order], roots.device)
        width = placement.positions.shape[1]
        inputs = torch.zeros(len(order), width, roots.shape[1], dtype=roots.dtype, device=roots.device)
        tokens = torch.zeros(len(order), width, dtype=torch.long, device=roots.device)
        # every frontier node's parent feature and token placed in one indexed copy each (no per-node write)
        at_row = [i for i, b in enumerate(order) for _ in nxt[b]]
        at_col = [t for b in order for t in range(len(nxt[b]))]
        picked = [offset[b] + source[(b, node)] for b in order for node in nxt[b]]
        inputs[at_row, at_col] = stacked[picked]
        tokens[at_row, at_col] = torch.tensor([rows[b].nodes[node].token for b in order for node in nxt[b]],
                                              dtype=torch.long, device=roots.device)
        out = step(inputs, tokens, placement, order)  # [B', W, H]
        frontiers = {b: nxt[b] for b in order}
        features = {b: out[i, :len(nxt[b])] for i, b in enumerate(order)}
    return [_finish(row) for row in rows]


__all__ = ["DraftTree", "TreeShape", "draw_without_replacement", "grow_trees"]
