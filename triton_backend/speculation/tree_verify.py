"""Verification of a draft tree against the target: short pure functions over tensors.

Rows of the target's output: row 0 follows the last committed token (the root), row
``i + 1`` follows tree node ``i``. A node is **accepted** when the target, at its parent's
row, would emit it; the accepted nodes form one root-to-node path, followed by one target
token from the last accepted row (**recovered** when the path stopped early, **bonus** when
it reached a leaf). Each round commits ``len(path) + 1`` tokens.

- Greedy: a node is accepted when it equals the argmax at its parent's row, so the output is
  token-identical to plain greedy decoding.
- Exact sampling: the tree's tokens are deterministic proposals (``q`` one-hot), so at the
  current row draw ``x ~ p``; when a child holds ``x`` the walk moves there, else ``x`` is the
  recovered token. Every committed token is drawn from the target's ``p`` given the tokens
  before it: the output distribution is exactly the target's.
- Exact sampling with the drafter's ``q`` (the multi-draft rule; SpecInfer, Miao et al. 2024;
  recursive rejection sampling, Jeon et al. 2024): a sampled tree's children were drawn from
  their parent's ``q`` without replacement, in order. At the current row, with ``p`` the
  target's distribution, try the children in order: child ``x`` is accepted with probability
  ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(0, p - q))`` and ``q <- q`` without
  ``x``, renormalised, and the next sibling is tried; when every child is rejected, the
  recovered token is drawn from the last ``p``. Each step outputs ``x`` with probability
  ``min(p, q)(x)`` and passes on ``1 - sum(min(p, q))`` of mass to the residual, so the token
  leaving the row is distributed as ``p`` (the chain rule is the one-child case). With
  one-hot ``q`` it reduces to the rule above.
- A merged tree (``auto``: the n-gram match's continuation as one branch beside the drafter's
  tree, :mod:`~triton_backend.speculation.merged_tree`): the match is a deterministic proposal,
  not a draw from ``q``. At a row with a match child ``x`` it is tried FIRST, as a draft with a
  point-mass ``q``: accepted with probability ``p(x)``; on rejection ``p <- norm(p without x)``
  (the residual ``max(0, p - one_hot(x))``). Then the drafter's children in draw order with
  their ``q``, against that residual, as above. A drafter child holding ``x`` too (the two
  sources share the node) is tried in its turn and rejected for certain (``p(x)`` is 0 by
  then), but its step still updates ``p`` and ``q``: the later siblings were drawn from ``q``
  without ``x``. Each step leaves ``p`` intact as above, so the rule stays exact; trying the
  match against the drafter's ``q``, or leaving ``p`` unchanged after rejecting it, does not.
- Typical acceptance (Medusa, Cai et al. 2024): a node is accepted when
  ``p(node) > min(threshold, alpha * exp(-H(p)))`` at its parent's row; the deepest
  accepted path wins (ties: the earlier node) and the next token is drawn from ``p`` at its
  end. Faster at high temperature, but NOT distribution-preserving; an opt-in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from triton_backend.core.sampling import sample
from triton_backend.core.tree import check_parents, node_depths, path_to


# the target's rows: a tensor [n+1, vocab], or a function of the row index (rows computed on demand,
# so a verifier that walks the tree pays the LM head only for the rows it visits)
Rows = Union[torch.Tensor, Callable[[int], torch.Tensor]]


@dataclass(frozen=True)
class TreeVerifyResult:
    path: tuple[int, ...]  # accepted node indices, root-to-leaf
    next_token: int  # recovered or bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def _check(rows: Rows, tree_tokens: Sequence[int], parents: Sequence[int]) -> Callable[[int], torch.Tensor]:
    """The row function, after checking shapes: ``[n+1, vocab]`` rows for ``n`` nodes."""
    shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else None
    if len(parents) != len(tree_tokens) or (shape is not None and (len(shape) != 2 or shape[0] != len(tree_tokens) + 1)):
        raise ValueError(f"expected [n+1, vocab] rows for n={len(tree_tokens)} nodes and {len(parents)} parents, "
                         f"got {shape}")
    check_parents(parents)
    if isinstance(rows, torch.Tensor):
        return rows.__getitem__
    return rows


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def verify_tree_greedy(
    target_logits: Rows,  # [n+1, vocab]
    tree_tokens: Sequence[int],  # [n]
    parents: Sequence[int],  # [n]
) -> TreeVerifyResult:
    """Follow the target's argmax down the tree for as long as a child matches it."""
    row = _check(target_logits, tree_tokens, parents)
    children = _children(parents)
    node, path = -1, []
    while True:
        want = int(row(node + 1).argmax())
        match = next((c for c in children.get(node, []) if tree_tokens[c] == want), None)
        if match is None:
            return TreeVerifyResult(tuple(path), int(want))
        node = match
        path.append(node)


