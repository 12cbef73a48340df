"""The gain rule for n-gram lookup: a :class:`~triton_backend.speculation.policy.GainPolicy`
per match bucket (match length; repeated or unique short n-gram; own text or the
cross-request index), so a proposal's length follows how long its match is and how matches
of that kind fared in this request."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from triton_backend.speculation.cost_model import PassCostModel
from triton_backend.speculation.policy import DrafterKind, GainPolicy, GainSettings, Prior
from triton_backend.speculation.round_plan import RowOption


# n-gram matches by length: a bucket is the largest entry <= the match length; its prior is the
# per-position conditional acceptance a request starts from (first draft, later drafts), fit on
# held-out prompts (builder/data/heldout_prompts.txt, heldout_copy_prompts.json), not the bench's.
# A short match whose n-gram occurs several times earlier is a weaker signal than a unique one:
# those get their own bucket and prior.
MATCH_BUCKETS = (1, 2, 3, 4, 6, 10, 16)
MATCH_PRIOR: dict[int, Prior] = {1: (0.26, 0.66), 2: (0.58, 0.77), 3: (0.63, 0.79), 4: (0.79, 0.78), 6: (0.78, 0.85),
                                 10: (0.88, 0.9), 16: (0.96, 0.93)}
REPEATED_MATCH_PRIOR: dict[int, Prior] = {1: (0.1, 0.7)}

MatchKey = tuple[int, bool, bool]  # (length bucket, a short match whose n-gram occurs more than once, cross-request)


class MatchLengthPolicy:
    """The gain rule for n-gram lookup: one :class:`GainPolicy` per match bucket (length, and
    for short matches whether the n-gram is repeated), so the proposal's length follows how
    long the match is and how matches of that kind fared in this request; a long match is a
    free signal to speculate again after short ones failed. Matches from the cross-request
    index (:mod:`~triton_backend.speculation.drafters.suffix_index`) have buckets of their own,
    made on first use with the same priors, so the two sources' acceptance is learnt apart."""

    def __init__(self, max_k: int, settings: GainSettings, cost_model: PassCostModel | None = None,
                 priors: Mapping[int, Prior] | None = None,
                 repeated_priors: Mapping[int, Prior] | None = None) -> None:
        explicit = settings.prior is not None
        if priors is None:  # an explicit prior in the settings overrides the per-length table
            priors = MATCH_PRIOR if not explicit else {b: settings.prior for b in MATCH_PRIOR}
            if repeated_priors is None and not explicit:
                repeated_priors = REPEATED_MATCH_PRIOR
        priors = dict(priors)
        repeated = dict(repeated_priors or {})
        self.buckets = tuple(sorted(priors))
        self._priors: dict[tuple[int, bool], Prior] = {(b, False): priors[b] for b in self.buckets}
        self._priors.update({(b, True): p for b, p in repeated.items() if b in priors})
        self._max_k, self._settings, self._cost_model = max_k, settings, cost_model
        self.policies: dict[MatchKey, GainPolicy] = {(*key, False): self._make(prior) for key, prior in self._priors.items()}
        self.source_totals = {False: [0, 0, 0], True: [0, 0, 0]}  # cross-request? -> drafted, accepted, rounds
        self._last: MatchKey | None = None  # the bucket of the last proposal, when it drafted
        self._planned: int | None = None  # a batch plan's length for the next proposal
        self.paused = False

    def _make(self, prior: Prior) -> GainPolicy:
        return GainPolicy(DrafterKind.NGRAM, self._max_k, 0.0, dataclasses.replace(self._settings, prior=prior),
                          self._cost_model)

    def bucket(self, match_length: int) -> int:
        return max((b for b in self.buckets if b <= match_length), default=self.buckets[0])

    def key(self, match_length: int, occurrences: int = 1, cross: bool = False) -> MatchKey:
        bucket = self.bucket(match_length)
        repeated = occurrences > 1 and (bucket, True) in self._priors
        return bucket, repeated, cross

    def policy_for(self, match_length: int, occurrences: int = 1, cross: bool = False) -> GainPolicy:
        """The gain policy of this match's bucket (a cross-request bucket is made on first use)."""
        key = self.key(match_length, occurrences, cross)
        policy = self.policies.get(key)
        if policy is None:
            policy = self.policies[key] = self._make(self._priors[key[:2]])
        return policy

    def option(self, match_length: int, available: int, occurrences: int = 1, cross: bool = False) -> RowOption:
        """This match's row for a batch plan: the running acceptance of its bucket, at most
        ``available`` positions (the continuation the match offers)."""
        policy = self.policy_for(match_length, occurrences, cross)
        return policy.option(policy.estimate.conditional()[:max(0, available)])

    def plan_next(self, k: int) -> None:
        """A batch plan decided the next proposal's length (``k`` > 0): it drafts exactly that
        (cut to the continuation) instead of this request's own decision, and is recorded
        in its match bucket as usual."""
        self._planned = k if k > 0 else None

    def draft_length(self, match_length: int, available: int, occurrences: int = 1, cross: bool = False) -> int:
        key = self.key(match_length, occurrences, cross)
        planned, self._planned = self._planned, None
        if planned is not None:
            k = min(planned, available)
        else:
            k = self.policy_for(match_length, occurrences, cross).next_draft_length(limit=available)
        self._last = key if k > 0 else None
        self.paused = k == 0
        return k

    @property
    def drafted(self) -> bool:
        """Whether the last proposal drafted (its round is to be recorded here)."""
        return self._last is not None

    def record(self, drafted: int, accepted: int) -> None:
        if self._last is not None and drafted > 0:
            self.policies[self._last].record(drafted, accepted)
            totals = self.source_totals[self._last[2]]
            totals[0] += drafted
            totals[1] += accepted
            totals[2] += 1
        self._last = None


__all__ = ["MATCH_BUCKETS", "MATCH_PRIOR", "MatchKey", "MatchLengthPolicy", "REPEATED_MATCH_PRIOR"]
