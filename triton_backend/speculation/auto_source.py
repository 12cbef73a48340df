"""``auto``: per round and per request, draft from the n-gram match or from the model drafter.

A request in ``auto`` mode runs the deployment's model drafter (EAGLE, a draft model such as the
target's own int8 self draft, or Medusa heads; ``SpeculationConfig.auto_drafter``, else the first
deployed in :data:`~triton_backend.speculation.decoding.AUTO_PREFERENCE`) and, beside it, an n-gram
lookup session. Every round the two sources are compared as the gain rule compares draft lengths
for one drafter: each source's best draft length and the expected committed tokens per unit of
pass cost it gives (:func:`~triton_backend.speculation.round_plan.choose_source`), from
the acceptance measured for that source in this request (the n-gram match's bucket of
:class:`~triton_backend.speculation.match_policy.MatchLengthPolicy`; the model's
:class:`~triton_backend.speculation.policy.GainPolicy`). Lookup is free to propose, so a round with
no match, or whose match does not pay, costs nothing; the model drafter keeps its own pause and
probe logic (a paused model drafter is not asked for an option: no upkeep). The round is recorded
in the acceptance of the source that drafted it.

With an EAGLE tree drafter (``eagle.merge_lookup``, on by default) there is a third choice: both
sources in one tree, the match's continuation as one branch of the drafter's tree
(:mod:`~triton_backend.speculation.merged_tree`), sized by the gain rule over one row option that
merges the match's and the drafter's expected nodes best first; it is picked when it beats
either source alone. A merged round teaches the match's bucket (its branch), the drafter (its
nodes) and an overlap estimate (what the drafter's nodes added past the match, measured against
what they were expected to add).

Exactness does not depend on the choice: the source is picked before drafting, an n-gram draft
is deterministic (``q`` one-hot), and the verifier (greedy or exact rejection sampling) is the
one every round uses; a model drafter whose round was drafted by lookup still gets the target's
features/hidden state of every kept position (its state catches up lazily at its next proposal).
"""

from __future__ import annotations

from typing import Sequence

from triton_backend.speculation.drafters.protocol import EMPTY_PROPOSAL, DraftProposal
from triton_backend.speculation.drafters.ngram import NgramSession
from triton_backend.speculation.match_policy import MatchLengthPolicy
from triton_backend.speculation.merged_tree import MergedOption, OverlapEstimate, merged_option
from triton_backend.speculation.round_plan import DraftSource, RowOption, choose_source
from triton_backend.speculation.tree_plan import TreeRecord


