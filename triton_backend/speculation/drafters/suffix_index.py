"""The cross-request n-gram source: a suffix index over the deployment's recent requests.

Every finished request's committed tokens (prompt and output) are added as one document. A
request's n-gram session asks the index for the longest suffix of its recent tokens that
occurs in any indexed document, and drafts the continuation that followed it there.

Structure: suffix automata (one per *generation*) over the concatenated documents, each
document closed by a separator id of its own (negative, so never in a query and never part of
a match: no match spans two documents). A suffix automaton has at most ``2n`` states for ``n``
tokens, matches a query's longest suffix in O(query) transitions, and knows for each state how
often its strings occur (``count``) and where the latest occurrence ends (``last``).

Bounded memory: the index keeps at most ``max_tokens`` tokens in ``generations`` automata;
documents are appended to the newest one until it holds ``max_tokens / generations`` tokens,
then a new one starts, and the oldest generations are dropped while the total exceeds the
budget (the oldest requests go first, a generation at a time).

Threads: one writer, any number of readers without a lock. A finishing request only queues its
tokens (:meth:`CrossRequestIndex.submit`); a writer thread indexes them (a few ms per request,
off the scheduler's thread; when it falls behind by ``QUEUE_DEPTH`` requests, more are dropped:
the index is best-effort). Published automata are never changed: the writer extends a copy of
the newest one and swaps the tuple of generations in one assignment, so a reader always sees a
consistent snapshot.

Continuation: from the matched state, one token at a time, the follower whose string occurs
most often in the generation (``frequent``, ties to the more recent; the frequency-weighted
path of suffix decoding), or the follower seen most recently (``recent``).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Sequence

from triton_backend.core.config import CrossRequestConfig, CrossRequestContinuation

logger = logging.getLogger(__name__)

QUERY_WINDOW = 32  # the request's last this many tokens are matched (longer matches are capped)
QUEUE_DEPTH = 64  # finished requests waiting for the writer thread; more are dropped


class SuffixAutomaton:
    """One generation: the suffix automaton of its documents' concatenation (separators included)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.end: list[int] = [0]  # an occurrence's end (exclusive) for new states, -1 for clones
        self.count: list[int] = [0]  # occurrences of the state's strings (set by _finish)
        self.last: list[int] = [0]  # end of the latest occurrence (set by _finish)
        self.followers: tuple[dict[int, int], dict[int, int]] = ({}, {})  # state -> drafted follower (recent, frequent)
        self.documents = 0
        self._tail = 0

    def copy(self) -> "SuffixAutomaton":
        other = SuffixAutomaton.__new__(SuffixAutomaton)
        other.tokens, other.next = list(self.tokens), [dict(d) for d in self.next]
        other.link, other.length, other.end = list(self.link), list(self.length), list(self.end)
        other.count, other.last = self.count, self.last  # replaced, never changed, by _finish
        other.followers = ({}, {})
        other.documents, other._tail = self.documents, self._tail
        return other

    def add(self, document: Sequence[int], separator: int) -> None:
        """Append ``document`` and its ``separator`` (< 0, unique to it); recount occurrences."""
        for token in document:
            self._extend(token)
        self._extend(separator)
        self.documents += 1
        self._finish()

    def _extend(self, token: int) -> None:
        nxt, link, length, end = self.next, self.link, self.length, self.end
        self.tokens.append(token)
        cur = len(nxt)
        nxt.append({})
        link.append(0)
        length.append(length[self._tail] + 1)
        end.append(len(self.tokens))
        p = self._tail
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                end.append(-1)
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self._tail = cur

    def _finish(self) -> None:
        """``count`` and ``last`` of every state (summed / maxed up the suffix-link tree, longest
        states first); the followers drafted after each state are found when first asked."""
        n, length, link = len(self.next), self.length, self.link
        count = [1 if e >= 0 else 0 for e in self.end]
        last = list(self.end)
        count[0] = 0
        by_length: list[list[int]] = [[] for _ in range(length[self._tail] + 1)]  # a counting sort
        for state in range(1, n):
            by_length[length[state]].append(state)
        for group in reversed(by_length):
            for state in group:
                parent = link[state]
                count[parent] += count[state]
                if last[state] > last[parent]:
                    last[parent] = last[state]
        self.count, self.last = count, last
        self.followers = ({}, {})  # memo of _best, filled by lookups (a benign race: the same value)

    def _best(self, state: int, frequent: bool) -> int:
        """The follower drafted after ``state`` (-1: none but a document's end)."""
        count, last = self.count, self.last
        best, best_key = -1, (-1, -1)
        for token, child in self.next[state].items():
            if token >= 0:
                key = (count[child], last[child]) if frequent else (last[child], count[child])
                if key > best_key:
                    best, best_key = token, key
        return best

    @property
    def size(self) -> int:
        return len(self.tokens)

    def match(self, query: Sequence[int]) -> tuple[int, int]:
        """The state and length of the longest suffix of ``query`` that occurs here."""
        nxt, link, length = self.next, self.link, self.length
        state, matched = 0, 0
        for token in query:
            while state and token not in nxt[state]:
                state = link[state]
                matched = length[state]
            state = nxt[state].get(token, 0)
            matched = matched + 1 if state else 0
        return state, matched

    def continuation(self, state: int, k: int, frequent: bool) -> list[int]:
        """Up to ``k`` tokens from ``state``: each step the follower occurring most often
        (``frequent``; ties: the latest) or most recently; stops at a document's end."""
        out: list[int] = []
        memo = self.followers[frequent]
        while len(out) < k:
            token = memo.get(state)
            if token is None:
                token = memo[state] = self._best(state, frequent)
            if token < 0:
                break
            out.append(token)
            state = self.next[state][token]
        return out


