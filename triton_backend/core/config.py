"""Typed configuration for one generation: sampling parameters and speculation settings.

Every field is validated at construction; a bad sampling parameter raises
:class:`~triton_backend.core.errors.InvalidRequestError` (it comes with a request), a bad speculation
or runtime setting :class:`~triton_backend.core.errors.ConfigError` (it comes from a deployment), each
with a short message. The speculation settings are one config per concern: the draft length and
the fallback rule that every method shares, and one per method with settings of its own.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Mapping, TypeVar

from triton_backend.core.config_io import read_config, setting
from triton_backend.core.checks import config_check as _config, is_int as _is_int
from triton_backend.core.errors import ConfigError, InvalidRequestError
from triton_backend.core.guide import Guide

logger = logging.getLogger(__name__)
E = TypeVar("E", bound=enum.Enum)


class SpeculationMode(str, enum.Enum):
    """How tokens are proposed for the target to verify."""

    AUTO = "auto"  # the best drafter this deployment has
    DRAFT = "draft"  # a smaller draft model sharing the target's tokenizer
    NGRAM = "ngram"  # n-gram / prompt lookup in the context so far
    MEDUSA = "medusa"  # Medusa heads on the target propose a token tree, verified in one pass
    EAGLE = "eagle"  # an EAGLE drafter on the target's hidden states proposes a chain
    OFF = "off"  # plain autoregressive decoding

    @classmethod
    def parse(cls, value: "str | SpeculationMode") -> "SpeculationMode":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown speculation mode {value!r}; expected one of: {names}") from None


# the model drafters ``auto`` can pair with n-gram lookup, in its default order of preference
AUTO_MODEL_DRAFTERS = (SpeculationMode.EAGLE, SpeculationMode.DRAFT, SpeculationMode.MEDUSA)


class TreeAcceptance(str, enum.Enum):
    """How a draft tree (Medusa) is verified when sampling; greedy is always exact."""

    EXACT = "exact"  # rejection sampling: the output distribution is the target's
    TYPICAL = "typical"  # Medusa's typical acceptance: faster, not distribution-preserving


class FallbackRule(str, enum.Enum):
    """When a request stops speculating (see :mod:`triton_backend.speculation.controller`)."""

    GAIN = "gain"  # per round, from expected gain under the measured pass cost (resumes when it pays again)
    THRESHOLD = "threshold"  # the seed articles' rule: window acceptance below fallback_threshold -> plain for good


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens (or the model's context) reached
    EOS = "eos"  # an end-of-sequence token was generated
    STOP = "stop"  # a stop string or stop token sequence was generated


MAX_TOP_LOG_PROBS = 20  # alternatives per output token a request may ask for (OpenAI's top_logprobs limit)
TopLogProbs = tuple[tuple[int, ...], tuple[float, ...]]  # one position's most likely tokens and their log probs


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequestError(message)


MAX_TEMPERATURE = 2.0  # the OpenAI API's bound, the same on every path


def check_sampling_values(temperature: object = None, top_p: object = None, top_k: object = None) -> None:
    """The one check of a request's temperature, top-p and top-k, whatever path it came by
    (:class:`SamplingParams`; the tensorrtllm_backend front models before they apply TensorRT-LLM's
    greedy default; the OpenAI front). ``None``: not sent. Temperature: a finite number in
    [0, :data:`MAX_TEMPERATURE`]; top-p: in (0, 1]; top-k: an integer >= 0."""
    if temperature is not None:
        _require(_is_number(temperature) and 0 <= temperature <= MAX_TEMPERATURE,
                 f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}")
    if top_p is not None:
        _require(_is_number(top_p) and 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None:
        _require(_is_int(top_k) and top_k >= 0, f"top_k must be an integer >= 0, got {top_k!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters.

    ``temperature == 0`` (or ``top_k == 1``) means greedy decoding. ``top_k == 0``
    disables top-k; ``top_p == 1`` disables nucleus filtering. ``stop`` holds stop
    strings, ``stop_token_ids`` stop token sequences; neither appears in the output.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    # TensorRT-LLM's penalties (see triton_backend.core.sampling.LogitsProcessor): repetition over the
    # prompt and output tokens (multiplicative), presence / frequency over the output tokens (additive)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # the end tokens are masked until this many tokens are generated
    bad_words: tuple[str, ...] = ()  # strings, tokenized with the model's tokenizer
    bad_token_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never generated
    return_log_probs: bool = False  # per output token: see GenerationChunk.log_probs
    top_log_probs: int = 0  # with return_log_probs: the most likely tokens per position (GenerationChunk.top_log_probs)
    guide: Guide | None = None  # structured output: the output follows this JSON schema / regex / grammar

    def __post_init__(self) -> None:
        self._check_penalties()
        _require(_is_int(self.max_tokens) and self.max_tokens > 0, f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "top_k"):  # (None means "not sent" to the shared check only)
            _require(getattr(self, name) is not None, f"{name} must be set, got None")
        check_sampling_values(self.temperature, self.top_p, self.top_k)
        _require(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64), f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        _require(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
                 "stop must be a list of non-empty strings")
        _require(
            isinstance(self.stop_token_ids, (list, tuple))
            and all(isinstance(seq, (list, tuple)) and len(seq) > 0 and all(_is_int(t) and t >= 0 for t in seq)
                    for seq in self.stop_token_ids),
            "stop token sequences must be non-empty sequences of token ids >= 0",
        )
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(tuple(seq) for seq in self.stop_token_ids))

    def _check_penalties(self) -> None:
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                     f"{name} must be a finite number, got {value!r}")
        _require(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _require(isinstance(self.bad_words, (list, tuple)) and all(isinstance(s, str) and s for s in self.bad_words),
                 "bad_words must be a list of non-empty strings")
        _require(
            isinstance(self.bad_token_ids, (list, tuple))
            and all(isinstance(seq, (list, tuple)) and len(seq) > 0 and all(_is_int(t) and t >= 0 for t in seq)
                    for seq in self.bad_token_ids),
            "bad word token sequences must be non-empty sequences of token ids >= 0",
        )
        _require(isinstance(self.return_log_probs, bool), "return_log_probs must be true or false")
        _require(_is_int(self.top_log_probs) and 0 <= self.top_log_probs <= MAX_TOP_LOG_PROBS,
                 f"top_log_probs must be an integer in [0, {MAX_TOP_LOG_PROBS}], got {self.top_log_probs!r}")
        _require(self.top_log_probs == 0 or self.return_log_probs, "top_log_probs needs return_log_probs")
        _require(self.guide is None or isinstance(self.guide, Guide), "guide must be a Guide")
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_token_ids", tuple(tuple(seq) for seq in self.bad_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def history_dependent(self) -> bool:
        """Whether a token's distribution depends on the tokens before it beyond the model
        (penalties, min_tokens, bad words): the sampler then needs each row's history."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.bad_words) or bool(self.bad_token_ids))


