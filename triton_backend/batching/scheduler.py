"""In-flight (continuous) batching: one scheduler per model instance owns the batched engines.

Requests wait in a bounded queue (full: :class:`QueueFullError` at once, never a hang) and
join the batch at the next round while a slot is free; they leave when finished, cancelled
or failed, and their slots go back at once. Each round (:mod:`triton_backend.batching.batch_round`):
drop cancelled requests, pick every row's draft length (:mod:`triton_backend.batching.plan`),
draft, run ONE ragged target pass over all rows (prefill chunks of new prompts beside
decode/verify rows, at most ``prefill_chunk_tokens`` prompt tokens a round so a long prompt
cannot stall everyone), then verify, commit and stream each row on its own. A new request
whose prompt starts with tokens an active sequence has committed (a chat template's system
prompt) takes their keys and values from that sequence's slot instead of prefilling them,
where the engine can share a prefix exactly (:class:`~triton_backend.engines.batch.PrefixSharing`).
A request that leaves keeps its slot's keys and values resident (prefix caching,
:mod:`triton_backend.batching.prefix_cache`): a later request whose prompt starts with the same
tokens starts from them, and the least recently used of those slots is evicted when a new
request needs one. Everything runs on the scheduler's thread; clients are told through their :class:`RequestHandle`.

One request's failure stays its own. A request with a structured-output guide waits outside the
queue until its guide is compiled and probed on a thread of its own, within the time budget
(:mod:`triton_backend.core.guide_cache`); a guide the grammar engine refuses fails that request
alone, before it joins the batch. In a round, whatever fails for one row (its grammar, stop rule,
sampling or drafter; a batched drafter call that raises is run again row by row:
:func:`~triton_backend.batching.batch_round.isolated`) fails that row's request only; only a failure of
the one target pass, which every row shares, fails the batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence, runtime_checkable

from triton_backend.batching.plan import BatchPolicy, DraftPlanner
from triton_backend.batching.prefix_cache import (CachedPrefix, DrafterContext, PrefixCache, PrefixCacheStats,
                                                  copy_drafter_rows, drafter_context, resume_drafter, shared_length)
from triton_backend.batching.batch_round import (BatchSequence, PlannedRow, describe, drafted_tokens, propose_eagle_rows,
                                        propose_per_row, propose_with_draft_model, verify_row)
from triton_backend.core.guide_cache import GUIDES, CompiledGuide, GuideCache, over_budget
from triton_backend.speculation.commit import GenerationChunk
from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.drafters.client import ClientDraft
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.eagle import FeatureDrafter
from triton_backend.engines.batch import BatchedEngine, BatchRow, PrefixSharing, SlotsExhaustedError
from triton_backend.engines.torch.hf_batched import HFBatchedEngine
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.core.errors import InvalidRequestError, OverloadedError, SpecbuildError
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.policy import PassCostModel

logger = logging.getLogger(__name__)


class QueueFullError(OverloadedError):
    """The scheduler's queue is full: the server is overloaded; retry later."""


class SchedulerClosedError(SpecbuildError):
    code = "overloaded"


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_batch_size``: requests in the batch at once (KV slots); ``max_queue_size``:
    requests waiting for a slot; ``prefill_chunk_tokens``: prompt tokens one round may
    prefill (a longer prompt is split over rounds); ``policy``: who picks draft lengths;
    ``prefix_cache``: keep finished requests' keys and values for later requests sharing their
    prefix (:mod:`~triton_backend.batching.prefix_cache`; engines that can share a prefix)."""

    max_batch_size: int = 8
    max_queue_size: int = 64
    prefill_chunk_tokens: int = 512
    policy: BatchPolicy = BatchPolicy.LOAD_AWARE
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue_size", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "policy", BatchPolicy.parse(self.policy))
        if not isinstance(self.prefix_cache, bool):
            raise InvalidRequestError(f"prefix_cache must be true or false, got {self.prefix_cache!r}")


class RequestHandle(Protocol):
    """How the scheduler talks to one request's client (called on the scheduler thread)."""

    def on_chunk(self, chunk: GenerationChunk) -> None: ...
    def on_error(self, exc: BaseException) -> None: ...
    def cancelled(self) -> bool: ...
    def on_cancelled(self) -> None: ...


