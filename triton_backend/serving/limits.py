"""Documented maxima of one request, refused above them with a typed error before any work.

A request's work must not grow without bound with what one client sends: the prompt is
checked in bytes before it is decoded and in characters before it is tokenized, wherever it
enters (Triton's tensors: :func:`check_prompt_bytes` then :func:`check_prompt`; the front models
before they forward; the OpenAI front: :func:`check_text` on the messages and on the rendered
prompt), stop and bad words are bounded in number and
length (the stop check runs on the scheduler's thread every token, for every row), and
``max_tokens`` may not exceed the model's context (a larger value can never be generated; it
is refused instead of being cut silently). Integers that do not fit the served INT32 inputs
are refused at the HTTP edge (:mod:`triton_backend.serving.front.http_guard`): Triton's JSON conversion would
wrap them silently. docs/security.md lists these figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from triton_backend.core.config import SamplingParams
from triton_backend.core.errors import InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_chars: int = 128 * 1024  # text_input, checked before tokenizing
    max_prompt_bytes: int = 512 * 1024  # text_input's UTF-8 bytes, checked before decoding
    max_prompt_tokens: int = 1 << 20  # input_ids
    max_stop_words: int = 32  # stop strings + stop token sequences
    max_stop_word_chars: int = 256
    max_bad_words: int = 64  # bad word strings + bad token sequences
    max_word_tokens: int = 64  # tokens of one stop / bad token sequence
    max_bad_word_chars: int = 256


LIMITS = RequestLimits()


def check_prompt(prompt: str | Sequence[int], limits: RequestLimits = LIMITS) -> None:
    if isinstance(prompt, str):
        check_text(prompt, "text_input", limits)
    elif len(prompt) > limits.max_prompt_tokens:
        raise InvalidRequestError(f"input_ids has {len(prompt)} tokens, over the limit of {limits.max_prompt_tokens}")


def check_text(text: str, what: str = "the prompt", limits: RequestLimits = LIMITS) -> None:
    """A prompt's text within the limits in characters and UTF-8 bytes, and encodable (a lone
    surrogate such as ``"\\ud800"``, which JSON allows, is refused): before any tokenizing."""
    if len(text) > limits.max_prompt_chars:
        raise InvalidRequestError(f"{what} has {len(text)} characters, over the limit of {limits.max_prompt_chars}")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid Unicode text: {exc.reason} at character {exc.start}") from None
    if size > limits.max_prompt_bytes:
        raise InvalidRequestError(f"{what} has {size} bytes of UTF-8, over the limit of {limits.max_prompt_bytes}")


def unencodable_text(value: Any) -> UnicodeEncodeError | None:
    """The first string (or key) of a parsed JSON value that does not encode as UTF-8, as its
    encoding error: JSON lets a lone surrogate through (``"\\ud800"``), which no tokenizer or
    Triton tensor takes. ``None`` when every string encodes."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return exc
    return None


def check_prompt_bytes(arrays: Mapping[str, np.ndarray], name: str = "text_input",
                       limits: RequestLimits = LIMITS) -> None:
    """``name``'s raw bytes within :attr:`RequestLimits.max_prompt_bytes`, before they are decoded
    (every item of a batched input)."""
    array = arrays.get(name)
    if array is None:
        return
    for item in np.asarray(array).reshape(-1):
        if isinstance(item, (bytes, bytearray, np.bytes_, str)) and len(item) > limits.max_prompt_bytes:
            raise InvalidRequestError(f"{name} has {len(item)} bytes, over the limit of {limits.max_prompt_bytes}")


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


__all__ = ["LIMITS", "RequestLimits", "check_max_tokens", "check_prompt", "check_prompt_bytes", "check_sampling",
           "check_text"]
