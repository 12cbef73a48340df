"""One round of EAGLE chain speculation inside :class:`triton_backend.generation._Run`.

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
from typing import Any

from triton_backend.drafters.base import EMPTY_PROPOSAL
from triton_backend.errors import InvalidRequestError


def eagle_round(run: Any) -> list[int]:
    """The tokens this round commits (accepted drafts + one target token)."""
    session, drafter_session = run.target_session, run.drafter_session
    if not hasattr(session, "tree_hidden"):
        raise InvalidRequestError("this target engine cannot return hidden states (EAGLE needs the torch runtime)")
    k = run._draft_length()
    t0 = time.perf_counter()
    proposal = drafter_session.propose(run.tokens, k, run.processor, run.rng) if k > 0 else EMPTY_PROPOSAL
    t1 = time.perf_counter()
    start = drafter_session.feature_end  # <= len(run.tokens) - 1
    known = len(run.tokens) - 1 - start  # committed tokens after the drafter's root, before the last one
    chain = list(run.tokens[start + 1:]) + proposal.tokens
    hidden = session.tree_hidden(run.tokens[: start + 1], chain, list(range(-1, len(chain) - 1)))  # [1 + len(chain), H]
    logits = session.head_logits(hidden[known:])  # [k + 1, vocab]
    result = run.verify_chain(logits, proposal)  # penalties per row's history, log probs when asked
    accepted = result.num_accepted
    session.keep_tree_path(list(range(known + accepted)))
    drafter_session.observe(start, hidden[: known + accepted + 1])
    t2 = time.perf_counter()
    run.stats.draft_time_s += t1 - t0
    run.stats.verify_time_s += t2 - t1
    run.stats.record_round(len(proposal), accepted)
    if run.controller.record(len(proposal), accepted):
        run.stats.record_fallback(len(run.generated) + accepted + 1)
    return proposal.tokens[:accepted] + [result.next_token]
