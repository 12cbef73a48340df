"""Slot management for the batch: which target KV slot a new request takes, what it starts from,
and what a leaving request leaves behind.

A new request whose prompt starts with tokens another slot holds (a cached entry of its
namespace, or a running request's committed positions: a chat template's system prompt) takes
their keys and values from that slot instead of prefilling them, where the engine can share a
prefix exactly (:class:`~triton_backend.engines.batch.PrefixSharing`); an EAGLE request only as far
as the drafter's context in that slot goes too. A request that leaves keeps its slot's keys and
values resident (prefix caching, :mod:`triton_backend.batching.prefix_cache`): a later request
extending them whole adopts the slot, and the least recently used entry is evicted when a new
request needs a slot. Runs on the scheduler's thread.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from triton_backend.batching.batch_round import BatchSequence
from triton_backend.batching.prefix_cache import (CachedPrefix, DrafterContext, PrefixCache, copy_drafter_rows,
                                                  drafter_context, resume_drafter, shared_length)
from triton_backend.batching.round_stats import PrefixCacheObserver
from triton_backend.engines.batch import BatchedEngine, PrefixSharing, SlotsExhaustedError
from triton_backend.speculation.drafters.protocol import Drafter

SHARED_PREFIX_MIN = 4  # prompt tokens another sequence's slot must hold for a new one to copy them


@dataclass(frozen=True)
class PrefixSource:
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


class SlotManager:
    """The target's slots as the batch uses them. ``eagle_kv``: the one EAGLE drafter cache of
    the batch (a row per target slot) and ``eagle``: its drafter; ``prefix_cache``: None when
    off or when the engine cannot share a prefix."""

    def __init__(self, target: BatchedEngine, max_batch_size: int, prefix_cache: PrefixCache | None,
                 eagle_kv: object | None, eagle: Drafter | None, observer: object | None) -> None:
        self.target = target
        self.max_batch_size = max_batch_size
        self.prefix_cache = prefix_cache
        self.eagle_kv, self.eagle = eagle_kv, eagle
        self.observer = observer if isinstance(observer, PrefixCacheObserver) else None
        self.shared_prefix_tokens = 0  # prompt tokens copied from a running request's slot instead of prefilled

    def seat(self, seq: BatchSequence, namespace: str, bound: bool, active: Sequence[BatchSequence],
             namespaces: Mapping[int, str]) -> None:
        """Give ``seq`` a target slot, starting from the best prefix source there is (``bound``:
        its EAGLE drafter's context lives in :attr:`eagle_kv`). On failure the slot goes back (a
        source it adopted is lost) and the error propagates; SlotsExhaustedError: none free."""
        source = (self._prefix_source(seq, namespace, bound, active, namespaces)
                  if isinstance(self.target, PrefixSharing) else None)
        evicted = self.prefix_cache.stats.evictions if self.prefix_cache is not None else 0
        seq.slot, source = self._take_slot(source, len(active))
        try:
            if bound:
                seq.eagle.bind(self.eagle_kv, seq.slot)
            self._reuse(seq, source, bound)
        except BaseException:
            self.target.release(seq.slot)
            raise
        if self.prefix_cache is not None and self.observer is not None:
            self.observer.prefix_lookup(len(seq.tokens), seq.valid, self.prefix_cache.stats.evictions - evicted)

    def _prefix_source(self, seq: BatchSequence, namespace: str, bound: bool, active: Sequence[BatchSequence],
                       namespaces: Mapping[int, str]) -> PrefixSource | None:
        """The slot holding the most of ``seq``'s prompt that it can start from: a cached entry of
        its namespace or a running request's committed positions (an EAGLE request: only as far
        as the drafter's context in that slot goes too). None: none worth a copy."""
        if seq.eagle is not None and not bound:  # its drafter's context lives outside the scheduler's cache
            return None
        best: PrefixSource | None = None
        prompt = seq.tokens
        candidates: list[tuple[int, list[int], int, CachedPrefix | None, BatchSequence | None]] = []
        if self.prefix_cache is not None:
            candidates += [(e.slot, e.tokens, len(e.tokens), e, None) for e in self.prefix_cache.entries(namespace)]
        for other in active:
            if other.slot is not None and namespaces.get(id(other), "") == namespace:
                candidates.append((other.slot, other.tokens, other.valid, None, other))
        for slot, tokens, valid, entry, other in candidates:
            shared = min(shared_length(tokens, prompt), valid)  # positions holding this prompt's keys and values
            usable = min(shared, len(prompt) - 1)  # the last prompt token is fed: its logits start decoding
            if usable < SHARED_PREFIX_MIN or (best is not None and usable <= best.length):
                continue
            context, fed, reused = None, 0, usable
            if seq.eagle is not None:  # as far as the drafter's context goes too
                context = entry.drafter if entry is not None else self.drafter_context(other)
                fed, reused = context.reusable(shared, usable) if context is not None else (0, 0)
            if reused >= SHARED_PREFIX_MIN and (best is None or reused > best.length):
                best = PrefixSource(slot, reused, context, fed, entry,
                                    adopt=entry is not None and shared >= len(entry.tokens))
        return best

    def drafter_context(self, seq: BatchSequence | None) -> DrafterContext | None:
        """The EAGLE drafter's context that ``seq``'s slot row of the batch's drafter cache
        holds (None: none there)."""
        if seq is None or seq.eagle is None or self.eagle_kv is None or seq.slot is None:
            return None
        kv, row, _ = seq.eagle.cache(0)
        return drafter_context(seq.eagle, seq.tokens) if kv is self.eagle_kv and row == seq.slot else None

    def _take_slot(self, source: PrefixSource | None, running: int) -> tuple[int, PrefixSource | None]:
        """A target slot for a new request, and its prefix source as it stands then: a cached
        entry's slot the request extends whole (adopted), else a free one, else the least
        recently used entry's (evicted; never the source's while another can go, and never a
        running request's, which the cache does not hold)."""
        cache, entry = self.prefix_cache, source.entry if source is not None else None
        if cache is not None and entry is not None and source.adopt:
            return cache.take(entry.slot).slot, source
        # the cache holds only slots the batch would hold otherwise: the engine's other slots stay
        # free for whoever else runs on it (sessions of the single-request loop, measurements)
        if cache is None or running + len(cache) < self.max_batch_size:
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

    def _reuse(self, seq: BatchSequence, source: PrefixSource | None, bound: bool) -> None:
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
            resume_drafter(seq.eagle, self.eagle, source.drafter, source.drafter_fed, source.length)
        seq.valid = source.length
        if source.entry is None:
            self.shared_prefix_tokens += source.length
        elif not source.adopt and cache is not None:
            cache.touch(source.entry.slot)
        if cache is not None:
            cache.stats.hits += 1
            cache.stats.reused_tokens += source.length
            cache.stats.adopted += int(source.adopt)

    def retain(self, seq: BatchSequence, namespace: str) -> None:
        """Keep a leaving request's slot as a prefix-cache entry of the positions it holds
        committed (its prompt and answer), with its EAGLE drafter's context there; the slot is
        the cache's then, not the request's."""
        if self.prefix_cache is None or seq.slot is None:
            return
        held = min(seq.valid, len(seq.tokens))
        tokens = list(seq.tokens[:held])
        context = self.drafter_context(seq)
        if context is not None:  # what holds for the entry's own tokens (pairs need the token after them)
            fed, end = context.reusable(held, held)
            features = context.features[:end - fed] if context.features is not None and end > fed else None
            context = DrafterContext(fed, features)
        entry = CachedPrefix(seq.slot, tokens, namespace, context)
        if self.prefix_cache.retain(entry):
            seq.slot = None  # BatchSequence.release gives back what the request still owns

    def clear(self) -> None:
        """Give every cached entry's slot back (the scheduler is closing)."""
        if self.prefix_cache is not None:
            for slot in self.prefix_cache.clear():
                self.target.release(slot)


__all__ = ["PrefixSource", "SHARED_PREFIX_MIN", "SlotManager"]