def _finite(value: object, name: str) -> None:
    _config(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            f"{name} must be a finite number, got {value!r}")


def _enum_value(cls: type[E], value: object, name: str) -> E:
    try:
        return cls(value)
    except ValueError:
        names = " or ".join(m.value for m in cls)
        raise ConfigError(f"{name} must be {names}, got {value!r}") from None


@dataclass(frozen=True)
class DraftLengthConfig:
    """How many tokens a round drafts (every method)."""

    num_draft_tokens: int = setting(4, "draft length k: the upper bound under the gain rule or adaptive; "
                                       "0 = plain decoding")
    min_draft_tokens: int = setting(1, "the shortest draft the adaptive length picks (1..num_draft_tokens)")
    adaptive: bool = setting(False, "threshold rule / no fallback: pick the length from an EMA of the acceptance "
                                    "instead of always num_draft_tokens")
    verify_cost_per_token: float = setting(0.06, "the adaptive length's cost model: extra cost of verifying one "
                                                 "more token, in target steps")
    forced_tokens: int = setting(16, "structured output: up to this many tokens the request's grammar forces "
                                     "(keys, punctuation) are drafted for free before any drafter runs; 0: off")

    def __post_init__(self) -> None:
        _config(_is_int(self.num_draft_tokens) and 0 <= self.num_draft_tokens <= 64,
                f"num_draft_tokens must be in [0, 64], got {self.num_draft_tokens!r}")
        _config(_is_int(self.min_draft_tokens) and 1 <= self.min_draft_tokens <= max(1, self.num_draft_tokens),
                f"min_draft_tokens must be in [1, num_draft_tokens], got {self.min_draft_tokens!r}")
        _config(isinstance(self.adaptive, bool), "adaptive must be true or false")
        _finite(self.verify_cost_per_token, "verify_cost_per_token")
        _config(self.verify_cost_per_token >= 0, "verify_cost_per_token must be >= 0")
        _config(_is_int(self.forced_tokens) and 0 <= self.forced_tokens <= 64,
                f"forced_tokens must be in [0, 64], got {self.forced_tokens!r}")


