"""Typed configuration for one generation: sampling parameters and speculation settings.

Every field is validated at construction; a bad value raises
:class:`~triton_backend.errors.InvalidRequestError` with a short message.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from triton_backend.errors import InvalidRequestError


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
            raise InvalidRequestError(f"unknown speculation mode {value!r}; expected one of: {names}") from None


class TreeAcceptance(str, enum.Enum):
    """How a draft tree (Medusa) is verified when sampling; greedy is always exact."""

    EXACT = "exact"  # rejection sampling: the output distribution is the target's
    TYPICAL = "typical"  # Medusa's typical acceptance: faster, not distribution-preserving


class FallbackRule(str, enum.Enum):
    """When a request stops speculating (see :mod:`triton_backend.controller`)."""

    GAIN = "gain"  # per round, from expected gain under the measured pass cost (resumes when it pays again)
    THRESHOLD = "threshold"  # the seed articles' rule: window acceptance below fallback_threshold -> plain for good


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens (or the model's context) reached
    EOS = "eos"  # an end-of-sequence token was generated
    STOP = "stop"  # a stop string or stop token sequence was generated


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequestError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    # TensorRT-LLM's penalties (see triton_backend.sampling.LogitsProcessor): repetition over the
    # prompt and output tokens (multiplicative), presence / frequency over the output tokens (additive)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # the end tokens are masked until this many tokens are generated
    bad_words: tuple[str, ...] = ()  # strings, tokenized with the model's tokenizer
    bad_token_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never generated
    return_log_probs: bool = False  # per output token: see GenerationChunk.log_probs

    def __post_init__(self) -> None:
        self._check_penalties()
        _require(_is_int(self.max_tokens) and self.max_tokens > 0, f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _require(
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        _require(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _require(
            isinstance(self.top_p, (int, float)) and math.isfinite(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
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


@dataclass(frozen=True)
class SpeculationConfig:
    """How the speculative loop proposes, verifies and falls back.

    ``num_draft_tokens`` is the draft length k (the upper bound under the gain rule or
    ``adaptive``). ``fallback`` off: always draft (k fixed, or adaptive without stopping).
    ``fallback_rule`` ``gain`` (the default): every round, draft only the length whose
    expected committed tokens per unit of pass cost beat a plain step by ``gain_margin``,
    from an acceptance estimate that starts at ``prior_acceptance`` (None: the drafter
    type's prior) with ``prior_strength`` pseudo-observations and whose evidence decays by
    ``acceptance_decay`` a round; a paused request probes again after ``probe_interval``
    plain steps (doubling while probes do not pay). ``threshold``: over a sliding window of
    the last ``fallback_window`` drafted tokens, once at least ``fallback_min_drafted`` have
    been drafted, the request decodes plainly for good when the window's acceptance is below
    ``fallback_threshold`` (0.5 when unset; setting a threshold selects this rule).
    """

    mode: SpeculationMode = SpeculationMode.AUTO
    num_draft_tokens: int = 4
    adaptive: bool = False
    min_draft_tokens: int = 1
    fallback: bool = True
    fallback_window: int = 200
    fallback_threshold: float | None = None  # set: the threshold rule with this acceptance bar
    fallback_min_drafted: int = 50
    fallback_rule: FallbackRule = FallbackRule.GAIN
    gain_margin: float = 0.03  # draft only when the expected rate beats plain decoding by this fraction
    prior_acceptance: float | None = None  # None: the drafter type's prior (speculation_policy)
    prior_strength: float = 2.0  # pseudo-observations behind the prior
    acceptance_decay: float = 0.9  # evidence kept per recorded round
    probe_interval: int = 8  # plain steps before a paused request probes again
    ngram_min: int = 1
    ngram_max: int = 3
    verify_cost_per_token: float = 0.06  # extra cost of verifying one more token, in target steps
    tree_acceptance: TreeAcceptance = TreeAcceptance.EXACT
    typical_threshold: float = 0.09  # typical acceptance: p(x) > min(threshold, alpha * exp(-entropy))
    typical_alpha: float = 0.3

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", SpeculationMode.parse(self.mode))
        for name in ("fallback_threshold", "verify_cost_per_token", "typical_threshold", "typical_alpha"):
            value = getattr(self, name)
            if name == "fallback_threshold" and value is None:
                continue
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                     f"{name} must be a finite number, got {value!r}")
        try:
            object.__setattr__(self, "tree_acceptance", TreeAcceptance(self.tree_acceptance))
        except ValueError:
            raise InvalidRequestError(f"tree_acceptance must be exact or typical, got {self.tree_acceptance!r}") from None
        _require(0 < self.typical_threshold <= 1 and 0 < self.typical_alpha <= 1,
                 "typical_threshold and typical_alpha must be in (0, 1]")
        _require(_is_int(self.num_draft_tokens) and 0 <= self.num_draft_tokens <= 64, f"num_draft_tokens must be in [0, 64], got {self.num_draft_tokens!r}")
        _require(
            _is_int(self.min_draft_tokens) and 1 <= self.min_draft_tokens <= max(1, self.num_draft_tokens),
            f"min_draft_tokens must be in [1, num_draft_tokens], got {self.min_draft_tokens!r}",
        )
        _require(_is_int(self.fallback_window) and self.fallback_window > 0, "fallback_window must be a positive integer")
        _require(self.fallback_threshold is None or 0 <= self.fallback_threshold <= 1,
                 "fallback_threshold must be in [0, 1] (or unset: break-even)")
        _require(
            _is_int(self.fallback_min_drafted) and 0 < self.fallback_min_drafted <= self.fallback_window,
            "fallback_min_drafted must be in [1, fallback_window]",
        )
        _require(_is_int(self.ngram_min) and _is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max, "need 1 <= ngram_min <= ngram_max")
        _require(self.verify_cost_per_token >= 0, "verify_cost_per_token must be >= 0")
        self._check_gain_rule()

    def _check_gain_rule(self) -> None:
        try:
            rule = FallbackRule(self.fallback_rule)
        except ValueError:
            raise InvalidRequestError(f"fallback_rule must be gain or threshold, got {self.fallback_rule!r}") from None
        if self.fallback_threshold is not None:
            rule = FallbackRule.THRESHOLD
        object.__setattr__(self, "fallback_rule", rule)
        for name in ("gain_margin", "prior_strength", "acceptance_decay") + (("prior_acceptance",) if self.prior_acceptance is not None else ()):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                     f"{name} must be a finite number, got {value!r}")
        _require(0 <= self.gain_margin <= 1, "gain_margin must be in [0, 1]")
        _require(self.prior_acceptance is None or 0 <= self.prior_acceptance <= 1, "prior_acceptance must be in [0, 1]")
        _require(0 < self.prior_strength <= 1000, "prior_strength must be in (0, 1000]")
        _require(0 < self.acceptance_decay <= 1, "acceptance_decay must be in (0, 1]")
        _require(_is_int(self.probe_interval) and 1 <= self.probe_interval <= 4096, "probe_interval must be in [1, 4096]")

    def with_overrides(self, **changes: object) -> "SpeculationConfig":
        """A copy with the given fields replaced (``None`` values are ignored)."""
        from dataclasses import replace

        return replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class RuntimeConfig:
    """How the torch runtime runs: device, dtype, torch threads, how many rows the CPU
    float32 linear layers are prepacked for (0: not packed; see ``engines/packed_linear.py``),
    and the slot engine's KV cache (``max_batch_size`` slots x ``max_seq_len`` positions)."""

    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 1
    packed_gemm_rows: int = 8
    # the slot engine (engines/llama_engine.py): KV-cache slots (concurrent sequences) x positions
    max_batch_size: int = 16
    max_seq_len: int = 2048
    batch_invariant: bool = False  # pad one-row passes too: every row bit-identical batched or alone
    row_kernel: bool = True  # CPU float32, one thread: the row-invariant matmul kernel (engines/row_gemm.py) where it builds
    torch_engine: str = "auto"  # auto: the compact Llama forward where it covers the model, else hf

    def __post_init__(self) -> None:
        _require(_is_int(self.max_batch_size) and 1 <= self.max_batch_size <= 4096,
                 f"max_batch_size (KV-cache slots) must be in [1, 4096], got {self.max_batch_size!r}")
        _require(_is_int(self.max_seq_len) and 1 <= self.max_seq_len <= 1 << 20,
                 f"max_seq_len must be in [1, 2^20], got {self.max_seq_len!r}")
        _require(isinstance(self.batch_invariant, bool), "batch_invariant must be true or false")
        _require(isinstance(self.row_kernel, bool), "row_kernel must be true or false")
        _require(self.torch_engine in ("auto", "llama", "hf"), f"torch_engine must be auto, llama or hf, got {self.torch_engine!r}")
        _require(_is_int(self.packed_gemm_rows) and (self.packed_gemm_rows == 0 or 4 <= self.packed_gemm_rows <= 64),
                 f"packed_gemm_rows must be 0 (off) or 4..64, got {self.packed_gemm_rows!r}")
        _require(self.dtype in ("float32", "float16", "bfloat16"), f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        _require(_is_int(self.num_threads) and self.num_threads >= 1, "num_threads must be >= 1")


__all__ = ["FallbackRule", "FinishReason", "RuntimeConfig", "SamplingParams", "SpeculationConfig", "SpeculationMode", "TreeAcceptance"]
