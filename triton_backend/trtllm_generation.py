"""The speculative loop of the ``trtllm`` runtime, in plain Python over engine requests.

The target engine verifies draft tokens itself (TensorRT-LLM's draft_tokens_external mode),
so one round here is: the controller picks ``k``; a draft engine (or n-gram lookup) proposes
up to ``k`` tokens; ONE target request verifies them and returns the accepted drafts plus one
token of its own; the tokens are committed one by one through the stop checker, exactly as
in :mod:`triton_backend.generation`. Plain decoding (``mode=off``, after fallback, or when the
next round would not fit the engine's ``max_input_len``) is one streaming request for the
rest. A Medusa target engine drafts and verifies its own tree inside one streaming request.

What is exact: greedy requests accept by token comparison, so the output is the target
engine's own greedy output. Sampling requests accept by comparing each draft token with the
token the target samples at that position (or, with draft logits, by TensorRT-LLM's
rejection rule); both keep the target's distribution. Each request gets its own seed.

:class:`TrtllmSpeculativeDecoder` is a :class:`~triton_backend.generation.SpeculativeDecoder`
(same ``encode``/``generate``/``stream`` and chunk/stats types), so serving runs it unchanged.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

from triton_backend.config import SamplingParams, SpeculationConfig, SpeculationMode, TreeAcceptance
from triton_backend.controller import controller_for
from triton_backend.drafters.ngram import NgramDrafter, find_ngram_continuation
from triton_backend.engines.trtllm_engine import EngineOutput, TrtllmEngineError
from triton_backend.engines.trtllm_requests import (
    RequestSpec, SeedRole, count_accepted, draft_request, end_ids, plain_request, request_seed, target_request,
)
from triton_backend.errors import ContextLengthError, InvalidRequestError
from triton_backend.generation import GenerationChunk, SpeculativeDecoder, commit_blocks
from triton_backend.stats import GenerationStats
from triton_backend.text import IncrementalDetokenizer, StopChecker

logger = logging.getLogger(__name__)


class RequestEngine(Protocol):
    """What the loop needs of an engine (:class:`~triton_backend.engines.trtllm_engine.TrtllmEngine`)."""

    name: str

    def generate(self, spec: RequestSpec) -> EngineOutput: ...
    def stream(self, spec: RequestSpec) -> Iterator[EngineOutput]: ...


@dataclass(frozen=True)
class TargetInfo:
    """The target as the loop and ``encode`` see it (``max_context``: the engine's max_seq_len)."""

    name: str
    vocab_size: int
    max_context: int
    max_input_len: int
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class EngineDrafter:
    """A draft engine in the decoder's ``drafters`` map (``relative_cost``: per drafted token,
    in target steps)."""

    engine: RequestEngine
    relative_cost: float

    @property
    def name(self) -> str:
        return f"draft:{self.engine.name}"


@dataclass(frozen=True)
class EngineMedusa:
    """The target engine's own Medusa heads; ``depth``: the tree's depth (heads used)."""

    depth: int
    name: str = "medusa(engine)"
    relative_cost: float = 0.0


class TrtllmSpeculativeDecoder(SpeculativeDecoder):
    """Generates with TensorRT-LLM engines; thread-compatible like the torch decoder (every
    request is independent; the executor batches concurrent requests in flight)."""

    def __init__(self, target: RequestEngine, info: TargetInfo, tokenizer: Any = None, *,
                 draft: EngineDrafter | None = None, ngram: NgramDrafter | None = None,
                 medusa: EngineMedusa | None = None, speculation: SpeculationConfig | None = None,
                 use_draft_logits: bool = True) -> None:
        drafters: dict[SpeculationMode, Any] = {}
        if medusa is not None:
            if draft is not None or ngram is not None:
                raise ValueError("a Medusa target engine verifies only its own tree")
            drafters[SpeculationMode.MEDUSA] = medusa
        if draft is not None:
            drafters[SpeculationMode.DRAFT] = draft
        if ngram is not None:
            drafters[SpeculationMode.NGRAM] = ngram
        super().__init__(info, tokenizer, drafters=drafters, speculation=speculation)  # type: ignore[arg-type]
        self.engine = target
        self.use_draft_logits = use_draft_logits

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        ids = super().encode(prompt)
        limit = self.target.max_input_len
        if len(ids) > limit:
            raise ContextLengthError(f"prompt has {len(ids)} tokens; the engine takes at most {limit} input tokens")
        return ids

    def check_request(self, mode: SpeculationMode, params: SamplingParams, spec: SpeculationConfig) -> None:
        """Refuse what these engines cannot do exactly as asked."""
        if mode is SpeculationMode.MEDUSA and not params.greedy and spec.medusa.tree_acceptance is TreeAcceptance.EXACT:
            raise InvalidRequestError(
                "the TensorRT-LLM Medusa engine verifies its tree with its own acceptance rule, which keeps the "
                "target's distribution only for greedy requests; send temperature 0, or set the deployment's "
                "speculation.medusa.tree_acceptance to \"typical\" to accept the engine's sampling")

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               speculation: SpeculationConfig | None = None) -> Iterator[GenerationChunk]:
        """Yields one chunk per verified block; the last has ``finished=True`` and the stats."""
        params = params or SamplingParams()
        spec = speculation or self.speculation
        prompt_ids = self.encode(prompt)
        mode, _ = self.resolve(spec.method)
        self.check_request(mode, params, spec)
        yield from _TrtllmRun(self, prompt_ids, params, spec, mode).chunks()

    def resolve(self, mode: SpeculationMode) -> tuple[SpeculationMode, Any]:
        """As the torch decoder; a Medusa engine always speculates, so ``off`` is Medusa too."""
        if mode is SpeculationMode.OFF and SpeculationMode.MEDUSA in self.drafters:
            return SpeculationMode.MEDUSA, self.drafters[SpeculationMode.MEDUSA]
        return super().resolve(mode)