@dataclass(frozen=True)
class FallbackConfig:
    """When a request stops (or pauses) speculating (every method; see :mod:`triton_backend.speculation.controller`)."""

    enabled: bool = setting(True, "false: always draft (k fixed, or the adaptive length, never 0)")
    rule: FallbackRule = setting(FallbackRule.GAIN, "gain: decide every round from expected gain under the measured "
                                                    "pass cost; threshold: the seed articles' window rule")
    threshold: float | None = setting(None, "threshold rule: window acceptance below this -> plain decoding for good "
                                            "(unset: 0.5); setting it selects the threshold rule")
    window: int = setting(200, "threshold rule: the last this many drafted tokens form the window")
    min_drafted: int = setting(50, "threshold rule: drafted tokens in the window before it may fall back")
    gain_margin: float = setting(0.03, "gain rule: draft only when the expected rate beats plain decoding by this "
                                       "fraction")
    prior_acceptance: float | None = setting(None, "gain rule: the acceptance estimate's start (unset: the drafter "
                                                   "type's prior, see speculation_policy)")
    prior_strength: float = setting(2.0, "gain rule: pseudo-observations behind the prior")
    acceptance_decay: float = setting(0.9, "gain rule: evidence kept per recorded round")
    probe_interval: int = setting(8, "gain rule: plain steps before a paused request probes again (doubling while "
                                     "probes do not pay)")

    def __post_init__(self) -> None:
        _config(isinstance(self.enabled, bool), "fallback enabled must be true or false")
        rule = _enum_value(FallbackRule, self.rule, "fallback rule")
        object.__setattr__(self, "rule", FallbackRule.THRESHOLD if self.threshold is not None else rule)
        if self.threshold is not None:
            _finite(self.threshold, "fallback threshold")
            _config(0 <= self.threshold <= 1, "fallback threshold must be in [0, 1] (or unset: break-even)")
        _config(_is_int(self.window) and self.window > 0, "fallback window must be a positive integer")
        _config(_is_int(self.min_drafted) and 0 < self.min_drafted <= self.window,
                "fallback min_drafted must be in [1, window]")
        for name in ("gain_margin", "prior_strength", "acceptance_decay") + (
                ("prior_acceptance",) if self.prior_acceptance is not None else ()):
            _finite(getattr(self, name), name)
        _config(0 <= self.gain_margin <= 1, "gain_margin must be in [0, 1]")
        _config(self.prior_acceptance is None or 0 <= self.prior_acceptance <= 1, "prior_acceptance must be in [0, 1]")
        _config(0 < self.prior_strength <= 1000, "prior_strength must be in (0, 1000]")
        _config(0 < self.acceptance_decay <= 1, "acceptance_decay must be in (0, 1]")
        _config(_is_int(self.probe_interval) and 1 <= self.probe_interval <= 4096, "probe_interval must be in [1, 4096]")


class CrossRequestContinuation(str, enum.Enum):
    """Which follower the cross-request index drafts after a match, one token at a time."""

    FREQUENT = "frequent"  # the follower seen most often after the matched text (ties: the latest)
    RECENT = "recent"  # the follower seen most recently


@dataclass(frozen=True)
class CrossRequestConfig:
    """N-gram lookup across requests (opt-in): a suffix index over the deployment's recent
    prompts and outputs. Outputs stay exact (it only proposes drafts), but a request's latency
    can reveal whether another request's text matched its own, as with prefix caching: enable it
    only where requests may share that much."""

    enabled: bool = setting(False, "true: also draft from the suffix index of recent requests (off by default)")
    max_tokens: int = setting(32768, "tokens of recent requests kept (prompts and outputs); the oldest go first")
    min_match: int = setting(2, "shortest suffix match (tokens) the index drafts from")
    continuation: CrossRequestContinuation = setting(CrossRequestContinuation.FREQUENT,
                                                     "frequent or recent: the follower drafted after a match")

    def __post_init__(self) -> None:
        _config(isinstance(self.enabled, bool), "cross_request enabled must be true or false")
        _config(_is_int(self.max_tokens) and 64 <= self.max_tokens <= 1 << 24,
                f"cross_request max_tokens must be in [64, {1 << 24}], got {self.max_tokens!r}")
        _config(_is_int(self.min_match) and 1 <= self.min_match <= 32,
                f"cross_request min_match must be in [1, 32], got {self.min_match!r}")
        object.__setattr__(self, "continuation", _enum_value(CrossRequestContinuation, self.continuation,
                                                             "cross_request continuation"))