@dataclass(frozen=True)
class CrossMatch:
    length: int  # tokens of the request's suffix that matched (<= QUERY_WINDOW)
    continuation: list[int]
    occurrences: int  # occurrences of the matched suffix in its generation


class CrossRequestIndex:
    """The deployment's recent requests, at most ``max_tokens`` tokens (see the module doc)."""

    def __init__(self, max_tokens: int = 32768, generations: int = 4, min_match: int = 2,
                 frequent: bool = True) -> None:
        if max_tokens < 1 or generations < 1 or min_match < 1:
            raise ValueError("need max_tokens, generations and min_match >= 1")
        self.max_tokens, self.generations, self.min_match, self.frequent = max_tokens, generations, min_match, frequent
        self._generations: tuple[SuffixAutomaton, ...] = ()
        self._lock = threading.Lock()
        self._documents = 0
        self._queue: queue.Queue[list[int]] = queue.Queue(QUEUE_DEPTH)
        self._writer: threading.Thread | None = None
        # rounds drafted from the index (summed at release), their tokens, and requests dropped unindexed
        self.stats: dict[str, int] = {"drafted": 0, "accepted": 0, "rounds": 0, "dropped": 0}

    @property
    def size(self) -> int:
        """Tokens held (separators included)."""
        return sum(g.size for g in self._generations)

    def submit(self, document: Sequence[int]) -> None:
        """Queue a finished request's committed tokens for the writer thread (never blocks)."""
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="cross-request-index", daemon=True)
                self._writer.start()
        try:
            self._queue.put_nowait(list(document))
        except queue.Full:
            self.stats["dropped"] += 1

    def flush(self) -> None:
        """Wait until every submitted request is indexed (tests, benchmarks)."""
        self._queue.join()

    def _write(self) -> None:
        while True:
            document = self._queue.get()
            try:
                self.add(document)
            except Exception:  # noqa: BLE001 - the index is best-effort; the server log gets the traceback
                logger.exception("cross-request index: a finished request could not be indexed")
            finally:
                self._queue.task_done()

    def add(self, document: Sequence[int]) -> None:
        """Index a finished request's committed tokens now (the writer; one at a time)."""
        document = list(document[-(self.max_tokens - 1):]) if self.max_tokens > 1 else []
        if not document:
            return
        per_generation = max(1, self.max_tokens // self.generations)
        with self._lock:
            generations = self._generations
            self._documents += 1
            if generations and generations[-1].size + len(document) + 1 <= per_generation:
                newest = generations[-1].copy()
                generations = generations[:-1]
            else:
                newest = SuffixAutomaton()
            newest.add(document, -self._documents)
            generations = generations + (newest,)
            while len(generations) > 1 and sum(g.size for g in generations) > self.max_tokens:
                generations = generations[1:]
            self._generations = generations  # one assignment: readers see the old or the new tuple

    def clear(self) -> None:
        with self._lock:
            self._generations = ()
            self.stats = {key: 0 for key in self.stats}

    def lookup(self, tokens: Sequence[int], k: int) -> CrossMatch | None:
        """The longest suffix match of ``tokens`` (newest generation on ties, at least
        ``min_match`` long) and up to ``k`` tokens that followed it."""
        if k <= 0:
            return None
        query = tokens[-QUERY_WINDOW:]
        best: tuple[SuffixAutomaton, int, int] | None = None
        for generation in reversed(self._generations):  # a snapshot: the tuple is never changed in place
            state, matched = generation.match(query)
            if matched >= self.min_match and (best is None or matched > best[2]):
                best = (generation, state, matched)
        if best is None:
            return None
        generation, state, matched = best
        while matched >= self.min_match:
            drafts = generation.continuation(state, k, self.frequent)
            if drafts:
                return CrossMatch(matched, drafts, generation.count[state])
            state = generation.link[state]  # every occurrence ended its document: a shorter suffix
            matched = generation.length[state]
        return None

    def record(self, drafted: int, accepted: int, rounds: int) -> None:
        """A finished request's rounds drafted from this index (for reports)."""
        with self._lock:
            self.stats["drafted"] += drafted
            self.stats["accepted"] += accepted
            self.stats["rounds"] += rounds


def cross_request_index(config: CrossRequestConfig) -> CrossRequestIndex | None:
    """The deployment's index when its config opts in, else None."""
    if not config.enabled:
        return None
    return CrossRequestIndex(config.max_tokens, min_match=config.min_match,
                             frequent=config.continuation is CrossRequestContinuation.FREQUENT)


__all__ = ["CrossMatch", "CrossRequestIndex", "QUERY_WINDOW", "SuffixAutomaton", "cross_request_index"]
