"""What every decoder offers serving, and the request handling they share.

A :class:`Decoder` (the torch runtime's :class:`~triton_backend.speculation.torch_decoder.SpeculativeDecoder`,
the TensorRT-LLM runtime's :class:`~triton_backend.speculation.trtllm_loop.TrtllmSpeculativeDecoder`)
encodes a prompt, streams a generation chunk by chunk, and collects one into a result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol, Sequence

from triton_backend.speculation.commit import GenerationChunk
from triton_backend.core.config import FinishReason, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.core.errors import ContextLengthError, InvalidRequestError
from triton_backend.core.stats import GenerationStats

# AUTO picks the first of these the deployment has
AUTO_PREFERENCE = (SpeculationMode.EAGLE, SpeculationMode.DRAFT, SpeculationMode.MEDUSA, SpeculationMode.NGRAM)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    prompt_token_ids: list[int] = field(default_factory=list)


class Decoder(Protocol):
    """What serving needs of a decoder (``target``: its engine, or what the loop knows of it)."""

    tokenizer: Any
    speculation: SpeculationConfig

    @property
    def target(self) -> object: ...

    def encode(self, prompt: str | Sequence[int]) -> list[int]: ...

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 speculation: SpeculationConfig | None = None) -> GenerationResult: ...

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               speculation: SpeculationConfig | None = None) -> Iterator[GenerationChunk]: ...


def encode_prompt(prompt: str | Sequence[int], tokenizer: Any, vocab_size: int, max_context: int) -> list[int]:
    """Prompt token ids, checked: not empty, in the vocabulary, leaving room for one token."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        if tokenizer is None:
            raise InvalidRequestError("this decoder has no tokenizer; pass token ids")
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequestError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_context:
        raise ContextLengthError(
            f"prompt has {len(ids)} tokens; the model's context is {max_context} "
            "and at least one token must be generated"
        )
    return ids


def resolve_mode(mode: SpeculationMode, available: Iterable[SpeculationMode],
                 prefer: SpeculationMode | None = None) -> SpeculationMode:
    """The mode a request runs in: ``auto`` picks ``prefer`` (``SpeculationConfig.auto_drafter``)
    when it is deployed, else by :data:`AUTO_PREFERENCE` (``off`` when the deployment has no
    drafter); any other mode must be deployed."""
    have = list(available)
    if mode is SpeculationMode.OFF:
        return mode
    if mode is SpeculationMode.AUTO:
        if prefer is not None and prefer in have:
            return prefer
        return next((m for m in AUTO_PREFERENCE if m in have), SpeculationMode.OFF)
    if mode not in have:
        names = ", ".join(m.value for m in have) or "none"
        raise InvalidRequestError(f"speculation mode {mode.value!r} is not available in this deployment (available: {names})")
    return mode


def collect(prompt_ids: list[int], chunks: Iterable[GenerationChunk]) -> GenerationResult:
    """A whole generation from its chunks."""
    tokens: list[int] = []
    text: list[str] = []
    last: GenerationChunk | None = None
    for chunk in chunks:
        tokens.extend(chunk.token_ids)
        text.append(chunk.text)
        last = chunk
    assert last is not None and last.finish_reason is not None and last.stats is not None
    return GenerationResult("".join(text), tokens, last.finish_reason, last.stats, prompt_ids)


__all__ = ["AUTO_PREFERENCE", "Decoder", "GenerationResult", "collect", "encode_prompt", "resolve_mode"]
