"""One round of tree speculation (Medusa) inside :class:`triton_backend.generation._Run`.

Propose a tree (depth ``k`` from the controller; empty on the first round and after
fallback, which makes the round a plain decoding step), score the last committed token and
every node in ONE target pass with tree attention, accept a path (greedy / exact sampling /
typical), compact the target's KV cache to that path, and hand the drafter the hidden state
at the path's end for the next round. For statistics and fallback a round drafts ``depth``
positions (the tree's depth) and accepts ``len(path)`` of them.
"""

from __future__ import annotations

import time
from typing import Any

from triton_backend.config import TreeAcceptance
from triton_backend.drafters.medusa import EMPTY_TREE
from triton_backend.errors import InvalidRequestError
from triton_backend.tree import node_depths
from triton_backend.tree_verify import verify_tree_greedy, verify_tree_sampling, verify_tree_typical


def tree_round(run: Any) -> list[int]:
    """The tokens this round commits (accepted path + one target token)."""
    session, drafter_session = run.target_session, run.drafter_session
    if not hasattr(session, "tree_logits"):
        raise InvalidRequestError("this target engine cannot verify draft trees (Medusa needs the torch runtime)")
    k = run._draft_length()
    t0 = time.perf_counter()
    proposal = drafter_session.propose(run.tokens, k, run.processor, run.rng) if k > 0 else EMPTY_TREE
    parents = proposal.parents if proposal.parents is not None else list(range(-1, len(proposal) - 1))
    t1 = time.perf_counter()
    logits, hidden = session.tree_logits(run.tokens, proposal.tokens, parents)
    spec = run.controller.config
    if run.processor.greedy:
        result = verify_tree_greedy(logits, proposal.tokens, parents)
    elif spec.tree_acceptance is TreeAcceptance.TYPICAL:
        result = verify_tree_typical(run.processor.probs(logits), proposal.tokens, parents, run.rng,
                                     spec.typical_threshold, spec.typical_alpha)
    else:
        result = verify_tree_sampling(run.processor.probs(logits), proposal.tokens, parents, run.rng)
    session.keep_tree_path(result.path)
    end = result.path[-1] + 1 if result.path else 0
    drafter_session.observe(len(run.tokens) + len(result.path) + 1, hidden[end])
    t2 = time.perf_counter()
    depth = max(node_depths(parents), default=0)
    run.stats.draft_time_s += t1 - t0
    run.stats.verify_time_s += t2 - t1
    run.stats.record_round(depth, result.num_accepted)
    if run.controller.record(depth, result.num_accepted):
        run.stats.fallback = True
        run.stats.fallback_at_token = len(run.generated) + result.num_accepted + 1
    return [proposal.tokens[i] for i in result.path] + [result.next_token]
