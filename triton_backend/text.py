"""Stop conditions and incremental detokenization.

Neither stop strings, stop token sequences nor EOS appear in the output. Streamed text
never ends in the middle of a multi-byte character and never shows the beginning of
what may turn out to be a stop string.
"""

from __future__ import annotations

from typing import Any, Sequence

from triton_backend.config import FinishReason, SamplingParams

REPLACEMENT = "\ufffd"


def decode(tokenizer: Any, tokens: Sequence[int]) -> str:
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


class StopChecker:
    """Applied token by token as an accepted block is committed, so a stop inside the
    block truncates exactly there."""

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int], tokenizer: Any) -> None:
        self._params = params
        self._eos = frozenset() if params.ignore_eos else eos_token_ids
        self._tokenizer = tokenizer
        self._stop_tail = max((len(s) for s in params.stop), default=0) + 4
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
        if self._params.stop and self._tokenizer is not None:
            tail = decode(self._tokenizer, generated[-self._stop_tail:])
            if any(s in tail for s in self._params.stop):
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
    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stop_strings)
        self.emitted = ""

    def update(self, tokens: Sequence[int], *, final: bool, text_cut: int | None = None) -> str:
        """The text to add after ``tokens`` (all generated tokens so far)."""
        if self._tokenizer is None:
            return ""
        text = decode(self._tokenizer, tokens)
        if text_cut is not None:
            text = text[:text_cut]
        if not final:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - held_back(text, self._stops)]
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta
