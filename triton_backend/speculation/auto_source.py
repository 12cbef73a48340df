"""``auto``: per round and per request, draft from the n-gram match or from the model drafter.

A request in ``auto`` mode runs the deployment's model drafter (EAGLE, a draft model or Medusa
heads; :data:`~triton_backend.speculation.decoding.AUTO_PREFERENCE`) and, beside it, an n-gram
lookup session. Every round the two sources are compared as the gain rule compares draft lengths
for one drafter: each source's best draft length and the expected committed tokens per unit of
pass cost it gives (:func:`~triton_backend.speculation.policy.plan_round` on its row option), from
the acceptance measured for that source in this request (the n-gram match's bucket of
:class:`~triton_backend.speculation.match_policy.MatchLengthPolicy`; the model's
:class:`~triton_backend.speculation.policy.GainPolicy`). Lookup is free to propose, so a round with
no match, or whose match does not pay, costs nothing; the model drafter keeps its own pause and
probe logic (a paused model drafter is not asked for an option: no upkeep). The round is recorded
in the acceptance of the source that drafted it.

Exactness does not depend on the choice: the source is picked before drafting, an n-gram draft
is deterministic (``q`` one-hot), and the verifier (greedy or exact rejection sampling) is the
one every round uses; a model drafter whose round was drafted by lookup still gets the target's
features/hidden state of every kept position (its state catches up lazily at its next proposal).
"""

from __future__ import annotations

import enum
from typing import Sequence

from triton_backend.speculation.drafters.base import EMPTY_PROPOSAL, DraftProposal
from triton_backend.speculation.drafters.ngram import NgramSession
from triton_backend.speculation.match_policy import MatchLengthPolicy
from triton_backend.speculation.policy import RowOption, plan_round, rate_of


class DraftSource(str, enum.Enum):
    NGRAM = "ngram"
    MODEL = "model"


class AutoSource:
    """One request's per-round choice between its n-gram session and its model drafter.
    ``controller``: the model drafter's :class:`~triton_backend.speculation.controller.SpeculationController`
    (under the gain rule), which routes each round's record to the source that drafted it."""

    def __init__(self, ngram: NgramSession, controller: "object") -> None:
        self.ngram = ngram
        self.controller = controller
        self.policy = MatchLengthPolicy(controller.max_k, controller.gain_settings(), controller.cost_model_or_none)
        ngram.policy = self.policy
        self.source = DraftSource.MODEL  # the current round's
        self.rounds = {DraftSource.NGRAM: 0, DraftSource.MODEL: 0}  # rounds that drafted, by source

    def _rate(self, option: RowOption, k: int) -> float:
        return rate_of(option, k, self.controller.cost_model)

    def _ngram(self, tokens: Sequence[int]) -> tuple[int, RowOption | None]:
        """The n-gram match's draft length under its bucket's gain policy (which pauses and
        probes per bucket, as lookup alone does) and its row option; (0, None) without a match."""
        match = self.ngram.peek(tokens, self.controller.max_k)
        if match is None:
            return 0, None
        available = len(match.continuation)
        bucket = self.policy.policy_for(match.length, match.occurrences, match.cross)
        option = bucket.option(bucket.estimate.conditional()[:available])
        return bucket.next_draft_length(limit=available), option

    def _model_option(self) -> RowOption | None:
        policy = self.controller.policy
        if policy is None or policy.paused:  # paused: its own pause/probe logic decides, at no cost here
            return None
        return policy.current_option()

    def choose(self, tokens: Sequence[int]) -> tuple[DraftSource, int, RowOption | None]:
        """This round's source, and for n-gram its draft length and row option."""
        k_ngram, ngram = self._ngram(tokens)
        if k_ngram <= 0 or ngram is None:
            return DraftSource.MODEL, 0, None
        model = self._model_option()
        if model is not None:
            k_model = plan_round([model], self.controller.cost_model, self.controller.config.fallback.gain_margin)[0]
            if k_model > 0 and self._rate(model, k_model) > self._rate(ngram, k_ngram):
                return DraftSource.MODEL, 0, None
        return DraftSource.NGRAM, k_ngram, ngram

    def draft_length(self, tokens: Sequence[int]) -> int:
        """This round's source and draft length (0: plain; :meth:`planned` then sets the final one)."""
        self.source, k, _ = self.choose(tokens)
        return k if self.source is DraftSource.NGRAM else self.controller.model_draft_length()

    def row_option(self, tokens: Sequence[int]) -> RowOption:
        """This round's row for a batch plan: the chosen source's option."""
        self.source, _, option = self.choose(tokens)
        return option if option is not None else self.controller.model_row_option()

    def planned(self, k: int) -> None:
        """The round's final draft length (after a batch plan or the generation cap)."""
        if self.source is DraftSource.NGRAM:
            self.policy.plan_next(k)

    def propose(self, tokens: Sequence[int], k: int, processor: object, generator: object,
                tree: bool) -> DraftProposal | None:
        """The n-gram proposal when lookup drafts this round (a chain; ``tree``: with explicit
        chain parents, for a tree drafter's round); None when the model drafts."""
        if self.source is not DraftSource.NGRAM:
            if k > 0:
                self.model_round()
            return None
        proposal = self.ngram.propose(tokens, k, processor, generator) if k > 0 else EMPTY_PROPOSAL
        if proposal.tokens:
            self.rounds[DraftSource.NGRAM] += 1
            if tree:
                proposal = DraftProposal(proposal.tokens, parents=list(range(-1, len(proposal) - 1)))
        return proposal

    def model_round(self) -> None:
        """The model drafter drafts this round (a tree drafter proposes without :meth:`propose`)."""
        self.rounds[DraftSource.MODEL] += 1

    def record(self, drafted: int, accepted: int) -> bool:
        """Record a round in the n-gram policy when lookup drafted it; False otherwise."""
        if self.policy.drafted:
            self.policy.record(drafted, accepted)  # the bucket of the proposal that drafted
            return True
        return False


__all__ = ["AutoSource", "DraftSource"]
