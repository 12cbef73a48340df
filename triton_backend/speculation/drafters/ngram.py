"""N-gram / prompt lookup drafting: propose what followed the latest earlier occurrence of
the sequence's last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``), searching the prompt
and the output. No model, no cost. An occurrence close enough to overlap the suffix (the text
repeats with a short period) continues periodically past the end of the sequence.

The lookup is incremental: each session keeps an index from every n-gram of the committed
sequence to its latest end position, extended by the tokens committed since the last round
(O(new tokens x n range) per round, never a scan of the whole context). A match is then
extended backwards to its full length (capped), the signal the gain rule uses: how many
tokens the session proposes depends on how long the match is and how matches of that length
fared so far in this request (:class:`~triton_backend.speculation.match_policy.MatchLengthPolicy`).

A deployment may opt in to a second source (``ngram.cross_request``): a suffix index over its
recent requests' prompts and outputs (:mod:`~triton_backend.speculation.drafters.suffix_index`).
A session drafts from its own text first and from the index when that has no match or a
shorter one; a finished request's committed tokens are queued for the index at release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from triton_backend.speculation.drafters.protocol import EMPTY_PROPOSAL, DraftProposal
from triton_backend.speculation.drafters.suffix_index import QUERY_WINDOW, CrossRequestIndex
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.speculation.match_policy import MatchLengthPolicy

MAX_MATCH_LENGTH = 64  # a match is measured backwards up to this many tokens


@dataclass(frozen=True)
class NgramMatch:
    length: int  # tokens the suffix shares with the earlier occurrence (>= n, capped)
    continuation: list[int]  # what followed that occurrence (up to k tokens)
    occurrences: int = 1  # earlier occurrences of the matched n-gram (a unique one is a stronger signal)
    cross: bool = False  # found in the cross-request index, not in the request's own text


class NgramIndex:
    """Latest end position of every n-gram (``min_n <= n <= max_n``) of a growing sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._count: dict[tuple[int, ...], int] = {}  # n-gram -> occurrences with something after them

    def update(self, tokens: Sequence[int]) -> None:
        """Catch up with ``tokens`` (the committed sequence: the indexed one plus new tokens)."""
        old = len(self.tokens)
        if len(tokens) < old or (old and tokens[old - 1] != self.tokens[old - 1]):
            self.tokens, self._latest, self._count, old = [], {}, {}, 0  # not an extension: start over
        self.tokens.extend(tokens[old:])
        seq, latest, count = self.tokens, self._latest, self._count
        # an occurrence ending at e is useful when something follows it: e <= len - 1
        for end in range(max(1, old), len(seq)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(seq[end - n:end])
                latest[gram] = end
                count[gram] = count.get(gram, 0) + 1

    def lookup(self, k: int) -> NgramMatch | None:
        """The longest suffix n-gram's latest earlier occurrence and up to ``k`` tokens after it."""
        seq, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            gram = tuple(seq[length - n:])
            end = self._latest.get(gram)
            if end is None:
                continue
            match = n
            while match < MAX_MATCH_LENGTH and end - match - 1 >= 0 and seq[end - match - 1] == seq[length - match - 1]:
                match += 1
            return NgramMatch(match, continuation(seq, end, k), self._count.get(gram, 1))
        return None


def continuation(seq: Sequence[int], end: int, k: int) -> list[int]:
    """Up to ``k`` tokens after an occurrence ending at ``end``. An occurrence that overlaps the
    suffix it matches (a repetition of period ``len(seq) - end``) runs past the end of ``seq``:
    the pattern repeats, so the draft continues with its own tokens, one period back."""
    out = list(seq[end:end + k])
    period = len(seq) - end
    while 0 < len(out) < k:
        out.append(out[len(out) - period])
    return out


def find_ngram_continuation(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The up-to-``k`` tokens after the most recent earlier match of the longest suffix
    n-gram (``max_n`` >= n >= ``min_n``); empty when nothing matches."""
    if k <= 0:
        return []
    index = NgramIndex(min_n, max_n)
    index.update(tokens)
    found = index.lookup(k)
    return found.continuation if found is not None else []


class NgramSession:
    def __init__(self, drafter: "NgramDrafter") -> None:
        self._index = NgramIndex(drafter.min_n, drafter.max_n)
        self.policy: MatchLengthPolicy | None = None  # set by the controller under the gain rule
        self.cross: CrossRequestIndex | None = drafter.cross_request  # None: this request's own text only
        self._private = False  # True: never drafts from the index (its text is still added)
        self._cross_memo: tuple[int, int, NgramMatch | None] = (-1, 0, None)  # (length, k, match) of the last lookup

    def private(self) -> None:
        """Draft from this request's own text only (a seeded sampling request: its drafts, and
        so its random stream, must not depend on other requests). Its text is still indexed."""
        self._private = True

    def peek(self, tokens: Sequence[int], k: int) -> NgramMatch | None:
        """The match the next proposal would draft from (up to ``k`` tokens), without deciding
        its length (a batch plan sizes it): the request's own longest match, or the
        cross-request index's when that one is longer."""
        self._index.update(tokens)
        if k <= 0:
            return None
        found = self._index.lookup(k)
        if self.cross is not None and not self._private and (
                found is None or found.length < QUERY_WINDOW):
            other = self._cross_lookup(k)
            if other is not None and (found is None or not found.continuation or other.length > found.length):
                found = other
        return found if found is not None and found.continuation else None

    def _cross_lookup(self, k: int) -> NgramMatch | None:
        length, memo_k, memo = self._cross_memo
        seq = self._index.tokens
        if length == len(seq) and memo_k == k:  # asked twice in one round (a batch plan, then the proposal)
            return memo
        assert self.cross is not None
        hit = self.cross.lookup(seq, k)
        match = None if hit is None else NgramMatch(hit.length, hit.continuation, hit.occurrences, cross=True)
        self._cross_memo = (len(seq), k, match)
        return match

    def propose(self, tokens: Sequence[int], k: int, processor: LogitsProcessor,
                generator: torch.Generator | None) -> DraftProposal:
        found = self.peek(tokens, k)
        if found is None:
            return EMPTY_PROPOSAL
        drafts = found.continuation
        if self.policy is not None:
            drafts = drafts[: self.policy.draft_length(found.length, len(drafts), found.occurrences, found.cross)]
        return DraftProposal(tokens=list(drafts)) if drafts else EMPTY_PROPOSAL

    def release(self) -> None:
        if self.cross is not None and self._index.tokens:
            self.cross.submit(self._index.tokens)
            if self.policy is not None:
                self.cross.record(*self.policy.source_totals[True])
        self._index = NgramIndex(self._index.min_n, self._index.max_n)


class NgramDrafter:
    name = "ngram"
    relative_cost = 0.0

    def __init__(self, min_n: int = 1, max_n: int = 3, cross_request: CrossRequestIndex | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.cross_request = cross_request  # the deployment's index of recent requests (opt-in), shared by its sessions

    def new_session(self) -> NgramSession:
        return NgramSession(self)
