"""What the ``trtllm`` runtime asks TensorRT-LLM's Executor for, as plain data.

Every request and executor setting is built here from the project's typed configs
(:class:`~triton_backend.core.config.SamplingParams`, :class:`~triton_backend.core.config.SpeculationConfig`,
:class:`~triton_backend.engines.trtllm.trtllm_config.TrtllmConfig`) without importing TensorRT-LLM;
:mod:`triton_backend.engines.trtllm.engine` turns the specs into
``tensorrt_llm.bindings.executor`` objects with the keyword arguments of ``kwargs()``.

One speculative round (the draft-target scheme of TensorRT-LLM's draft_tokens_external mode):

- draft request: the committed tokens, ``max_tokens = k``; with sampling and a draft engine,
  also the draft's generation logits;
- target request: the committed tokens, ``max_tokens = k + 1``, the ``k`` draft tokens (and
  logits) in ``external_draft_tokens_config``; the engine verifies them in one step and
  returns the accepted draft tokens plus one token of its own (recovered or bonus).

Greedy requests accept by token comparison: the output equals the target's greedy decoding.
Sampling requests get a fresh seed per request, derived from the request's seed, so rounds
never reuse one random stream.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from triton_backend.core.config import SamplingParams
from triton_backend.engines.trtllm.trtllm_config import TrtllmConfig
from triton_backend.core.eos import stopping_eos

NO_END_ID = -1  # TensorRT-LLM's end_id for "never stop at an end token" (ignore_eos)
_MASK64 = (1 << 64) - 1


class SeedRole(int, enum.Enum):
    """Whose random stream a derived seed feeds (so draft and target never share one)."""

    TARGET = 1
    DRAFT = 2


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(base: int, request_index: int, role: SeedRole) -> int:
    """The seed of the ``request_index``-th request of one generation (uint64)."""
    return _splitmix64(_splitmix64(base & _MASK64) ^ _splitmix64((request_index << 2) | int(role)))


@dataclass(frozen=True)
class SamplingSpec:
    """``tensorrt_llm.bindings.executor.SamplingConfig`` keyword arguments."""

    beam_width: int = 1
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    seed: int | None = None

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"beam_width": self.beam_width}
        for name in ("top_k", "top_p", "temperature", "seed"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def sampling_spec(params: SamplingParams, seed: int | None) -> SamplingSpec:
    """Greedy: ``top_k = 1``. Sampling: temperature, top-k (0 = off) and top-p (1.0 = off) as
    given, both set explicitly (with neither set TensorRT-LLM decodes greedily), and ``seed``."""
    if params.greedy:
        return SamplingSpec(top_k=1)
    if seed is None:
        raise ValueError("a sampling request needs a seed")
    return SamplingSpec(top_k=params.top_k, top_p=float(params.top_p), temperature=float(params.temperature), seed=seed)


@dataclass(frozen=True)
class OutputSpec:
    """``tensorrt_llm.bindings.executor.OutputConfig`` keyword arguments."""

    exclude_input_from_output: bool = True
    return_generation_logits: bool = False

    def kwargs(self) -> dict[str, Any]:
        return {"exclude_input_from_output": self.exclude_input_from_output,
                "return_generation_logits": self.return_generation_logits}


@dataclass(frozen=True)
class DraftTokensSpec:
    """``tensorrt_llm.bindings.executor.ExternalDraftTokensConfig`` keyword arguments.
    ``logits``: the draft's generation logits ``[len(tokens), vocab]`` (a torch tensor), or
    None for acceptance by token comparison."""

    tokens: tuple[int, ...]
    logits: Any = None
    acceptance_threshold: float | None = None

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": list(self.tokens)}
        if self.logits is not None:
            out["logits"] = self.logits
        if self.acceptance_threshold is not None:
            out["acceptance_threshold"] = self.acceptance_threshold
        return out


@dataclass(frozen=True)
class RequestSpec:
    """``tensorrt_llm.bindings.executor.Request`` keyword arguments; ``sampling``, ``output``
    and ``draft`` become its ``sampling_config``, ``output_config`` and
    ``external_draft_tokens_config``."""

    input_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingSpec
    end_id: int
    pad_id: int
    streaming: bool = False
    output: OutputSpec = field(default_factory=OutputSpec)
    draft: DraftTokensSpec | None = None

    def __post_init__(self) -> None:
        if not self.input_token_ids:
            raise ValueError("a request needs at least one input token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.draft is not None and self.max_tokens != len(self.draft.tokens) + 1:
            raise ValueError("a verification request generates exactly len(draft tokens) + 1 tokens")

    def kwargs(self) -> dict[str, Any]:
        """The plain keyword arguments (the nested configs are converted separately)."""
        return {"input_token_ids": list(self.input_token_ids), "max_tokens": self.max_tokens,
                "streaming": self.streaming, "end_id": self.end_id, "pad_id": self.pad_id}


@dataclass(frozen=True)
class EndIds:
    end_id: int
    pad_id: int


def end_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> EndIds:
    """The engine stops at the model's (first) EOS token unless the request ignores EOS; the
    runtime checks every EOS id and stop sequence itself as it commits tokens."""
    eos = sorted(int(t) for t in eos_token_ids)
    stops = sorted(stopping_eos(params, eos))
    return EndIds(stops[0] if stops else NO_END_ID, eos[0] if eos else 0)


def draft_request(tokens: Sequence[int], k: int, params: SamplingParams, ids: EndIds, seed: int | None,
                  want_logits: bool) -> RequestSpec:
    """Ask the draft engine for ``k`` tokens after ``tokens`` (with its logits when asked)."""
    return RequestSpec(tuple(tokens), k, sampling_spec(params, seed), ids.end_id, ids.pad_id,
                       output=OutputSpec(return_generation_logits=want_logits))


def target_request(tokens: Sequence[int], drafts: Sequence[int], params: SamplingParams, ids: EndIds,
                   seed: int | None, draft_logits: Any = None) -> RequestSpec:
    """Ask the target engine to verify ``drafts`` after ``tokens`` in one step (no drafts: one
    plain decoding step)."""
    draft = DraftTokensSpec(tuple(int(t) for t in drafts), draft_logits) if drafts else None
    return RequestSpec(tuple(tokens), len(drafts) + 1, sampling_spec(params, seed), ids.end_id, ids.pad_id, draft=draft)


def plain_request(tokens: Sequence[int], max_tokens: int, params: SamplingParams, ids: EndIds,
                  seed: int | None) -> RequestSpec:
    """A streaming request for up to ``max_tokens`` tokens (plain decoding; a Medusa engine
    speculates inside it)."""
    return RequestSpec(tuple(tokens), max_tokens, sampling_spec(params, seed), ids.end_id, ids.pad_id, streaming=True)


def count_accepted(drafts: Sequence[int], output: Sequence[int]) -> int:
    """How many draft tokens the target kept: the common prefix of the drafts and the
    target's output (which is the accepted drafts, then one token of the target's own,
    unless an end token ended it early)."""
    n = 0
    for d, o in zip(drafts, output):
        if d != o:
            break
        n += 1
    return n


@dataclass(frozen=True)
class KvCacheSpec:
    """``tensorrt_llm.bindings.executor.KvCacheConfig`` keyword arguments: block reuse lets
    each round's request reuse the KV cache of the prefix the previous round computed."""

    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float = 0.45

    def kwargs(self) -> dict[str, Any]:
        return {"enable_block_reuse": self.enable_block_reuse, "free_gpu_memory_fraction": self.free_gpu_memory_fraction}


