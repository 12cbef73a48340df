"""Documented maxima of one request, refused above them with a typed error before any work.

A request's work must not grow without bound with what one client sends: the prompt is
checked in characters before it is tokenized, stop and bad words are bounded in number and
length (the stop check runs on the scheduler's thread every token, for every row), and
``max_tokens`` may not exceed the model's context (a larger value can never be generated; it
is refused instead of being cut silently). Integers that do not fit the served INT32 inputs
are refused at the HTTP edge (:mod:`builder.ops.http_guard`): Triton's JSON conversion would
wrap them silently. docs/security.md lists these figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from triton_backend.core.config import SamplingParams
from triton_backend.core.errors import InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_chars: int = 128 * 1024  # text_input, checked before tokenizing
    max_prompt_tokens: int = 1 << 20  # input_ids
    max_stop_words: int = 32  # stop strings + stop token sequences
    max_stop_word_chars: int = 256
    max_bad_words: int = 64  # bad word strings + bad token sequences
    max_word_tokens: int = 64  # tokens of one stop / bad token sequence
    max_bad_word_chars: int = 256


LIMITS = RequestLimits()


def check_prompt(prompt: str | Sequence[int], limits: RequestLimits = LIMITS) -> None:
    if isinstance(prompt, str):
        if len(prompt) > limits.max_prompt_chars:
            raise InvalidRequestError(f"text_input has {len(prompt)} characters, over the limit of "
                                      f"{limits.max_prompt_chars}")
    elif len(prompt) > limits.max_prompt_tokens:
        raise InvalidRequestError(f"input_ids has {len(prompt)} tokens, over the limit of {limits.max_prompt_tokens}")


def _check_words(what: str, strings: Sequence[str], sequences: Sequence[Sequence[int]], count: int, chars: int,
                 tokens: int) -> None:
    if len(strings) + len(sequences) > count:
        raise InvalidRequestError(f"{len(strings) + len(sequences)} {what} words, over the limit of {count}")
    longest = max((len(s) for s in strings), default=0)
    if longest > chars:
        raise InvalidRequestError(f"a {what} word of {longest} characters, over the limit of {chars}")
    longest = max((len(s) for s in sequences), default=0)
    if longest > tokens:
        raise InvalidRequestError(f"a {what} token sequence of {longest} tokens, over the limit of {tokens}")


def check_sampling(params: SamplingParams, limits: RequestLimits = LIMITS) -> None:
    """Stop and bad words within their maxima (``stop_token_ids`` includes ``end_id``'s one)."""
    _check_words("stop", params.stop, params.stop_token_ids, limits.max_stop_words, limits.max_stop_word_chars,
                 limits.max_word_tokens)
    _check_words("bad", params.bad_words, params.bad_token_ids, limits.max_bad_words, limits.max_bad_word_chars,
                 limits.max_word_tokens)


def check_max_tokens(max_tokens: int, max_context: int) -> None:
    """``max_tokens`` above the model's whole context can never be generated: refused."""
    if max_tokens > max_context:
        raise InvalidRequestError(f"max_tokens = {max_tokens} is over the maximum of {max_context} (the model's "
                                  "context; the prompt's tokens count against it too)")


__all__ = ["LIMITS", "RequestLimits", "check_max_tokens", "check_prompt", "check_sampling"]
