"""Draft lengths for one round of the batch scheduler.

``per_request``: each request's own :class:`~triton_backend.speculation.controller.SpeculationController`
decides, exactly as the single-request loop does (a request gives the same draft lengths,
so the same output even when sampling, batched or alone). ``load_aware``: per round, the
draft length of every row of the ragged pass from
:func:`triton_backend.speculation.round_plan.plan_batch`: expected committed tokens per unit
of pass time under the measured pass-cost table, each row's running acceptance (its
controller's :meth:`~triton_backend.speculation.controller.SpeculationController.row_option`; for n-gram
lookup, the match its next proposal would use and how matches of that kind fared in the request,
no match being a free plain row) and the current batch (speculate at low load, back off as the batch grows). Rows whose controller
does not follow the gain rule (``fallback`` off: always speculate; the threshold rule) and
seeded sampling requests (their RNG use, hence their output, must not depend on who else
is in the batch) keep their controller's decision; so does a row alone in its pass. Every
row's controller learns from its rounds either way.

The pass-cost table is a model: measured on uniform ``rows x tokens`` passes (or the default
figures when the machine was too busy to measure), it can be far off for the ragged passes
a plan makes (an engine whose attention takes a slower path as soon as one row carries
several tokens) and it leaves out what a round costs besides the pass. So the load-aware
planner also measures: per batch size (powers of two) it keeps the committed tokens per
second of whole rounds run under each :class:`Regime` (every planned row plain, the
pass-cost plan, each row's own controller as alone, every row drafting all its option offers
as a request with ``fallback`` off would: so the measured choice includes both regimes a
deployment could fix by hand, plain and always). Plain rounds are the incumbent: a
speculating regime runs only once it has measured clearly faster than plain. The others are
probed every ``probe_every`` rounds; a probe that loses by a clear margin doubles that
regime's interval (up to ``max_probe_every``, and a larger batch starts from the interval a
smaller one reached), one that comes close or wins resets it, so a regime that keeps losing
costs ever fewer probe rounds and one that starts winning is still found
(:class:`RegimeChooser`). Rounds that prefill a prompt are not measured. Greedy outputs
do not depend on draft lengths, so exactness is untouched.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass
from typing import Sequence

from triton_backend.batching.batch_round import BatchSequence
from triton_backend.speculation.cost_model import PassCostModel
from triton_backend.speculation.round_plan import NO_DRAFT, RowOption, plan_batch

logger = logging.getLogger(__name__)


class BatchPolicy(str, enum.Enum):
    LOAD_AWARE = "load_aware"
    PER_REQUEST = "per_request"

    @classmethod
    def parse(cls, value: "str | BatchPolicy") -> "BatchPolicy":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"batch policy must be one of {[p.value for p in cls]}, got {value!r}") from None


class Regime(str, enum.Enum):
    """How the load-aware planner decides a round's planned rows."""

    PLAN = "plan"  # the pass-cost plan
    OWN = "own"  # each row's own controller (as alone)
    FULL = "full"  # every planned row drafts all its option offers (what ``fallback`` off does)
    PLAIN = "plain"  # every planned row decodes plainly


@dataclass
class _RegimeRate:
    """Decayed sums over a regime's measured rounds: committed tokens, seconds, rounds."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0
    samples: int = 0
    last_round: int = 0  # the bucket's round of the latest sample (0: the bucket's start)
    interval: int = 0  # bucket rounds from one probe of this regime to the next

    @property
    def rate(self) -> float:
        """Committed tokens per second over the kept rounds (a ratio of sums: a round that
        happened to accept every draft weighs by its length, not as a rate of its own)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def round_s(self) -> float:
        return self.seconds / self.weight if self.weight > 0 else 0.0

    def add(self, tokens: int, seconds: float, keep: float) -> None:
        self.tokens = keep * self.tokens + tokens
        self.seconds = keep * self.seconds + seconds
        self.weight = keep * self.weight + 1.0
        self.samples += 1


@dataclass
class _Bucket:
    rates: dict[Regime, _RegimeRate]
    rounds: int = 0
    probe: Regime | None = None  # the regime the latest choice probed (not the best)