@dataclass(frozen=True)
class ExecutorSpec:
    """``tensorrt_llm.bindings.executor.ExecutorConfig`` of one engine. ``medusa_choices``
    go into its ``DecodingConfig``; ``orchestrator``: the engine has several ranks, which the
    executor spawns itself (orchestrator mode) so one Triton process serves it."""

    kv_cache: KvCacheSpec
    max_beam_width: int = 1
    medusa_choices: tuple[tuple[int, ...], ...] | None = None
    orchestrator: bool = False

    def kwargs(self) -> dict[str, Any]:
        return {"max_beam_width": self.max_beam_width}


def executor_spec(config: TrtllmConfig, world_size: int,
                  medusa_choices: Sequence[Sequence[int]] | None = None) -> ExecutorSpec:
    choices = tuple(tuple(int(r) for r in c) for c in medusa_choices) if medusa_choices else None
    return ExecutorSpec(KvCacheSpec(True, float(config.kv_cache_free_gpu_memory_fraction)),
                        medusa_choices=choices, orchestrator=world_size > 1)


__all__ = [
    "NO_END_ID", "DraftTokensSpec", "EndIds", "ExecutorSpec", "KvCacheSpec", "OutputSpec", "RequestSpec",
    "SamplingSpec", "SeedRole", "count_accepted", "draft_request", "end_ids", "executor_spec", "plain_request",
    "request_seed", "sampling_spec", "target_request",
]
