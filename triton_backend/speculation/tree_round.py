"""Tree speculation (Medusa): one round on the torch runtime, and the verification the batch
scheduler's tree rows share with it.

Propose a tree (depth ``k`` from the controller; empty on the first round and after
fallback, which makes the round a plain decoding step), score the last committed token and
every node in ONE target pass with tree attention (the LM head runs only on the rows the
verifier visits), accept a path (greedy / exact sampling /
typical), compact the target's KV cache to that path, and hand the drafter the hidden state
at the path's end for the next round. For statistics and fallback a round drafts ``depth``
positions (the tree's depth) and accepts ``len(path)`` of them.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from triton_backend.core.config import TreeAcceptance
from triton_backend.speculation.drafters.protocol import EMPTY_PROPOSAL, DraftProposal
from triton_backend.speculation.drafters.medusa import EMPTY_TREE, MedusaSession
from triton_backend.engines.base import EngineSession
from triton_backend.speculation.rounds import RoundOutcome
from triton_backend.speculation.run_state import Accepted, RunState
from triton_backend.core.tree import node_depths, path_to
from triton_backend.speculation.tree_verify import (TreeVerifyResult, verify_tree_greedy, verify_tree_multidraft,
                                                   verify_tree_sampling, verify_tree_typical)

Head = Callable[[torch.Tensor], torch.Tensor]  # the LM head: hidden states [r, H] -> logits [r, vocab]


def head_rows(head: Head, hidden: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """Row ``i``'s raw logits ``[vocab]``, computed when first asked for (the processor is
    applied per row by :func:`verify_tree`, which knows each row's history)."""
    cache: dict[int, torch.Tensor] = {}

    def row(i: int) -> torch.Tensor:
        if i not in cache:
            cache[i] = head(hidden[i:i + 1])[0]  # [vocab]
        return cache[i]

    return row


def processed_rows(run: RunState, logits: Callable[[int], torch.Tensor], tokens: list[int],
                   parents: Sequence[int]) -> Callable[[int], torch.Tensor]:
    """Row ``i`` (0: after the committed tokens; ``i + 1``: after tree node ``i``) as the
    verifier needs it: penalised logits (greedy) or probabilities, each row with the history
    plain decoding would have there (committed tokens, then the node's ancestors and itself)."""
    processor = run.processor
    cache: dict[int, torch.Tensor] = {}

    def row(i: int) -> torch.Tensor:
        if i not in cache:
            history = processor.rows(run.tokens, [[tokens[j] for j in path_to(i - 1, parents)]])
            one = logits(i)[None]
            cache[i] = processor.scores(one, history)[0] if processor.greedy else processor.probs(one, history)[0]
        return cache[i]

    return row


def verify_tree(run: RunState, rows: Callable[[int], torch.Tensor], tokens: list[int],
                parents: Sequence[int], draft_probs: torch.Tensor | None = None, *,
                typical: bool = True, lookup: Sequence[bool] | None = None,
                drawn: Sequence[bool] | None = None) -> TreeVerifyResult:
    """The run's tree verification (greedy / exact sampling / typical) over lazily computed
    raw logits ``rows`` (see :func:`head_rows`); records log probabilities when asked for.
    ``draft_probs`` ``[n, vocab]``: each node's parent ``q`` (a sampled EAGLE tree: the
    multi-draft rule); ``typical``: whether Medusa's typical acceptance may apply; ``lookup``
    and ``drawn``: a merged tree's match nodes and the drafter's (the multi-draft rule tries
    the match first)."""
    spec = run.controller.config
    processed = processed_rows(run, rows, tokens, parents)
    if run.processor.greedy:
        result = verify_tree_greedy(processed, tokens, parents)
    elif draft_probs is not None:
        result = verify_tree_multidraft(processed, tokens, parents, draft_probs, run.rng, lookup, drawn)
    elif typical and spec.medusa.tree_acceptance is TreeAcceptance.TYPICAL:
        result = verify_tree_typical(processed, tokens, parents, run.rng, spec.medusa.typical_threshold,
                                     spec.medusa.typical_alpha)
    else:
        result = verify_tree_sampling(processed, tokens, parents, run.rng)
    if run.commit.log_probs is not None:
        row_ids = [0] + [node + 1 for node in result.path]
        block = [tokens[node] for node in result.path] + [result.next_token]
        histories = run.processor.rows(run.tokens, [[tokens[j] for j in path_to(i - 1, parents)] for i in row_ids])
        run.note_log_probs(torch.stack([rows(i) for i in row_ids]), histories, block)
    return result


def accept_tree(run: RunState, drafter: MedusaSession, head: Head, hidden: torch.Tensor,
                proposal: DraftProposal, parents: Sequence[int]) -> Accepted:
    """Verify a tree pass (``hidden``: ``[1 + n, H]``, the last committed token then each
    node) and hand the drafter the hidden state at the accepted path's end. The caller
    keeps the path in the target's KV cache."""
    result = verify_tree(run, head_rows(head, hidden), proposal.tokens, parents)
    path = list(result.path)
    end = path[-1] + 1 if path else 0
    drafter.observe(len(run.tokens) + len(path) + 1, hidden[end])
    block = [proposal.tokens[i] for i in path] + [result.next_token]
    return Accepted(block, max(node_depths(parents), default=0), result.num_accepted, path)


class TreeRound:
    """One Medusa round on a target session (see the module docstring)."""

    def __init__(self, run: RunState, session: EngineSession, drafter: MedusaSession) -> None:
        self.run = run
        self.session = session
        self.drafter = drafter

    def __call__(self) -> RoundOutcome:
        run, session = self.run, self.session
        k = run.draft_length()
        if k == 0 and not run.controller.may_draft_next():
            return self._plain_step()
        t0 = time.perf_counter()
        proposal = run.propose(k, tree=True) if k > 0 else EMPTY_TREE  # auto: or the n-gram match's chain
        parents = proposal.parents if proposal.parents is not None else list(range(-1, len(proposal) - 1))
        t1 = time.perf_counter()
        hidden = session.tree_hidden(run.tokens, proposal.tokens, parents)
        accepted = accept_tree(run, self.drafter, session.head_logits, hidden, proposal, parents)
        session.keep_tree_path(accepted.path)
        return accepted.outcome(t1 - t0, time.perf_counter() - t1)

    def _plain_step(self) -> RoundOutcome:
        """A paused request's round: the chain path's plain step, without the hidden state the
        drafter would need (the round before the controller may draft again takes the tree path)."""
        t0 = time.perf_counter()
        accepted = self.run.verify_chain(self.session.logits(self.run.tokens, 1), EMPTY_PROPOSAL)
        return accepted.outcome(0.0, time.perf_counter() - t0)


__all__ = ["TreeRound", "accept_tree", "verify_tree"]