class RegimeChooser:
    """Per batch-size bucket (powers of two), the measured committed tokens per second of the
    rounds each :class:`Regime` ran.

    Plain rounds are the incumbent: a bucket starts plain, and another regime runs as the
    best only once it has been measured ``warmup`` times and beats plain by ``switch_margin``
    (a speculating regime must show that it pays; one lucky round of drafts that happened to
    be accepted does not make it the best). Each other regime is probed once its interval
    has passed since it last ran (``probe_every`` rounds at first; a new bucket starts from the
    interval the next smaller measured bucket reached, since speculation pays less, not more,
    as the batch grows). A probe that measures the regime more than ``backoff_margin`` below
    the best doubles its interval (at most ``max_probe_every``); a probe within the margin (or
    better) resets it; a losing probe is also spaced so that what it cost (its round's time
    over the best regime's, times the tokens/s it gave up) stays within ``probe_overhead`` of the
    time between probes (a probe drafting for every row of a large batch can run several plain
    rounds long). A regime's figure is a ratio of decayed sums over its rounds (tokens over
    seconds): each new round keeps ``decay`` of the older ones, times ``stale_decay`` per
    round of the bucket in between. A round's tokens vary with how many drafts happened to
    be accepted and its time with a busy machine (15 % from round to round on a shared VM),
    so a probe's round is weighed with the regime's earlier probes, not taken alone; a
    figure many rounds old still fades (a regime that starts winning shows it within a
    probe or two), and the running regime's figure averages over its recent rounds."""

    def __init__(self, probe_every: int = 8, warmup: int = 1, decay: float = 0.8, max_probe_every: int = 256,
                 backoff_margin: float = 0.1, switch_margin: float = 0.03, probe_overhead: float = 0.01,
                 stale_decay: float = 0.99) -> None:
        if probe_every < 2 or warmup < 1 or not 0.0 <= decay < 1.0 or not 0.0 < stale_decay <= 1.0:
            raise ValueError("need probe_every >= 2, warmup >= 1, 0 <= decay < 1 and 0 < stale_decay <= 1")
        if max_probe_every < probe_every or not 0.0 <= backoff_margin < 1.0 or not 0.0 <= switch_margin < 1.0:
            raise ValueError("need max_probe_every >= probe_every and margins in [0, 1)")
        if not 0.0 < probe_overhead < 1.0:
            raise ValueError("need 0 < probe_overhead < 1")
        self.probe_overhead = probe_overhead
        self.probe_every, self.warmup, self.decay, self.stale_decay = probe_every, warmup, decay, stale_decay
        self.max_probe_every, self.backoff_margin = max_probe_every, backoff_margin
        self.switch_margin = switch_margin
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _bucket(self, rows: int) -> _Bucket:
        key = self.bucket(rows)
        found = self._buckets.get(key)
        if found is None:
            smaller = [k for k, b in self._buckets.items() if k < key and b.rates[Regime.PLAIN].samples]
            start = self._buckets[max(smaller)].rates if smaller else None
            found = self._buckets[key] = _Bucket({r: _RegimeRate(interval=start[r].interval if start else 0)
                                                  for r in Regime})
        return found

    def _best(self, b: _Bucket) -> Regime:
        plain = b.rates[Regime.PLAIN]
        if not plain.samples:
            return Regime.PLAIN
        ready = [r for r in Regime if r is not Regime.PLAIN and b.rates[r].samples >= self.warmup]
        best = max(ready, key=lambda r: b.rates[r].rate, default=None)
        if best is not None and b.rates[best].rate > (1.0 + self.switch_margin) * plain.rate:
            return best
        return Regime.PLAIN

    def choose(self, rows: int) -> Regime:
        b = self._bucket(rows)
        b.rounds += 1
        b.probe = None
        rates = b.rates
        if not rates[Regime.PLAIN].samples:
            return Regime.PLAIN
        best = self._best(b)
        due = [r for r in Regime if r is not best and b.rounds - rates[r].last_round >= self._interval(rates[r])]
        if due:  # the longest overdue first
            b.probe = max(due, key=lambda r: (b.rounds - rates[r].last_round) / self._interval(rates[r]))
            return b.probe
        return best

    def _interval(self, entry: _RegimeRate) -> int:
        return entry.interval or self.probe_every

    def record(self, rows: int, regime: Regime, tokens: int, seconds: float) -> None:
        """A round of ``rows`` rows under ``regime`` committed ``tokens`` in ``seconds``."""
        if seconds <= 0:
            return
        b = self._bucket(rows)
        entry = b.rates[regime]
        age = max(1, b.rounds - entry.last_round)
        entry.add(tokens, seconds, self.decay * self.stale_decay ** (age - 1))
        entry.last_round = b.rounds
        if regime is b.probe:
            others = [v for r, v in b.rates.items() if r is not regime and v.samples]
            best = max(others, key=lambda v: v.rate, default=None)
            losing = best is not None and entry.rate < (1.0 - self.backoff_margin) * best.rate
            entry.interval = min(2 * self._interval(entry), self.max_probe_every) if losing else self.probe_every
            if losing and best.round_s > 0:
                # what the probe cost, in rounds of the best regime: a probe that drafts for every row
                # of a large batch runs several times as long as a plain round; space such probes
                # out so they take at most ``probe_overhead`` of the time
                lost = seconds / best.round_s * (1.0 - entry.rate / best.rate)
                entry.interval = min(max(entry.interval, math.ceil(lost / self.probe_overhead)), self.max_probe_every)
            b.probe = None

    def rates(self, rows: int) -> dict[str, float]:
        """The measured rates of ``rows``'s bucket (for the decision log)."""
        return {r.value: round(v.rate, 2) for r, v in self._bucket(rows).rates.items() if v.samples}

    def probe_intervals(self, rows: int) -> dict[str, int]:
        """Rounds between probes of each regime in ``rows``'s bucket (for the decision log)."""
        return {r.value: self._interval(v) for r, v in self._bucket(rows).rates.items()}


