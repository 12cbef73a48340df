"""The speculative loop of the ``trtllm`` runtime, in plain Python over engine requests.

The target engine verifies draft tokens itself (TensorRT-LLM's draft_tokens_external mode),
so one round here is: the controller picks ``k``; a draft engine (or n-gram lookup) proposes
up to ``k`` tokens; ONE target request verifies them and returns the accepted drafts plus one
token of its own; the tokens are committed one by one through the stop checker, exactly as
in :mod:`triton_backend.speculation.torch_decoder`. Plain decoding (``mode=off``, after fallback, or when the
next round would not fit the engine's ``max_input_len``) is one streaming request for the
rest. A Medusa target engine drafts and verifies its own tree inside one streaming request.

What is exact: greedy requests accept by token comparison, so the output is the target
engine's own greedy output. Sampling requests accept by comparing each draft token with the
token the target samples at that position (or, with draft logits, by TensorRT-LLM's
rejection rule); both keep the target's distribution. Each request gets its own seed.

:class:`TrtllmSpeculativeDecoder` is a :class:`~triton_backend.speculation.decoding.Decoder` like the torch
runtime's (same ``encode``/``generate``/``stream`` and chunk/stats types), so serving runs it
unchanged; its rounds (engine-verified, or streamed) run through the loop every runtime shares
(:func:`~triton_backend.speculation.rounds.generation_loop`).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Protocol, Sequence

from triton_backend.speculation.commit import Commit, GenerationChunk
from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode, TreeAcceptance
from triton_backend.speculation.controller import controller_for
from triton_backend.speculation.decoding import GenerationResult, collect, encode_prompt, resolve_mode
from triton_backend.speculation.drafters.protocol import DraftCost
from triton_backend.speculation.drafters.ngram import NgramDrafter, NgramIndex
from triton_backend.engines.trtllm.engine import EngineOutput, TrtllmEngineError
from triton_backend.engines.trtllm.requests import (
    RequestSpec, SeedRole, count_accepted, draft_request, end_ids, plain_request, request_seed, target_request,
)
from triton_backend.core.errors import ContextLengthError, InvalidRequestError
from triton_backend.speculation.rounds import RoundOutcome, cap_draft_length, generation_loop

logger = logging.getLogger(__name__)


class RequestEngine(Protocol):
    """What the loop needs of an engine (:class:`~triton_backend.engines.trtllm.engine.TrtllmEngine`)."""

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
    """A draft engine (``relative_cost``: per drafted token, in target steps)."""

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


class TrtllmSpeculativeDecoder:
    """Generates with TensorRT-LLM engines; thread-compatible like the torch decoder (every
    request is independent; the executor batches concurrent requests in flight)."""

    def __init__(self, target: RequestEngine, info: TargetInfo, tokenizer: Any = None, *,
                 draft: EngineDrafter | None = None, ngram: NgramDrafter | None = None,
                 medusa: EngineMedusa | None = None, speculation: SpeculationConfig | None = None,
                 use_draft_logits: bool = True) -> None:
        if medusa is not None and (draft is not None or ngram is not None):
            raise ValueError("a Medusa target engine verifies only its own tree")
        self.engine = target
        self.target = info
        self.tokenizer = tokenizer
        self.draft, self.ngram, self.medusa = draft, ngram, medusa
        self.speculation = speculation or SpeculationConfig()
        self.use_draft_logits = use_draft_logits

    def drafter(self, mode: SpeculationMode) -> DraftCost | None:
        """The drafter behind ``mode`` (None: not deployed, or ``off``)."""
        drafters: dict[SpeculationMode, DraftCost | None] = {
            SpeculationMode.MEDUSA: self.medusa, SpeculationMode.DRAFT: self.draft, SpeculationMode.NGRAM: self.ngram}
        return drafters.get(mode)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        ids = encode_prompt(prompt, self.tokenizer, self.target.vocab_size, self.target.max_context)
        limit = self.target.max_input_len
        if len(ids) > limit:
            raise ContextLengthError(f"prompt has {len(ids)} tokens; the engine takes at most {limit} input tokens")
        return ids

    def resolve(self, mode: SpeculationMode, prefer: SpeculationMode | None = None) -> tuple[SpeculationMode, DraftCost | None]:
        """As the torch decoder; a Medusa engine always speculates, so ``off`` is Medusa too."""
        if mode is SpeculationMode.OFF and self.medusa is not None:
            mode = SpeculationMode.MEDUSA
        deployed = [m for m in (SpeculationMode.MEDUSA, SpeculationMode.DRAFT, SpeculationMode.NGRAM)
                    if self.drafter(m) is not None]
        mode = resolve_mode(mode, deployed, prefer if prefer is not None else self.speculation.auto_drafter)
        return mode, self.drafter(mode)

    def check_request(self, mode: SpeculationMode, params: SamplingParams, spec: SpeculationConfig) -> None:
        """Refuse what these engines cannot do exactly as asked."""
        if mode is SpeculationMode.MEDUSA and not params.greedy and spec.medusa.tree_acceptance is TreeAcceptance.EXACT:
            raise InvalidRequestError(
                "the TensorRT-LLM Medusa engine verifies its tree with its own acceptance rule, which keeps the "
                "target's distribution only for greedy requests; send temperature 0, or set the deployment's "
                "speculation.medusa.tree_acceptance to \"typical\" to accept the engine's sampling")
        if params.guide is not None:
            raise InvalidRequestError("structured output (guided decoding) is not wired to the trtllm runtime yet; "
                                      "use the torch runtime")
        if params.history_dependent or params.return_log_probs:
            raise InvalidRequestError("penalties, min_tokens, bad words and log probs are not wired to the "
                                      "trtllm runtime yet; use the torch runtime or leave them out")

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 speculation: SpeculationConfig | None = None) -> GenerationResult:
        ids = self.encode(prompt)
        return collect(ids, self.stream(ids, params, speculation))

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               speculation: SpeculationConfig | None = None) -> Iterator[GenerationChunk]:
        """Yields one chunk per verified block; the last has ``finished=True`` and the stats."""
        params = params or SamplingParams()
        spec = speculation or self.speculation
        prompt_ids = self.encode(prompt)
        mode, _ = self.resolve(spec.method, spec.auto_drafter)
        self.check_request(mode, params, spec)
        yield from _TrtllmRun(self, prompt_ids, params, spec, mode).chunks()


class _TrtllmRun:
    """The state of one generation; its rounds (:meth:`rounds`) are engine-verified, or one
    streaming request for the rest."""

    def __init__(self, decoder: TrtllmSpeculativeDecoder, prompt_ids: list[int], params: SamplingParams,
                 spec: SpeculationConfig, mode: SpeculationMode) -> None:
        self.decoder, self.params, self.spec, self.mode = decoder, params, spec, mode
        self.info = decoder.target
        self.commit = Commit(prompt_ids, params, eos_token_ids=self.info.eos_token_ids, tokenizer=decoder.tokenizer,
                             max_context=self.info.max_context, method=mode.value)
        self.controller = controller_for(spec, mode, decoder.drafter(mode))
        self.ids = end_ids(params, self.info.eos_token_ids)
        self.base_seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.requests = 0
        ngram = decoder.ngram if mode is SpeculationMode.NGRAM else None
        self.ngram_index = NgramIndex(ngram.min_n, ngram.max_n) if ngram is not None else None  # follows the commits

    # -- requests ---------------------------------------------------------------------------
    def _seed(self, role: SeedRole) -> int | None:
        if self.params.greedy:
            return None
        self.requests += 1
        return request_seed(self.base_seed, self.requests, role)

    def _propose(self, k: int) -> tuple[list[int], Any]:
        tokens = self.commit.tokens
        if self.ngram_index is not None:
            self.ngram_index.update(tokens)
            found = self.ngram_index.lookup(k)
            return (found.continuation if found is not None else []), None
        draft = self.decoder.draft
        assert draft is not None  # rounds() drafts only where the mode's drafter is deployed
        want_logits = self.decoder.use_draft_logits and not self.params.greedy
        out = draft.engine.generate(draft_request(tokens, k, self.params, self.ids, self._seed(SeedRole.DRAFT),
                                                  want_logits))
        drafts = out.tokens[:k]
        logits = out.logits[:len(drafts)] if want_logits and out.logits is not None else None
        return drafts, logits

    def _end_token(self) -> list[int]:
        """An engine stops early only at its end token; where it did not return that token,
        the loop adds it, so the stop checker ends the generation with reason EOS."""
        return [self.ids.end_id] if self.ids.end_id >= 0 else []

    def _round(self, k: int) -> RoundOutcome:
        """One engine-verified round: draft ``k`` tokens, ONE target request verifies them."""
        t0 = time.perf_counter()
        drafts, logits = self._propose(k) if k > 0 else ([], None)
        t1 = time.perf_counter()
        request = target_request(self.commit.tokens, drafts, self.params, self.ids, self._seed(SeedRole.TARGET),
                                 logits)
        out = self.decoder.engine.generate(request).tokens
        t2 = time.perf_counter()
        accepted = count_accepted(drafts, out)
        block = out[:accepted + 1]
        if len(block) == accepted and not (block and block[-1] in self.info.eos_token_ids):
            block = block + self._end_token()  # no token of the engine's own: it stopped at its end token
        if not block:
            raise TrtllmEngineError("the target engine returned no token")
        return RoundOutcome(block, len(drafts), accepted, t1 - t0, t2 - t1)

    def _streamed(self, depth: int) -> Generator[RoundOutcome, None, None]:
        """The rest as one streaming request; ``depth > 0``: a Medusa engine, whose every
        response is one step that drafted ``depth`` positions and accepted all but one token.
        No controller decides these rounds."""
        asked = self.commit.remaining
        request = plain_request(self.commit.tokens, asked, self.params, self.ids, self._seed(SeedRole.TARGET))
        returned = 0
        stream = self.decoder.engine.stream(request)
        try:
            started = time.perf_counter()
            for out in stream:
                waited = time.perf_counter() - started
                n = len(out.tokens)
                returned += n
                if depth and n:
                    yield RoundOutcome(out.tokens, depth, min(n - 1, depth), verify_s=waited, controller=False)
                else:  # plain: one pass per token (a response without tokens only took time)
                    yield RoundOutcome(out.tokens, verify_s=waited, passes=n, controller=False)
                started = time.perf_counter()
        finally:
            stream.close()
        if returned < asked:
            yield RoundOutcome(self._end_token(), passes=0, controller=False)

    def rounds(self) -> Generator[RoundOutcome, None, None]:
        """Engine-verified rounds while the controller drafts; then (or when there is nothing
        to draft with) the rest as one streaming request."""
        if self.mode is SpeculationMode.MEDUSA:
            yield from self._streamed(self.decoder.medusa.depth if self.decoder.medusa is not None else 0)
            return
        if self.decoder.drafter(self.mode) is None or self.spec.draft_length.num_draft_tokens == 0:
            yield from self._streamed(0)
            return
        while True:
            k = cap_draft_length(self.commit, self.controller, self.controller.next_draft_length())
            if self.controller.fallen_back:
                yield from self._streamed(0)
                return
            if len(self.commit.tokens) + k + 1 > self.info.max_input_len:
                logger.info("the next round would exceed the engine's max_input_len (%d): decoding the rest plainly",
                            self.info.max_input_len)
                yield from self._streamed(0)
                return
            yield self._round(k)

    def chunks(self) -> Iterator[GenerationChunk]:
        outcomes = self.rounds()
        try:
            yield from generation_loop(self.commit, self.controller, outcomes)
        finally:
            outcomes.close()
        if not self.commit.finished:
            raise TrtllmEngineError("the engine ended the request before it was complete")


__all__ = ["EngineDrafter", "EngineMedusa", "RequestEngine", "TargetInfo", "TrtllmSpeculativeDecoder"]
