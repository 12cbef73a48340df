"""One parsed request, as the service and its responses read it."""

from __future__ import annotations

from dataclasses import dataclass

from triton_backend.core.config import SamplingParams, SpeculationConfig
from triton_backend.speculation.drafters.client import ClientDraft


@dataclass(frozen=True)
class ServingRequest:
    """One parsed request. ``prompt`` is text, or token ids for the token-level interface
    (``token_level``: ``input_ids`` in, ``output_ids`` out); both go to
    :meth:`Decoder.encode` as they are."""

    prompt: str | tuple[int, ...]
    sampling: SamplingParams
    speculation: SpeculationConfig
    stream: bool = False
    chat: bool = False
    include_prompt: bool = False  # exclude_input_in_output = false: the output starts with the prompt as sent
    token_level: bool = False
    return_perf_metrics: bool = False
    arrival_ns: int = 0  # time.time_ns() when parsed (perf metrics)
    client_draft: ClientDraft | None = None  # draft_input_ids (+ draft_logits): verified instead of a drafter's
    namespace: str = ""  # prefix_cache_namespace: the prefix cache shares keys and values only within it


__all__ = ["ServingRequest"]
