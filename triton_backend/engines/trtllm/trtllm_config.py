"""Typed configuration of a deployment's engine runtime (``torch`` or ``trtllm``).

The ``trtllm`` runtime serves compiled TensorRT-LLM engines through TensorRT-LLM's Executor
API (see :mod:`triton_backend.engines.trtllm.engine`). :class:`TrtllmConfig` names the engine
folders ``trtllm-build`` wrote and says what kind of target engine it is:

- ``draft_tokens_external``: built with ``--speculative_decoding_mode draft_tokens_external``;
  it verifies draft tokens handed to it with each request (from a draft engine or from n-gram
  lookup) and returns the accepted ones plus one token of its own;
- ``medusa``: built with ``--speculative_decoding_mode medusa``; it drafts and verifies its own
  token tree in every step.

Nothing here imports TensorRT-LLM: the config is plain data, valid on any machine.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Callable

from triton_backend.core.errors import ConfigError


class EngineRuntime(str, enum.Enum):
    """Which runtime serves the deployment's models."""

    TORCH = "torch"  # Hugging Face models in torch (CPU or CUDA): runs everywhere
    TRTLLM = "trtllm"  # compiled TensorRT-LLM engines: needs TensorRT-LLM and a GPU

    @classmethod
    def parse(cls, value: "str | EngineRuntime") -> "EngineRuntime":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ConfigError(f"unknown engine runtime {value!r}; expected torch or trtllm") from None


class TrtllmTargetKind(str, enum.Enum):
    """How the target engine was compiled (``trtllm-build --speculative_decoding_mode``)."""

    DRAFT_TOKENS_EXTERNAL = "draft_tokens_external"  # verifies draft tokens given with each request
    MEDUSA = "medusa"  # drafts and verifies its own Medusa tree


@dataclass(frozen=True)
class TrtllmConfig:
    """The compiled engines of a ``trtllm`` deployment.

    ``target_engine`` / ``draft_engine``: folders holding ``config.json`` and
    ``rank<N>.engine`` (``trtllm-build --output_dir``). ``kv_cache_free_gpu_memory_fraction``:
    the share of the GPU memory still free when an engine loads that its paged KV cache takes
    (the target loads first, then the draft). ``use_draft_logits``: when sampling with a draft
    engine, hand the draft's logits to the target so it accepts by the ratio of the two
    models' probabilities (rejection sampling) instead of by token comparison.
    ``response_timeout_s``: the longest wait for one engine response.
    """

    target_engine: str
    target_kind: TrtllmTargetKind = TrtllmTargetKind.DRAFT_TOKENS_EXTERNAL
    draft_engine: str | None = None
    kv_cache_free_gpu_memory_fraction: float = 0.45
    use_draft_logits: bool = True
    response_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "target_kind", TrtllmTargetKind(self.target_kind))
        except ValueError:
            kinds = ", ".join(k.value for k in TrtllmTargetKind)
            raise ConfigError(f"trtllm target_kind must be one of: {kinds}; got {self.target_kind!r}") from None
        if not isinstance(self.target_engine, str) or not self.target_engine:
            raise ConfigError("trtllm target_engine must name the target's engine folder")
        if self.draft_engine is not None and (not isinstance(self.draft_engine, str) or not self.draft_engine):
            raise ConfigError("trtllm draft_engine must name the draft's engine folder (or be left out)")
        if self.target_kind is TrtllmTargetKind.MEDUSA and self.draft_engine is not None:
            raise ConfigError("a Medusa target engine drafts for itself; it takes no draft engine")
        fraction = self.kv_cache_free_gpu_memory_fraction
        if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ConfigError(f"kv_cache_free_gpu_memory_fraction must be in (0, 1), got {fraction!r}")
        timeout = self.response_timeout_s
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ConfigError(f"response_timeout_s must be a positive number, got {timeout!r}")

    def with_paths(self, resolve: Callable[[str | None], str | None]) -> "TrtllmConfig":
        """A copy whose engine folders went through ``resolve`` (e.g. made absolute)."""
        return replace(self, target_engine=resolve(self.target_engine) or self.target_engine,
                       draft_engine=resolve(self.draft_engine))


__all__ = ["EngineRuntime", "TrtllmConfig", "TrtllmTargetKind"]
