"""EAGLE chain speculation: one round on the torch runtime, and the verification the batch
scheduler's EAGLE rows share with it.

The drafter proposes ``k`` tokens (none on the first round: it has no target features
yet); ONE target pass over the positions whose features the drafter lacks (the whole prompt
on the first round, then the last committed token) plus the drafts returns their last
hidden states; the LM head turns the last ``k + 1`` rows into logits for the verifier
(greedy or exact rejection sampling with the drafter's ``q``); the target's KV cache keeps
the accepted drafts (the chain is passed as a one-branch tree, the same pass Medusa's tree
rounds make), and the drafter gets the target's features at every position it kept.
"""

from __future__ import annotations

import time

import torch

from triton_backend.speculation.drafters.base import DraftProposal
from triton_backend.speculation.drafters.eagle import EagleSession
from triton_backend.engines.base import EngineSession
from triton_backend.speculation.rounds import RoundOutcome
from triton_backend.speculation.run_state import Accepted, RunState
from triton_backend.speculation.tree_round import Head


def accept_eagle(run: RunState, drafter: EagleSession, head: Head, hidden: torch.Tensor, proposal: DraftProposal,
                 start: int, logits: torch.Tensor | None = None) -> Accepted:
    """Verify an EAGLE pass whose rows start at the drafter's root ``start`` (``hidden``:
    ``[1 + known + k, H]``) and hand the drafter the target's features at every position
    kept. ``logits``: the last ``k + 1`` rows' logits when the pass computed them (a batch
    pass puts them in its one LM-head product), else ``head`` makes them from ``hidden``.
    ``path``: the chain's nodes to keep after the root (the committed tokens the drafter
    lacked, then the accepted drafts)."""
    known = len(run.tokens) - 1 - start  # committed tokens after the drafter's root, before the last one
    if logits is None:
        logits = head(hidden[known:])
    elif logits.shape[0] != len(proposal) + 1:
        raise ValueError(f"{logits.shape[0]} logits rows for a chain of {len(proposal)} drafts")
    accepted = run.verify_chain(logits, proposal)  # [k + 1, vocab]: penalties per row, log probs
    kept = known + accepted.accepted
    drafter.observe(start, hidden[: kept + 1])
    return Accepted(accepted.block, accepted.drafted, accepted.accepted, list(range(kept)))


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
        proposal = run.propose(k)  # the drafter's chain (auto: or the n-gram match's)
        t1 = time.perf_counter()
        start = drafter.feature_end  # <= len(run.tokens) - 1
        chain = run.tokens[start + 1:] + proposal.tokens
        hidden = self.session.tree_hidden(run.tokens[: start + 1], chain, list(range(-1, len(chain) - 1)))
        accepted = accept_eagle(run, drafter, self.session.head_logits, hidden, proposal, start)
        self.session.keep_tree_path(accepted.path)
        return accepted.outcome(t1 - t0, time.perf_counter() - t1)


__all__ = ["EagleRound", "accept_eagle"]
