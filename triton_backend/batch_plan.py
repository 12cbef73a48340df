"""Draft lengths for one round of the batch scheduler.

``per_request``: each request's own :class:`~triton_backend.controller.SpeculationController`
decides, exactly as the single-request loop does (a request gives the same draft lengths,
so the same output even when sampling, batched or alone). ``load_aware``: per round, the
draft length of every row of the ragged pass from
:func:`triton_backend.speculation_policy.plan_round`: expected committed tokens per unit
of pass time under the measured pass-cost table, each row's running acceptance and the
current batch (speculate at low load, back off as the batch grows). Two kinds of rows keep
their controller's decision under ``load_aware``: seeded sampling requests (their RNG use,
hence their output, must not depend on who else is in the batch) and requests that turned
fallback off (always speculate).
"""

from __future__ import annotations

import enum
import logging
from typing import Sequence

from triton_backend.batch_round import BatchSequence
from triton_backend.config import SpeculationMode
from triton_backend.speculation_policy import (PRIOR_ACCEPTANCE, AcceptanceEstimate, DrafterKind, PassCostModel,
                                               RowOption, current_cost_model, plan_round, prefix_probabilities)

logger = logging.getLogger(__name__)

_KINDS = {SpeculationMode.DRAFT: DrafterKind.DRAFT, SpeculationMode.MEDUSA: DrafterKind.MEDUSA,
          SpeculationMode.NGRAM: DrafterKind.NGRAM}
NO_DRAFT = RowOption(prefix_probs=())


class BatchPolicy(str, enum.Enum):
    LOAD_AWARE = "load_aware"
    PER_REQUEST = "per_request"

    @classmethod
    def parse(cls, value: "str | BatchPolicy") -> "BatchPolicy":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"batch policy must be one of {[p.value for p in cls]}, got {value!r}") from None


class _RowEstimate:
    """A request's acceptance estimate and what one row of it may carry (load-aware)."""

    def __init__(self, seq: BatchSequence) -> None:
        spec = seq.controller.config
        kind = _KINDS.get(seq.mode, DrafterKind.DRAFT)
        prior = PRIOR_ACCEPTANCE[kind] if spec.prior_acceptance is None else spec.prior_acceptance
        depths = list(seq.drafter.depths) if seq.tree else []  # a tree row drafts with Medusa heads
        self.max_k = min(spec.num_draft_tokens, max(depths)) if seq.tree else spec.num_draft_tokens
        self.estimate = AcceptanceEstimate(self.max_k, prior, spec.prior_strength, spec.acceptance_decay)
        self.draft_cost = seq.drafter.relative_cost if seq.drafter is not None else 0.0
        # a Medusa row carries the root plus every node down to the depth it drafts
        self.verify_tokens = tuple(1 + sum(1 for d in depths if d <= k) for k in range(self.max_k + 1)) if seq.tree else None
        self.probe_after = spec.probe_interval

    def option(self, plain_rounds: int) -> RowOption:
        probing = plain_rounds >= self.probe_after
        conditional = self.estimate.prior_conditional() if probing else self.estimate.conditional()
        return RowOption(tuple(prefix_probabilities(conditional)), self.draft_cost, self.verify_tokens)


class DraftPlanner:
    """Picks each row's draft length for a round and learns from what each row accepted."""

    def __init__(self, policy: BatchPolicy, cost_model: PassCostModel | None = None) -> None:
        self.policy = policy
        self.cost_model = cost_model
        self._estimates: dict[int, _RowEstimate] = {}

    def _planned(self, seq: BatchSequence) -> bool:
        """Whether the load-aware plan decides this row (else its controller does)."""
        spec = seq.controller.config
        return (self.policy is BatchPolicy.LOAD_AWARE and seq.use_drafter and spec.fallback
                and spec.num_draft_tokens > 0 and not seq.seeded_sampling)

    def plan(self, seqs: Sequence[BatchSequence]) -> list[int]:
        ks = [seq._draft_length() if not self._planned(seq) else 0 for seq in seqs]
        planned = [i for i, seq in enumerate(seqs) if self._planned(seq)]
        if planned:
            options = [NO_DRAFT] * len(seqs)
            for i in planned:
                options[i] = self._estimate(seqs[i]).option(seqs[i].plain_rounds)
            fixed = [i for i in range(len(seqs)) if i not in set(planned)]
            for i in fixed:  # the rows the plan does not decide still share the pass: count their tokens
                options[i] = RowOption(prefix_probs=(0.0,) * ks[i]) if ks[i] else NO_DRAFT
            margin = seqs[planned[0]].controller.config.gain_margin
            chosen = plan_round_fixed(options, ks, planned, self.cost_model or current_cost_model(), margin)
            for i in planned:
                seq = seqs[i]
                ks[i] = seq.cap_draft_length(chosen[i])
                seq.plain_rounds = 0 if ks[i] else seq.plain_rounds + 1
        return ks

    def record(self, seq: BatchSequence, drafted: int, accepted: int) -> None:
        if self._planned(seq) and drafted > 0:
            self._estimate(seq).estimate.record(drafted, accepted)

    def controls(self, seq: BatchSequence) -> bool:
        """Whether the request's controller (not this planner) should learn from its rounds."""
        return not self._planned(seq)

    def forget(self, seq: BatchSequence) -> None:
        self._estimates.pop(id(seq), None)

    def _estimate(self, seq: BatchSequence) -> _RowEstimate:
        key = id(seq)
        if key not in self._estimates:
            self._estimates[key] = _RowEstimate(seq)
        return self._estimates[key]


def plan_round_fixed(options: Sequence[RowOption], ks: Sequence[int], free: Sequence[int], cost_model: PassCostModel,
                     margin: float) -> list[int]:
    """:func:`plan_round` over every row, then the rows not in ``free`` put back to ``ks``
    (they carry their tokens into the pass, counted through their options)."""
    chosen = plan_round(options, cost_model, margin)
    free_set = set(free)
    return [chosen[i] if i in free_set else ks[i] for i in range(len(options))]


__all__ = ["BatchPolicy", "DraftPlanner"]
