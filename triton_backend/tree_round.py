"""One round of tree speculation (Medusa) inside :class:`triton_backend.generation._Run`.

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
from typing import Any, Callable

import torch

from triton_backend.config import TreeAcceptance
from triton_backend.drafters.medusa import EMPTY_TREE
from triton_backend.errors import InvalidRequestError
from triton_backend.sampling import LogitsProcessor
from triton_backend.tree import node_depths
from triton_backend.tree_verify import verify_tree_greedy, verify_tree_sampling, verify_tree_typical


def _rows(session: Any, hidden: torch.Tensor, processor: LogitsProcessor) -> Callable[[int], torch.Tensor]:
    """Row ``i``'s logits (greedy) or processed probabilities, computed when first asked for."""
    cache: dict[int, torch.Tensor] = {}

    def row(i: int) -> torch.Tensor:
        if i not in cache:
            logits = session.head_logits(hidden[i:i + 1])  # [1, vocab]
            cache[i] = logits[0] if processor.greedy else processor.probs(logits)[0]
        return cache[i]

    return row


def verify_tree(run: Any, rows: Callable[[int], torch.Tensor], tokens: list[int], parents: list[int]) -> Any:
    """The run's tree verification (greedy / exact sampling / typical) over lazily computed ``rows``."""
    spec = run.controller.config
    if run.processor.greedy:
        return verify_tree_greedy(rows, tokens, parents)
    if spec.tree_acceptance is TreeAcceptance.TYPICAL:
        return verify_tree_typical(rows, tokens, parents, run.rng, spec.typical_threshold, spec.typical_alpha)
    return verify_tree_sampling(rows, tokens, parents, run.rng)


def tree_round(run: Any) -> list[int]:
    """The tokens this round commits (accepted path + one target token)."""
    session, drafter_session = run.target_session, run.drafter_session
    if not hasattr(session, "tree_hidden"):
        raise InvalidRequestError("this target engine cannot verify draft trees (Medusa needs the torch runtime)")
    k = run._draft_length()
    t0 = time.perf_counter()
    proposal = drafter_session.propose(run.tokens, k, run.processor, run.rng) if k > 0 else EMPTY_TREE
    parents = proposal.parents if proposal.parents is not None else list(range(-1, len(proposal) - 1))
    t1 = time.perf_counter()
    hidden = session.tree_hidden(run.tokens, proposal.tokens, parents)
    result = verify_tree(run, _rows(session, hidden, run.processor), proposal.tokens, parents)
    session.keep_tree_path(result.path)
    end = result.path[-1] + 1 if result.path else 0
    drafter_session.observe(len(run.tokens) + len(result.path) + 1, hidden[end])
    depth = max(node_depths(parents), default=0)
    run.record_verification(depth, result.num_accepted, t1 - t0, time.perf_counter() - t1)
    return [proposal.tokens[i] for i in result.path] + [result.next_token]
