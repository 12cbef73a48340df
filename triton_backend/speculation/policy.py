"""When speculation pays: the pass-cost model, acceptance estimates and the per-round plan.

Units: the cost of one target pass is measured in target decoding steps of one row and one
token (``PassCostModel``). A round that drafts ``k`` tokens for a row commits, in
expectation, ``E(k) = 1 + sum_{j=1..k} P_j`` tokens, where ``P_j`` is the probability that
the first ``j`` drafts are all accepted (the ``1`` is the recovered/bonus token). A plan
gives each row of a batch a draft length (0: decode plainly) that maximises the expected
committed tokens per unit of time of the whole ragged pass; a row speculates only when that
beats plain decoding by ``margin``. With one row this is the single-request decision.

Acceptance per request starts from a prior per drafter type (a cold request does not pay to
learn) and is updated every round (a Beta posterior per draft position whose evidence decays,
so the estimate follows the text). A request whose speculation stops paying decodes plainly;
it probes again after ``probe_interval`` plain steps (the interval doubles after each probe
that does not pay) when the prior says a probe may pay.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

logger = logging.getLogger(__name__)

# Passes on one row: the CPU runtime's prepacked 8-row GEMMs (benchmarks/results/pass-cost-cpu.md);
# several rows: the batch figures of DESIGN.md. Replaced by a measurement where one exists.
DEFAULT_COST_TABLE: dict[int, dict[int, float]] = {
    1: {1: 1.0, 2: 1.21, 3: 1.24, 4: 1.33, 8: 1.35, 9: 2.05, 16: 2.1},
    4: {1: 1.59, 4: 2.84},
    8: {1: 2.03, 4: 4.59},
    16: {1: 3.41, 4: 8.15},
}


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted ``points``; past the last point, proportional to ``x``."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    last_x, last_y = points[-1]
    return last_y * x / last_x


def _non_decreasing(curve: Mapping[int, float]) -> dict[int, float]:
    """A measured curve made non-decreasing in tokens: a cell below a cell of fewer tokens is
    timing noise (a pass never costs less for carrying more tokens) and takes its value; the
    one-token point, the unit, stays."""
    out: dict[int, float] = {}
    top = 0.0
    for tokens, value in sorted(curve.items()):
        top = out[tokens] = max(top, value)
    return out


@dataclass(frozen=True)
class PassCostModel:
    """Cost of one target pass, in units of one 1-row-1-token decode step.

    ``table[rows][tokens_per_row]``: measured points. A ragged pass is looked up by its row
    count and mean tokens per row, interpolated linearly between measured points (beyond the
    table: proportional to the tokens, or to the rows).
    """

    table: Mapping[int, Mapping[int, float]]
    source: str = "default"

    def __post_init__(self) -> None:
        if 1 not in self.table or 1 not in self.table[1]:
            raise ValueError("a pass-cost table needs the 1-row 1-token step")
        for rows, curve in self.table.items():
            if rows < 1 or not curve or min(curve) < 1 or any(not (c > 0) for c in curve.values()):
                raise ValueError(f"bad pass-cost table entry for {rows} rows: {dict(curve)}")
        # sorted once (a decision looks the table up a few dozen times)
        object.__setattr__(self, "_curves", {rows: tuple(sorted(curve.items())) for rows, curve in self.table.items()})
        object.__setattr__(self, "_rows", tuple(sorted(self.table)))

    @classmethod
    def default(cls) -> "PassCostModel":
        return cls(DEFAULT_COST_TABLE, "default")

    @classmethod
    def from_measurements(cls, seconds: Mapping[tuple[int, int], float], source: str = "measured") -> "PassCostModel":
        """From median seconds per pass keyed by ``(rows, tokens_per_row)``; normalised by (1, 1)."""
        if (1, 1) not in seconds or not seconds[(1, 1)] > 0:
            raise ValueError("measurements need the 1-row 1-token step")
        step = seconds[(1, 1)]
        table: dict[int, dict[int, float]] = {}
        for (rows, tokens), value in sorted(seconds.items()):
            table.setdefault(rows, {})[tokens] = max(value / step, 1e-3)
        return cls({rows: _non_decreasing(curve) for rows, curve in table.items()}, source)

    def _curve_cost(self, rows: int, tokens: float) -> float:
        return _interpolate(self._curves[rows], tokens)

    def pass_cost(self, tokens_per_row: Sequence[int]) -> float:
        """One ragged pass whose rows carry ``tokens_per_row`` new tokens each."""
        rows = len(tokens_per_row)
        if rows == 0:
            return 0.0
        mean = sum(tokens_per_row) / rows
        known = self._rows
        lower = max((r for r in known if r <= rows), default=known[0])
        upper = min((r for r in known if r >= rows), default=None)
        if upper is None:  # more rows than measured: proportional to the rows
            return self._curve_cost(lower, mean) * rows / lower
        if upper == lower:
            return self._curve_cost(lower, mean)
        c0, c1 = self._curve_cost(lower, mean), self._curve_cost(upper, mean)
        return c0 + (c1 - c0) * (rows - lower) / (upper - lower)

    def to_json(self) -> dict:
        return {"source": self.source, "table": {str(r): {str(t): c for t, c in curve.items()} for r, curve in self.table.items()}}

    @classmethod
    def from_json(cls, data: Mapping) -> "PassCostModel":
        table = {int(r): {int(t): float(c) for t, c in curve.items()} for r, curve in data["table"].items()}
        return cls(table, str(data.get("source", "cached")))


_current_cost_model: PassCostModel | None = None


def install_cost_model(model: PassCostModel | None) -> None:
    """Make ``model`` the process's cost model (the loop's controllers read it); None: the default table."""
    global _current_cost_model
    _current_cost_model = model


_DEFAULT_MODEL: PassCostModel | None = None


def current_cost_model() -> PassCostModel:
    global _DEFAULT_MODEL
    if _current_cost_model is not None:
        return _current_cost_model
    if _DEFAULT_MODEL is None:
        _DEFAULT_MODEL = PassCostModel.default()
    return _DEFAULT_MODEL


# -- expected gain ------------------------------------------------------------------------------


def prefix_probabilities(conditional: Sequence[float]) -> list[float]:
    """``P_j`` (all of the first ``j`` drafts accepted) from per-position conditional acceptance."""
    out, running = [], 1.0
    for p in conditional:
        running *= min(1.0, max(0.0, p))
        out.append(running)
    return out


@dataclass(frozen=True)
class RowOption:
    """What one row could draft this round.

    ``prefix_probs[j - 1]``: probability that the first ``j`` drafts are all accepted
    (``j = 1 .. max_k``). ``draft_cost``: drafting one more position, in target steps.
    ``verify_tokens[k]``: tokens the row carries into the target pass when it drafts ``k``
    (None: ``k + 1``; a Medusa tree carries its nodes). ``draft_costs[k]``: drafting ``k``
    (None: ``k * draft_cost``; an EAGLE tree of ``k`` nodes, :mod:`~triton_backend.speculation.tree_plan`,
    whose ``prefix_probs`` are then its nodes' probabilities, best first).
    """

    prefix_probs: tuple[float, ...]
    draft_cost: float = 0.0
    verify_tokens: tuple[int, ...] | None = None
    draft_costs: tuple[float, ...] | None = None

    def drafting(self, k: int) -> float:
        return self.draft_costs[k] if self.draft_costs is not None else self.draft_cost * k

    @property
    def max_k(self) -> int:
        return len(self.prefix_probs)

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.prefix_probs[:k])

    def tokens(self, k: int) -> int:
        return self.verify_tokens[k] if self.verify_tokens is not None else k + 1


def _rate(rows: Sequence[RowOption], ks: Sequence[int], cost_model: PassCostModel) -> float:
    tokens = sum(r.expected_tokens(k) for r, k in zip(rows, ks))
    cost = cost_model.pass_cost([r.tokens(k) for r, k in zip(rows, ks)]) + sum(r.drafting(k) for r, k in zip(rows, ks))
    return tokens / cost


def rate_of(option: RowOption, k: int, cost_model: PassCostModel) -> float:
    """Expected committed tokens per unit of cost of one row alone drafting ``k``."""
    return _rate([option], [k], cost_model)


def plan_round(rows: Sequence[RowOption], cost_model: PassCostModel, margin: float = 0.03) -> list[int]:
    """Each row's draft length (0: plain) for one ragged pass, maximising expected committed
    tokens per unit of time of the whole pass. A row drafts only when that beats its plain
    step by ``margin`` given the others (coordinate ascent; exhaustive for one row)."""
    ks = [0] * len(rows)
    for _ in range(4):
        changed = False
        for i, row in enumerate(rows):
            def rate_at(k: int) -> float:
                trial = list(ks)
                trial[i] = k
                return _rate(rows, trial, cost_model)

            plain = rate_at(0)
            best_k, best = 0, plain * (1.0 + margin)
            for k in range(1, row.max_k + 1):
                value = rate_at(k)
                if value > best + 1e-12:
                    best_k, best = k, value
            if best_k != ks[i]:
                ks[i], changed = best_k, True
        if not changed or len(rows) == 1:  # one row: the first sweep was exhaustive
            break
    return ks


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


__all__ = ["AcceptanceEstimate", "DEFAULT_COST_TABLE", "DrafterKind", "GainPolicy", "GainSettings", "PRIOR_ACCEPTANCE", "Prior",
           "PassCostModel", "RowOption", "current_cost_model", "install_cost_model", "plan_round",
           "prefix_probabilities", "rate_of"]
