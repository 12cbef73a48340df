"""Client I/O off the batch scheduler's thread.

Under Triton's Python backend every response ``send`` and every ``is_cancelled`` query is a
blocking round trip to the server process (shared memory plus a wait for a server thread).
Made on the scheduler thread, a few of them per row and round cost more than the engine
pass itself at 8 rows on a busy CPU. :class:`ResponsePump` moves them to one thread of their own:
the scheduler hands each request's chunks, errors and cancellations to the request's
:class:`PumpedHandle` (queued, in order, never blocking) and reads its cancellation from a
flag the pump refreshes before each response and every ``poll_interval_s``; nothing more
reaches a client once it has cancelled (a final chunk then ends it as cancelled). When the pump falls behind, a request's
queued partial chunks are merged into one (same tokens and text, fewer responses), so the
client I/O never holds the batch back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from triton_backend.speculation.commit import GenerationChunk

logger = logging.getLogger(__name__)


def merge_chunks(first: GenerationChunk, second: GenerationChunk) -> GenerationChunk:
    """One partial chunk saying what two consecutive partial chunks say."""
    if first.finished or second.finished:
        raise ValueError("only partial chunks merge")
    log_probs = top = None
    if first.log_probs is not None or second.log_probs is not None:
        log_probs = list(first.log_probs or []) + list(second.log_probs or [])
    if first.top_log_probs is not None or second.top_log_probs is not None:
        top = list(first.top_log_probs or []) + list(second.top_log_probs or [])
    return GenerationChunk(list(first.token_ids) + list(second.token_ids), first.text + second.text,
                           stats=second.stats or first.stats, log_probs=log_probs, top_log_probs=top)


@dataclass
class _Item:
    handle: "PumpedHandle"
    call: Callable[..., None]
    chunk: GenerationChunk | None = None  # the call's argument when it is a chunk
    args: tuple = field(default_factory=tuple)  # else its arguments

    @property
    def partial(self) -> bool:
        """A partial chunk: later ones of the same request merge into it while it waits."""
        return self.chunk is not None and not self.chunk.finished


class ResponsePump:
    """One thread that delivers every request's responses (see the module docstring)."""

    def __init__(self, poll_interval_s: float = 0.25, flush: Callable[[], None] | None = None,
                 flush_interval_s: float = 0.5, name: str = "specdec-responses") -> None:
        self.poll_interval_s = poll_interval_s
        self._flush = flush
        self.flush_interval_s = flush_interval_s
        self._queue: deque[_Item] = deque()
        self._live: set[PumpedHandle] = set()
        self._cond = threading.Condition()
        self._closed = False
        self.merged = 0  # partial chunks folded into an earlier queued one
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def wrap(self, inner: object) -> "PumpedHandle":
        """The scheduler-side handle of a request whose client side is ``inner`` (a
        :class:`~triton_backend.batching.admission.RequestHandle`)."""
        handle = PumpedHandle(self, inner)
        with self._cond:
            self._live.add(handle)
        return handle

    def _put(self, item: _Item) -> None:
        with self._cond:
            if item.partial:
                last = item.handle._pending
                if last is not None:  # still queued: fold this chunk into it
                    last.chunk = merge_chunks(last.chunk, item.chunk)
                    self.merged += 1
                    return
                item.handle._pending = item
            elif item.handle._pending is not None:
                item.handle._pending = None  # a final chunk or an error goes after it, unmerged
            self._queue.append(item)
            self._cond.notify()

    def _loop(self) -> None:
        next_poll = time.monotonic() + self.poll_interval_s
        next_flush = time.monotonic() + self.flush_interval_s
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    if not self._cond.wait(max(0.0, min(next_poll, next_flush) - time.monotonic())):
                        break
                if self._closed and not self._queue:
                    break
                item = self._queue.popleft() if self._queue else None
                if item is not None and item.handle._pending is item:
                    item.handle._pending = None
            if item is not None:
                if not item.partial:  # a request's last word: the metrics count its rounds first
                    self._flush_rounds()
                self._deliver(item)
            now = time.monotonic()
            if now >= next_flush:
                self._flush_rounds()
                next_flush = now + self.flush_interval_s
            if now >= next_poll:
                self._poll_cancelled()
                next_poll = time.monotonic() + self.poll_interval_s
        self._flush_rounds()

    def _flush_rounds(self) -> None:
        if self._flush is None:
            return
        try:
            self._flush()
        except Exception:  # metrics are not worth a request
            logger.exception("could not publish the batch metrics")

    def _deliver(self, item: _Item) -> None:
        handle = item.handle
        try:
            if item.chunk is not None and self._ask_cancelled(handle):  # nothing more reaches a cancelled client
                if item.chunk.finished:  # the scheduler is done with it: end it as cancelled
                    handle._inner.on_cancelled()
                return
            item.call(*((item.chunk,) if item.chunk is not None else item.args))
        except Exception:  # the client is gone: the scheduler drops the request at its next round
            logger.exception("a request's client callback failed")
            item.handle._cancelled = True

    def _poll_cancelled(self) -> None:
        with self._cond:
            live = [h for h in self._live if not h._cancelled]
        for handle in live:
            self._ask_cancelled(handle)

    @staticmethod
    def _ask_cancelled(handle: "PumpedHandle") -> bool:
        if not handle._cancelled:
            try:
                handle._cancelled = bool(handle._inner.cancelled())
            except Exception:  # answer as if not cancelled; asked again later
                logger.exception("could not ask whether a request is cancelled")
        return handle._cancelled

    def discard(self, handle: "PumpedHandle") -> None:
        """Stop polling ``handle`` (its request ended, or never reached the scheduler)."""
        with self._cond:
            self._live.discard(handle)

    def close(self) -> None:
        """Deliver what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()


class PumpedHandle:
    """A :class:`~triton_backend.batching.admission.RequestHandle` whose calls run on the pump's thread."""

    def __init__(self, pump: ResponsePump, inner: object) -> None:
        self._pump = pump
        self._inner = inner
        self._cancelled = False
        self._pending: _Item | None = None  # the request's last queued partial chunk (guarded by the pump's lock)

    def on_chunk(self, chunk: GenerationChunk) -> None:
        if chunk.finished:
            self._pump.discard(self)
        self._pump._put(_Item(self, self._inner.on_chunk, chunk=chunk))

    def on_error(self, exc: BaseException) -> None:
        self._pump.discard(self)
        self._pump._put(_Item(self, self._inner.on_error, args=(exc,)))

    def on_cancelled(self) -> None:
        self._pump.discard(self)
        self._pump._put(_Item(self, self._inner.on_cancelled))

    def cancelled(self) -> bool:
        return self._cancelled


__all__ = ["PumpedHandle", "ResponsePump", "merge_chunks"]