@dataclass(frozen=True)
class NgramConfig:
    """N-gram / prompt lookup (``method: ngram``): draft what followed the latest match of the
    context's last n tokens (and, opted in, of the deployment's recent requests)."""

    method: ClassVar[SpeculationMode] = SpeculationMode.NGRAM
    min_n: int = setting(1, "shortest suffix matched (tokens)")
    max_n: int = setting(3, "longest suffix matched (tokens); longer matches are tried first")
    cross_request: CrossRequestConfig = setting(doc="lookup across the deployment's recent requests (opt-in)",
                                                factory=CrossRequestConfig)

    def __post_init__(self) -> None:
        _config(_is_int(self.min_n) and _is_int(self.max_n) and 1 <= self.min_n <= self.max_n,
                "need 1 <= ngram min_n <= max_n")
        _config(isinstance(self.cross_request, CrossRequestConfig), "ngram cross_request must be a CrossRequestConfig")


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads (``method: medusa``): a token tree verified in one target pass."""

    method: ClassVar[SpeculationMode] = SpeculationMode.MEDUSA
    tree_acceptance: TreeAcceptance = setting(TreeAcceptance.EXACT, "sampling: exact (rejection sampling, the "
                                              "target's distribution) or typical (Medusa's, faster, not "
                                              "distribution-preserving); greedy is always exact")
    typical_threshold: float = setting(0.09, "typical acceptance: accept x when p(x) > min(threshold, "
                                             "alpha * exp(-entropy))")
    typical_alpha: float = setting(0.3, "typical acceptance: alpha of the rule above")

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree_acceptance", _enum_value(TreeAcceptance, self.tree_acceptance, "tree_acceptance"))
        _finite(self.typical_threshold, "typical_threshold")
        _finite(self.typical_alpha, "typical_alpha")
        _config(0 < self.typical_threshold <= 1 and 0 < self.typical_alpha <= 1,
                "typical_threshold and typical_alpha must be in (0, 1]")


@dataclass(frozen=True)
class EagleConfig:
    """EAGLE drafting (``method: eagle``): chains, or dynamic trees verified in one target pass."""

    method: ClassVar[SpeculationMode] = SpeculationMode.EAGLE
    tree: bool = setting(True, "draft dynamic trees (EAGLE-2: the drafter's likeliest candidates, sized each round "
                               "by the gain rule; a chain when no tree pays); false: chains only")
    max_tree_nodes: int = setting(11, "the most nodes a tree carries into the target pass (11: with the root, the 12 rows the "
                                           "AVX-512 row kernel multiplies in one sweep of the weights)")
    tree_top_k: int = setting(4, "the most children per expanded node (and nodes expanded per level); the depth "
                                 "is at most draft_length.num_draft_tokens")
    merge_lookup: bool = setting(True, "auto: when both the n-gram match and the EAGLE tree pay, draft one tree "
                                       "holding both (the match as one branch) in the round's target pass")

    def __post_init__(self) -> None:
        _config(isinstance(self.tree, bool), "eagle tree must be true or false")
        _config(isinstance(self.merge_lookup, bool), "eagle merge_lookup must be true or false")
        _config(_is_int(self.max_tree_nodes) and 1 <= self.max_tree_nodes <= 64,
                f"max_tree_nodes must be in [1, 64], got {self.max_tree_nodes!r}")
        _config(_is_int(self.tree_top_k) and 1 <= self.tree_top_k <= 8, f"tree_top_k must be in [1, 8], got {self.tree_top_k!r}")


@dataclass(frozen=True)
class SpeculationConfig:
    """How the speculative loop proposes, verifies and falls back.

    ``method`` selects the drafter (a request may choose another the deployment has); the
    settings of each method with settings of its own sit in that method's config
    (:class:`NgramConfig`, :class:`MedusaConfig`, :class:`EagleConfig`; a draft model has none
    beyond its file, which is :class:`~triton_backend.deployment.deployment_config.DeploymentConfig` fields), the
    knobs every method shares in :class:`DraftLengthConfig` and :class:`FallbackConfig`.
    """

    method: SpeculationMode = setting(SpeculationMode.AUTO, "auto (the best drafter deployed), draft, ngram, "
                                                            "medusa, eagle or off")
    draft_length: DraftLengthConfig = setting(doc="draft length (every method)", factory=DraftLengthConfig)
    fallback: FallbackConfig = setting(doc="when to stop speculating (every method)", factory=FallbackConfig)
    ngram: NgramConfig = setting(doc="n-gram lookup's settings", factory=NgramConfig)
    medusa: MedusaConfig = setting(doc="Medusa tree verification's settings", factory=MedusaConfig)
    eagle: EagleConfig = setting(doc="EAGLE drafting's settings (chains or trees)", factory=EagleConfig)
    auto_drafter: SpeculationMode | None = setting(
        None, "auto's model drafter beside n-gram lookup when several are deployed: eagle, draft (a draft model "
              "or the target's own self draft) or medusa; unset: the first deployed of eagle, draft, medusa")

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", SpeculationMode.parse(self.method))
        if self.auto_drafter is not None:
            drafter = SpeculationMode.parse(self.auto_drafter)
            _config(drafter in AUTO_MODEL_DRAFTERS, f"speculation auto_drafter must be one of "
                    f"{[m.value for m in AUTO_MODEL_DRAFTERS]}, got {drafter.value!r}")
            object.__setattr__(self, "auto_drafter", drafter)
        for name, cls in (("draft_length", DraftLengthConfig), ("fallback", FallbackConfig), ("ngram", NgramConfig),
                          ("medusa", MedusaConfig), ("eagle", EagleConfig)):
            _config(isinstance(getattr(self, name), cls), f"speculation {name} must be a {cls.__name__}")

    def for_request(self, method: str | None = None, num_draft_tokens: int | None = None) -> "SpeculationConfig":
        """This config with a request's choices (``None``: the deployment's); a bad value is
        the request's error (:class:`~triton_backend.core.errors.InvalidRequestError`)."""
        try:
            spec = self if method is None else replace(self, method=method)
            if num_draft_tokens is None:
                return spec
            k = num_draft_tokens
            _config(_is_int(k) and 0 <= k <= 64, f"num_draft_tokens must be in [0, 64], got {k!r}")
            length = replace(spec.draft_length, num_draft_tokens=k,
                             min_draft_tokens=min(spec.draft_length.min_draft_tokens, max(1, k)))
            return replace(spec, draft_length=length)
        except ConfigError as exc:
            raise InvalidRequestError(str(exc)) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpeculationConfig":
        """Read from a deployment file's ``speculation`` section; the flat spelling of
        deployments written before the per-method configs is migrated (with a warning)."""
        if isinstance(data, Mapping) and any(key in _FLAT_SPELLING and not isinstance(value, Mapping)
                                             for key, value in data.items()):
            data = migrate_flat_speculation(data)
        return read_config(cls, data, "speculation")


