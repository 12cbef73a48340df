"""One request's responses, from its generation chunks: text level (``text_output``) or token
level (``output_ids`` / ``sequence_length``), streamed or whole, plus the outputs that
``return_perf_metrics`` asks for. Plain numpy; the serving loop (or the batch scheduler's
request handle) calls :meth:`ResponseBuilder.partial` for every chunk that is not the last and
:meth:`ResponseBuilder.final` for the last one.
"""

from __future__ import annotations

import time
import numpy as np

from triton_backend.speculation.commit import GenerationChunk
from triton_backend.core.stats import GenerationStats
from triton_backend.serving.tensors import TritonType as T
from triton_backend.serving.tensors import array_tensor, scalar_tensor, string_tensor
from triton_backend.serving.interface import (
    ACCEPTANCE_RATE, FALLBACK, FINISH_REASON, METHOD, NUM_OUTPUT_TOKENS, TARGET_PASSES, TEXT_OUTPUT, TOTAL_ACCEPTED,
    TOTAL_DRAFT,
)
from triton_backend.serving.request import ServingRequest
from triton_backend.serving.trtllm_interface import (
    ARRIVAL_NS, BATCH_INDEX, CUM_LOG_PROBS, OUTPUT_LOG_PROBS, OUTPUT_TOP_IDS, OUTPUT_TOP_LOG_PROBS, FIRST_SCHEDULED_NS, FIRST_TOKEN_NS, KV_NEW_BLOCKS, KV_REUSED_BLOCKS, KV_TOTAL_BLOCKS,
    LAST_TOKEN_NS, OUTPUT_IDS, SEQUENCE_INDEX, SEQUENCE_LENGTH,
)

Outputs = dict[str, np.ndarray]


def token_outputs(ids: list[int]) -> Outputs:
    """``output_ids`` [1, beam=1, n] and ``sequence_length`` [1, 1]."""
    return {OUTPUT_IDS.name: np.asarray([[ids]], dtype=np.int32).reshape(1, 1, len(ids)),
            SEQUENCE_LENGTH.name: array_tensor([len(ids)], T.INT32)}


def log_prob_outputs(log_probs: list[float], cumulative: float) -> Outputs:
    """``output_log_probs`` [1, beam=1, n] (the tokens of this response) and ``cum_log_probs``
    [1, 1] (the sum over every output token so far)."""
    return {OUTPUT_LOG_PROBS.name: np.asarray(log_probs, dtype=np.float32).reshape(1, 1, len(log_probs)),
            CUM_LOG_PROBS.name: np.asarray([[cumulative]], dtype=np.float32)}


def top_log_prob_outputs(top: list[tuple[tuple[int, ...], tuple[float, ...]]], k: int) -> Outputs:
    """``output_top_ids`` / ``output_top_log_probs`` [1, beam=1, n, k]: per output token of this
    response, the ``k`` most likely tokens and their log probabilities."""
    ids = np.asarray([list(i) for i, _ in top], dtype=np.int32).reshape(1, 1, len(top), k)
    values = np.asarray([list(v) for _, v in top], dtype=np.float32).reshape(1, 1, len(top), k)
    return {OUTPUT_TOP_IDS.name: ids, OUTPUT_TOP_LOG_PROBS.name: values}


def index_outputs() -> Outputs:
    """One prompt per request and one sequence: both indexes are 0."""
    return {BATCH_INDEX.name: scalar_tensor(0, T.INT32), SEQUENCE_INDEX.name: scalar_tensor(0, T.INT32)}


def final_outputs(text: str, chunk: GenerationChunk) -> dict[str, np.ndarray]:
    """The last response: text plus the request's acceptance statistics."""
    stats = chunk.stats or GenerationStats()
    reason = chunk.finish_reason.value if chunk.finish_reason is not None else ""
    return {
        TEXT_OUTPUT.name: string_tensor(text),
        ACCEPTANCE_RATE.name: scalar_tensor(stats.acceptance_rate, T.FP32),
        TOTAL_ACCEPTED.name: scalar_tensor(stats.accepted_tokens, T.INT32),
        TOTAL_DRAFT.name: scalar_tensor(stats.drafted_tokens, T.INT32),
        TARGET_PASSES.name: scalar_tensor(stats.target_passes, T.INT32),
        FALLBACK.name: scalar_tensor(stats.fallback, T.BOOL),
        NUM_OUTPUT_TOKENS.name: scalar_tensor(stats.generated_tokens, T.INT32),
        METHOD.name: string_tensor(stats.method),
        FINISH_REASON.name: string_tensor(reason),
    }


