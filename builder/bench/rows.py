"""The benchmark's rows: our runtime's methods and the peer's (transformers generate)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from builder.bench.config import Sample
from triton_backend.config import SamplingParams, SpeculationConfig
from triton_backend.generation import SpeculativeDecoder


class Row(Protocol):
    name: str
    info: dict

    def run(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float, float, dict | None]:
        """(generated tokens, latency s, time to first token s, stats or None)."""


@dataclass
class OursRow:
    name: str
    decoder: SpeculativeDecoder
    speculation: SpeculationConfig
    info: dict = field(default_factory=dict)

    def run(self, prompt_ids: list[int], max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        result = self.decoder.generate(prompt_ids, params, self.speculation)
        latency = time.perf_counter() - start
        return result.token_ids, latency, result.stats.time_to_first_token_s, result.stats.to_dict()


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class PeerRow:
    """transformers ``generate``: plain greedy, assisted generation or prompt lookup."""

    name: str
    model: Any
    kwargs: dict
    info: dict = field(default_factory=dict)

    def run(self, prompt_ids: list[int], max_tokens: int):
        ids = torch.tensor([prompt_ids])
        clock = _FirstTokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, streamer=clock,
                                      pad_token_id=0, **self.kwargs)
        latency = time.perf_counter() - start
        ttft = (clock.first - start) if clock.first is not None else latency
        return out[0, len(prompt_ids):].tolist(), latency, ttft, None


def run_sample(row: Row, workload: str, index: int, repeat: int, prompt_ids: list[int], max_tokens: int) -> Sample:
    tokens, latency, ttft, stats = row.run(prompt_ids, max_tokens)
    return Sample(row.name, workload, index, repeat, tokens, latency, ttft, stats)
