"""The speculation controller: how many tokens to draft next, and when not to speculate.

Rules (``FallbackConfig.rule``, the ``fallback`` section of :class:`~triton_backend.core.config.SpeculationConfig`):

- ``gain`` (the default): a per-round decision from expected gain
  (:mod:`triton_backend.speculation.round_plan`). Every round the controller drafts the length
  whose expected committed tokens per unit of pass cost (the measured pass-cost table plus
  the drafter's own cost) beat a plain step, from an acceptance estimate that starts at the
  drafter type's prior and is updated after every round; 0 (a plain step) when no length
  pays. A paused request probes again later, and n-gram lookup decides per match: how long
  the match is and how matches of that length fared in this request (a long match is a free
  signal to speculate again). A Medusa round that cannot pay is not run.
- ``threshold`` (the seed articles' rule): draft ``num_draft_tokens`` (or an adaptive length
  from an EMA of the acceptance); over a sliding window of the last ``window`` drafted
  tokens, once ``min_drafted`` are in it, fall back to plain decoding for good when the
  window's acceptance is below ``threshold`` (0.5 when unset).
- ``enabled=False``: always draft (fixed ``k``, or the adaptive length, never 0).

Every length is decided in :mod:`~triton_backend.speculation.round_plan`; a batch scheduler
plans every active request's :meth:`SpeculationController.row_option` there once per round.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Callable

from triton_backend.core.config import FallbackConfig, FallbackRule, SpeculationConfig, SpeculationMode
from triton_backend.speculation.drafters.protocol import DraftCost, DrafterSession
from triton_backend.speculation.drafters.eagle_tree import TreeShape
from triton_backend.speculation.shared_prior import SharedAcceptance, shared_acceptance
from triton_backend.speculation.tree_plan import TreeModel, TreeRecord
from triton_backend.speculation.match_policy import MatchLengthPolicy
from triton_backend.speculation.cost_model import PassCostModel, current_cost_model
from triton_backend.speculation.policy import PRIOR_ACCEPTANCE, DrafterKind, GainPolicy, GainSettings, Prior
from triton_backend.speculation.round_plan import (RowOption, adaptive_length, expected_tokens_per_round,
                                                   prefix_probabilities)

if TYPE_CHECKING:
    from triton_backend.speculation.auto_source import AutoSource
    from triton_backend.speculation.drafters.ngram import NgramSession

logger = logging.getLogger(__name__)


def gain_settings(config: FallbackConfig) -> GainSettings:
    prior = None if config.prior_acceptance is None else (config.prior_acceptance, config.prior_acceptance)
    return GainSettings(margin=config.gain_margin, prior=prior, prior_strength=config.prior_strength,
                        decay=config.acceptance_decay, probe_interval=config.probe_interval)


class SpeculationController:
    """One request's draft-length decisions. ``kind``: the drafter type (its prior, and n-gram
    lookup's per-match decision); ``verify_tokens(k)``: tokens a round drafting ``k`` carries
    into the target pass (a Medusa tree's nodes + 1; default ``k + 1``)."""

    def __init__(self, config: SpeculationConfig, draft_cost: float, *, ema_decay: float = 0.8,
                 initial_acceptance: float = 0.7, kind: DrafterKind | None = None,
                 cost_model: PassCostModel | None = None,
                 verify_tokens: Callable[[int], int] | None = None, shared: SharedAcceptance | None = None,
                 tree: TreeModel | None = None, drafter_prior: Prior | None = None) -> None:
        self.config = config
        self.draft_cost = max(0.0, float(draft_cost))
        self.kind = kind or (DrafterKind.NGRAM if self.draft_cost == 0.0 else DrafterKind.DRAFT)
        self._cost_model = cost_model
        self._ema_decay = ema_decay
        self.acceptance_ema = initial_acceptance
        self._window: deque[bool] = deque(maxlen=config.fallback.window)
        self.fallen_back = False  # threshold rule: for good; gain rule: the last decision was a plain step
        self.max_k = config.draft_length.num_draft_tokens
        self.gain_rule = config.fallback.enabled and config.fallback.rule is FallbackRule.GAIN and self.max_k > 0
        self.policy: GainPolicy | None = None
        self.match_policy: MatchLengthPolicy | None = None  # set when an n-gram session decides per match
        self.auto: AutoSource | None = None  # set under ``auto``: the per-round n-gram / model choice
        # an EAGLE tree drafter: under the gain rule a round's k is the tree's node count (tree_plan.py)
        self.tree = tree
        if self.gain_rule:
            self.policy = GainPolicy(self.kind, tree.max_nodes if tree is not None else self.max_k, self.draft_cost,
                                     gain_settings(config.fallback), cost_model, verify_tokens, shared, tree,
                                     drafter_prior=drafter_prior)

    def attach_match_policy(self) -> MatchLengthPolicy | None:
        """Under the gain rule, the per-match policy an n-gram session applies to each lookup
        (the controller then lets every round look up; the session drafts what pays)."""
        if self.gain_rule and self.kind is DrafterKind.NGRAM and self.match_policy is None:
            self.match_policy = MatchLengthPolicy(self.max_k, gain_settings(self.config.fallback), self._cost_model)
        return self.match_policy

    @property
    def cost_model(self) -> PassCostModel:
        """The pass costs this request decides from (given: its target's, taken when it started;
        else the default table)."""
        return self._cost_model or current_cost_model()

    @property
    def cost_model_or_none(self) -> PassCostModel | None:
        """The cost model this controller was given (None: the default table)."""
        return self._cost_model

    def gain_settings(self) -> GainSettings:
        return gain_settings(self.config.fallback)

    def attach_auto(self, ngram: "NgramSession") -> "AutoSource | None":
        """``auto`` under the gain rule with a model drafter: the per-round choice between
        ``ngram``'s match and the model drafter (:mod:`triton_backend.speculation.auto_source`)."""
        from triton_backend.speculation.auto_source import AutoSource

        if not self.gain_rule or self.policy is None or self.match_policy is not None:
            return None
        self.auto = AutoSource(ngram, self)
        return self.auto

    # -- the gain rule ----------------------------------------------------------------------
    def row_option(self) -> RowOption:
        """This request's row for a batch plan (:func:`~triton_backend.speculation.round_plan.plan_round`)."""
        return self.model_row_option()

    def model_row_option(self) -> RowOption:
        """The row option of this controller's own drafter (under ``auto``: the model drafter's)."""
        if self.policy is not None and self.match_policy is None:
            return self.policy.current_option()
        # n-gram under the gain rule (the session sizes each draft by its match) and the other
        # rules: the running acceptance at every position, up to the length the rule allows
        k = self.next_draft_length() if not self.gain_rule else self.max_k
        return RowOption(tuple(prefix_probabilities([self.acceptance_ema] * k)), self.draft_cost)

    def model_draft_length(self) -> int:
        """The drafter's own draft length this round (under ``auto``: the model drafter's)."""
        return self._gain_draft_length() if self.gain_rule else self.next_draft_length()

    def _gain_draft_length(self) -> int:
        if self.match_policy is not None:  # lookup is free: the n-gram session decides per match
            return self.max_k
        assert self.policy is not None
        k = self.policy.next_draft_length()
        if k == 0 and not self.fallen_back:
            logger.debug("speculation paused: no draft length pays at acceptance %s", self.policy.estimate.conditional()[:3])
        self.fallen_back = k == 0
        return k

    def may_draft_next(self) -> bool:
        """Whether the next :meth:`next_draft_length` could be above 0 (nothing changes): a
        paused Medusa request skips the tree pass's hidden state while this is False."""
        if self.max_k == 0:
            return False
        if self.gain_rule:
            if self.match_policy is not None:
                return True
            assert self.policy is not None
            return self.policy.may_draft_next()
        return not self.fallen_back

    def tree_shape(self, k: int) -> TreeShape | None:
        """The draft tree of a round that drafts ``k`` (None: a chain of ``k``). Under the gain
        rule ``k`` counts the tree's nodes, shaped by the model of :mod:`~triton_backend.speculation.tree_plan`;
        otherwise the configured tree at depth ``k``."""
        if self.tree is None or k <= 0:
            return None
        if self.policy is not None:
            shape = self.tree.shape(self.policy.estimate.conditional(), k)
        else:
            eagle = self.config.eagle
            shape = TreeShape(k, eagle.tree_top_k, max(k, eagle.max_tree_nodes))
        return None if shape is None or shape.is_chain else shape

    # -- the threshold rule and fixed k -----------------------------------------------------
    def round_cost(self, k: int) -> float:
        """A round drafting ``k`` tokens, in target decoding steps (the threshold rule's adaptive k)."""
        return 1.0 + k * (self.draft_cost + self.config.draft_length.verify_cost_per_token)

    def _adaptive_length(self) -> int:
        min_k = self.config.draft_length.min_draft_tokens
        return adaptive_length(self.acceptance_ema, min_k, self.max_k, self.round_cost)

    def next_draft_length(self) -> int:
        """0 means: decode this step plainly."""
        if self.max_k == 0:
            return 0
        if self.gain_rule:
            return self._gain_draft_length()
        if self.fallen_back:
            return 0
        return self._adaptive_length() if self.config.draft_length.adaptive else self.max_k

    def window_acceptance(self) -> float | None:
        return sum(self._window) / len(self._window) if self._window else None

    def record(self, num_drafted: int, num_accepted: int, tree: TreeRecord | None = None) -> bool:
        """Record one verification round; returns True when this round triggered a fallback for good.
        ``tree``: a tree round, learned from as the chain of the drafter's first choices in it (the
        acceptance estimate) plus how its other choices fared (the tree model)."""
        if tree is not None:
            if self.tree is not None:
                self.tree.record(tree)
            if self.auto is not None and tree.lookup_drafted > 0:  # a merged tree: the match's branch and overlap
                self.auto.record_merged(tree)
            num_drafted, num_accepted = tree.chain_drafted, tree.chain_accepted
        if num_drafted <= 0:
            return False
        self._window.extend(i < num_accepted for i in range(num_drafted))
        self.acceptance_ema = self._ema_decay * self.acceptance_ema + (1 - self._ema_decay) * num_accepted / num_drafted
        if self.match_policy is not None:
            self.match_policy.record(num_drafted, num_accepted)
        elif self.auto is not None and self.auto.record(num_drafted, num_accepted):
            pass  # lookup drafted this round: its match bucket learned from it
        elif self.policy is not None:
            self.policy.record(num_drafted, num_accepted)
        cfg = self.config.fallback
        if self.gain_rule or not cfg.enabled or self.fallen_back or len(self._window) < cfg.min_drafted:
            return False
        threshold = 0.5 if cfg.threshold is None else cfg.threshold
        window_rate = self.window_acceptance()
        if window_rate is None or window_rate >= threshold:
            return False
        self.fallen_back = True
        logger.info("speculation fallback: over the last %d drafted tokens, acceptance %.3f is below %.3f; "
                    "continuing with plain decoding", len(self._window), window_rate, threshold)
        return True


def controller_for(config: SpeculationConfig, mode: SpeculationMode, drafter: DraftCost | None,
                   session: DrafterSession | None = None, cost_model: PassCostModel | None = None, *,
                   learned_prior: bool = False, reproducible: bool = False) -> SpeculationController:
    """The controller for one request of ``mode``: the drafter type's prior (``learned_prior``:
    a model drafter's acceptance measured over the deployment's requests,
    :mod:`triton_backend.speculation.shared_prior`), a Medusa round's cost counting its tree's
    nodes, n-gram lookup's per-match decision hooked into ``session``. ``reproducible`` (a
    seeded sampling request: its draft lengths, hence its random stream and output, must depend
    on the request alone): priced by the default pass-cost table and the drafter's nominal cost,
    never by what this machine measured at load (another process, or another machine, measures
    other values)."""
    from triton_backend.speculation.drafters.eagle import FeatureDrafter
    from triton_backend.speculation.drafters.medusa import MedusaDrafter
    from triton_backend.speculation.drafters.ngram import NgramSession

    if reproducible:
        cost_model = PassCostModel.default()
    if drafter is None:
        return SpeculationController(config, 0.0, cost_model=cost_model)
    relative_cost = float(getattr(drafter, "nominal_cost", drafter.relative_cost) if reproducible
                          else drafter.relative_cost)
    if isinstance(drafter, MedusaDrafter):
        depths = list(drafter.depths)
        per_depth = relative_cost / max(1, max(depths, default=1))
        return SpeculationController(config, per_depth, kind=DrafterKind.MEDUSA, cost_model=cost_model,
                                     verify_tokens=lambda k: 1 + sum(1 for d in depths if d <= k),
                                     shared=_shared(drafter, DrafterKind.MEDUSA, learned_prior))
    kind = DrafterKind.NGRAM if mode is SpeculationMode.NGRAM else DrafterKind.DRAFT
    own_prior = getattr(drafter, "prior_acceptance", None) if kind is DrafterKind.DRAFT else None
    shared = _shared(drafter, kind, learned_prior, own_prior) if kind is not DrafterKind.NGRAM else None
    tree = None
    if isinstance(drafter, FeatureDrafter) and mode is not SpeculationMode.NGRAM and config.eagle.tree:
        tree = TreeModel(config.eagle.max_tree_nodes, config.eagle.tree_top_k, config.draft_length.num_draft_tokens)
    controller = SpeculationController(config, relative_cost, kind=kind, cost_model=cost_model, shared=shared,
                                       tree=tree, drafter_prior=own_prior)
    if isinstance(session, NgramSession):
        session.policy = controller.attach_match_policy()
    return controller


def _shared(drafter: DraftCost, kind: DrafterKind, learned: bool, own_prior: Prior | None = None) -> SharedAcceptance | None:
    return shared_acceptance(drafter, kind, own_prior or PRIOR_ACCEPTANCE[kind]) if learned else None


__all__ = ["SpeculationController", "controller_for", "expected_tokens_per_round", "gain_settings"]
