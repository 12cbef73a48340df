"""Prefix caching: a finished request's keys and values stay in its slot for the next request.

When a request leaves the batch its target slot is not given back at once: the positions it
holds committed (its prompt and answer) stay resident as a :class:`CachedPrefix`, indexed by
their tokens. A new request whose prompt starts with the same tokens (the next turn of a chat,
an agent's system prompt and tool list sent with every call) starts from that KV and prefills
only the rest: it adopts the slot when it extends the entry's whole text (the next turn of
the same conversation), else it copies the shared positions into a slot of its own, leaving
the entry for others. Entries are matched by the longest common prefix (a scan over at most
one entry per slot). Exact: a position's keys and values depend only on the tokens up to it,
the property chunked prefill rests on too.

Slots are the budget: the cache holds only slots no running request uses (a request's slot
joins the cache when it leaves, and leaves the cache when a request adopts it), at most as many
as the batch leaves unused (running requests and entries together hold at most the
scheduler's ``max_batch_size`` slots, so the engine's other slots stay free), and when a new
request needs a slot and none is free, the least recently used entry is evicted. So a running
request's slot is never evicted, and the cache never makes a request wait for a slot.

Entries live in a namespace (:attr:`CachedPrefix.namespace`): a request matches only entries
of its own. One namespace for every request (the default) lets latency reveal that a recent
request shared a prefix (a cached prefix is answered sooner); tenants that must not learn that
about each other send distinct namespaces (docs/prefix-caching.md).

An EAGLE drafter's context is its own KV cache over the target's features, in the row of the
scheduler's drafter cache that belongs to the slot, plus the target's features it has not fed
yet (it feeds lazily, when it next drafts); an entry keeps both (:class:`DrafterContext`), so an
EAGLE request reuses the drafter's context with the target's (:func:`resume_drafter`). Other drafters rebuild their context as they always do (a
draft model prefills its own slot, n-gram lookup indexes the tokens, Medusa reads the last
hidden state).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from triton_backend.speculation.drafters.eagle import EagleSession, FeatureDrafter
from triton_backend.speculation.drafters.eagle_model import EagleKV

logger = logging.getLogger(__name__)

COMPARE_BLOCK = 256  # tokens compared per list slice (C speed) before a token-by-token search


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (blocks compared as slices, then token by token)."""
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(n, i + COMPARE_BLOCK)
        if list(a[i:j]) == list(b[i:j]):
            i = j
            continue
        while a[i] == b[i]:
            i += 1
        return i
    return n


@dataclass(frozen=True)
class DrafterContext:
    """An EAGLE session's context in a slot: ``fed`` pairs ``(feature_j, token_j+1)``, ``j <
    fed``, in the drafter cache's row of the slot, then the target's ``features`` ``[n,
    feature_size]`` at positions ``fed .. fed + n - 1``, not fed yet."""

    fed: int = 0
    features: torch.Tensor | None = None

    @property
    def end(self) -> int:
        """The first position whose feature the context lacks."""
        return self.fed + (0 if self.features is None else int(self.features.shape[0]))

    def reusable(self, shared: int, limit: int) -> tuple[int, int]:
        """(pairs, features' end) that hold for a prompt sharing ``shared`` leading tokens with
        this context's text, at most ``limit`` positions: a feature holds while the tokens up to
        it are shared, a pair while the token after it is too."""
        fed = max(0, min(self.fed, shared - 1, limit))
        if fed < self.fed:  # the features after the shared pairs were fed: only the pairs remain
            return fed, fed
        return fed, max(fed, min(self.end, shared, limit))


def drafter_context(session: EagleSession, tokens: Sequence[int]) -> DrafterContext:
    """What a bound EAGLE session holds for ``tokens`` (its sequence's text): the pairs its
    drafter cache row holds and the features it has not fed yet."""
    _, _, fed = session.cache(0)
    end = min(session.feature_end, len(tokens) - 1)  # a pending feature is handed out with the token after it
    backlog = session.backlog(list(tokens[:end + 1])) if end > fed else None
    return DrafterContext(fed, backlog[0] if backlog is not None else None)


@dataclass
class CachedPrefix:
    """A finished request's slot kept resident: ``tokens`` are the tokens whose keys and values
    positions ``0 .. len(tokens) - 1`` of ``slot`` hold; ``drafter``: an EAGLE drafter's
    context in the drafter cache's row ``slot`` (None: none)."""

    slot: int
    tokens: list[int]
    namespace: str = ""
    drafter: DrafterContext | None = None


