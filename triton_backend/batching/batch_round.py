"""One round of the batch scheduler: every active sequence drafts, ONE ragged target pass
verifies all rows, each row is verified and committed on its own.

A :class:`BatchSequence` is one request's generation (a :class:`RunState`: committed output,
seeded RNG, controller, stop checker) plus its slot(s) and what its caches hold. Rows
follow the engine contract (:mod:`triton_backend.engines.batch`): a row starts at what
the slot holds that is still committed (``valid``, at most the committed length minus 1,
so the last committed token is re-fed and yields the first logits row), so rollback of
rejected drafts is only the next row starting earlier. Per row the steps are those of the
single-request loop's rounds (:mod:`triton_backend.speculation.torch_decoder`, :mod:`triton_backend.speculation.tree_round`,
:mod:`triton_backend.speculation.eagle_round`, whose verification they call) in the same order, so each
sequence consumes its RNG exactly as it would alone: draft (n-gram per row; a draft model
batched across rows, one pass per draft position; EAGLE trees and chains batched across rows,
one drafter call per round; Medusa trees from the hidden states of the previous pass), then
verification (EAGLE and Medusa trees as tree rows of the same ragged pass); the round is recorded and committed
as the single loop does (:meth:`RunState.record`, :meth:`~triton_backend.speculation.commit.Commit.commit`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.core.guide_cache import CompiledGuide
from triton_backend.speculation.drafters.protocol import EMPTY_PROPOSAL, DraftProposal, Drafter
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter, doubtful
from triton_backend.speculation.drafters.eagle import EagleSession, FeatureDrafter
from triton_backend.speculation.drafters.eagle_tree import TreeShape
from triton_backend.speculation.drafters.medusa import MedusaSession
from triton_backend.speculation.drafters.ngram import NgramSession
from triton_backend.speculation.eagle_round import accept_eagle, eagle_parents
from triton_backend.engines.base import CausalLMEngine
from triton_backend.engines.batch import BatchedEngine, BatchRow, RowOutput
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.speculation.cost_model import PassCostModel
from triton_backend.speculation.round_plan import RowOption
from triton_backend.speculation.run_state import Accepted, RunState
from triton_backend.speculation.tree_round import accept_tree

logger = logging.getLogger(__name__)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    i, n = 0, min(len(a), len(b))
    while i < n and a[i] == b[i]:
        i += 1
    return i


class BatchSequence(RunState):
    """One request in the batch. ``draft_engine``: the batched draft model's engine when
    the request drafts with one (its own slot there), else None (the drafter's session
    proposes)."""

    def __init__(self, target: CausalLMEngine, tokenizer: Any, prompt_ids: list[int], params: SamplingParams,
                 spec: SpeculationConfig, mode: SpeculationMode, drafter: Drafter | None, *, started: float,
                 drafter_session: bool = True, ngram: Drafter | None = None,
                 compiled_guide: CompiledGuide | None = None, cost_model: PassCostModel | None = None) -> None:
        super().__init__(target, tokenizer, prompt_ids, params, spec, mode, drafter, started=started,
                         drafter_session=drafter_session, ngram=ngram, compiled_guide=compiled_guide,
                         cost_model=cost_model)
        self.mode = mode if drafter is not None else SpeculationMode.OFF
        self.drafter = drafter
        session = self.drafter_session
        self.medusa = session if isinstance(session, MedusaSession) else None  # tree rows
        self.eagle = session if isinstance(session, EagleSession) else None  # chain rows that return hidden states
        self.slot: int | None = None
        self.valid = 0  # leading committed tokens the target slot holds
        self.draft_slot: int | None = None
        self.draft_valid = 0

    def row_option(self) -> RowOption:
        """This request's row for a batch plan. N-gram lookup under the gain rule offers the
        match the next proposal would use: nothing when there is none (a free plain row), else
        the running acceptance of matches of its kind in this request, over its continuation
        (the plan then sizes the draft: :meth:`plan_draft`)."""
        if self.auto is not None:  # auto: the option of this round's source (n-gram match or model)
            return self.auto.row_option(self.tokens)
        session, policy = self.drafter_session, self.controller.match_policy
        if isinstance(session, NgramSession) and policy is not None:
            match = session.peek(self.tokens, self.controller.max_k)
            if match is None:
                return RowOption(prefix_probs=())
            return policy.option(match.length, len(match.continuation), match.occurrences, match.cross)
        return self.controller.row_option()

    def plan_draft(self, k: int) -> None:
        """The batch plan gave this row ``k`` drafts: an n-gram session drafts exactly that."""
        if self.auto is not None:
            self.auto.planned(k)
            return
        policy = self.controller.match_policy
        if k > 0 and policy is not None and isinstance(self.drafter_session, NgramSession):
            policy.plan_next(k)

    @property
    def prompting(self) -> bool:
        """Nothing committed after the prompt yet: the row's next pass prefills (the rest of) it."""
        return len(self.tokens) == self.commit.prompt_len

    @property
    def seeded_sampling(self) -> bool:
        """A seeded sampling request: its draft lengths must not depend on the batch (same output alone)."""
        return self.params.seed is not None and not self.processor.greedy

    def pending(self) -> int:
        """Committed tokens the target has not seen yet (the prompt, before prefill)."""
        return len(self.tokens) - self._start()

    def _start(self) -> int:
        if self.eagle is not None:  # re-fed from the first position whose feature the drafter lacks (its row ends there)
            return min(self.eagle.feature_end, len(self.tokens) - 1)
        return min(self.valid, len(self.tokens) - 1)

    def prefill_row(self, budget: int) -> BatchRow:
        """A chunk of the prompt (its logits are not needed); leaves at least one token."""
        start = self._start()
        n = max(1, min(budget, self.pending() - 1))
        return BatchRow(self.slot, start, self.tokens[start:start + n])

    def after_prefill(self, row: BatchRow) -> None:
        self.valid = row.start + len(row.tokens)

    def release(self, target: BatchedEngine, draft: BatchedEngine | None) -> None:
        if self.slot is not None:
            target.release(self.slot)
            self.slot = None
        if self.draft_slot is not None and draft is not None:
            draft.release(self.draft_slot)
            self.draft_slot = None
        if self.drafter_session is not None:
            self.drafter_session.release()
        if self.auto is not None:
            self.auto.ngram.release()