# the flat SpeculationConfig's field -> (section, field) of the nested one
_FLAT_SPELLING: dict[str, tuple[str, str]] = {
    "mode": ("", "method"),
    **{name: ("draft_length", name) for name in ("num_draft_tokens", "min_draft_tokens", "adaptive",
                                                 "verify_cost_per_token")},
    "fallback": ("fallback", "enabled"), "fallback_rule": ("fallback", "rule"),
    "fallback_threshold": ("fallback", "threshold"), "fallback_window": ("fallback", "window"),
    "fallback_min_drafted": ("fallback", "min_drafted"),
    **{name: ("fallback", name) for name in ("gain_margin", "prior_acceptance", "prior_strength", "acceptance_decay",
                                             "probe_interval")},
    "ngram_min": ("ngram", "min_n"), "ngram_max": ("ngram", "max_n"),
    **{name: ("medusa", name) for name in ("tree_acceptance", "typical_threshold", "typical_alpha")},
}


def migrate_flat_speculation(data: Mapping[str, Any]) -> dict[str, Any]:
    """A flat ``speculation`` section (deployments written before the per-method configs) in
    the nested spelling. A key in neither spelling is left for the reader to refuse."""
    logger.warning("deployment: the flat speculation section is deprecated; read as the nested one "
                   "(method, draft_length, fallback, ngram, medusa)")
    out: dict[str, Any] = {}
    for key, value in data.items():
        section, name = _FLAT_SPELLING.get(key, ("", key))
        if not section:
            out[name] = dict(value) if isinstance(value, Mapping) else value  # filled below: the caller's stays
        elif isinstance(out.setdefault(section, {}), dict):
            out[section][name] = value
    return out


__all__ = ["CrossRequestConfig", "CrossRequestContinuation", "DraftLengthConfig", "FallbackConfig", "FallbackRule", "FinishReason",
           "MedusaConfig", "NgramConfig", "SamplingParams", "SpeculationConfig", "SpeculationMode", "TreeAcceptance",
           "migrate_flat_speculation", "MAX_TEMPERATURE", "MAX_TOP_LOG_PROBS", "TopLogProbs", "check_sampling_values"]
