"""Guides compiled before their request joins a batch: off the scheduler's thread, within a time
and a size budget, probed, and cached by guide.

Compiling a grammar is the costly, client-controlled part of structured output: llguidance took
36 s to build the matcher of a JSON schema with 10,000 optional properties, and such a schema
then failed at its first object (``Current row has 40007 items; max is 2000``). Done on the batch
scheduler's thread, that stalled every request and failed the round. So a guide is:

- bounded in size before anything (:data:`~triton_backend.core.guide.MAX_GUIDE_CHARS`);
- compiled on a thread of its own (:meth:`GuideCache.prepare` returns a future; at most
  :attr:`GuideBudget.max_compiling` distinct guides compile at once, more are refused with
  :class:`~triton_backend.core.errors.OverloadedError`); a request waits for its guide at most
  :attr:`GuideBudget.max_compile_s`, and a guide whose compile took longer is refused from then
  on (:class:`GuideRefusedError`, the same answer every time);
- probed once compiled: the mask at the start, then a walk of :attr:`GuideBudget.probe_steps`
  tokens (each step the lowest allowed token id that is not the end), so what the grammar engine
  gives up on at the start of an output (too many alternatives in one row, a ``$ref`` loop that
  admits no output) is refused before the request joins a batch;
- cached by (kind, text, tokenizer): every request copies the cached, pristine matcher
  (:meth:`CompiledGuide.matcher`), refusals are cached too.

A guide that still fails later (deep in an output the probe did not reach) fails its own row only
(:mod:`triton_backend.batching.scheduler`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence

from triton_backend.core.errors import InvalidRequestError, OverloadedError
from triton_backend.core.grammar import GuideMatcher, ll_tokenizer, refusal, short_message, validated_matcher
from triton_backend.core.guide import Guide

logger = logging.getLogger(__name__)


class GuideRefusedError(InvalidRequestError):
    """The grammar engine refuses this guide (too complex, no finite output, over the time
    budget): the client's guide is at fault, the answer is a 400."""


@dataclass(frozen=True)
class GuideBudget:
    """``max_compile_s``: the longest a request waits for its guide (and the longest a compile
    may take to be used); ``probe_steps``: tokens walked after compiling; ``max_compiling``:
    distinct guides compiling at once; ``capacity``: compiled guides (and refusals) cached."""

    max_compile_s: float = 5.0
    probe_steps: int = 8
    max_compiling: int = 4
    capacity: int = 64


class CompiledGuide:
    """A guide compiled and probed for one tokenizer: each request gets its own copy of the
    pristine matcher."""

    def __init__(self, guide: Guide, matcher: Any, vocab: int, compile_s: float) -> None:
        self.guide = guide
        self.vocab = vocab
        self.compile_s = compile_s
        self._matcher = matcher  # never advanced
        self._lock = threading.Lock()

    def matcher(self, prompt_len: int) -> GuideMatcher:
        """A fresh grammar state for a request whose prompt is ``prompt_len`` tokens long."""
        with self._lock:
            copy = self._matcher.deep_copy()
        return GuideMatcher(copy, self.vocab, prompt_len)


def compile_and_probe(guide: Guide, lltok: Any, vocab: int, eos_token_ids: Sequence[int], probe_steps: int) -> Any:
    """llguidance's matcher for ``guide``, checked: it validates, builds, and survives the
    probe walk (see the module doc). Raises :class:`GuideRefusedError` /
    :class:`InvalidRequestError` with a short reason."""
    matcher = validated_matcher(guide, lltok)
    if matcher.is_error():
        raise refusal(guide.type.value, matcher, GuideRefusedError)
    probe = matcher.deep_copy()
    eos = {int(t) for t in eos_token_ids}
    for _ in range(max(0, probe_steps) + 1):
        bits = probe.compute_bitmask()
        if probe.is_error():
            raise refusal(guide.type.value, probe, GuideRefusedError)
        token = _lowest_allowed(bits, vocab, eos)
        if token is None or not probe.consume_token(token) or probe.is_error():
            break
    if probe.is_error():
        raise refusal(guide.type.value, probe, GuideRefusedError)
    return matcher


def _lowest_allowed(bits: bytes, vocab: int, eos: set[int]) -> int | None:
    for i, byte in enumerate(bits):
        if not byte:
            continue
        for b in range(8):
            token = 8 * i + b
            if token >= vocab:
                return None
            if byte >> b & 1 and token not in eos:
                return token
    return None


