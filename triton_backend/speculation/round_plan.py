"""Where a round's draft is decided: its source (``auto``), draft length or tree size, for a
request alone and for a row of a batch alike, from the gain rule over the target's pass costs.

The gain rule. A round that drafts ``k`` tokens for a row commits, in expectation,
``E(k) = 1 + sum_{j=1..k} P_j`` tokens, where ``P_j`` is the probability that the first ``j``
drafts are all accepted (the ``1`` is the recovered/bonus token). It costs one target pass
over the row's ``k + 1`` tokens (a tree: its nodes + 1), priced by the target's
:class:`~triton_backend.speculation.cost_model.PassCostModel`, plus the drafting. A plan gives
each row of a ragged pass the draft length (0: decode plainly) that maximises the expected
committed tokens per unit of time of the whole pass; a row drafts only when that beats plain
decoding by ``margin``. One row is the single-request decision.

The inputs are explicit: what each row could draft (a :class:`RowOption`: per-position
acceptance from the request's estimate, the drafter's cost per token, the verify tokens; an
EAGLE tree's nodes best first, :mod:`~triton_backend.speculation.tree_plan`), the cost model
the request took from its target when it started, and the margin. Nothing here keeps state.

Who asks, each round:

- a request's controller (:mod:`~triton_backend.speculation.controller`): its drafter's length
  through :meth:`~triton_backend.speculation.policy.GainPolicy.next_draft_length` (which adds
  the pause and probe schedule) -> :func:`plan_round`; the seed articles' threshold rule ->
  :func:`adaptive_length`;
- n-gram lookup per match (:mod:`~triton_backend.speculation.match_policy`): the match bucket's
  GainPolicy -> :func:`plan_round`;
- ``auto`` (:mod:`~triton_backend.speculation.auto_source`): n-gram match, model drafter or
  both in one tree -> :func:`choose_source`;
- the batch scheduler's load-aware plan (:mod:`~triton_backend.batching.plan`): every planned
  row of the ragged pass at once -> :func:`plan_batch`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from triton_backend.speculation.cost_model import PassCostModel


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


NO_DRAFT = RowOption(prefix_probs=())


def plan_batch(options: Sequence[RowOption], ks: Sequence[int], free: Sequence[int], cost_model: PassCostModel,
               margin: float) -> list[int]:
    """A batch round: :func:`plan_round` over every row, then the rows not in ``free`` put back
    to ``ks`` (rows whose length is decided elsewhere still carry their tokens into the pass,
    counted through their options)."""
    chosen = plan_round(options, cost_model, margin)
    free_set = set(free)
    return [chosen[i] if i in free_set else ks[i] for i in range(len(options))]


# -- auto: which source drafts the round ---------------------------------------------------------


class DraftSource(str, enum.Enum):
    NGRAM = "ngram"
    MODEL = "model"
    MERGED = "merged"  # both: the match as one branch of the EAGLE drafter's tree (merged_tree.py)


class SplitOption(Protocol):
    """A merged tree's row option (:class:`~triton_backend.speculation.merged_tree.MergedOption`):
    its ``k`` nodes split into the match's tokens and the drafter's nodes."""

    option: RowOption

    def split(self, k: int) -> tuple[int, int]: ...


@dataclass(frozen=True)
class SourceChoice:
    """``auto``'s round: its source, the draft length (MODEL: the model drafter decides its own
    with its pause and probe schedule), the chosen option, and the merged tree when MERGED."""

    source: DraftSource
    k: int = 0
    option: RowOption | None = None
    merged: SplitOption | None = None


def choose_source(ngram: RowOption | None, k_ngram: int, model: RowOption | None, cost_model: PassCostModel,
                  margin: float, merged: Callable[[], SplitOption] | None = None) -> SourceChoice:
    """``auto``'s choice for one round: the n-gram match (``ngram``, its bucket's length
    ``k_ngram``; None: no match), the model drafter (``model``; None: paused, its own schedule
    decides) or both in one tree (``merged`` builds its option), by expected committed tokens per
    unit of cost at each one's best length. Lookup is free: a round with no match, or whose match
    does not pay, costs nothing; on a tie the match wins over the model drafter; a merged tree
    must beat both."""
    if ngram is None:
        return SourceChoice(DraftSource.MODEL)
    if model is None:
        return SourceChoice(DraftSource.NGRAM, k_ngram, ngram) if k_ngram > 0 else SourceChoice(DraftSource.MODEL)
    best, best_rate = SourceChoice(DraftSource.MODEL), 0.0
    k_model = plan_round([model], cost_model, margin)[0]
    if k_model > 0:
        best_rate = rate_of(model, k_model, cost_model)
    if k_ngram > 0 and rate_of(ngram, k_ngram, cost_model) >= best_rate:
        best, best_rate = SourceChoice(DraftSource.NGRAM, k_ngram, ngram), rate_of(ngram, k_ngram, cost_model)
    if merged is not None:
        tree = merged()
        k = plan_round([tree.option], cost_model, margin)[0]
        if all(tree.split(k)) and rate_of(tree.option, k, cost_model) > best_rate:
            best = SourceChoice(DraftSource.MERGED, k, tree.option, tree)
    return best


# -- the threshold rule (the seed articles'): a length from the running acceptance ---------------


def expected_tokens_per_round(acceptance: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): expected tokens committed per target pass."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def adaptive_length(acceptance: float, min_k: int, max_k: int, round_cost: Callable[[int], float]) -> int:
    """The length in ``min_k .. max_k`` whose expected tokens per round cost are best, at one
    acceptance rate for every position (``round_cost(k)``: a round drafting ``k``, in target steps)."""
    best_k, best_rate = min_k, -1.0
    for k in range(min_k, max_k + 1):
        rate = expected_tokens_per_round(acceptance, k) / round_cost(k)
        if rate > best_rate + 1e-9:
            best_k, best_rate = k, rate
    return best_k


__all__ = ["DraftSource", "NO_DRAFT", "RowOption", "SourceChoice", "SplitOption", "adaptive_length", "choose_source",
           "expected_tokens_per_round", "plan_batch", "plan_round", "prefix_probabilities", "rate_of"]
