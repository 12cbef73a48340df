"""The torch runtime's draft-then-verify loop, in plain Python over tensors (no Triton here).

One round: the controller picks a draft length ``k``; the drafter proposes up to ``k``
tokens; the target scores the last committed token plus the proposal in one pass
(``k + 1`` logits rows); the verifier accepts a prefix and adds one recovered/bonus
token; the tokens are committed one by one through the stop checker. ``k == 0`` (no
drafter, nothing proposed, or after fallback) is plain autoregressive decoding in the
same runtime. The round strategy follows the drafter: chain rounds (:class:`ChainRound`),
Medusa trees (:class:`~triton_backend.speculation.tree_round.TreeRound`) or EAGLE chains
(:class:`~triton_backend.speculation.eagle_round.EagleRound`); the loop itself is
:func:`~triton_backend.speculation.rounds.generation_loop`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator, Mapping, Sequence

from triton_backend.core.stats import GenerationStats
from triton_backend.speculation.commit import GenerationChunk
from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.decoding import GenerationResult, collect, encode_prompt, resolve_mode
from triton_backend.speculation.drafters.protocol import Drafter
from triton_backend.speculation.drafters.eagle import EagleSession
from triton_backend.speculation.drafters.medusa import MedusaSession
from triton_backend.speculation.eagle_round import EagleRound
from triton_backend.engines.base import CausalLMEngine, EngineSession
from triton_backend.speculation.rounds import Round, RoundOutcome, generation_loop, repeat
from triton_backend.speculation.run_state import RunState
from triton_backend.speculation.tree_round import TreeRound

logger = logging.getLogger(__name__)


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

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.target.vocab_size, self.target.max_context)

    def resolve(self, mode: SpeculationMode, prefer: SpeculationMode | None = None) -> tuple[SpeculationMode, Drafter | None]:
        """The mode a request runs in and its drafter; ``prefer``: ``auto``'s model drafter (the
        request's ``auto_drafter``; None: the deployment's)."""
        prefer = prefer if prefer is not None else self.speculation.auto_drafter
        mode = resolve_mode(mode, self.drafters, prefer)
        return mode, self.drafters.get(mode)

    def auto_ngram(self, requested: SpeculationMode, mode: SpeculationMode) -> Drafter | None:
        """The n-gram drafter an ``auto`` request drafts from beside its model drafter, round by
        round (:mod:`triton_backend.speculation.auto_source`); None for any other request."""
        if requested is not SpeculationMode.AUTO or mode in (SpeculationMode.NGRAM, SpeculationMode.OFF):
            return None
        return self.drafters.get(SpeculationMode.NGRAM)

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
        mode, drafter = self.resolve(spec.method, spec.auto_drafter)
        run = RunState(self.target, self.tokenizer, prompt_ids, params, spec, mode, drafter,
                       ngram=self.auto_ngram(spec.method, mode))
        session = self.target.new_session()
        try:
            outcomes = clocked(repeat(round_for(run, session)), run.commit.stats, session)
            yield from generation_loop(run.commit, run.controller, outcomes)
        finally:
            session.release()
            if run.drafter_session is not None:
                run.drafter_session.release()
            if run.auto is not None:
                run.auto.ngram.release()


class ChainRound:
    """A chain round: draft ``k`` tokens, one target pass over them, verify the chain."""

    def __init__(self, run: RunState, session: EngineSession) -> None:
        self.run = run
        self.session = session

    def __call__(self) -> RoundOutcome:
        run = self.run
        t0 = time.perf_counter()
        proposal = run.forced_draft()  # structured output: what the grammar forces, drafted for free
        forced = bool(proposal.tokens)
        if not forced and not run.context_pending:
            k = run.draft_length()
            if k > 0:
                run.take_context(self.session)
                proposal = run.constrain(run.propose(k))
        t1 = time.perf_counter()
        logits = self.session.logits(run.tokens + proposal.tokens, len(proposal) + 1)
        accepted = run.verify_chain(logits, proposal)
        return accepted.outcome(t1 - t0, time.perf_counter() - t1, forced=forced)


def clocked(outcomes: Iterator[RoundOutcome], stats: GenerationStats, session: EngineSession) -> Iterator[RoundOutcome]:
    """``outcomes``, noting in ``stats`` before each is recorded the time the request's target
    passes took so far (the last chunk carries it: the round time beyond the target's passes is
    the rest of ``total_time_s``)."""
    for outcome in outcomes:
        stats.target_pass_time_s = session.pass_time_s
        yield outcome


def round_for(run: RunState, session: EngineSession) -> Round:
    """The round strategy of ``run``'s drafter: Medusa trees, EAGLE chains, or chain rounds."""
    drafter = run.drafter_session
    if isinstance(drafter, MedusaSession):
        return TreeRound(run, session, drafter)
    if isinstance(drafter, EagleSession):
        return EagleRound(run, session, drafter)
    return ChainRound(run, session)


__all__ = ["ChainRound", "SpeculativeDecoder", "clocked", "round_for"]
