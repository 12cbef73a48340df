"""The benchmark's rows: our runtime's methods, the peer's (transformers generate), and
the same requests through a real Triton server."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch

from builder.bench.config import BenchPrompt, Sample
from triton_backend.core.config import SamplingParams, SpeculationConfig
from triton_backend.core.eos import eos_token_ids
from triton_backend.speculation.torch_decoder import SpeculativeDecoder


@dataclass
class RowResult:
    tokens: list[int]  # empty where only text comes back (Triton)
    latency_s: float
    ttft_s: float
    stats: dict | None = None  # our GenerationStats.to_dict(); None for the peer
    text: str | None = None  # None: decode ``tokens``
    num_tokens: int | None = None  # None: len(tokens)


class Row(Protocol):
    name: str
    info: dict

    def run(self, prompt: BenchPrompt, max_tokens: int, ignore_eos: bool) -> RowResult: ...


@dataclass
class OursRow:
    name: str
    decoder: SpeculativeDecoder
    speculation: SpeculationConfig
    info: dict = field(default_factory=dict)

    def run(self, prompt: BenchPrompt, max_tokens: int, ignore_eos: bool) -> RowResult:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        start = time.perf_counter()
        result = self.decoder.generate(prompt.ids, params, self.speculation)
        latency = time.perf_counter() - start
        return RowResult(result.token_ids, latency, result.stats.time_to_first_token_s, result.stats.to_dict())


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


SETTLE_S = 0.03  # after a multi-threaded torch block (libgomp's workers spin ~1-4 ms before they sleep)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block (a peer measured on as many CPU
    threads as our engine's row kernel uses), restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        if count > 1:  # torch's OpenMP workers spin a few ms after their last region: let them sleep first,
            time.sleep(SETTLE_S)  # or the next engine timed shares the cores with them


@dataclass
class PeerRow:
    """transformers ``generate``: plain greedy, assisted generation or prompt lookup, on
    ``threads`` torch threads (our engine's count: a fair comparison)."""

    name: str
    model: Any
    kwargs: dict
    info: dict = field(default_factory=dict)
    threads: int = 1

    def run(self, prompt: BenchPrompt, max_tokens: int, ignore_eos: bool) -> RowResult:
        ids = torch.tensor([prompt.ids], device=self.model.device)
        clock = _FirstTokenClock()
        # ignore_eos: transformers has no "generate EOS but keep going"; min_new_tokens masks EOS
        # instead, so past an EOS the peer's text differs from ours (reported as not identical)
        fixed = {"min_new_tokens": max_tokens} if ignore_eos else {}
        start = time.perf_counter()
        with torch.inference_mode(), torch_threads(self.threads):
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, streamer=clock, pad_token_id=0, **fixed, **self.kwargs)
            latency = time.perf_counter() - start  # (before the threads settle)
        ttft = (clock.first - start) if clock.first is not None else latency
        tokens = out[0, len(prompt.ids):].tolist()
        if not ignore_eos and tokens and tokens[-1] in eos_token_ids(self.model.generation_config):
            tokens.pop()  # transformers returns the EOS it stopped at; ours reports it as the finish reason
        return RowResult(tokens, latency, ttft)


@dataclass
class TritonRow:
    """The same request end to end through a real Triton server (gRPC streaming)."""

    name: str
    url: str
    speculation: str
    num_draft_tokens: int | None = None
    info: dict = field(default_factory=dict)

    def run(self, prompt: BenchPrompt, max_tokens: int, ignore_eos: bool) -> RowResult:
        from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, generate

        request = GenerateRequest(prompt=prompt.text, max_tokens=max_tokens, speculation=self.speculation,
                                  num_draft_tokens=self.num_draft_tokens, stream=True, ignore_eos=ignore_eos)
        result = generate(ClientConfig(self.url, ClientProtocol.GRPC), request)
        return RowResult([], result.latency_s, result.time_to_first_chunk_s, None, text=result.text,
                         num_tokens=int(result.stats.get("num_output_tokens", 0)))


def is_speculative_row(info: dict) -> bool:
    """One of our in-process speculative rows (not plain, not the peer, not the Triton or
    unpacked comparison rows): the rows the headline's speculation figures are taken over."""
    return info.get("kind") == "ours" and info.get("method") not in (None, "off") and info.get("packed", True)


def run_sample(row: Row, prompt: BenchPrompt, repeat: int, max_tokens: int, ignore_eos: bool, tokenizer: Any) -> Sample:
    r = row.run(prompt, max_tokens, ignore_eos)
    text = r.text if r.text is not None else tokenizer.decode(r.tokens, skip_special_tokens=True)
    num_tokens = len(r.tokens) if r.num_tokens is None else r.num_tokens
    return Sample(row.name, prompt.workload, prompt.index, repeat, r.tokens, text, num_tokens, r.latency_s, r.ttft_s, r.stats)