@dataclass
class PlannedRow:
    """A sequence's share of one round: its draft length and, once drafted, its proposal."""

    seq: BatchSequence
    k: int
    proposal: DraftProposal = field(default_factory=lambda: EMPTY_PROPOSAL)
    draft_s: float = 0.0
    forced: bool = False  # the proposal is the grammar's forced tokens (structured output), not a drafter's
    proposed: bool = False  # drafted already this round (EAGLE rows, batched across rows)
    error: Exception | None = None  # this row failed this round (its own request fails; the others go on)

    def offer_forced(self) -> bool:
        """A chain row whose grammar forces its next tokens drafts them for free, as the single
        loop does (no drafter, no plan); returns whether it did."""
        seq = self.seq
        if seq.guide is None or seq.medusa is not None or seq.eagle is not None:
            return False
        proposal = seq.forced_draft()
        if proposal.tokens:
            self.proposal, self.forced = proposal, True
        return self.forced

    def target_row(self) -> BatchRow:
        seq, start = self.seq, self.seq._start()
        tokens = seq.tokens[start:] + self.proposal.tokens
        if seq.eagle is not None:  # the committed tokens after the drafter's root, then the chain or tree
            parents = eagle_parents(len(seq.tokens) - 1 - start, self.proposal)
            # the drafter lacks only the last committed token's feature (every round after the
            # first): the row's logits are the verifier's, computed in the pass's one LM-head
            # product with the other rows' (a head call per row would cost a pass's head each)
            fused = len(tokens) == len(self.proposal) + 1
            return BatchRow(seq.slot, start, tokens, num_logits=1 + len(parents), tree_parents=parents,
                            return_hidden=True, return_logits=fused, capture=seq.eagle.capture_layers or ())
        if seq.medusa is not None:
            parents = self.proposal.parents if self.proposal.parents is not None else []
            return BatchRow(seq.slot, start, tokens, num_logits=1 + len(parents), tree_parents=parents,
                            return_hidden=True, return_logits=False)
        return BatchRow(seq.slot, start, tokens, num_logits=len(self.proposal) + 1)


