"""Token trees for tree verification (Medusa): one target pass scores every candidate. Topology
only; the engines build a pass's attention inputs from it (`engines/torch/tree_attention.py`).

A tree of ``n`` draft nodes is given by ``parents``: ``parents[i]`` is the index of node
``i``'s parent, ``-1`` for children of the root (the last committed token); parents come
before children (``parents[i] < i``). Node ``i`` sits at depth ``depth(i)`` (1 for a root
child), so its position id is ``root_position + depth(i)``, and it attends to the whole
committed sequence plus its own ancestors and itself, never to other branches.

``medusa_choices`` describe a tree by paths of ranks: ``(0, 1)`` is the node holding head
0's best token followed by head 1's second-best. Every prefix of a path must be a path too.
"""

from __future__ import annotations

from typing import Sequence

import torch

Choices = tuple[tuple[int, ...], ...]

# 15 nodes, 4 levels: a small tree, cheap to verify in one pass on a CPU
DEFAULT_MEDUSA_CHOICES: Choices = (
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0), (0, 2),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
)


def check_parents(parents: Sequence[int]) -> None:
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree parent of node {i} is {p}; parents must precede their children (-1 = root)")


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (1 for children of the root)."""
    check_parents(parents)
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def path_to(node: int, parents: Sequence[int]) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for the root, ``-1``)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """``[n, n]`` bool: ``out[i, j]`` when node ``j`` is ``i`` or one of its ancestors."""
    check_parents(parents)
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        out[i, i] = True
        if p >= 0:
            out[i] |= out[p]
    return out


def choices_to_parents(choices: Sequence[Sequence[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Sorted tree of ``choices``: each node's parent index and ``(head, rank)`` of its token."""
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(paths)}
    parents, slots = [], []
    for c in paths:
        if not c or any(r < 0 for r in c):
            raise ValueError(f"medusa choice {c} must be a non-empty path of ranks >= 0")
        if len(c) > 1 and c[:-1] not in index:
            raise ValueError(f"medusa choice {c} has no parent {c[:-1]} in the tree")
        parents.append(index[c[:-1]] if len(c) > 1 else -1)
        slots.append((len(c) - 1, c[-1]))
    return parents, slots


def normalise_choices(choices: Sequence[Sequence[int]]) -> Choices:
    """Validated, sorted and deduplicated choices (raises ValueError)."""
    choices_to_parents(choices)
    return tuple(sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c)))