class ResponseBuilder:
    """Turns one request's chunks into response tensors (see the module doc)."""

    def __init__(self, request: ServingRequest) -> None:
        self.request = request
        self.pieces: list[str] = [request.prompt] if request.include_prompt and not request.token_level else []
        self.ids: list[int] = list(request.prompt) if request.include_prompt and request.token_level else []
        self.first_token_ns: int | None = None
        self.log_probs: list[float] = []  # not sent yet (return_log_probs)
        self.log_prob_ids: list[int] = []  # their tokens (sent as output_ids by a text-level request)
        self.top_log_probs: list[tuple[tuple[int, ...], tuple[float, ...]]] = []  # their alternatives (top_log_probs)
        self.cum_log_prob = 0.0

    def partial(self, chunk: GenerationChunk) -> Outputs | None:
        """What to send now for a chunk that is not the last (``None``: nothing yet)."""
        self._saw(chunk)
        if not self.request.stream:
            self.pieces.append(chunk.text)
            self.ids.extend(chunk.token_ids)
            return None
        if self.request.token_level:
            if not chunk.token_ids:
                return None
            return {**token_outputs(list(chunk.token_ids)), **index_outputs(), **self._log_probs(),
                    **self._perf_so_far(chunk)}
        if not chunk.text:
            return None
        out = {"text_output": string_tensor("".join(self.pieces) + chunk.text), **index_outputs(), **self._log_probs(),
               **self._perf_so_far(chunk)}
        self.pieces.clear()
        return out

    def final(self, chunk: GenerationChunk) -> Outputs:
        """The last response: the rest of the output, the request's statistics, perf metrics."""
        self._saw(chunk)
        text = "".join(self.pieces) + chunk.text
        out = final_outputs(text, chunk)
        if self.request.token_level:
            del out["text_output"]
            out.update(token_outputs(self.ids + list(chunk.token_ids)))
        out.update(index_outputs())
        out.update(self._log_probs())
        if self.request.return_perf_metrics:
            out.update(self._perf(chunk.stats or GenerationStats()))
        return out

    def _saw(self, chunk: GenerationChunk) -> None:
        if chunk.token_ids and self.first_token_ns is None:
            self.first_token_ns = time.time_ns()
        if chunk.log_probs:
            self.log_probs.extend(chunk.log_probs)
            self.log_prob_ids.extend(chunk.token_ids[:len(chunk.log_probs)])
            self.top_log_probs.extend(chunk.top_log_probs or [])
            self.cum_log_prob += float(sum(chunk.log_probs))

    def _log_probs(self) -> Outputs:
        """The log probabilities not sent yet, when the request asked for them; a text-level
        request gets their tokens too (``output_ids``, one per log probability: what the OpenAI
        front needs to name each token)."""
        if not self.request.sampling.return_log_probs:
            return {}
        out = log_prob_outputs(self.log_probs, self.cum_log_prob)
        if not self.request.token_level:
            out[OUTPUT_IDS.name] = token_outputs(self.log_prob_ids)[OUTPUT_IDS.name]
        if self.request.sampling.top_log_probs:
            out.update(top_log_prob_outputs(self.top_log_probs, self.request.sampling.top_log_probs))
        self.log_probs, self.log_prob_ids, self.top_log_probs = [], [], []
        return out

    def _perf_so_far(self, chunk: GenerationChunk) -> Outputs:
        """A streamed response's perf outputs (as TensorRT-LLM sends them on every response):
        timings and the acceptance counts so far."""
        if not self.request.return_perf_metrics:
            return {}
        stats = chunk.stats or GenerationStats()
        return {**self._perf(stats), ACCEPTANCE_RATE.name: scalar_tensor(stats.acceptance_rate, T.FP32),
                TOTAL_ACCEPTED.name: scalar_tensor(stats.accepted_tokens, T.INT32),
                TOTAL_DRAFT.name: scalar_tensor(stats.drafted_tokens, T.INT32)}

    def _perf(self, stats: GenerationStats) -> Outputs:
        """TensorRT-LLM's per-request perf outputs with specbuild's values: no paged KV cache
        (a slot per sequence), so no blocks are allocated or reused; the scheduling time is
        the arrival (admission is not recorded separately)."""
        now = time.time_ns()
        arrival = self.request.arrival_ns
        values = {KV_NEW_BLOCKS: 0, KV_REUSED_BLOCKS: 0, KV_TOTAL_BLOCKS: 0, ARRIVAL_NS: arrival,
                  FIRST_SCHEDULED_NS: arrival, FIRST_TOKEN_NS: self.first_token_ns or now, LAST_TOKEN_NS: now}
        return {spec.name: scalar_tensor(value, spec.dtype) for spec, value in values.items()}


__all__ = ["ResponseBuilder", "index_outputs", "log_prob_outputs", "token_outputs", "top_log_prob_outputs"]
