"""The draft-then-verify loop, in plain Python over tensors (no Triton here).

One round: the controller picks a draft length ``k``; the drafter proposes up to ``k``
tokens; the target scores the last committed token plus the proposal in one pass
(``k + 1`` logits rows); the verifier accepts a prefix and adds one recovered/bonus
token; the tokens are committed one by one through the stop checker. ``k == 0`` (no
drafter, nothing proposed, or after fallback) is plain autoregressive decoding in the
same runtime.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Protocol, Sequence

import torch

from triton_backend.config import FinishReason, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.controller import controller_for
from triton_backend.drafters.base import EMPTY_PROPOSAL, DraftProposal, Drafter
from triton_backend.engines.base import CausalLMEngine
from triton_backend.errors import ContextLengthError, InvalidRequestError
from triton_backend.sampling import LogitsProcessor, make_generator
from triton_backend.stats import GenerationStats
from triton_backend.text import IncrementalDetokenizer, StopChecker, held_back
from triton_backend.verifier import VerifyResult, verify_greedy, verify_rejection

logger = logging.getLogger(__name__)

# AUTO picks the first of these the deployment has
AUTO_PREFERENCE = (SpeculationMode.EAGLE, SpeculationMode.DRAFT, SpeculationMode.MEDUSA, SpeculationMode.NGRAM)


@dataclass
class GenerationChunk:
    token_ids: list[int]  # newly committed tokens
    text: str  # newly decodable text
    finished: bool = False
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    log_probs: list[float] | None = None  # return_log_probs: one per token of token_ids


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    prompt_token_ids: list[int] = field(default_factory=list)


class SpeculativeDecoder:
    """Generates with a target engine and optional drafters; thread-compatible: each call
    uses its own KV sessions, so several requests may run at once on one decoder."""

    def __init__(self, target: CausalLMEngine, tokenizer: Any = None, *,
                 drafters: Mapping[SpeculationMode, Drafter] | None = None,
                 speculation: SpeculationConfig | None = None) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafters: dict[SpeculationMode, Drafter] = dict(drafters or {})
        self.speculation = speculation or SpeculationConfig()

    # -- inputs ---------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this decoder has no tokenizer; pass token ids")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {self.target.vocab_size}): {bad[:5]}")
        if len(ids) >= self.target.max_context:
            raise ContextLengthError(
                f"prompt has {len(ids)} tokens; the model's context is {self.target.max_context} "
                "and at least one token must be generated"
            )
        return ids

    def resolve(self, mode: SpeculationMode) -> tuple[SpeculationMode, Drafter | None]:
        if mode == SpeculationMode.OFF:
            return mode, None
        if mode == SpeculationMode.AUTO:
            for candidate in AUTO_PREFERENCE:
                if candidate in self.drafters:
                    return candidate, self.drafters[candidate]
            return SpeculationMode.OFF, None
        if mode not in self.drafters:
            have = ", ".join(m.value for m in self.drafters) or "none"
            raise InvalidRequestError(f"speculation mode {mode.value!r} is not available in this deployment (available: {have})")
        return mode, self.drafters[mode]

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 speculation: SpeculationConfig | None = None) -> GenerationResult:
        tokens: list[int] = []
        text: list[str] = []
        last: GenerationChunk | None = None
        ids = self.encode(prompt)
        for chunk in self.stream(ids, params, speculation):
            tokens.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        assert last is not None and last.finish_reason is not None and last.stats is not None
        return GenerationResult("".join(text), tokens, last.finish_reason, last.stats, ids)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               speculation: SpeculationConfig | None = None) -> Iterator[GenerationChunk]:
        """Yields one chunk per verified block; the last has ``finished=True`` and the stats."""
        params = params or SamplingParams()
        spec = speculation or self.speculation
        prompt_ids = self.encode(prompt)
        mode, drafter = self.resolve(spec.method)
        run = _Run(self, prompt_ids, params, spec, mode, drafter)
        try:
            yield from run.chunks()
        finally:
            run.release()


class CommitState(Protocol):
    """What :func:`commit_blocks` reads and updates on a run (the torch loop and the TensorRT-LLM loop)."""

    params: SamplingParams
    tokens: list[int]
    generated: list[int]
    emitted_tokens: int
    limit: int
    stats: GenerationStats
    stopper: StopChecker
    detok: IncrementalDetokenizer
    log_probs: list[float] | None  # return_log_probs: one per committed token (may run ahead of generated)


def _commit(run: CommitState, block: list[int]) -> FinishReason | None:
    """Commit a verified block token by token, so a stop inside it truncates exactly there."""
    reason: FinishReason | None = None
    for token in block:
        run.generated.append(token)
        reason = run.stopper.after_append(run.generated)
        if reason is None and len(run.generated) >= run.limit:
            reason = FinishReason.LENGTH
        if reason is not None:
            break
    run.tokens = run.tokens[: run.stats.prompt_tokens] + run.generated
    return reason


def _new_token_ids(run: CommitState, finished: bool) -> tuple[list[int], list[float] | None]:
    """Tokens not yet streamed (and their log probabilities when asked for), holding back a
    possible start of a stop token sequence."""
    end = len(run.generated)
    if not finished:
        end -= held_back(run.generated, run.params.stop_token_ids)
    start = run.emitted_tokens
    new = run.generated[start:end]
    run.emitted_tokens = max(run.emitted_tokens, end)
    log_probs = run.log_probs[start:max(start, end)] if run.log_probs is not None else None
    return new, log_probs


def commit_blocks(run: CommitState, blocks: Iterator[list[int]]) -> Iterator[GenerationChunk]:
    """Commit each block of ``blocks`` and yield what it adds; the last chunk is finished and
    carries the stats. Returns without a finished chunk only when ``blocks`` runs out."""
    started = time.perf_counter()
    for block in blocks:
        chunk = commit_block(run, block, started)
        if chunk is not None:
            yield chunk
            if chunk.finished:
                return


def commit_block(run: CommitState, block: list[int], started: float) -> GenerationChunk | None:
    """Commit one verified block; the chunk it adds (finished, with the stats, when the run
    ends), or ``None`` when it adds nothing to stream yet. ``started``: the run's start
    (``time.perf_counter()``), for the time to first token and the total time."""
    reason = _commit(run, block)
    if not run.stats.time_to_first_token_s:
        run.stats.time_to_first_token_s = time.perf_counter() - started
    finished = reason is not None
    text = run.detok.update(run.generated, final=finished, text_cut=run.stopper.text_cut)
    new, log_probs = _new_token_ids(run, finished)
    if finished:
        run.stats.generated_tokens = len(run.generated)
        run.stats.total_time_s = time.perf_counter() - started
        return GenerationChunk(new, text, True, reason, run.stats, log_probs)
    return GenerationChunk(new, text, log_probs=log_probs) if new or text else None


class RunState:
    """What one generation tracks whatever runs its passes (this loop, or the batch
    scheduler's rows): tokens, sampler and seeded RNG, controller, stats, stop checker and
    detokenizer. Implements :class:`CommitState`."""

    def __init__(self, decoder: SpeculativeDecoder, prompt_ids: list[int], params: SamplingParams,
                 spec: SpeculationConfig, mode: SpeculationMode, drafter: Drafter | None, *,
                 drafter_session: bool = True) -> None:
        self.decoder = decoder
        self.target = decoder.target
        self.params = params
        self.tokens = list(prompt_ids)
        self.generated: list[int] = []
        self.processor = LogitsProcessor.from_params(
            params, prompt_len=len(prompt_ids), end_ids=self._end_ids(params),
            bad_words=_tokenize_words(decoder.tokenizer, params.bad_words))
        self.log_probs: list[float] | None = [] if params.return_log_probs else None
        self.rng = make_generator(params.seed)
        # drafter_session=False: the caller drafts for this run itself (a batched draft model)
        self.drafter_session = drafter.new_session() if drafter is not None and drafter_session else None
        self.controller = controller_for(spec, mode, drafter, self.drafter_session)
        self.use_drafter = drafter is not None
        self.tree = mode is SpeculationMode.MEDUSA and drafter is not None  # tree rounds (triton_backend.tree_round)
        self.eagle = mode is SpeculationMode.EAGLE and drafter is not None  # triton_backend.eagle_round
        self.stats = GenerationStats(method=mode.value if drafter else SpeculationMode.OFF.value,
                                     prompt_tokens=len(prompt_ids))
        self.stopper = StopChecker(params, self.target.eos_token_ids, decoder.tokenizer)
        self.detok = IncrementalDetokenizer(decoder.tokenizer, params.stop)
        self.emitted_tokens = 0
        # generation also ends at the model's context
        self.limit = min(params.max_tokens, self.target.max_context - len(prompt_ids))

    def _end_ids(self, params: SamplingParams) -> list[int]:
        """What min_tokens holds back: EOS (unless ignored) and one-token stop sequences (end_id)."""
        eos = [] if params.ignore_eos else list(self.target.eos_token_ids)
        return eos + [seq[0] for seq in params.stop_token_ids if len(seq) == 1]

    def _draft_length(self) -> int:
        if not self.use_drafter:
            return 0
        return self.cap_draft_length(self.controller.next_draft_length())

    def cap_draft_length(self, k: int) -> int:
        """``k`` cut so the round never drafts past what may still be generated (it adds
        ``k + 1`` tokens at most); records a fallback the controller has decided."""
        if self.controller.fallen_back:  # counts when the adaptive controller decided it (break-even)
            self.stats.record_fallback(len(self.generated))
        return max(0, min(k, self.limit - len(self.generated) - 1))

    def verify_chain(self, logits: torch.Tensor, proposal: DraftProposal) -> VerifyResult:
        """Verify a chain proposal against the target's ``[len(proposal) + 1, vocab]`` logits."""
        drafts = torch.tensor(proposal.tokens, dtype=torch.long)
        histories = self.processor.chain_rows(self.tokens, proposal.tokens)  # row j: committed + drafts[:j]
        if self.processor.greedy:
            result = verify_greedy(self.processor.scores(logits, histories), drafts)
        else:
            result = verify_rejection(self.processor.probs(logits, histories), drafts, proposal.probs, self.rng)
        if self.log_probs is not None:
            m = result.num_accepted
            block = proposal.tokens[:m] + [result.next_token]
            self.note_log_probs(logits[: m + 1], None if histories is None else histories[: m + 1], block)
        return result

    def note_log_probs(self, logits: torch.Tensor, histories: Any, block: list[int]) -> None:
        """Record the log probabilities of a verified block (``logits`` [len(block), vocab]:
        the target's rows that chose it); committing cuts them to what is kept."""
        if self.log_probs is None:
            return
        del self.log_probs[len(self.generated):]  # a stop inside the previous block cut it short
        self.log_probs.extend(self.processor.log_probs(logits, histories, block))

    def record_verification(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float, *,
                            controller: bool = True) -> None:
        """Stats and (unless another policy picks the draft lengths) the controller after one
        verified round (fallback recorded where it triggers)."""
        self.stats.draft_time_s += draft_s
        self.stats.verify_time_s += verify_s
        self.stats.record_round(num_drafted, num_accepted)
        if controller and self.controller.record(num_drafted, num_accepted):
            self.stats.record_fallback(len(self.generated) + num_accepted + 1)


def _tokenize_words(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Bad words as token sequences (as the preprocessing model encodes word lists)."""
    if not words:
        return []
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs a tokenizer; send bad_words_list token ids instead")
    return [list(tokenizer.encode(w, add_special_tokens=False)) for w in words]


class _Run(RunState):
    """One generation run by this loop, with its own KV sessions."""

    def __init__(self, decoder: SpeculativeDecoder, prompt_ids: list[int], params: SamplingParams,
                 spec: SpeculationConfig, mode: SpeculationMode, drafter: Drafter | None) -> None:
        super().__init__(decoder, prompt_ids, params, spec, mode, drafter)
        self.target_session = self.target.new_session()

    def release(self) -> None:
        self.target_session.release()
        if self.drafter_session is not None:
            self.drafter_session.release()

    def _round(self) -> list[int]:
        if self.tree:
            from triton_backend.tree_round import tree_round

            return tree_round(self)
        if self.eagle:
            from triton_backend.eagle_round import eagle_round

            return eagle_round(self)
        k = self._draft_length()
        t0 = time.perf_counter()
        proposal = EMPTY_PROPOSAL
        if k > 0 and self.drafter_session is not None:
            proposal = self.drafter_session.propose(self.tokens, k, self.processor, self.rng)
        t1 = time.perf_counter()
        logits = self.target_session.logits(self.tokens + proposal.tokens, len(proposal) + 1)
        result = self.verify_chain(logits, proposal)
        self.record_verification(len(proposal), result.num_accepted, t1 - t0, time.perf_counter() - t1)
        return proposal.tokens[: result.num_accepted] + [result.next_token]

    def _rounds(self) -> Iterator[list[int]]:
        while True:
            yield self._round()

    def chunks(self) -> Iterator[GenerationChunk]:
        return commit_blocks(self, self._rounds())
