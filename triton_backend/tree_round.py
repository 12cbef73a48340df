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
from triton_backend.drafters.base import EMPTY_PROPOSAL
from triton_backend.drafters.medusa import EMPTY_TREE
from triton_backend.errors import InvalidRequestError
from triton_backend.sampling import LogitsProcessor
from triton_backend.tree import node_depths, path_to
from triton_backend.tree_verify import verify_tree_greedy, verify_tree_sampling, verify_tree_typical


def _rows(session: Any, hidden: torch.Tensor, processor: LogitsProcessor) -> Callable[[int], torch.Tensor]:
    """Row ``i``'s raw logits ``[vocab]``, computed when first asked for (``processor`` is
    applied per row by :func:`verify_tree`, which knows each row's history)."""
    cache: dict[int, torch.Tensor] = {}

    def row(i: int) -> torch.Tensor:
        if i not in cache:
            cache[i] = session.head_logits(hidden[i:i + 1])[0]  # [vocab]
        return cache[i]

    return row


def processed_rows(run: Any, logits: Callable[[int], torch.Tensor], tokens: list[int],
                   parents: list[int]) -> Callable[[int], torch.Tensor]:
    """Row ``i`` (0: after the committed tokens; ``i + 1``: after tree node ``i``) as the
    verifier needs it: penalised logits (greedy) or probabilities, each row with the history
    plain decoding would have there (committed tokens, then the node's ancestors and itself)."""
    processor: LogitsProcessor = run.processor
    cache: dict[int, torch.Tensor] = {}

    def row(i: int) -> torch.Tensor:
        if i not in cache:
            history = processor.rows(run.tokens, [[tokens[j] for j in path_to(i - 1, parents)]])
            one = logits(i)[None]
            cache[i] = processor.scores(one, history)[0] if processor.greedy else processor.probs(one, history)[0]
        return cache[i]

    return row


def verify_tree(run: Any, rows: Callable[[int], torch.Tensor], tokens: list[int], parents: list[int]) -> Any:
    """The run's tree verification (greedy / exact sampling / typical) over lazily computed
    raw logits ``rows`` (see :func:`_rows`); records log probabilities when asked for."""
    spec = run.controller.config
    processed = processed_rows(run, rows, tokens, parents)
    if run.processor.greedy:
        result = verify_tree_greedy(processed, tokens, parents)
    elif spec.medusa.tree_acceptance is TreeAcceptance.TYPICAL:
        result = verify_tree_typical(processed, tokens, parents, run.rng, spec.medusa.typical_threshold,
                                     spec.medusa.typical_alpha)
    else:
        result = verify_tree_sampling(processed, tokens, parents, run.rng)
    if run.log_probs is not None:
        row_ids = [0] + [node + 1 for node in result.path]
        block = [tokens[node] for node in result.path] + [result.next_token]
        histories = run.processor.rows(run.tokens, [[tokens[j] for j in path_to(i - 1, parents)] for i in row_ids])
        run.note_log_probs(torch.stack([rows(i) for i in row_ids]), histories, block)
    return result


def _plain_step(run: Any) -> list[int]:
    """A paused request's round: the chain path's plain step, without the hidden state the
    drafter would need (the round before the controller may draft again takes the tree path)."""
    t0 = time.perf_counter()
    result = run.verify_chain(run.target_session.logits(run.tokens, 1), EMPTY_PROPOSAL)
    run.record_verification(0, 0, 0.0, time.perf_counter() - t0)
    return [result.next_token]


def tree_round(run: Any) -> list[int]:
    """The tokens this round commits (accepted path + one target token)."""
    session, drafter_session = run.target_session, run.drafter_session
    if not hasattr(session, "tree_hidden"):
        raise InvalidRequestError("this target engine cannot verify draft trees (Medusa needs the torch runtime)")
    k = run._draft_length()
    if k == 0 and not run.controller.may_draft_next():
        return _plain_step(run)
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
