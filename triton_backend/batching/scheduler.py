"""In-flight (continuous) batching: one scheduler per model instance owns the batched engines.

The round is read here, in :meth:`BatchScheduler._round`: drop cancelled requests, admit queued
ones while a slot is free, share the round's prompt budget out (prefill chunks of new prompts
beside decode/verify rows: as many prompt tokens as keep the running streams' pace, from the
target's pass costs (:mod:`~triton_backend.batching.prefill_budget`), so a long prompt cannot
stall everyone, shared out by :mod:`~triton_backend.batching.prefill_rows`), pick every row's
draft length (:mod:`~triton_backend.batching.plan`), draft, run ONE ragged target pass over all
rows, then verify, commit and stream each row on its own
(:mod:`~triton_backend.batching.batch_round`). Requests leave when finished, cancelled or
failed, and their slots go back at once. The parts it calls:

- :mod:`~triton_backend.batching.admission` -- a request's mode resolved once at submit, the
  bounded queue (full: :class:`~triton_backend.batching.admission.QueueFullError` at once, never
  a hang) and structured-output guides compiling beside it;
- :mod:`~triton_backend.batching.slots` -- which slot a new request takes and what it starts from
  (a running request's or a cached entry's keys and values: prefix sharing and caching,
  :mod:`~triton_backend.batching.prefix_cache`), what a leaving one leaves behind;
- :mod:`~triton_backend.batching.round_stats` -- the observers told about rounds, and timing.

Everything runs on the scheduler's thread; clients are told through their
:class:`~triton_backend.batching.admission.RequestHandle`. One request's failure stays its own:
whatever fails for one row (its guide, grammar, stop rule, sampling or drafter; a batched
drafter call that raises is run again row by row: :func:`~triton_backend.batching.batch_round.isolated`)
fails that row's request only; only a failure of the one target pass, which every row shares,
fails the batch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from triton_backend.batching.admission import (AdmissionQueue, QueuedRequest, RequestHandle, SchedulerClosedError,
                                               tell)
from triton_backend.batching.batch_round import (BatchSequence, PlannedRow, describe, drafted_tokens, propose_eagle_rows,
                                                 propose_per_row, propose_with_draft_model, verify_row)
from triton_backend.batching.plan import BatchPolicy, DraftPlanner
from triton_backend.batching.prefill_budget import PrefillBudget, check_slowdown
from triton_backend.batching.prefill_rows import split_rows
from triton_backend.batching.prefix_cache import PrefixCache, PrefixCacheStats
from triton_backend.batching.round_stats import TIMING_LOG_ROUNDS, RoundObserver, RoundTiming
from triton_backend.batching.slots import SHARED_PREFIX_MIN, SlotManager
from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.core.errors import InvalidRequestError, SpecbuildError
from triton_backend.core.guide_cache import GUIDES, GuideCache
from triton_backend.engines.batch import BatchedEngine, PrefixSharing, SlotsExhaustedError
from triton_backend.engines.torch.hf_batched import HFBatchedEngine
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.speculation.cost_model import PassCostModel, current_cost_model
from triton_backend.speculation.drafters.client import ClientDraft
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.eagle import FeatureDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_batch_size``: requests in the batch at once (KV slots); ``max_queue_size``:
    requests waiting for a slot; ``prefill_chunk_tokens``: prompt tokens one round may
    prefill (a longer prompt is split over rounds); ``prefill_slowdown``: beside running decode
    rows, a round's prompt tokens are fewer: as many as keep the pass's cost (the target's
    pass-cost model) within this factor of the decode-only pass, so running streams keep about
    ``1 / prefill_slowdown`` of their pace while a long prompt arrives (None: always
    ``prefill_chunk_tokens``; :mod:`~triton_backend.batching.prefill_budget`); ``policy``: who picks draft lengths;
    ``prefix_cache``: keep finished requests' keys and values for later requests sharing their
    prefix (:mod:`~triton_backend.batching.prefix_cache`; engines that can share a prefix)."""

    max_batch_size: int = 8
    max_queue_size: int = 64
    prefill_chunk_tokens: int = 512
    prefill_slowdown: float | None = 1.3
    policy: BatchPolicy = BatchPolicy.LOAD_AWARE
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue_size", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        check_slowdown(self.prefill_slowdown)
        object.__setattr__(self, "policy", BatchPolicy.parse(self.policy))
        if not isinstance(self.prefix_cache, bool):
            raise InvalidRequestError(f"prefix_cache must be true or false, got {self.prefix_cache!r}")