class AutoSource:
    """One request's per-round choice between its n-gram session and its model drafter, or
    (an EAGLE tree drafter, ``eagle.merge_lookup``) both in one merged tree.
    ``controller``: the model drafter's :class:`~triton_backend.speculation.controller.SpeculationController`
    (under the gain rule), which routes each round's record to the source that drafted it."""

    def __init__(self, ngram: NgramSession, controller: "object") -> None:
        self.ngram = ngram
        self.controller = controller
        self.policy = MatchLengthPolicy(controller.max_k, controller.gain_settings(), controller.cost_model_or_none)
        ngram.policy = self.policy
        self.merge = controller.tree is not None and controller.config.eagle.merge_lookup
        self.overlap = OverlapEstimate()
        self.source = DraftSource.MODEL  # the current round's
        self.rounds = {s: 0 for s in DraftSource}  # rounds that drafted, by source
        self._merged: MergedOption | None = None  # this round's merged option (MERGED)
        self._split = (0, 0)  # a merged round's match tokens and drafter nodes
        self._expected_gain = 0.0  # what its drafter nodes were expected to add

    def _ngram(self, tokens: Sequence[int]) -> tuple[int, RowOption | None]:
        """The n-gram match's draft length under its bucket's gain policy (which pauses and
        probes per bucket, as lookup alone does) and its row option over the whole continuation;
        (0, None) without a match."""
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

    def _merged_option(self, ngram: RowOption, model: RowOption) -> MergedOption:
        tree = self.controller.tree
        depths = [n.depth for n in tree.nodes(self.controller.policy.current_conditional())]
        return merged_option(ngram.prefix_probs, model, depths, self.overlap.factor, tree.max_nodes)

    def choose(self, tokens: Sequence[int]) -> tuple[DraftSource, int, RowOption | None]:
        """This round's source, and for n-gram or a merged tree its draft length (a merged tree:
        its nodes, :meth:`planned` splits them) and row option
        (:func:`~triton_backend.speculation.round_plan.choose_source`)."""
        k_ngram, ngram = self._ngram(tokens)
        model = self._model_option() if ngram is not None else None
        merged = None
        if self.merge and ngram is not None and model is not None:
            merged = lambda: self._merged_option(ngram, model)  # noqa: E731  (built only when both offer a draft)
        margin = self.controller.config.fallback.gain_margin
        choice = choose_source(ngram, k_ngram, model, self.controller.cost_model, margin, merged)
        self._merged = choice.merged  # a MergedOption (built by _merged_option) when MERGED
        return choice.source, choice.k, choice.option

    def draft_length(self, tokens: Sequence[int]) -> int:
        """This round's source and draft length (0: plain; :meth:`planned` then sets the final one)."""
        self.source, k, _ = self.choose(tokens)
        return k if self.source is not DraftSource.MODEL else self.controller.model_draft_length()

    def row_option(self, tokens: Sequence[int]) -> RowOption:
        """This round's row for a batch plan: the chosen source's option."""
        self.source, _, option = self.choose(tokens)
        return option if option is not None else self.controller.model_row_option()

    def planned(self, k: int) -> None:
        """The round's final draft length (after a batch plan or the generation cap); a merged
        tree's ``k`` nodes split into the match's and the drafter's (one of them none: that source alone)."""
        if self.source is DraftSource.MERGED:
            assert self._merged is not None
            self._split = self._merged.split(k)
            self._expected_gain = self._merged.model_gain(k)
            if self._split[1] == 0:
                self.source, k = DraftSource.NGRAM, self._split[0]
            elif self._split[0] == 0:
                self.source = DraftSource.MODEL
                return
        if self.source is DraftSource.NGRAM:
            self.policy.plan_next(k)
        elif self.source is DraftSource.MERGED:
            self.policy.plan_next(self._split[0])

    def model_nodes(self, k: int) -> int:
        """The drafter's nodes of a round of ``k`` (a merged tree: its share)."""
        return self._split[1] if self.source is DraftSource.MERGED else k

    def lookup_chain(self, tokens: Sequence[int], processor: object, generator: object) -> list[int]:
        """A merged round's match tokens (the branch :func:`~triton_backend.speculation.merged_tree.merge_lookup`
        adds to the drafter's tree); empty in any other round."""
        if self.source is not DraftSource.MERGED or self._split[0] <= 0:
            return []
        return self.ngram.propose(tokens, self._split[0], processor, generator).tokens

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
        """The model drafter drafts this round, alone or in a merged tree (a tree drafter proposes
        without :meth:`propose`)."""
        self.rounds[self.source if self.source is DraftSource.MERGED else DraftSource.MODEL] += 1

    def record(self, drafted: int, accepted: int) -> bool:
        """Record a round in the n-gram policy when lookup drafted it; False otherwise."""
        if self.policy.drafted:
            self.policy.record(drafted, accepted)  # the bucket of the proposal that drafted
            return True
        return False

    def record_merged(self, tree: TreeRecord) -> None:
        """A merged round: the match's bucket learns from its branch, the overlap estimate from
        the tokens the path kept past the match's against what the drafter's nodes were expected to add."""
        if self.policy.drafted:
            self.policy.record(tree.lookup_drafted, tree.lookup_accepted)
        if tree.chain_drafted > 0:  # the drafter had nodes in the tree (not a first round's match alone)
            self.overlap.record(tree.path_length - tree.lookup_accepted, self._expected_gain)


__all__ = ["AutoSource", "DraftSource"]