def propose_eagle_rows(planned: Sequence[PlannedRow]) -> int:
    """Every EAGLE row the model drafter drafts this round (its tree, or a chain), in ONE
    batched drafter call per drafter (each tree level one drafter step over all rows; the
    rows' drafter caches are rows of one shared cache, :meth:`EagleSession.bind`). Returns
    the rows drafted; ``auto``'s n-gram rounds are left to :func:`propose_per_row`."""
    groups: dict[int, list[tuple[PlannedRow, TreeShape]]] = {}
    for row in planned:
        seq = row.seq
        if seq.eagle is None or row.forced or row.k <= 0:
            continue
        shape = seq.eagle_shape(row.k)
        if shape is not None:
            groups.setdefault(id(seq.drafter), []).append((row, shape))
    for group in groups.values():
        shapes = {id(row): shape for row, shape in group}
        isolated([row for row, _ in group], lambda rows: _propose_eagle_group(rows, shapes), "EAGLE drafting")
    return sum(len(g) for g in groups.values())


def _propose_eagle_group(rows: Sequence[PlannedRow], shapes: dict[int, TreeShape]) -> None:
    t0 = time.perf_counter()
    drafter = rows[0].seq.drafter
    assert isinstance(drafter, FeatureDrafter)
    seqs = [r.seq for r in rows]
    proposals = drafter.propose_trees([s.eagle for s in seqs], [s.tokens for s in seqs], [shapes[id(r)] for r in rows],
                                      [s.processor for s in seqs], [s.rng for s in seqs])
    spent = (time.perf_counter() - t0) / len(rows)
    for row, proposal in zip(rows, proposals):
        row.proposal, row.proposed = row.seq.with_lookup(proposal), True  # auto's merged rounds: the match too
        row.draft_s += spent


def isolated(rows: Sequence[PlannedRow], step: Callable[[Sequence[PlannedRow]], object], what: str) -> None:
    """Run ``step`` over the ``rows`` that have not failed, batched; when it raises, again over
    each row alone: a row that fails alone keeps its error (:attr:`PlannedRow.error`, its
    request fails), the others their results. One request's failure stays its own."""
    live = [r for r in rows if r.error is None]
    if not live:
        return
    try:
        step(live)
        return
    except Exception as exc:
        if len(live) == 1:
            live[0].error = exc
            return
        logger.warning("%s failed for %d rows at once (%s); again row by row", what, len(live), exc)
    for row in live:
        try:
            step([row])
        except Exception as exc:
            row.error = exc


def propose_per_row(planned: Sequence[PlannedRow]) -> None:
    """Drafters with their own sessions (n-gram lookup, Medusa trees; ``auto``'s n-gram
    rounds): one proposal per row."""
    for row in planned:
        seq = row.seq
        if (row.error is not None or row.k <= 0 or row.forced or row.proposed
                or (seq.draft_slot is not None and seq.model_drafts)):
            continue
        t0 = time.perf_counter()
        try:
            proposal = seq.propose(row.k, tree=seq.medusa is not None)
            row.proposal = proposal if seq.medusa is not None else seq.constrain(proposal)
        except Exception as exc:  # this row's drafter or grammar: its request fails, the round goes on
            row.error = exc
        row.draft_s += time.perf_counter() - t0


def propose_with_draft_model(engine: BatchedEngine, planned: Sequence[PlannedRow], target: BatchedEngine) -> int:
    """A draft model batched across rows: draft position ``j`` of every row drafting more
    than ``j`` tokens in one pass (as :class:`DraftModelSession` drafts alone: argmax, or a
    sample from the processed ``q`` with the row's own generator; a row whose drafter stops on a
    doubtful token drafts no further). A drafter taking its context from the target's cache
    copies it from ``target``'s slot first. Returns the passes run."""
    rows = [r for r in planned if r.k > 0 and r.seq.draft_slot is not None and r.seq.model_drafts and not r.forced
            and r.error is None]
    passes = [0]

    def step(some: Sequence[PlannedRow]) -> None:
        passes[0] += _draft_model_rows(engine, some, target)

    isolated(rows, step, "draft-model drafting")
    return passes[0]