def batchable(engine: object) -> bool:
    """Whether the scheduler can run ``engine``'s rows (the torch runtime's engines)."""
    return isinstance(engine, (TorchEngine, BatchedEngine))


def as_batched(engine: object, num_slots: int) -> BatchedEngine:
    """The batched engine for a torch engine: the slot engine itself, or the HF wrapper."""
    if isinstance(engine, TorchEngine):
        return HFBatchedEngine(engine, num_slots)
    if isinstance(engine, BatchedEngine):
        return engine
    raise SpecbuildError(f"engine {engine!r} cannot run batched rows")


class BatchScheduler:
    """Continuous batching over a decoder's target and drafters (see the module docstring)."""

    def __init__(self, decoder: SpeculativeDecoder, config: SchedulerConfig | None = None,
                 observer: RoundObserver | None = None, cost_model: PassCostModel | None = None,
                 guides: GuideCache | None = None) -> None:
        self.decoder = decoder
        self.config = config or SchedulerConfig()
        self.observer = observer
        self.target = as_batched(decoder.target, self.config.max_batch_size)
        drafter = decoder.drafters.get(SpeculationMode.DRAFT)
        self.draft_engine = (as_batched(drafter.engine, self.config.max_batch_size)
                             if isinstance(drafter, DraftModelDrafter) else None)
        eagle = decoder.drafters.get(SpeculationMode.EAGLE)
        # one drafter cache for every EAGLE row, a row per target slot: a round drafts all rows in one call
        self.eagle_kv = eagle.new_cache(self.target.num_slots) if isinstance(eagle, FeatureDrafter) else None
        self.planner = DraftPlanner(self.config.policy, cost_model)
        self.prefill_budget = PrefillBudget(self.config.prefill_chunk_tokens, self.config.prefill_slowdown)
        self.rounds = 0
        sharing = self.config.prefix_cache and isinstance(self.target, PrefixSharing)
        self.prefix_cache = PrefixCache(min_tokens=SHARED_PREFIX_MIN) if sharing else None
        self.slots = SlotManager(self.target, self.config.max_batch_size, self.prefix_cache, self.eagle_kv, eagle, observer)
        self.timing = RoundTiming()
        target = decoder.target
        self.queue = AdmissionQueue(self.config.max_queue_size, self.config.max_batch_size, guides or GUIDES,
                                    decoder.tokenizer, target.vocab_size, target.eos_token_ids)
        self._active: list[BatchSequence] = []
        self._handles: dict[int, RequestHandle] = {}
        self._namespaces: dict[int, str] = {}  # a running request's prefix-cache namespace
        self._thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)
        self._thread.start()
        logger.info("batch scheduler: %d slots on %r, queue %d, %s draft lengths", self.config.max_batch_size,
                    self.target, self.config.max_queue_size, self.config.policy.value)

    @property
    def shared_prefix_tokens(self) -> int:
        """Prompt tokens copied from a running request's slot instead of prefilled."""
        return self.slots.shared_prefix_tokens

    # -- client side (any thread) -----------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, spec: SpeculationConfig,
               handle: RequestHandle, client_draft: ClientDraft | None = None, namespace: str = "") -> None:
        """Queue a request (validated: ``prompt_ids`` from :meth:`SpeculativeDecoder.encode`); its
        mode is resolved here, once, against the deployed drafters.
        ``client_draft``: the client's drafts, verified in its first round instead of a drafter's.
        ``namespace``: its prefix-cache namespace (a tenant's key): keys and values are shared
        only between requests of one namespace.
        Raises at once: InvalidRequestError (mode not deployed, a bad draft), QueueFullError."""
        if not isinstance(namespace, str):
            raise InvalidRequestError(f"a prefix-cache namespace is a string, got {type(namespace).__name__}")
        requested = SpeculationMode.OFF if client_draft is not None else spec.method
        mode, drafter = self.decoder.resolve(requested, spec.auto_drafter)
        if client_draft is not None:
            client_draft.check_vocab(self.decoder.target.vocab_size)
        self.queue.put(QueuedRequest(list(prompt_ids), params, spec, mode, drafter,
                                     self.decoder.auto_ngram(spec.method, mode), handle, time.perf_counter(),
                                     client_draft, namespace))

    def load(self) -> tuple[int, int]:
        """(requests in the batch, requests queued, their guides compiling among them)."""
        return len(self._active), self.queue.waiting()

    def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; finish the admitted and queued ones (``drain``) or fail them."""
        self.queue.close(drain)
        self._thread.join()

    # -- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while self.queue.wait_for_work(bool(self._active)):
            try:
                self.queue.take_compiled()
                self._drop_cancelled()
                self._admit()
                if self._active:
                    self._round()
                else:  # queued but no slot free (held outside the batch): wait a moment, do not spin
                    self.queue.pause(0.01)
            except Exception as exc:  # a failed pass fails the requests in it, never the scheduler
                logger.exception("batch round failed")
                for seq in list(self._active):
                    self._finish(seq, error=exc)
        self._close_all()

    def _admit(self) -> None:
        while len(self._active) < self.config.max_batch_size:
            job = self.queue.pop()
            if job is None:
                return
            if job.handle.cancelled():
                tell(job.handle.on_cancelled)
                continue
            try:
                seq = self._start(job)
            except SlotsExhaustedError:
                self.queue.push_front(job)
                return
            except Exception as exc:  # this request cannot start; the others go on
                if not isinstance(exc, SpecbuildError):
                    logger.exception("a request could not join the batch")
                tell(job.handle.on_error, exc)
                continue
            self._active.append(seq)
            self._handles[id(seq)] = job.handle
            self._namespaces[id(seq)] = job.namespace

    def _start(self, job: QueuedRequest) -> BatchSequence:
        """The request's sequence in the batch, in the mode resolved at submit, on a slot."""
        batched_draft = isinstance(job.drafter, DraftModelDrafter) and self.draft_engine is not None
        seq = BatchSequence(self.decoder.target, self.decoder.tokenizer, job.prompt_ids, job.params, job.spec, job.mode,
                            job.drafter, started=job.submitted, drafter_session=not batched_draft, ngram=job.ngram,
                            compiled_guide=job.compiled)
        if job.client_draft is not None:
            seq.attach_client_draft(job.client_draft)
        bound = (seq.eagle is not None and self.eagle_kv is not None
                 and seq.drafter is self.decoder.drafters.get(SpeculationMode.EAGLE))
        self.slots.seat(seq, job.namespace, bound, self._active, self._namespaces)
        if batched_draft:
            try:
                seq.draft_slot = self.draft_engine.allocate()
            except BaseException:  # this request cannot start: its slot goes back
                self.target.release(seq.slot)
                raise
        return seq

    def _drop_cancelled(self) -> None:
        for seq in list(self._active):
            if self._handles[id(seq)].cancelled():
                self._finish(seq, cancelled=True)

    def _round(self) -> None:
        """One round for every active row: plan, draft, ONE ragged target pass, verify, commit, stream."""
        started = time.perf_counter()
        decoding = sum(1 for seq in self._active if not seq.prompting)  # rows past their prompt
        budget = self.prefill_budget.tokens(decoding, self.planner.cost_model or current_cost_model(self.decoder.target))
        prefill, planned = split_rows(self._active, budget)
        # a prompt short enough for the round's budget rides in a planned row: such a round
        # runs several plain rounds long, whatever the regime, so it is not measured either
        prompting = bool(prefill) or any(r.seq.prompting for r in planned)
        # structured output: forced tokens ride for free; a draft taking the prompt from the
        # target's cache waits for the target's prefill (the row's first round is plain)
        free = [r for r in planned if not self._offer_forced(r) and not r.seq.context_pending]
        ks = self.planner.plan([r.seq for r in free])
        for row, k in zip(free, ks):
            row.k = k
        propose_eagle_rows(planned)
        propose_per_row(planned)
        if self.draft_engine is not None:
            propose_with_draft_model(self.draft_engine, planned, self.target)
        planned = self._without_failed(planned)
        if not planned and not prefill:
            return
        rows = prefill + [r.target_row() for r in planned]
        t0 = time.perf_counter()
        outputs = self.target.forward(rows)
        verify_s = time.perf_counter() - t0
        self.rounds += 1
        for row in prefill:
            next(s for s in self._active if s.slot == row.slot).after_prefill(row)
        committed = sum(self._verify_and_stream(row, out, verify_s) for row, out in zip(planned, outputs[len(prefill):]))
        if not prompting:  # the planner measures its regimes on decode/verify rounds only
            self.planner.record_round(len(rows), committed, time.perf_counter() - started)
        speculating = sum(1 for r in planned if len(r.proposal))
        if logger.isEnabledFor(logging.DEBUG):  # the round's shape is built only for the decision log
            logger.debug("round %d: %s, regime %s", self.rounds, describe(planned, len(prefill)),
                         self.planner.regime.value if self.planner.regime is not None else "-")
        if self.observer is not None:
            self.observer.round_done(len(rows), speculating, drafted_tokens(planned), len(self.queue.queued))
        self.timing.add(len(rows), speculating, verify_s, time.perf_counter() - started)
        if self.timing.rounds >= TIMING_LOG_ROUNDS:
            chooser = self.planner.chooser
            logger.info("batch scheduler: %s; measured tokens/s by regime at %d rows: %s; prompt tokens shared "
                        "so far: %d; prefix cache: %s", self.timing.summary(), len(rows),
                        chooser.rates(len(rows)) if chooser is not None else "-", self.shared_prefix_tokens,
                        self.prefix_cache_stats().as_dict() if self.prefix_cache is not None else "off")
            self.timing = RoundTiming()

    @staticmethod
    def _offer_forced(row: PlannedRow) -> bool:
        """The row's grammar-forced draft (structured output); a row whose grammar fails here
        keeps the error and drafts nothing."""
        try:
            return row.offer_forced()
        except Exception as exc:
            row.error = exc
            return True

    def _without_failed(self, planned: list[PlannedRow]) -> list[PlannedRow]:
        """Fail the rows that failed while drafting (their requests alone); the others go on."""
        kept = []
        for row in planned:
            if row.error is None:
                kept.append(row)
                continue
            if not isinstance(row.error, SpecbuildError):
                logger.error("a row failed while drafting; its request fails, the batch goes on",
                             exc_info=row.error)
            self._finish(row.seq, error=row.error)
        return kept

    def _verify_and_stream(self, row: PlannedRow, out: object, verify_s: float) -> int:
        """Verify, commit and stream one row; returns the tokens it committed."""
        seq = row.seq
        try:
            outcome = verify_row(self.target, row, out).outcome(row.draft_s, verify_s, forced=row.forced)
            seq.record(outcome)
            chunk = seq.commit.commit(outcome.block)
        except Exception as exc:  # its grammar, sampling or stop rule: this request fails, the others go on
            if not isinstance(exc, SpecbuildError):
                logger.exception("a row failed in verification; its request fails, the batch goes on")
            self._finish(seq, error=exc)
            return 0
        if chunk is not None and not tell(self._handles[id(seq)].on_chunk, chunk):
            self._finish(seq, cancelled=True)
            return len(outcome.block)
        if seq.commit.finished:
            self._finish(seq)
        return len(outcome.block)

    def _finish(self, seq: BatchSequence, *, error: BaseException | None = None, cancelled: bool = False) -> None:
        """Take a sequence out of the batch and give its slots back (a clean finish leaves its
        keys and values to the prefix cache); tell the client why."""
        if seq in self._active:
            self._active.remove(seq)
        namespace = self._namespaces.pop(id(seq), "")
        if error is None:
            self.slots.retain(seq, namespace)
        seq.release(self.target, self.draft_engine)
        handle = self._handles.pop(id(seq), None)
        if handle is None:
            return
        if error is not None:
            tell(handle.on_error, error)
        elif cancelled:
            tell(handle.on_cancelled)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counts (zeros when it is off)."""
        return self.prefix_cache.stats if self.prefix_cache is not None else PrefixCacheStats()

    def _close_all(self) -> None:
        closed = SchedulerClosedError("the model is shutting down")
        for seq in list(self._active):
            self._finish(seq, error=closed)
        self.slots.clear()
        for job in self.queue.take_all():
            tell(job.handle.on_error, closed)


__all__ = ["BatchScheduler", "SchedulerConfig", "as_batched", "batchable"]