class _TrtllmRun:
    """The state of one generation."""

    def __init__(self, decoder: TrtllmSpeculativeDecoder, prompt_ids: list[int], params: SamplingParams,
                 spec: SpeculationConfig, mode: SpeculationMode) -> None:
        self.decoder, self.params, self.spec, self.mode = decoder, params, spec, mode
        self.info: TargetInfo = decoder.target  # type: ignore[assignment]
        self.drafter = decoder.drafters.get(mode)
        self.tokens = list(prompt_ids)
        self.generated: list[int] = []
        self.stats = GenerationStats(method=mode.value, prompt_tokens=len(prompt_ids))
        self.controller = controller_for(spec, mode, self.drafter)
        self.stopper = StopChecker(params, self.info.eos_token_ids, decoder.tokenizer)
        self.detok = IncrementalDetokenizer(decoder.tokenizer, params.stop)
        self.emitted_tokens = 0
        if params.history_dependent or params.return_log_probs:
            raise InvalidRequestError("penalties, min_tokens, bad words and log probs are not wired to the "
                                      "trtllm runtime yet; use the torch runtime or leave them out")
        self.log_probs: list[float] | None = None
        self.limit = min(params.max_tokens, self.info.max_context - len(prompt_ids))
        self.ids = end_ids(params, self.info.eos_token_ids)
        self.base_seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.requests = 0

    # -- requests ---------------------------------------------------------------------------
    def _seed(self, role: SeedRole) -> int | None:
        if self.params.greedy:
            return None
        self.requests += 1
        return request_seed(self.base_seed, self.requests, role)

    def _propose(self, k: int) -> tuple[list[int], Any]:
        if isinstance(self.drafter, NgramDrafter):
            return find_ngram_continuation(self.tokens, k, self.drafter.min_n, self.drafter.max_n), None
        assert isinstance(self.drafter, EngineDrafter)
        want_logits = self.decoder.use_draft_logits and not self.params.greedy
        out = self.drafter.engine.generate(draft_request(self.tokens, k, self.params, self.ids,
                                                         self._seed(SeedRole.DRAFT), want_logits))
        drafts = out.tokens[:k]
        logits = out.logits[:len(drafts)] if want_logits and out.logits is not None else None
        return drafts, logits

    def _end_token(self) -> list[int]:
        """An engine stops early only at its end token; where it did not return that token,
        the loop adds it, so the stop checker ends the generation with reason EOS."""
        return [self.ids.end_id] if self.ids.end_id >= 0 else []

    def _round(self, k: int) -> list[int]:
        t0 = time.perf_counter()
        drafts, logits = self._propose(k) if k > 0 else ([], None)
        t1 = time.perf_counter()
        request = target_request(self.tokens, drafts, self.params, self.ids, self._seed(SeedRole.TARGET), logits)
        out = self.decoder.engine.generate(request).tokens
        t2 = time.perf_counter()
        accepted = count_accepted(drafts, out)
        block = out[:accepted + 1]
        if len(block) == accepted and not (block and block[-1] in self.info.eos_token_ids):
            block = block + self._end_token()  # no token of the engine's own: it stopped at its end token
        if not block:
            raise TrtllmEngineError("the target engine returned no token")
        self.stats.draft_time_s += t1 - t0
        self.stats.verify_time_s += t2 - t1
        self.stats.record_round(len(drafts), accepted)
        if self.controller.record(len(drafts), accepted):
            self.stats.record_fallback(len(self.generated) + accepted + 1)
        return block

    def _streamed(self, depth: int) -> Iterator[list[int]]:
        """The rest as one streaming request; ``depth > 0``: a Medusa engine, whose every
        response is one step that drafted ``depth`` positions and accepted all but one token."""
        asked = self.limit - len(self.generated)
        request = plain_request(self.tokens, asked, self.params, self.ids, self._seed(SeedRole.TARGET))
        returned = 0
        stream = self.decoder.engine.stream(request)
        try:
            started = time.perf_counter()
            for out in stream:
                self.stats.verify_time_s += time.perf_counter() - started
                if out.tokens:
                    returned += len(out.tokens)
                    if depth:
                        self.stats.record_round(depth, min(len(out.tokens) - 1, depth))
                    else:
                        for _ in out.tokens:
                            self.stats.record_round(0, 0)
                    yield out.tokens
                started = time.perf_counter()
        finally:
            stream.close()
        if returned < asked:
            yield self._end_token()

    def blocks(self) -> Iterator[list[int]]:
        if self.mode is SpeculationMode.MEDUSA:
            depth = self.drafter.depth if isinstance(self.drafter, EngineMedusa) else 0
            yield from self._streamed(depth)
            return
        if self.drafter is None or self.spec.draft_length.num_draft_tokens == 0:
            yield from self._streamed(0)
            return
        while True:
            k = max(0, min(self.controller.next_draft_length(), self.limit - len(self.generated) - 1))
            if self.controller.fallen_back:
                self.stats.record_fallback(len(self.generated))  # counts when the adaptive controller decided it
                yield from self._streamed(0)
                return
            if len(self.tokens) + k + 1 > self.info.max_input_len:
                logger.info("the next round would exceed the engine's max_input_len (%d): decoding the rest plainly",
                            self.info.max_input_len)
                yield from self._streamed(0)
                return
            yield self._round(k)

    # -- committing and streaming: the torch loop's own ----------------------------------------
    def chunks(self) -> Iterator[GenerationChunk]:
        blocks = self.blocks()
        try:
            for chunk in commit_blocks(self, blocks):
                yield chunk
                if chunk.finished:
                    return
        finally:
            blocks.close()
        raise TrtllmEngineError("the engine ended the request before it was complete")


__all__ = ["EngineDrafter", "EngineMedusa", "RequestEngine", "TargetInfo", "TrtllmSpeculativeDecoder"]