def _draft_model_rows(engine: BatchedEngine, rows: Sequence[PlannedRow], target: BatchedEngine) -> int:
    drafted: dict[int, list[int]] = {id(r): [] for r in rows}
    probs: dict[int, list[torch.Tensor]] = {id(r): [] for r in rows}
    stopped: set[int] = set()
    passes = 0
    t0 = time.perf_counter()
    for r in rows:
        _take_context(engine, target, r.seq)
    for j in range(max((r.k for r in rows), default=0)):
        active = [r for r in rows if r.k > j and id(r) not in stopped]
        if not active:
            break
        batch = []
        for r in active:
            seq, length = r.seq, len(r.seq.tokens)
            if j == 0:
                start = min(seq.draft_valid, length - 1)
                batch.append(BatchRow(seq.draft_slot, start, seq.tokens[start:]))
            else:
                batch.append(BatchRow(seq.draft_slot, length + j - 1, drafted[id(r)][-1:]))
        for r, out in zip(active, engine.forward(batch)):
            seq = r.seq
            history = seq.processor.rows(seq.tokens, [drafted[id(r)]])  # penalties as the target applies them
            assert out.logits is not None
            token, q = seq.processor.draw(out.logits[:1], None if history is None else history[0], seq.rng)
            if q is not None:
                probs[id(r)].append(q)
            drafted[id(r)].append(token)
            if doubtful(out.logits[:1], q, _stop_below(seq.drafter)):
                stopped.add(id(r))
        passes += 1
    spent = time.perf_counter() - t0
    for r in rows:
        tokens = drafted[id(r)]
        r.seq.draft_valid = len(r.seq.tokens) + len(tokens) - 1  # the last draft is never fed
        rows_q = probs[id(r)]
        r.proposal = DraftProposal(tokens, torch.stack(rows_q) if rows_q else None)
        r.draft_s += spent / max(1, len(rows))
    return passes


def _stop_below(drafter: Drafter | None) -> float:
    return drafter.stop_below if isinstance(drafter, DraftModelDrafter) else 0.0


def _take_context(engine: BatchedEngine, target: BatchedEngine, seq: BatchSequence) -> None:
    """Copy into ``seq``'s draft slot the committed positions its drafter takes from the target's
    slot (:class:`TargetContext`) and the draft does not hold yet."""
    context = seq.target_context
    if context is None or seq.slot is None or seq.draft_slot is None:
        return
    if not isinstance(engine, LlamaEngine) or not isinstance(target, LlamaEngine):
        raise TypeError("a draft taking the target's context needs slot engines for both")
    end = min(seq.valid, context.limit(seq.commit.prompt_len, len(seq.tokens)))
    if end > seq.draft_valid:
        engine.copy_kv_from(target, seq.slot, seq.draft_slot, seq.draft_valid, end, context.layers)
        seq.draft_valid = end


def verify_row(engine: BatchedEngine, row: PlannedRow, out: RowOutput) -> Accepted:
    """Verify one row of the target pass: what it keeps (the block to commit, the positions
    it drafted and accepted). Updates the bookkeeping of the sequence's caches."""
    seq, proposal = row.seq, row.proposal
    length = len(seq.tokens)
    if seq.medusa is not None:
        assert out.hidden is not None
        parents = proposal.parents if proposal.parents is not None else []
        accepted = accept_tree(seq, seq.medusa, engine.head_logits, out.hidden, proposal, parents)
        engine.keep_tree_path(seq.slot, length, accepted.path)
        seq.valid = length + len(accepted.path)
    elif seq.eagle is not None:
        assert out.hidden is not None
        start = seq._start()
        accepted = accept_eagle(seq, seq.eagle, engine.head_logits, out.hidden, proposal, start, out.logits, out.features)
        engine.keep_tree_path(seq.slot, start + 1, accepted.path)
        seq.valid = start + 1 + len(accepted.path)
    else:
        assert out.logits is not None
        accepted = seq.verify_chain(out.logits, proposal)
        seq.valid = length + _common_prefix(proposal.tokens, accepted.block)
        if seq.draft_slot is not None and row.k > 0 and seq.model_drafts and not row.forced:
            seq.draft_valid = length + _common_prefix(proposal.tokens[:-1], accepted.block)
    return accepted


def drafted_tokens(planned: Sequence[PlannedRow]) -> int:
    return sum(len(r.proposal) for r in planned)


def describe(planned: Sequence[PlannedRow], prefill: int) -> dict[str, Any]:
    """A round's shape for the decision log."""
    return {"rows": len(planned), "prefill_rows": prefill, "k": [r.k for r in planned],
            "methods": [r.seq.mode.value for r in planned]}


__all__ = ["BatchSequence", "PlannedRow", "describe", "drafted_tokens", "isolated", "propose_eagle_rows", "propose_per_row",
           "propose_with_draft_model", "verify_row"]
