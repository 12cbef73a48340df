"""Draft lengths for one round of the batch scheduler.

``per_request``: each request's own :class:`~triton_backend.controller.SpeculationController`
decides, exactly as the single-request loop does (a request gives the same draft lengths,
so the same output even when sampling, batched or alone). ``load_aware``: per round, the
draft length of every row of the ragged pass from
:func:`triton_backend.speculation_policy.plan_round`: expected committed tokens per unit
of pass time under the measured pass-cost table, each row's running acceptance (its
controller's :meth:`~triton_backend.controller.SpeculationController.row_option`) and the
current batch (speculate at low load, back off as the batch grows). Rows whose controller
does not follow the gain rule (``fallback`` off: always speculate; the threshold rule) and
seeded sampling requests (their RNG use, hence their output, must not depend on who else
is in the batch) keep their controller's decision; so does a row alone in its pass. Every
row's controller learns from its rounds either way.
"""

from __future__ import annotations

import enum
import logging
from typing import Sequence

from triton_backend.batch_round import BatchSequence
from triton_backend.speculation_policy import PassCostModel, RowOption, current_cost_model, plan_round

logger = logging.getLogger(__name__)

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


class DraftPlanner:
    """Picks each row's draft length for a round."""

    def __init__(self, policy: BatchPolicy, cost_model: PassCostModel | None = None) -> None:
        self.policy = policy
        self.cost_model = cost_model

    def _planned(self, seq: BatchSequence) -> bool:
        """Whether the load-aware plan decides this row (else its controller does)."""
        return (self.policy is BatchPolicy.LOAD_AWARE and seq.use_drafter and seq.controller.gain_rule
                and not seq.seeded_sampling)

    def plan(self, seqs: Sequence[BatchSequence]) -> list[int]:
        """Draft lengths of one round's rows. A row alone in its pass is its own controller's
        decision (the plan of one row; a request alone runs as through the single loop)."""
        planned = [i for i, seq in enumerate(seqs) if len(seqs) > 1 and self._planned(seq)]
        ks = [0 if i in planned else seq._draft_length() for i, seq in enumerate(seqs)]
        if not planned:
            return ks
        options = [NO_DRAFT] * len(seqs)
        for i, seq in enumerate(seqs):
            # the rows the plan does not decide still share the pass: their tokens count
            options[i] = seq.controller.row_option() if i in planned else RowOption(prefix_probs=(0.0,) * ks[i])
        margin = seqs[planned[0]].controller.config.gain_margin
        chosen = plan_round_fixed(options, ks, planned, self.cost_model or current_cost_model(), margin)
        for i in planned:
            ks[i] = seqs[i].cap_draft_length(chosen[i])
        logger.debug("load-aware plan over %d rows: %s", len(seqs), ks)
        return ks


def plan_round_fixed(options: Sequence[RowOption], ks: Sequence[int], free: Sequence[int], cost_model: PassCostModel,
                     margin: float) -> list[int]:
    """:func:`plan_round` over every row, then the rows not in ``free`` put back to ``ks``
    (they carry their tokens into the pass, counted through their options)."""
    chosen = plan_round(options, cost_model, margin)
    free_set = set(free)
    return [chosen[i] if i in free_set else ks[i] for i in range(len(options))]


__all__ = ["BatchPolicy", "DraftPlanner"]