class DraftPlanner:
    """Picks each row's draft length for a round. ``measured``: the load-aware plan is
    checked against measured rounds (:class:`RegimeChooser`); off, the pass-cost plan alone."""

    def __init__(self, policy: BatchPolicy, cost_model: PassCostModel | None = None,
                 chooser: RegimeChooser | None = None, measured: bool = True) -> None:
        self.policy = policy
        self.cost_model = cost_model
        self.chooser = (chooser or RegimeChooser()) if measured else None
        self.regime: Regime | None = None  # of the latest round's plan (None: no row was planned)

    def _planned(self, seq: BatchSequence) -> bool:
        """Whether the load-aware plan decides this row (else its controller does)."""
        return (self.policy is BatchPolicy.LOAD_AWARE and seq.use_drafter and seq.controller.gain_rule
                and not seq.seeded_sampling and not seq.client_drafting)

    def plan(self, seqs: Sequence[BatchSequence]) -> list[int]:
        """Draft lengths of one round's rows. A row alone in its pass is its own controller's
        decision (the plan of one row; a request alone runs as through the single loop)."""
        planned = [i for i, seq in enumerate(seqs) if len(seqs) > 1 and self._planned(seq)]
        self.regime = None
        if planned and self.chooser is not None:
            self.regime = self.chooser.choose(len(seqs))
            if self.regime is Regime.OWN:
                return [seq.draft_length() for seq in seqs]
        ks = [0 if i in planned else seq.draft_length() for i, seq in enumerate(seqs)]
        if not planned or self.regime is Regime.PLAIN:
            return ks
        self.regime = self.regime or Regime.PLAN
        options = [NO_DRAFT] * len(seqs)
        for i, seq in enumerate(seqs):
            # the rows the plan does not decide still share the pass: their tokens count
            options[i] = seq.row_option() if i in planned else RowOption(prefix_probs=(0.0,) * ks[i])
        first = seqs[planned[0]].controller  # planned rows decide from their target's pass costs, as alone
        cost_model, margin = self.cost_model or first.cost_model, first.config.fallback.gain_margin
        if self.regime is Regime.FULL:
            chosen = [options[i].max_k if i in planned else ks[i] for i in range(len(seqs))]
        else:
            chosen = plan_batch(options, ks, planned, cost_model, margin)
        for i in planned:
            ks[i] = seqs[i].cap_draft_length(chosen[i])
            seqs[i].plan_draft(ks[i])
        logger.debug("load-aware plan over %d rows: %s", len(seqs), ks)
        return ks

    def record_round(self, rows: int, tokens: int, seconds: float) -> None:
        """The round just planned committed ``tokens`` over ``rows`` rows in ``seconds`` (call
        only for rounds without prefill rows)."""
        if self.regime is not None and self.chooser is not None:
            self.chooser.record(rows, self.regime, tokens, seconds)


__all__ = ["BatchPolicy", "DraftPlanner", "Regime", "RegimeChooser"]
