"""What a request knows of its drafter's acceptance, and when it pauses and probes.

The draft of each round is decided in :mod:`~triton_backend.speculation.round_plan` (the gain
rule over the target's pass costs, :mod:`~triton_backend.speculation.cost_model`); this module
gives it its inputs and its schedule. Acceptance per request starts from a prior per drafter
type (a cold request does not pay to learn) and is updated every round (a Beta posterior per
draft position whose evidence decays, so the estimate follows the text). A request whose speculation stops paying decodes plainly;
it probes again after ``probe_interval`` plain steps (the interval doubles after each probe
that does not pay) when the prior says a probe may pay.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from triton_backend.speculation.cost_model import PassCostModel, current_cost_model
from triton_backend.speculation.round_plan import RowOption, plan_round, prefix_probabilities

logger = logging.getLogger(__name__)


# -- acceptance estimates -----------------------------------------------------------------------


class DrafterKind(str, enum.Enum):
    NGRAM = "ngram"
    DRAFT = "draft"
    MEDUSA = "medusa"


Prior = tuple[float, float]  # conditional acceptance of the first draft, and of each later one

# what a request starts from (before any round of its own): (first position, later positions)
PRIOR_ACCEPTANCE: dict[DrafterKind, Prior] = {DrafterKind.DRAFT: (0.6, 0.6), DrafterKind.MEDUSA: (0.5, 0.35),
                                              DrafterKind.NGRAM: (0.3, 0.6)}


class AcceptanceEstimate:
    """Per-position conditional acceptance (drafts ``0..i-1`` accepted -> draft ``i`` accepted):
    a Beta posterior per position whose evidence decays by ``decay`` each recorded round (the
    estimate follows the text), with ``strength`` pseudo-observations of its prior."""

    def __init__(self, positions: int, prior: Prior, strength: float = 2.0, decay: float = 0.9,
                 pooled: bool = False, min_strength: float | None = None) -> None:
        self.prior = (float(prior[0]), float(prior[1]))
        self.strength, self.decay = float(strength), float(decay)
        self.min_strength = min_strength  # set: the prior's weight fades with the evidence, down to this
        self.pooled = pooled
        self.accepted = [0.0] * positions
        self.rejected = [0.0] * positions

    def conditional(self) -> list[float]:
        """Position 0 shrinks toward the first prior; later positions toward the later prior
        scaled by how position 0 does against its prior (where first drafts fail in this
        request, later ones are not trusted either). ``pooled``: the later positions share one
        estimate (a copy that keeps being accepted at positions 1..6 is trusted at 7..15 too,
        which per-position estimates never learn when only 7 were ever drafted)."""
        s, (first, later) = self.strength, self.prior
        out: list[float] = []
        pooled_a, pooled_r = sum(self.accepted[1:]), sum(self.rejected[1:])
        for i, (a, r) in enumerate(zip(self.accepted, self.rejected)):
            prior = first if i == 0 else later * (min(1.0, out[0] / first) if first > 0 else 0.0)
            if i > 0 and self.pooled:
                a, r = pooled_a, pooled_r
            out.append((s * prior + a) / (s + a + r))
        return out

    def prior_conditional(self) -> list[float]:
        first, later = self.prior
        return [first] + [later] * (len(self.accepted) - 1)

    def age(self, factor: float) -> None:
        """Evidence fades while nothing is drafted (a paused request's estimate drifts back to its prior)."""
        self.accepted = [a * factor for a in self.accepted]
        self.rejected = [r * factor for r in self.rejected]

    def record(self, drafted: int, accepted: int) -> None:
        """A round drafted ``drafted`` positions; the first ``accepted`` were accepted."""
        self.accepted = [a * self.decay for a in self.accepted]
        self.rejected = [r * self.decay for r in self.rejected]
        if self.min_strength is not None:
            self.strength = max(self.min_strength, self.strength * self.decay)
        for i in range(min(drafted, len(self.accepted))):
            if i < accepted:
                self.accepted[i] += 1.0
            else:
                self.rejected[i] += 1.0  # position i was tried and the chain broke here
                break


@dataclass(frozen=True)
class GainSettings:
    """The gain rule's knobs (from :class:`~triton_backend.core.config.SpeculationConfig`)."""

    margin: float = 0.03
    prior: Prior | None = None  # None: the drafter type's prior
    prior_strength: float = 2.0
    decay: float = 0.9
    probe_interval: int = 8
    max_probe_interval: int = 256
    idle_decay: float = 0.97  # evidence kept per plain step while paused
    paused_recheck: int = 8  # a paused model drafter re-decides every this many plain steps (and at probes)
    # a model drafter's prior fades with the evidence down to this weight: evidence decays too, so
    # with a fixed prior weight the estimate could never fall below ~(2 x prior) / 12 (0.17 for a
    # 0.6 prior), and a drafter accepting 0.08 kept drafting at a loss. N-gram match buckets keep
    # their full prior (fit per match length on held-out prompts).
    min_prior_strength: float = 0.5


class TreeOptions(Protocol):
    """Tree sizing (:class:`~triton_backend.speculation.tree_plan.TreeModel`): a row option over tree sizes."""

    def option(self, conditional: Sequence[float], draft_cost: float) -> RowOption: ...


class SharedAcceptanceLike(Protocol):
    """A deployment-wide acceptance estimate (:class:`~triton_backend.speculation.shared_prior.SharedAcceptance`)."""

    def prior(self) -> Prior: ...
    def record(self, drafted: int, accepted: int) -> None: ...


class GainPolicy:
    """One request's per-round decision under the gain rule (draft models, Medusa)."""

    def __init__(self, kind: DrafterKind, max_k: int, draft_cost: float, settings: GainSettings,
                 cost_model: PassCostModel | None = None,
                 verify_tokens: Callable[[int], int] | None = None, shared: "SharedAcceptanceLike | None" = None,
                 tree: "TreeOptions | None" = None, drafter_prior: Prior | None = None) -> None:
        # an explicit setting wins, then the drafter's own prior, then its type's
        prior = settings.prior if settings.prior is not None else drafter_prior or PRIOR_ACCEPTANCE[kind]
        self.shared = shared if settings.prior is None else None  # an explicit prior is the user's: kept
        if self.shared is not None:  # the deployment's measured acceptance of this drafter
            prior = self.shared.prior()
        self.settings, self.max_k, self.draft_cost = settings, max_k, max(0.0, draft_cost)
        self.cost_model = cost_model
        self.tree = tree
        ngram = kind is DrafterKind.NGRAM
        self.estimate = AcceptanceEstimate(max_k, prior, settings.prior_strength, settings.decay, pooled=ngram,
                                           min_strength=None if ngram else min(settings.min_prior_strength,
                                                                               settings.prior_strength))
        self._verify = tuple(verify_tokens(k) for k in range(max_k + 1)) if verify_tokens is not None else None
        self.paused = False
        self._plain_steps = 0
        self._interval = settings.probe_interval
        self._probing = False
        # a paused model drafter costs nothing per token: its decision is re-made only every
        # ``recheck`` plain steps (and at a probe), its estimate aged lazily meanwhile
        self._recheck = 0 if ngram else max(1, settings.paused_recheck)
        self._idle = 0  # plain steps not yet applied to the estimate's age
        self._model: PassCostModel | None = None  # the cost model of the last decision (a new one: decide again)

    def option(self, conditional: Sequence[float]) -> RowOption:
        if self.tree is not None:  # an EAGLE tree: its nodes' probabilities and costs (tree_plan.py)
            return self.tree.option(conditional, self.draft_cost)
        verify = self._verify[:len(conditional) + 1] if self._verify is not None else None
        return RowOption(tuple(prefix_probabilities(conditional)), self.draft_cost, verify)

    def current_conditional(self) -> list[float]:
        """The acceptance estimate the next decision sees (unchanged)."""
        return self._aged_conditional()

    def current_option(self) -> RowOption:
        """This request's row for :func:`plan_round` (a batch scheduler's input)."""
        return self.option(self._aged_conditional())

    def _decide(self, conditional: Sequence[float]) -> int:
        model = self._model = self.cost_model or current_cost_model()
        return plan_round([self.option(conditional)], model, self.settings.margin)[0]

    def _skips(self) -> bool:
        """Whether the next decision is a paused step decided in O(1): no probe due, no recheck due."""
        return (self.paused and self._recheck > 0 and self._plain_steps + 1 < self._interval
                and (self._idle + 1) % self._recheck != 0 and (self.cost_model or current_cost_model()) is self._model)

    def _catch_up_age(self) -> None:
        if self._idle:
            self.estimate.age(self.settings.idle_decay ** self._idle)
            self._idle = 0

    def next_draft_length(self, limit: int | None = None) -> int:
        """This round's draft length (0: plain); ``limit``: at most this many (what a drafter has)."""
        if self.max_k <= 0 or (limit is not None and limit <= 0):
            return 0
        if self._skips():  # paused, nothing due: no per-token upkeep
            self._idle += 1
            self._plain_steps += 1
            return 0
        self._catch_up_age()
        cut = self.max_k if limit is None else min(limit, self.max_k)
        k = self._decide(self.estimate.conditional()[:cut])
        if k > 0:
            self.paused = False
            return k
        self.paused = True
        self.estimate.age(self.settings.idle_decay)
        self._plain_steps += 1
        if self._plain_steps >= self._interval:  # a probe, if the prior says drafting may pay
            probe = self._decide(self.estimate.prior_conditional()[:cut])
            if probe > 0:
                self._plain_steps, self._probing = 0, True
                self._interval = min(2 * self._interval, self.settings.max_probe_interval)
                return min(probe, 2)
        return 0

    def may_draft_next(self, limit: int | None = None) -> bool:
        """Whether the next :meth:`next_draft_length` call could draft (no state changes): a
        drafter whose state costs something to keep (Medusa's hidden state) keeps it only then."""
        if self.max_k <= 0 or (limit is not None and limit <= 0) or self._skips():
            return False
        cut = self.max_k if limit is None else min(limit, self.max_k)
        if self._decide(self._aged_conditional()[:cut]) > 0:
            return True
        return self._plain_steps + 1 >= self._interval and self._decide(self.estimate.prior_conditional()[:cut]) > 0

    def _aged_conditional(self) -> list[float]:
        """The estimate as the next decision sees it (the lazily applied age included), unchanged."""
        if not self._idle:
            return self.estimate.conditional()
        factor = self.settings.idle_decay ** self._idle
        est = self.estimate
        aged = AcceptanceEstimate(len(est.accepted), est.prior, est.strength, est.decay, est.pooled, est.min_strength)
        aged.accepted = [a * factor for a in est.accepted]
        aged.rejected = [r * factor for r in est.rejected]
        return aged.conditional()

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self._catch_up_age()
        self.estimate.record(drafted, accepted)
        if self.shared is not None:
            self.shared.record(drafted, accepted)
        if self._probing and self._decide(self.estimate.conditional()) > 0:
            self._interval = self.settings.probe_interval  # the probe paid: back to speculating
        self._probing = False


__all__ = ["AcceptanceEstimate", "DrafterKind", "GainPolicy", "GainSettings", "PRIOR_ACCEPTANCE", "Prior"]
