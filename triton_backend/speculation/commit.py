"""Committing verified tokens: one request's output, as every loop builds it.

A :class:`Commit` holds what a generation has produced so far (the prompt plus the committed
tokens, the stop checker, the incremental detokenizer, log probabilities and statistics).
:meth:`Commit.commit` takes one verified block, commits it token by token through the stop
checker (so a stop inside the block truncates exactly there) and returns the chunk to
stream. The torch loop, the batch scheduler's rows and the TensorRT-LLM loop all commit
through it. Work per block is proportional to the block, not to the output so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from triton_backend.core.config import FinishReason, SamplingParams, TopLogProbs
from triton_backend.core.stats import GenerationStats
from triton_backend.core.text import IncrementalDetokenizer, StopChecker, held_back


@dataclass
class GenerationChunk:
    token_ids: list[int]  # newly committed tokens
    text: str  # newly decodable text
    finished: bool = False
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    log_probs: list[float] | None = None  # return_log_probs: one per token of token_ids
    top_log_probs: list[TopLogProbs] | None = None  # top_log_probs: one per token of token_ids


class Commit:
    """One request's committed output. ``tokens``: the prompt then the committed tokens (grown
    in place; read it, never write it); ``generated``: the committed tokens alone; ``limit``:
    how many may be generated (``max_tokens``, cut to what the model's context leaves);
    ``started``: the request's start (``time.perf_counter()``), for the time to first token."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, *, eos_token_ids: frozenset[int],
                 tokenizer: Any, max_context: int, method: str, started: float | None = None) -> None:
        self.params = params
        self.tokens = list(prompt_ids)
        self.prompt_len = len(self.tokens)
        self.generated: list[int] = []
        self.limit = min(params.max_tokens, max_context - self.prompt_len)
        self.stats = GenerationStats(method=method, prompt_tokens=self.prompt_len)
        self.stopper = StopChecker(params, eos_token_ids, tokenizer)
        self.detok = IncrementalDetokenizer(tokenizer, params.stop)
        self.log_probs: list[float] | None = [] if params.return_log_probs else None  # may run ahead of generated
        self.top_log_probs: list[TopLogProbs] | None = [] if params.top_log_probs else None  # the same
        self.started = time.perf_counter() if started is None else started
        self.finished = False
        self._emitted_tokens = 0

    @property
    def remaining(self) -> int:
        """Tokens that may still be generated."""
        return self.limit - len(self.generated)

    def note_log_probs(self, values: Sequence[float], top: Sequence[TopLogProbs] = ()) -> None:
        """The log probabilities of the next block to commit (one per token; ``top``: its
        alternatives, when asked for); committing cuts them to what is kept."""
        if self.log_probs is None:
            return
        del self.log_probs[len(self.generated):]  # a stop inside the previous block cut it short
        self.log_probs.extend(values)
        if self.top_log_probs is not None:
            del self.top_log_probs[len(self.generated):]
            self.top_log_probs.extend(top)

    def commit(self, block: Sequence[int]) -> GenerationChunk | None:
        """Commit one verified block; the chunk it adds (finished when the request ends; its
        ``stats`` the request's statistics, still growing on a partial chunk), or ``None`` when it
        adds nothing to stream yet."""
        reason = self._append(block)
        if not self.stats.time_to_first_token_s:
            self.stats.time_to_first_token_s = time.perf_counter() - self.started
        self.finished = reason is not None
        text = self.detok.update(self.generated, final=self.finished, text_cut=self.stopper.text_cut)
        new, log_probs, top = self._new_token_ids()
        if self.finished:
            self.stats.generated_tokens = len(self.generated)
            self.stats.total_time_s = time.perf_counter() - self.started
            return GenerationChunk(new, text, True, reason, self.stats, log_probs, top)
        # a partial chunk carries the live statistics too (read when its response is made: perf metrics)
        return GenerationChunk(new, text, stats=self.stats, log_probs=log_probs, top_log_probs=top) if new or text \
            else None

    def _append(self, block: Sequence[int]) -> FinishReason | None:
        """Append ``block`` token by token until a stop; ``tokens`` follows in place (a stop
        sequence may take back tokens an earlier block committed)."""
        before = len(self.generated)
        reason: FinishReason | None = None
        for token in block:
            self.generated.append(int(token))
            reason = self.stopper.after_append(self.generated)
            if reason is None and len(self.generated) >= self.limit:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        kept = min(before, len(self.generated))
        del self.tokens[self.prompt_len + kept:]
        self.tokens.extend(self.generated[kept:])
        return reason

    def _new_token_ids(self) -> tuple[list[int], list[float] | None, list[TopLogProbs] | None]:
        """Tokens not yet streamed (and their log probabilities and alternatives when asked for),
        holding back a possible start of a stop token sequence."""
        end = len(self.generated)
        if not self.finished:
            end -= held_back(self.generated, self.params.stop_token_ids)
        start = self._emitted_tokens
        new = self.generated[start:end]
        self._emitted_tokens = max(start, end)
        log_probs = self.log_probs[start:max(start, end)] if self.log_probs is not None else None
        top = self.top_log_probs[start:max(start, end)] if self.top_log_probs is not None else None
        return new, log_probs, top


__all__ = ["Commit", "GenerationChunk"]