_Key = tuple[str, str, int]


class GuideCache:
    """Compiled guides by (kind, text, tokenizer); see the module doc. Thread-safe."""

    def __init__(self, budget: GuideBudget | None = None) -> None:
        self.budget = budget or GuideBudget()
        self._lock = threading.Lock()
        self._done: OrderedDict[_Key, Future] = OrderedDict()  # finished: a CompiledGuide or a refusal
        self._compiling: dict[_Key, Future] = {}
        self._tokenizers: dict[int, Any] = {}  # id(LLTokenizer) -> it (keeps the id a key can name)

    def prepare(self, guide: Guide, tokenizer: Any, *, vocab: int, eos_token_ids: Sequence[int]) -> "Future[CompiledGuide]":
        """The guide's compile: a finished future on a cache hit, else one a compile thread
        completes. Raises at once: InvalidRequestError (no tokenizer), OverloadedError (too many
        guides compiling)."""
        lltok = ll_tokenizer(tokenizer, vocab, eos_token_ids)
        key = (guide.type.value, guide.text, id(lltok))
        with self._lock:
            self._tokenizers[id(lltok)] = lltok
            hit = self._done.get(key) or self._compiling.get(key)
            if hit is not None:
                if key in self._done:
                    self._done.move_to_end(key)
                return hit
            if len(self._compiling) >= self.budget.max_compiling:
                raise OverloadedError(f"{len(self._compiling)} structured-output guides are compiling; retry later")
            future: Future = Future()
            self._compiling[key] = future
        thread = threading.Thread(target=self._compile, args=(key, future, guide, lltok, vocab, tuple(eos_token_ids)),
                                  name="guide-compile", daemon=True)
        thread.start()
        return future

    def compile(self, guide: Guide, tokenizer: Any, *, vocab: int, eos_token_ids: Sequence[int]) -> CompiledGuide:
        """The compiled guide, waiting for it within the time budget (a request's own thread)."""
        future = self.prepare(guide, tokenizer, vocab=vocab, eos_token_ids=eos_token_ids)
        return result(future, self.budget.max_compile_s, guide)

    def _compile(self, key: _Key, future: Future, guide: Guide, lltok: Any, vocab: int, eos: tuple[int, ...]) -> None:
        started = time.perf_counter()
        try:
            matcher = compile_and_probe(guide, lltok, vocab, eos, self.budget.probe_steps)
            spent = time.perf_counter() - started
            if spent > self.budget.max_compile_s:
                raise over_budget(guide, self.budget.max_compile_s)
            outcome: Any = CompiledGuide(guide, matcher, vocab, spent)
        except InvalidRequestError as exc:
            outcome = exc
        except Exception as exc:  # the engine's own failure: logged, the request gets a typed refusal
            logger.exception("compiling a %s guide failed", guide.type.value)
            outcome = GuideRefusedError(f"the grammar engine failed on this {guide.type.value} guide: "
                                        f"{short_message(str(exc))}")
        logger.info("%s guide of %d characters compiled in %.2f s: %s", guide.type.value, len(guide.text),
                    time.perf_counter() - started, "refused" if isinstance(outcome, Exception) else "ok")
        with self._lock:
            self._compiling.pop(key, None)
            self._done[key] = future
            while len(self._done) > self.budget.capacity:
                self._done.popitem(last=False)
            live = {k[2] for k in self._done} | {k[2] for k in self._compiling}
            for tok_id in [t for t in self._tokenizers if t not in live]:
                self._tokenizers.pop(tok_id)
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def over_budget(guide: Guide, budget_s: float) -> GuideRefusedError:
    return GuideRefusedError(f"the {guide.type.value} guide did not compile within {budget_s:g} s: too complex for "
                             "the grammar engine; simplify it (fewer optional properties or alternatives)")


def result(future: "Future[CompiledGuide]", budget_s: float, guide: Guide) -> CompiledGuide:
    """The compiled guide of ``future`` within ``budget_s`` (its refusal raised as it is)."""
    from concurrent.futures import TimeoutError as FutureTimeout

    try:
        return future.result(timeout=budget_s)
    except FutureTimeout:
        raise over_budget(guide, budget_s) from None


GUIDES = GuideCache()  # the process's guides (every scheduler and single-request run shares it)

__all__ = ["GUIDES", "CompiledGuide", "GuideBudget", "GuideCache", "GuideRefusedError", "compile_and_probe",
           "over_budget", "result"]