@dataclass
class PrefixCacheStats:
    """Counts since start: ``lookups`` requests admitted with the cache on; ``hits`` those that
    started from cached keys and values (a finished request's entry or a running request's
    slot); ``reused_tokens`` prompt positions they did not prefill; ``prompt_tokens`` every
    admitted prompt's tokens; ``evictions`` entries dropped for a slot."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    evictions: int = 0
    adopted: int = 0  # hits that took the entry's slot itself (no copy)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"lookups": self.lookups, "hits": self.hits, "hit_rate": round(self.hit_rate, 4),
                "reused_tokens": self.reused_tokens, "prompt_tokens": self.prompt_tokens,
                "evictions": self.evictions, "adopted": self.adopted}


@dataclass
class PrefixCache:
    """The retained slots, least recently used first (see the module docstring). Runs on the
    scheduler's thread only."""

    min_tokens: int = 4  # shorter shared prefixes are not worth a lookup's copy
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _entries: "OrderedDict[int, CachedPrefix]" = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, slot: int) -> bool:
        return slot in self._entries

    def slots(self) -> list[int]:
        """The retained slots, least recently used first."""
        return list(self._entries)

    def retain(self, entry: CachedPrefix) -> bool:
        """Keep ``entry``'s slot resident; False (the caller gives the slot back) when its text
        is too short to be worth a slot."""
        if len(entry.tokens) < self.min_tokens:
            return False
        if entry.slot in self._entries:
            raise ValueError(f"slot {entry.slot} is cached already")
        if entry.drafter is not None and entry.drafter.end > len(entry.tokens):
            raise ValueError("a drafter context reaches past its entry's tokens")
        self._entries[entry.slot] = entry  # most recently used
        return True

    def entries(self, namespace: str = "") -> list[CachedPrefix]:
        """The entries of ``namespace``, most recently used first."""
        return [e for e in reversed(self._entries.values()) if e.namespace == namespace]

    def longest(self, tokens: Sequence[int], namespace: str = "") -> tuple[CachedPrefix | None, int]:
        """The entry of ``namespace`` sharing the most leading ``tokens``, and how many (ties:
        the most recently used)."""
        best, length = None, 0
        for entry in self.entries(namespace):
            n = shared_length(entry.tokens, tokens)
            if n > length:
                best, length = entry, n
        return best, length

    def touch(self, slot: int) -> None:
        """``slot``'s entry was used: it becomes the most recently used."""
        self._entries.move_to_end(slot)

    def take(self, slot: int) -> CachedPrefix:
        """A request adopts ``slot``: its entry leaves the cache (the slot is the request's now)."""
        return self._entries.pop(slot)

    def evict(self, keep: int | None = None) -> int | None:
        """Drop the least recently used entry other than slot ``keep``; its slot (the caller
        gives it back to the engine), or None when there is none."""
        for slot in self._entries:
            if slot != keep:
                del self._entries[slot]
                self.stats.evictions += 1
                return slot
        return None

    def clear(self) -> list[int]:
        """Drop every entry; their slots (to give back)."""
        slots, self._entries = list(self._entries), OrderedDict()
        return slots


def resume_drafter(session: EagleSession, drafter: FeatureDrafter, context: DrafterContext, fed: int,
                   end: int) -> None:
    """Start a freshly bound EAGLE session from ``context`` (copied or adopted with the target's
    keys and values): its drafter cache row holds the pairs of positions ``0 .. fed - 1``, and
    it has the target's features up to ``end``, so the target's next row starts at ``end``.
    Through the session's own protocol: the fed pairs' features are observed and fed at once
    (placeholders: the drafter's cache holds their result, and fed features are never read
    again); the others are observed as they are."""
    if end <= 0:
        return
    _, _, cached = session.cache(end)
    if cached or session.feature_end:
        raise ValueError("a drafter context can only be resumed on a freshly bound session")
    if not 0 <= fed <= end <= context.end or fed > context.fed:
        raise ValueError(f"cannot resume pairs {fed} and features {end} of a context of {context.fed} / {context.end}")
    if fed:
        width = drafter.feature_size
        session.observe(0, torch.zeros(1, width, dtype=drafter.dtype, device=drafter.device).expand(fed, width))
        session.fed(fed)
    if end > fed:
        assert context.features is not None
        session.observe(fed, context.features[fed - context.fed:end - context.fed])


def copy_drafter_rows(kv: EagleKV, source: int, destination: int, length: int) -> None:
    """Drafter cache positions ``0 .. length - 1`` of row ``source`` into row ``destination``.
    The cache's tensors were made under inference mode (by the drafter's passes); admission runs
    outside it, where an in-place write to such a tensor is refused: the copy runs inside."""
    if length <= 0:
        return
    with torch.inference_mode():
        kv.reserve(length)
        kv.k[destination, :, :length] = kv.k[source, :, :length]
        kv.v[destination, :, :length] = kv.v[source, :, :length]


__all__ = ["CachedPrefix", "DrafterContext", "PrefixCache", "PrefixCacheStats", "copy_drafter_rows", "drafter_context",
           "resume_drafter", "shared_length"]
