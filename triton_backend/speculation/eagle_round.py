"""EAGLE speculation, chains and dynamic trees: one round on the torch runtime, and the
verification the batch scheduler's EAGLE rows share with it.

The drafter proposes ``k`` tokens, or a tree the gain rule sized
(:mod:`triton_backend.speculation.drafters.eagle_tree`, :mod:`triton_backend.speculation.tree_plan`;
none on the first round: it has no target features yet); ONE target pass over the positions whose features the drafter lacks (the whole prompt
on the first round, then the last committed token) plus the drafts returns their last
hidden states; the LM head turns the last ``k + 1`` rows into logits for the verifier
(greedy or exact rejection sampling with the drafter's ``q``); the target's KV cache keeps
the accepted drafts (the chain is passed as a one-branch tree, the same pass Medusa's tree
rounds make; a tree hangs from the last committed token), and the drafter gets the target's
features at every position it kept. A tree is verified greedily or, when sampling, by the
multi-draft rule with the drafter's ``q`` (:func:`~triton_backend.speculation.tree_verify.verify_tree_multidraft`).
"""

from __future__ import annotations

import time

import torch

from triton_backend.speculation.drafters.protocol import DraftProposal
from triton_backend.speculation.drafters.eagle import EagleSession
from triton_backend.engines.base import EngineSession, FeatureSession
from triton_backend.speculation.rounds import RoundOutcome
from triton_backend.speculation.run_state import Accepted, RunState
from triton_backend.speculation.tree_plan import TreeRecord
from triton_backend.speculation.tree_round import Head, verify_tree
from triton_backend.core.tree import node_depths


def eagle_parents(known: int, proposal: DraftProposal) -> list[int]:
    """Parents of an EAGLE pass's nodes after the drafter's root: the ``known`` committed tokens
    the drafter lacked as a chain, then the proposal (a chain, or a tree hanging from the last)."""
    if proposal.parents is None:
        return list(range(-1, known + len(proposal) - 1))
    return list(range(-1, known - 1)) + [known - 1 if p < 0 else known + p for p in proposal.parents]


def accept_eagle(run: RunState, drafter: EagleSession, head: Head, hidden: torch.Tensor, proposal: DraftProposal,
                 start: int, logits: torch.Tensor | None = None, features: torch.Tensor | None = None) -> Accepted:
    """Verify an EAGLE pass whose rows start at the drafter's root ``start`` (``hidden``:
    ``[1 + known + n, H]``) and hand the drafter the target's features at every position
    kept: ``features`` ``[1 + known + n, F]`` (an EAGLE-3 drafter's capture-layer outputs from
    the same pass), else ``hidden`` itself (EAGLE-1). ``logits``: the last ``n + 1`` rows'
    logits when the pass computed them (a batch pass puts them in its one LM-head product),
    else ``head`` makes them from ``hidden``. ``path``: the pass's nodes to keep after the
    root (the committed tokens the drafter lacked, then the accepted drafts)."""
    known = len(run.tokens) - 1 - start  # committed tokens after the drafter's root, before the last one
    if logits is not None and logits.shape[0] != len(proposal) + 1:
        raise ValueError(f"{logits.shape[0]} logits rows for a proposal of {len(proposal)} drafts")
    if (features is None) != (drafter.capture_layers is None):
        raise ValueError("an EAGLE-3 drafter needs the capture layers' features (and an EAGLE-1 drafter none)")
    feats = hidden if features is None else features
    if proposal.parents is not None:
        return _accept_tree(run, drafter, head, hidden, feats, proposal, start, known, logits)
    if logits is None:
        logits = head(hidden[known:])
    accepted = run.verify_chain(logits, proposal)  # [k + 1, vocab]: penalties per row, log probs
    kept = known + accepted.accepted
    drafter.observe(start, feats[: kept + 1])
    return Accepted(accepted.block, accepted.drafted, accepted.accepted, list(range(kept)))


def _accept_tree(run: RunState, drafter: EagleSession, head: Head, hidden: torch.Tensor, feats: torch.Tensor,
                 proposal: DraftProposal, start: int, known: int, logits: torch.Tensor | None) -> Accepted:
    """A drafted tree's verification (greedy, or the multi-draft rule with the drafter's ``q``; a
    merged tree's match branch first at each row, :mod:`~triton_backend.speculation.merged_tree`)."""
    parents = proposal.parents or []
    # every row's logits in one head product (a tree of up to ~12 nodes shares one kernel sweep)
    rows = (head(hidden[known:]) if logits is None else logits).__getitem__
    drawn = [r >= 0 for r in proposal.ranks] if proposal.lookup is not None and proposal.ranks is not None else None
    result = verify_tree(run, rows, proposal.tokens, parents, proposal.probs, typical=False, lookup=proposal.lookup,
                         drawn=drawn)
    path = list(result.path)
    drafter.observe(start, feats[list(range(known + 1)) + [known + 1 + i for i in path]])
    block = [proposal.tokens[i] for i in path] + [result.next_token]
    record = TreeRecord.of(parents, proposal.ranks, path, proposal.lookup) if proposal.ranks is not None else None
    return Accepted(block, max(node_depths(parents), default=0), len(path), list(range(known)) + [known + i for i in path],
                    record)


class EagleRound:
    """One EAGLE round on a target session (see the module docstring)."""

    def __init__(self, run: RunState, session: EngineSession, drafter: EagleSession) -> None:
        self.run = run
        self.session = session
        self.drafter = drafter

    def __call__(self) -> RoundOutcome:
        run, drafter = self.run, self.drafter
        k = run.draft_length()
        t0 = time.perf_counter()
        shape = run.eagle_shape(k)
        if shape is not None:  # the drafter's tree or chain
            proposal = run.with_lookup(drafter.propose_tree(run.tokens, shape, run.processor, run.rng))
        else:
            proposal = run.propose(k)  # auto: the n-gram match's chain
        t1 = time.perf_counter()
        start = drafter.feature_end  # <= len(run.tokens) - 1
        known = len(run.tokens) - 1 - start
        nodes = run.tokens[start + 1:] + proposal.tokens
        parents = eagle_parents(known, proposal)
        features = None
        if drafter.capture_layers is None:
            hidden = self.session.tree_hidden(run.tokens[: start + 1], nodes, parents)
        elif isinstance(self.session, FeatureSession):  # EAGLE-3: the capture layers' outputs from the same pass
            hidden, features = self.session.tree_features(run.tokens[: start + 1], nodes, parents, drafter.capture_layers)
        else:
            raise TypeError(f"an EAGLE-3 drafter needs a session that returns capture-layer outputs, not {self.session!r}")
        accepted = accept_eagle(run, drafter, self.session.head_logits, hidden, proposal, start, features=features)
        self.session.keep_tree_path(accepted.path)
        return accepted.outcome(t1 - t0, time.perf_counter() - t1)


__all__ = ["EagleRound", "accept_eagle", "eagle_parents"]
