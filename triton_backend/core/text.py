"""Stop conditions and incremental detokenization.

Neither stop strings, stop token sequences nor EOS appear in the output. Streamed text
never ends in the middle of a multi-byte character and never shows the beginning of
what may turn out to be a stop string.
"""

from __future__ import annotations

from typing import Any, Sequence

from triton_backend.core.config import FinishReason, SamplingParams
from triton_backend.core.eos import stopping_eos

REPLACEMENT = "\ufffd"


def decode(tokenizer: Any, tokens: Sequence[int]) -> str:
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


class StopMatcher:
    """Whether a text contains any of a set of stop strings, in one pass over the text whatever
    their number (an Aho-Corasick automaton built once per request): the per-token cost of the
    stop check does not grow with the number of stop strings."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._hit = [False]
        for stop in stops:
            state = 0
            for char in stop:
                if char not in self._goto[state]:
                    self._goto.append({})
                    self._fail.append(0)
                    self._hit.append(False)
                    self._goto[state][char] = len(self._goto) - 1
                state = self._goto[state][char]
            self._hit[state] = True
        queue = list(self._goto[0].values())
        for state in queue:  # breadth first: a state's failure link is set before its children's
            for char, child in self._goto[state].items():
                queue.append(child)
                fallback = self._fail[state]
                while fallback and char not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                target = self._goto[fallback].get(char, 0)
                self._fail[child] = target if target != child else 0
                self._hit[child] = self._hit[child] or self._hit[self._fail[child]]

    def found_in(self, text: str) -> bool:
        state = 0
        goto, fail, hit = self._goto, self._fail, self._hit
        for char in text:
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if hit[state]:
                return True
        return False


class StopChecker:
    """Applied token by token as an accepted block is committed, so a stop inside the
    block truncates exactly there."""

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int], tokenizer: Any) -> None:
        self._params = params
        self._eos = stopping_eos(params, eos_token_ids)
        self._tokenizer = tokenizer
        self._stop_tail = max((len(s) for s in params.stop), default=0) + 4
        self._stops = StopMatcher(params.stop) if params.stop else None
        self.text_cut: int | None = None  # where the output text ends (a stop string starts)

    def after_append(self, generated: list[int]) -> FinishReason | None:
        """Call after appending one token; may shorten ``generated``; returns why to stop, if so."""
        token = generated[-1]
        if token in self._eos:
            generated.pop()
            return FinishReason.EOS
        for seq in self._params.stop_token_ids:
            if len(generated) >= len(seq) and tuple(generated[-len(seq):]) == seq:
                del generated[-len(seq):]
                return FinishReason.STOP
        if self._stops is not None and self._tokenizer is not None:
            tail = decode(self._tokenizer, generated[-self._stop_tail:])
            if self._stops.found_in(tail):
                full = decode(self._tokenizer, generated)
                hits = [i for i in (full.find(s) for s in self._params.stop) if i >= 0]
                if hits:
                    self.text_cut = min(hits)
                    return FinishReason.STOP
        if len(generated) >= self._params.max_tokens:
            return FinishReason.LENGTH
        return None


def held_back(seq: Sequence[Any], stops: Sequence[Sequence[Any]]) -> int:
    """Length of the longest suffix of ``seq`` (a string or a token list) that is a proper
    prefix of one of ``stops``: what streaming must hold back until it is decided."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(seq)), best, -1):
            if list(seq[len(seq) - n:]) == list(stop[:n]):
                best = n
                break
    return best


class IncrementalDetokenizer:
    """Text to stream as tokens are committed, in work proportional to the new tokens.

    Each update decodes only a short window: the tokens since the last settled point plus
    :data:`CONTEXT_TOKENS` before it (so a tokenizer that merges across tokens, or strips a
    leading space at the start of a decode, sees what the whole decode would) and keeps the
    part after the context. Text settles once it no longer ends in an incomplete UTF-8
    character. Not yet final, text never ends in a replacement character nor with what may
    become a stop string. The final update decodes the whole output once, so the last text
    (and ``text_cut``, an index into it) is exactly the full decode's."""

    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stop_strings)
        self._pieces: list[str] = []  # what was emitted
        self._emitted = 0  # its length
        self._settled = 0  # tokens whose text is settled
        self._settled_chars = 0  # the length of their text
        self._pending = ""  # settled text not yet emitted (held back for a stop string)

    @property
    def emitted(self) -> str:
        return "".join(self._pieces)

    def update(self, tokens: Sequence[int], *, final: bool, text_cut: int | None = None) -> str:
        """The text to add after ``tokens`` (all generated tokens so far)."""
        if self._tokenizer is None:
            return ""
        if final:
            return self._final(tokens, text_cut)
        tail = self._tail(tokens)
        if tail and not tail.endswith(REPLACEMENT):
            self._pending += tail
            self._settled, self._settled_chars = len(tokens), self._settled_chars + len(tail)
            tail = ""
        # pending starts at the settled text not yet emitted; an unsettled tail may be emitted ahead
        text = self._pending + tail.rstrip(REPLACEMENT)
        start = self._emitted - (self._settled_chars - len(self._pending))  # emitted chars inside ``text``
        end = len(text) - held_back(text, self._stops)
        if end <= start:
            return ""
        delta = text[start:end]
        self._emit(delta)
        drop = min(self._emitted, self._settled_chars) - (self._settled_chars - len(self._pending))
        self._pending = self._pending[drop:]
        return delta

    def _tail(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens[settled:]`` as the whole decode has it (decoded with a few
        tokens of context before it)."""
        if len(tokens) <= self._settled:
            return ""
        context = max(0, self._settled - self.CONTEXT_TOKENS)
        window = decode(self._tokenizer, tokens[context:])
        before = decode(self._tokenizer, tokens[context:self._settled]) if context < self._settled else ""
        return window[len(before):] if window.startswith(before) else ""

    def _final(self, tokens: Sequence[int], text_cut: int | None) -> str:
        text = decode(self._tokenizer, tokens)
        if text_cut is not None:
            text = text[:text_cut]
        if len(text) <= self._emitted or not text.startswith(self.emitted):
            return ""
        delta = text[self._emitted:]
        self._emit(delta)
        return delta

    def _emit(self, delta: str) -> None:
        self._pieces.append(delta)
        self._emitted += len(delta)