@runtime_checkable
class RoundObserver(Protocol):
    """Told about every round. ``round_done`` runs on the scheduler thread every round: it
    must only count (no blocking I/O); ``flush`` publishes the counts (called elsewhere,
    every so often and before a request's last response)."""

    def round_done(self, batch_size: int, speculating_rows: int, draft_tokens: int, queued: int) -> None: ...
    def flush(self) -> None: ...


@runtime_checkable
class PrefixCacheObserver(Protocol):
    """Told, on the scheduler thread, where every admitted request's prompt came from: it must
    only count (published with the rounds' counts)."""

    def prefix_lookup(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None: ...


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


TIMING_LOG_ROUNDS = 256  # rounds between two timing lines in the log
SHARED_PREFIX_MIN = 4  # prompt tokens another sequence's slot must hold for a new one to copy them


@dataclass
class RoundTiming:
    """Where the rounds' time went: the target pass against the whole round (planning,
    drafting, verification, commits and handing chunks to the clients)."""

    rounds: int = 0
    rows: int = 0
    speculating_rows: int = 0
    pass_s: float = 0.0
    round_s: float = 0.0

    def add(self, rows: int, speculating_rows: int, pass_s: float, round_s: float) -> None:
        self.rounds += 1
        self.rows += rows
        self.speculating_rows += speculating_rows
        self.pass_s += pass_s
        self.round_s += round_s

    def summary(self) -> str:
        n = max(1, self.rounds)
        return (f"{self.rounds} rounds of {self.rows / n:.1f} rows ({self.speculating_rows / n:.1f} speculating): "
                f"target pass {1e3 * self.pass_s / n:.1f} ms, round {1e3 * self.round_s / n:.1f} ms "
                f"({1e3 * (self.round_s - self.pass_s) / n:.1f} ms outside the pass)")


@dataclass
class _Job:
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpeculationConfig
    mode: SpeculationMode
    handle: RequestHandle
    submitted: float
    client_draft: ClientDraft | None = None  # drafts the client sent, verified in the first round
    guide: "Future[CompiledGuide] | None" = None  # its structured-output guide, compiling
    compiled: CompiledGuide | None = None  # its guide, compiled and probed
    deadline: float = 0.0  # when a guide still compiling is refused (perf_counter)
    namespace: str = ""  # its prefix-cache namespace: it shares keys and values only with requests of the same


@dataclass(frozen=True)
class _PrefixSource:
    """Where a new request's leading keys and values come from: ``slot`` (a cached entry's,
    ``entry`` set, or a running request's) holds ``length`` of its positions; an EAGLE
    request's ``drafter`` context there, of which it reuses ``drafter_fed`` pairs (and features
    up to ``length``); ``adopt``: the request takes the entry's slot."""

    slot: int
    length: int
    drafter: DrafterContext | None = None
    drafter_fed: int = 0
    entry: CachedPrefix | None = None
    adopt: bool = False


class BatchScheduler:
    """Continuous batching over a decoder's target and drafters (see the module docstring)."""

    def __init__(self, decoder: SpeculativeDecoder, config: SchedulerConfig | None = None,
                 observer: RoundObserver | None = None, cost_model: PassCostModel | None = None,
                 guides: GuideCache | None = None) -> None:
        self.decoder = decoder
        self.guides = guides or GUIDES
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
        self.rounds = 0
        self.shared_prefix_tokens = 0  # prompt tokens copied from a running request's slot instead of prefilled
        sharing = self.config.prefix_cache and isinstance(self.target, PrefixSharing)
        self.prefix_cache = PrefixCache(min_tokens=SHARED_PREFIX_MIN) if sharing else None
        self.timing = RoundTiming()
        self._queue: deque[_Job] = deque()
        self._compiling: list[_Job] = []  # waiting for their guide (outside the queue's order, inside its bound)
        self._active: list[BatchSequence] = []
        self._handles: dict[int, RequestHandle] = {}
        self._namespaces: dict[int, str] = {}  # a running request's prefix-cache namespace
        self._cond = threading.Condition()
        self._closed = False
        self._draining = True
        self._thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)
        self._thread.start()
        logger.info("batch scheduler: %d slots on %r, queue %d, %s draft lengths", self.config.max_batch_size,
                    self.target, self.config.max_queue_size, self.config.policy.value)

    # -- client side (any thread) -----------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, spec: SpeculationConfig,
               handle: RequestHandle, client_draft: ClientDraft | None = None, namespace: str = "") -> None:
        """Queue a request (validated: ``prompt_ids`` from :meth:`SpeculativeDecoder.encode`).
        ``client_draft``: the client's drafts, verified in its first round instead of a drafter's.
        ``namespace``: its prefix-cache namespace (a tenant's key): keys and values are shared
        only between requests of one namespace.
        Raises at once: InvalidRequestError (mode not deployed, a bad draft), QueueFullError."""
        if not isinstance(namespace, str):
            raise InvalidRequestError(f"a prefix-cache namespace is a string, got {type(namespace).__name__}")
        mode, _ = self.decoder.resolve(SpeculationMode.OFF if client_draft is not None else spec.method,
                                       spec.auto_drafter)
        if client_draft is not None:
            client_draft.check_vocab(self.decoder.target.vocab_size)
        job = _Job(list(prompt_ids), params, spec, mode, handle, time.perf_counter(), client_draft, namespace=namespace)
        with self._cond:
            if self._closed:
                raise SchedulerClosedError("the model is shutting down")
            waiting = len(self._queue) + len(self._compiling)
            if waiting >= self.config.max_queue_size:
                raise QueueFullError(f"{waiting} requests already wait for one of "
                                     f"{self.config.max_batch_size} batch slots; retry later")
        if params.guide is not None:
            self._prepare_guide(job)
        with self._cond:
            if self._closed:  # closed while the guide compiled
                raise SchedulerClosedError("the model is shutting down")
            if job.guide is not None:
                self._compiling.append(job)
            else:
                self._queue.append(job)
            self._cond.notify()

    def _prepare_guide(self, job: _Job) -> None:
        """Start compiling the job's guide (a cached one is ready at once; a cached refusal
        raises here, as the submit's error)."""
        target = self.decoder.target
        future = self.guides.prepare(job.params.guide, self.decoder.tokenizer, vocab=target.vocab_size,
                                     eos_token_ids=sorted(target.eos_token_ids))
        if future.done():
            job.compiled = future.result()  # raises its refusal
            return
        job.guide, job.deadline = future, time.perf_counter() + self.guides.budget.max_compile_s
        future.add_done_callback(self._wake)

    def _wake(self, _: object = None) -> None:
        with self._cond:
            self._cond.notify()

    def load(self) -> tuple[int, int]:
        """(requests in the batch, requests queued, their guides compiling among them)."""
        with self._cond:
            return len(self._active), len(self._queue) + len(self._compiling)

    def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; finish the admitted and queued ones (``drain``) or fail them."""
        with self._cond:
            self._closed = True
            self._draining = drain
            self._cond.notify()
        self._thread.join()

    # -- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._queue and not self._active:
                    if self._compiling:  # a guide's deadline is due, or its compile ends
                        self._cond.wait(max(0.0, min(j.deadline for j in self._compiling) - time.perf_counter()))
                        break
                    self._cond.wait()
                if self._closed and not (self._draining and (self._queue or self._active or self._compiling)):
                    break
            try:
                self._take_compiled()
                self._drop_cancelled()
                self._admit()
                if self._active:
                    self._round()
                else:  # queued but no slot free (held outside the batch): wait a moment, do not spin
                    with self._cond:
                        self._cond.wait(0.01)
            except Exception as exc:  # a failed pass fails the requests in it, never the scheduler
                logger.exception("batch round failed")
                for seq in list(self._active):
                    self._finish(seq, error=exc)
        self._close_all()

    def _take_compiled(self) -> None:
        """Jobs whose guide compiled join the queue; a refused guide, or one past its time
        budget, fails its own request."""
        with self._cond:
            if not self._compiling:
                return
            now, ready, failed, waiting = time.perf_counter(), [], [], []
            for job in self._compiling:
                future = job.guide
                assert future is not None
                if future.done():
                    error = future.exception()
                    if error is None:
                        job.compiled, job.guide = future.result(), None
                        ready.append(job)
                    else:
                        failed.append((job, error))
                elif now >= job.deadline:
                    failed.append((job, over_budget(job.params.guide, self.guides.budget.max_compile_s)))
                elif job.handle.cancelled():
                    failed.append((job, None))
                else:
                    waiting.append(job)
            self._compiling = waiting
            self._queue.extend(ready)
        for job, error in failed:
            if error is None:
                self._tell(job.handle.on_cancelled)
            else:
                self._tell(job.handle.on_error, error)

    def _admit(self) -> None:
        while len(self._active) < self.config.max_batch_size:
            with self._cond:
                if not self._queue:
                    return
                job = self._queue.popleft()
            if job.handle.cancelled():
                self._tell(job.handle.on_cancelled)
                continue
            try:
                seq = self._start(job)
            except SlotsExhaustedError:
                with self._cond:
                    self._queue.appendleft(job)
                return
            except Exception as exc:  # this request cannot start; the others go on
                if not isinstance(exc, SpecbuildError):
                    logger.exception("a request could not join the batch")
                self._tell(job.handle.on_error, exc)
                continue
            self._active.append(seq)
            self._handles[id(seq)] = job.handle
            self._namespaces[id(seq)] = job.namespace

    def _start(self, job: _Job) -> BatchSequence:
        mode, drafter = self.decoder.resolve(job.mode, job.spec.auto_drafter)
        batched_draft = isinstance(drafter, DraftModelDrafter) and self.draft_engine is not None
        seq = BatchSequence(self.decoder.target, self.decoder.tokenizer, job.prompt_ids, job.params, job.spec, mode, drafter,
                            started=job.submitted, drafter_session=not batched_draft,
                            ngram=self.decoder.auto_ngram(job.spec.method, mode), compiled_guide=job.compiled)
        if job.client_draft is not None:
            seq.attach_client_draft(job.client_draft)
        bound = (seq.eagle is not None and self.eagle_kv is not None
                 and seq.drafter is self.decoder.drafters.get(SpeculationMode.EAGLE))
        source = self._prefix_source(seq, job.namespace, bound) if isinstance(self.target, PrefixSharing) else None
        evicted = self.prefix_cache.stats.evictions if self.prefix_cache is not None else 0
        seq.slot, source = self._take_slot(source)
        try:
            if bound:
                seq.eagle.bind(self.eagle_kv, seq.slot)
            self._reuse(seq, source, bound)
            if batched_draft:
                seq.draft_slot = self.draft_engine.allocate()
        except BaseException:  # this request cannot start: its slot goes back (a source it adopted is lost)
            self.target.release(seq.slot)
            raise
        if self.prefix_cache is not None and isinstance(self.observer, PrefixCacheObserver):
            self.observer.prefix_lookup(len(seq.tokens), seq.valid, self.prefix_cache.stats.evictions - evicted)
        return seq

    def _prefix_source(self, seq: BatchSequence, namespace: str, bound: bool) -> _PrefixSource | None:
        """The slot holding the most of ``seq``'s prompt that it can start from: a cached entry of
        its namespace or a running request's committed positions (an EAGLE request: only as far
        as the drafter's context in that slot goes too). None: none worth a copy."""
        if seq.eagle is not None and not bound:  # its drafter's context lives outside the scheduler's cache
            return None
        best: _PrefixSource | None = None
        prompt = seq.tokens
        candidates: list[tuple[int, list[int], int, CachedPrefix | None, BatchSequence | None]] = []
        if self.prefix_cache is not None:
            candidates += [(e.slot, e.tokens, len(e.tokens), e, None) for e in self.prefix_cache.entries(namespace)]
        for other in self._active:
            if other.slot is not None and self._namespaces.get(id(other), "") == namespace:
                candidates.append((other.slot, other.tokens, other.valid, None, other))
        for slot, tokens, valid, entry, other in candidates:
            shared = min(shared_length(tokens, prompt), valid)  # positions holding this prompt's keys and values
            usable = min(shared, len(prompt) - 1)  # the last prompt token is fed: its logits start decoding
            if usable < SHARED_PREFIX_MIN or (best is not None and usable <= best.length):
                continue
            context, fed, reused = None, 0, usable
            if seq.eagle is not None:  # as far as the drafter's context goes too
                context = entry.drafter if entry is not None else self._drafter_context(other)
                fed, reused = context.reusable(shared, usable) if context is not None else (0, 0)
            if reused >= SHARED_PREFIX_MIN and (best is None or reused > best.length):
                best = _PrefixSource(slot, reused, context, fed, entry,
                                     adopt=entry is not None and shared >= len(entry.tokens))
        return best

    def _drafter_context(self, seq: BatchSequence | None) -> DrafterContext | None:
        """The EAGLE drafter's context that ``seq``'s slot row of the scheduler's drafter cache
        holds (None: none there)."""
        if seq is None or seq.eagle is None or self.eagle_kv is None or seq.slot is None:
            return None
        kv, row, _ = seq.eagle.cache(0)
        return drafter_context(seq.eagle, seq.tokens) if kv is self.eagle_kv and row == seq.slot else None

    def _take_slot(self, source: _PrefixSource | None) -> tuple[int, _PrefixSource | None]:
        """A target slot for a new request, and its prefix source as it stands then: a cached
        entry's slot the request extends whole (adopted), else a free one, else the least
        recently used entry's (evicted; never the source's while another can go, and never a
        running request's, which the cache does not hold)."""
        cache, entry = self.prefix_cache, source.entry if source is not None else None
        if cache is not None and entry is not None and source.adopt:
            return cache.take(entry.slot).slot, source
        # the cache holds only slots the batch would hold otherwise: the engine's other slots stay
        # free for whoever else runs on it (sessions of the single-request loop, measurements)
        if cache is None or len(self._active) + len(cache) < self.config.max_batch_size:
            try:
                return self.target.allocate(), source
            except SlotsExhaustedError:
                if cache is None:
                    raise
        evicted = cache.evict(keep=entry.slot if entry is not None else None)
        if evicted is not None:
            self.target.release(evicted)
            return self.target.allocate(), source
        if entry is not None:  # the source's own slot is the only one left: the request takes it
            return cache.take(entry.slot).slot, replace(source, adopt=True)
        raise SlotsExhaustedError(f"all {self.target.num_slots} KV-cache slots are in use")

    def _reuse(self, seq: BatchSequence, source: _PrefixSource | None, bound: bool) -> None:
        """Start ``seq`` from ``source``'s keys and values (copied, or in place when adopted) and,
        for an EAGLE request, from its drafter's context there too: its prefill skips them."""
        cache = self.prefix_cache
        if cache is not None:
            cache.stats.lookups += 1
            cache.stats.prompt_tokens += len(seq.tokens)
        if source is None:
            return
        assert isinstance(self.target, PrefixSharing) and seq.slot is not None
        if not source.adopt:
            self.target.copy_prefix(source.slot, seq.slot, source.length)
            if bound and source.drafter_fed:
                copy_drafter_rows(self.eagle_kv, source.slot, seq.slot, source.drafter_fed)
        if bound and source.drafter is not None:
            resume_drafter(seq.eagle, self.decoder.drafters[SpeculationMode.EAGLE], source.drafter, source.drafter_fed,
                           source.length)
        seq.valid = source.length
        if source.entry is None:
            self.shared_prefix_tokens += source.length
        elif not source.adopt and cache is not None:
            cache.touch(source.entry.slot)
        if cache is not None:
            cache.stats.hits += 1
            cache.stats.reused_tokens += source.length
            cache.stats.adopted += int(source.adopt)

    def _drop_cancelled(self) -> None:
        for seq in list(self._active):
            if self._handles[id(seq)].cancelled():
                self._finish(seq, cancelled=True)

    def _round(self) -> None:
        started = time.perf_counter()
        prefill, planned = self._split(self._active)
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
            self.observer.round_done(len(rows), speculating, drafted_tokens(planned), len(self._queue))
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

    def _split(self, active: Sequence[BatchSequence]) -> tuple[list[BatchRow], list[PlannedRow]]:
        """Prefill chunks for prompts longer than what is left of the round's budget; a round
        (draft + verify) for every other sequence."""
        budget = self.config.prefill_chunk_tokens
        prefill: list[BatchRow] = []
        planned: list[PlannedRow] = []
        for seq in active:
            pending = seq.pending()
            if pending <= 1 or seq.eagle is not None:  # an EAGLE prompt feeds the drafter's features whole (no chunks)
                budget -= pending if pending > 1 else 0
                planned.append(PlannedRow(seq, 0))
            elif pending <= budget:
                budget -= pending
                planned.append(PlannedRow(seq, 0))
            elif budget > 0:
                row = seq.prefill_row(budget)
                budget -= len(row.tokens)
                prefill.append(row)
        return prefill, planned

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
        if chunk is not None and not self._tell(self._handles[id(seq)].on_chunk, chunk):
            self._finish(seq, cancelled=True)
            return len(outcome.block)
        if seq.commit.finished:
            self._finish(seq)
        return len(outcome.block)

    def _finish(self, seq: BatchSequence, *, error: BaseException | None = None, cancelled: bool = False) -> None:
        """Take a sequence out of the batch and give its slots back; tell the client why."""
        if seq in self._active:
            self._active.remove(seq)
        namespace = self._namespaces.pop(id(seq), "")
        if error is None:
            self._retain(seq, namespace)
        seq.release(self.target, self.draft_engine)
        handle = self._handles.pop(id(seq), None)
        if handle is None:
            return
        if error is not None:
            self._tell(handle.on_error, error)
        elif cancelled:
            self._tell(handle.on_cancelled)

    def _retain(self, seq: BatchSequence, namespace: str) -> None:
        """Keep a leaving request's slot as a prefix-cache entry of the positions it holds
        committed (its prompt and answer), with its EAGLE drafter's context there; the slot is
        the cache's then, not the request's."""
        if self.prefix_cache is None or seq.slot is None:
            return
        held = min(seq.valid, len(seq.tokens))
        tokens = list(seq.tokens[:held])
        context = self._drafter_context(seq)
        if context is not None:  # what holds for the entry's own tokens (pairs need the token after them)
            fed, end = context.reusable(held, held)
            features = context.features[:end - fed] if context.features is not None and end > fed else None
            context = DrafterContext(fed, features)
        entry = CachedPrefix(seq.slot, tokens, namespace, context)
        if self.prefix_cache.retain(entry):
            seq.slot = None  # BatchSequence.release gives back what the request still owns

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counts (zeros when it is off)."""
        return self.prefix_cache.stats if self.prefix_cache is not None else PrefixCacheStats()

    @staticmethod
    def _tell(callback: Callable[..., object], *args: object) -> bool:
        """Call a client callback; False when it raised (the client is gone; logged)."""
        try:
            callback(*args)
            return True
        except Exception:
            logger.exception("a request's client callback failed")
            return False

    def _close_all(self) -> None:
        closed = SchedulerClosedError("the model is shutting down")
        for seq in list(self._active):
            self._finish(seq, error=closed)
        if self.prefix_cache is not None:
            for slot in self.prefix_cache.clear():
                self.target.release(slot)
        with self._cond:
            jobs, self._queue = list(self._queue) + self._compiling, deque()
            self._compiling = []
        for job in jobs:
            self._tell(job.handle.on_error, closed)


__all__ = ["BatchScheduler", "PrefixCacheObserver", "QueueFullError", "RequestHandle", "RoundObserver", "SchedulerConfig",
           "as_batched", "batchable"]