def verify_tree_sampling(
    target_probs: Rows,  # [n+1, vocab] p, processed
    tree_tokens: Sequence[int],
    parents: Sequence[int],
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """Exact: draw from ``p`` at each row, follow the child holding the draw if any."""
    row = _check(target_probs, tree_tokens, parents)
    children = _children(parents)
    node, path = -1, []
    while True:
        x = sample(row(node + 1), generator)
        match = next((c for c in children.get(node, []) if tree_tokens[c] == x), None)
        if match is None:
            return TreeVerifyResult(tuple(path), x)
        node = match
        path.append(node)


def verify_tree_multidraft(
    target_probs: Rows,  # [n+1, vocab] p, processed
    tree_tokens: Sequence[int],  # [n], each drawn from its parent's q without replacement, siblings in draw order
    parents: Sequence[int],  # [n]
    draft_probs: torch.Tensor,  # [n, vocab] q of each node's parent (siblings share it; unused rows of match-only nodes)
    generator: torch.Generator | None,
    lookup: Sequence[bool] | None = None,  # [n] the node is on the n-gram match's branch (point-mass q, tried first)
    drawn: Sequence[bool] | None = None,  # [n] the node was drawn from its parent's q (None: every node)
) -> TreeVerifyResult:
    """Exact: the multi-draft rejection rule, with a merged tree's match branch tried first
    at each row as a point-mass draft (see the module docstring)."""
    row = _check(target_probs, tree_tokens, parents)
    n = len(tree_tokens)
    if draft_probs.ndim != 2 or draft_probs.shape[0] != n:
        raise ValueError(f"draft_probs must be [{n}, vocab], got {tuple(draft_probs.shape)}")
    if (lookup is not None and len(lookup) != n) or (drawn is not None and len(drawn) != n):
        raise ValueError(f"lookup and drawn flags must be given for each of the {n} nodes")
    children = _children(parents)
    node, path = -1, []
    while True:
        p = row(node + 1)
        kids = children.get(node, [])
        point = [c for c in kids if lookup is not None and lookup[c]]
        sampled = [c for c in kids if drawn is None or drawn[c]]
        accepted = None
        for child in point:  # the match's child: q = one_hot(x), accepted with probability p(x)
            x = tree_tokens[child]
            if float(torch.rand(1, generator=generator)) < float(p[x]):
                accepted = child
                break
            p = p.clone()
            p[x] = 0.0
            p = p / p.sum() if float(p.sum()) > 0 else p
        q = draft_probs[sampled[0]].float() if sampled and accepted is None else None
        for child in sampled if accepted is None else []:
            x = tree_tokens[child]
            q_x, p_x = float(q[x]), float(p[x])
            if q_x > 0 and float(torch.rand(1, generator=generator)) * q_x < p_x:
                accepted = child
                break
            residual = torch.clamp(p - q, min=0.0)
            p = residual / residual.sum() if float(residual.sum()) > 0 else p  # p == q (rounding): p is exact
            q = q.clone()
            q[x] = 0.0
            q = q / q.sum() if float(q.sum()) > 0 else q
        if accepted is None:
            return TreeVerifyResult(tuple(path), sample(p, generator))
        node = accepted
        path.append(node)


def verify_tree_typical(
    target_probs: Rows,  # [n+1, vocab] p, processed
    tree_tokens: Sequence[int],
    parents: Sequence[int],
    generator: torch.Generator | None,
    threshold: float = 0.09,
    alpha: float = 0.3,
) -> TreeVerifyResult:
    """Medusa's typical acceptance (not distribution-preserving)."""
    row = _check(target_probs, tree_tokens, parents)
    reachable: list[bool] = []
    bars: dict[int, float] = {}  # per parent row: siblings share it
    for i, (t, p) in enumerate(zip(tree_tokens, parents)):
        if p >= 0 and not reachable[p]:
            reachable.append(False)
            continue
        probs = row(p + 1)
        if p not in bars:
            entropy = float(-(probs * torch.log(probs.clamp_min(1e-20))).sum())
            bars[p] = min(threshold, alpha * math.exp(-entropy))
        reachable.append(float(probs[t]) > bars[p])
    depths = node_depths(parents)
    best = max((i for i in range(len(parents)) if reachable[i]), key=lambda i: (depths[i], -i), default=-1)
    next_token = sample(row(best + 1), generator)
    return TreeVerifyResult(tuple(path_to(best, parents)), next_token)
