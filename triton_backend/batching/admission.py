"""Admission to the batch: a request's queued form and the bounded queue it waits in.

A request is checked and its speculation mode resolved ONCE, when it is submitted
(:class:`QueuedRequest` carries the mode, its drafter and ``auto``'s n-gram drafter to the
batch). It then waits in a bounded queue (full: :class:`QueueFullError` at once, never a hang);
a request with a structured-output guide waits beside the queue (inside its bound) until its
guide is compiled and probed on a thread of its own, within the time budget
(:mod:`triton_backend.core.guide_cache`): a guide the grammar engine refuses, or one past its
budget, fails that request alone, before it joins the batch. The scheduler's thread takes
requests from the front while a batch slot is free (:class:`AdmissionQueue`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.core.errors import OverloadedError, SpecbuildError
from triton_backend.core.guide_cache import CompiledGuide, GuideCache, over_budget
from triton_backend.speculation.commit import GenerationChunk
from triton_backend.speculation.drafters.client import ClientDraft
from triton_backend.speculation.drafters.protocol import Drafter

logger = logging.getLogger(__name__)


class QueueFullError(OverloadedError):
    """The scheduler's queue is full: the server is overloaded; retry later."""


class SchedulerClosedError(SpecbuildError):
    code = "overloaded"


class RequestHandle(Protocol):
    """How the scheduler talks to one request's client (called on the scheduler thread)."""

    def on_chunk(self, chunk: GenerationChunk) -> None: ...
    def on_error(self, exc: BaseException) -> None: ...
    def cancelled(self) -> bool: ...
    def on_cancelled(self) -> None: ...


def tell(callback: Callable[..., object], *args: object) -> bool:
    """Call a client callback; False when it raised (the client is gone; logged)."""
    try:
        callback(*args)
        return True
    except Exception:
        logger.exception("a request's client callback failed")
        return False


@dataclass
class QueuedRequest:
    """A submitted request on its way into the batch. ``mode`` / ``drafter`` / ``ngram``: what it
    runs in, resolved once at submit against the deployed drafters (``ngram``: the n-gram drafter
    an ``auto`` request drafts from beside its model drafter, else None)."""

    prompt_ids: list[int]
    params: SamplingParams
    spec: SpeculationConfig
    mode: SpeculationMode
    drafter: Drafter | None
    ngram: Drafter | None
    handle: RequestHandle
    submitted: float
    client_draft: ClientDraft | None = None  # drafts the client sent, verified in the first round
    namespace: str = ""  # its prefix-cache namespace: it shares keys and values only with requests of the same
    guide: "Future[CompiledGuide] | None" = None  # its structured-output guide, compiling
    compiled: CompiledGuide | None = None  # its guide, compiled and probed
    deadline: float = 0.0  # when a guide still compiling is refused (perf_counter)


class AdmissionQueue:
    """The queue in front of the batch and the requests whose guide compiles beside it. Clients
    put from any thread; the scheduler's thread takes. ``closed``: no new request is taken;
    ``draining``: the admitted and queued ones still run."""

    def __init__(self, max_size: int, max_batch_size: int, guides: GuideCache, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> None:
        self.max_size, self.max_batch_size = max_size, max_batch_size
        self.guides = guides
        self._guide_args = (tokenizer, vocab_size, sorted(eos_token_ids))
        self.cond = threading.Condition()
        self.queued: deque[QueuedRequest] = deque()
        self.compiling: list[QueuedRequest] = []  # waiting for their guide (outside the queue's order, inside its bound)
        self.closed = False
        self.draining = True

    # -- client side (any thread) -----------------------------------------------------------
    def put(self, job: QueuedRequest) -> None:
        """Queue ``job`` (its guide compiling first, if it has one). Raises at once:
        QueueFullError, SchedulerClosedError, a cached refusal of its guide."""
        with self.cond:
            if self.closed:
                raise SchedulerClosedError("the model is shutting down")
            waiting = len(self.queued) + len(self.compiling)
            if waiting >= self.max_size:
                raise QueueFullError(f"{waiting} requests already wait for one of "
                                     f"{self.max_batch_size} batch slots; retry later")
        if job.params.guide is not None:
            self._prepare_guide(job)
        with self.cond:
            if self.closed:  # closed while the guide compiled
                raise SchedulerClosedError("the model is shutting down")
            if job.guide is not None:
                self.compiling.append(job)
            else:
                self.queued.append(job)
            self.cond.notify()

    def _prepare_guide(self, job: QueuedRequest) -> None:
        """Start compiling the job's guide (a cached one is ready at once; a cached refusal
        raises here, as the submit's error)."""
        tokenizer, vocab, eos = self._guide_args
        future = self.guides.prepare(job.params.guide, tokenizer, vocab=vocab, eos_token_ids=eos)
        if future.done():
            job.compiled = future.result()  # raises its refusal
            return
        job.guide, job.deadline = future, time.perf_counter() + self.guides.budget.max_compile_s
        future.add_done_callback(self.wake)

    def wake(self, _: object = None) -> None:
        with self.cond:
            self.cond.notify()

    def waiting(self) -> int:
        """Requests queued, their guides compiling among them."""
        with self.cond:
            return len(self.queued) + len(self.compiling)

    def close(self, drain: bool) -> None:
        with self.cond:
            self.closed = True
            self.draining = drain
            self.cond.notify()

    # -- the scheduler thread -------------------------------------------------------------
    def wait_for_work(self, active: bool) -> bool:
        """Block until there is something to do (``active``: the batch has requests); False when
        the scheduler is to stop (closed, and nothing left to drain)."""
        with self.cond:
            while not self.closed and not self.queued and not active:
                if self.compiling:  # a guide's deadline is due, or its compile ends
                    self.cond.wait(max(0.0, min(j.deadline for j in self.compiling) - time.perf_counter()))
                    break
                self.cond.wait()
            return not (self.closed and not (self.draining and (self.queued or active or self.compiling)))

    def pause(self, seconds: float) -> None:
        """Wait a moment (queued but no slot free: do not spin)."""
        with self.cond:
            self.cond.wait(seconds)

    def pop(self) -> QueuedRequest | None:
        with self.cond:
            return self.queued.popleft() if self.queued else None

    def push_front(self, job: QueuedRequest) -> None:
        """Put back a request that found no slot: it stays first."""
        with self.cond:
            self.queued.appendleft(job)

    def take_compiled(self) -> None:
        """Jobs whose guide compiled join the queue; a refused guide, or one past its time
        budget, fails its own request."""
        with self.cond:
            if not self.compiling:
                return
            now, ready, failed, waiting = time.perf_counter(), [], [], []
            for job in self.compiling:
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
            self.compiling = waiting
            self.queued.extend(ready)
        for job, error in failed:
            if error is None:
                tell(job.handle.on_cancelled)
            else:
                tell(job.handle.on_error, error)

    def take_all(self) -> list[QueuedRequest]:
        """Every request still waiting (the scheduler is closing)."""
        with self.cond:
            jobs, self.queued = list(self.queued) + self.compiling, deque()
            self.compiling = []
        return jobs


__all__ = ["AdmissionQueue", "QueueFullError", "QueuedRequest", "RequestHandle", "SchedulerClosedError", "tell"]
