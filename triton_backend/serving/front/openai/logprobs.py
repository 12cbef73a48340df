"""Log probabilities through the OpenAI API: ``logprobs`` / ``top_logprobs`` (chat) and
``logprobs: N`` (completions), in OpenAI's response shapes, streamed and not.

The served model returns them when asked (``return_log_probs``): ``output_log_probs``, one
per output token, and for a text-level request the tokens themselves (``output_ids``), on the
response that carries them; with ``top_log_probs`` k, the k most likely tokens at each position
(``output_top_ids`` / ``output_top_log_probs``). The values are the runtime's: log probabilities
under the target's processed distribution the token was chosen from, ``log_softmax(penalised_logits
/ T)`` (``T`` the temperature, 1 when greedy; penalties, ``min_tokens`` and a structured-output
grammar applied; *before* top-k / top-p truncation), see :mod:`triton_backend.core.sampling`.
A served model without those inputs gets ``logprobs`` / ``top_logprobs`` refused with a 400.

Which tokens are listed: each output token, once the text sent so far covers it (so the tokens
of a chunk spell its text); at the end, those that start before the end of the text. Tokens of
a stop string (not part of the output) and the end token are not listed. ``token`` is the
token's text; a token that is not a whole UTF-8 character on its own is written
``bytes:\\xNN...`` (as OpenAI does), its ``bytes`` exact. Completions' ``text_offset`` is the
token's start in the completion's text.
"""

from __future__ import annotations

import codecs
import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from triton_backend.serving.front.openai.openai_errors import OpenAIError, invalid, unsupported

RETURN_LOG_PROBS_INPUT = "return_log_probs"
TOP_LOG_PROBS_INPUT = "top_log_probs"
LOGPROB_FLOOR = -9999.0
MAX_TOP_LOGPROBS = 20  # chat's limit (OpenAI's, and the runtime's: triton_backend.core.config.MAX_TOP_LOG_PROBS)
MAX_COMPLETION_LOGPROBS = 5  # completions' limit (OpenAI's)


@dataclass(frozen=True)
class LogprobsRequest:
    """What a request asked for: the chosen token's log probability plus ``top`` alternatives."""

    top: int = 0

    def inputs(self) -> dict[str, Any]:
        """The served model's inputs that ask for them."""
        return {RETURN_LOG_PROBS_INPUT: True, **({TOP_LOG_PROBS_INPUT: self.top} if self.top else {})}


def parse_logprobs(body: Mapping[str, Any], chat: bool, offered: frozenset[str]) -> LogprobsRequest | None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs ``logprobs``); completions:
    ``logprobs`` (an integer 0..5); ``offered``: the served model's inputs. ``None``: not asked
    for. Raises :class:`OpenAIError` (400)."""
    if chat:
        asked = body.get("logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise invalid("'logprobs' must be a boolean", "logprobs")
        top, key = body.get("top_logprobs"), "top_logprobs"
        if top is not None and not asked:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        high = MAX_TOP_LOGPROBS
    else:
        top, key, high = body.get("logprobs"), "logprobs", MAX_COMPLETION_LOGPROBS
        asked = top is not None
    if not asked:
        return None
    top = 0 if top is None else top
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= high:
        raise invalid(f"'{key}' must be an integer in [0, {high}]", key)
    if RETURN_LOG_PROBS_INPUT not in offered:
        raise unsupported("logprobs", "the served model does not return log probabilities")
    if top and TOP_LOG_PROBS_INPUT not in offered:
        raise unsupported(key, f"the served model returns the chosen token's log probability only, no alternatives: "
                               f"{key} must be 0")
    return LogprobsRequest(top)


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's ``bytes_to_unicode``), inverted."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_alphabet()


class TokenText:
    """Each token's exact bytes and its text, from the target's tokenizer (byte-level BPE: the
    token's own bytes; otherwise its decode). Special tokens (``<|im_end|>``) take no room in
    the output text (the model skips them when decoding)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.special = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()))
        self.bytes_of = functools.lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str) and piece and token_id not in self.special and all(c in _BYTES for c in piece):
            return bytes(_BYTES[c] for c in piece)
        return self._tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def text(self, token_id: int) -> str:
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@dataclass(frozen=True)
class Alternative:
    token: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    bytes: bytes
    logprob: float
    start: int  # in the output text (characters)
    end: int
    top: tuple[Alternative, ...] = ()  # the most likely tokens at this position, most likely first


class ModelResponse(Protocol):
    """What the tracker reads of one response (:class:`triton_backend.serving.front.openai.backend.Piece`)."""

    text: str
    final: bool
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    top_log_probs: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]


class LogprobTracker:
    """One response's tokens and log probabilities, released as the text covers them (see the module doc)."""

    def __init__(self, text: TokenText, request: LogprobsRequest) -> None:
        self._text = text
        self.request = request
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0  # the tokens' text so far, in characters
        self._covered = 0  # the output text received so far, in characters
        self._pending: list[TokenLogprob] = []

    def take(self, piece: ModelResponse) -> list[TokenLogprob]:
        """Add one response of the model; the tokens to list with it."""
        return self.add(piece.text, piece.token_ids, piece.log_probs, piece.final, piece.top_log_probs)

    def add(self, text: str, token_ids: Sequence[int], log_probs: Sequence[float], final: bool,
            top: Sequence[tuple[Sequence[int], Sequence[float]]] = ()) -> list[TokenLogprob]:
        """Add one response of the model (its text, tokens, log probabilities and, when asked
        for, each token's alternatives ``top``); the tokens to list with it."""
        if len(token_ids) != len(log_probs) or (self.request.top and len(top) != len(token_ids)):
            raise OpenAIError(f"the model returned {len(log_probs)} log probabilities and {len(top)} lists of "
                              f"alternatives for {len(token_ids)} tokens", status=502, type="server_error",
                              code="bad_log_probs")
        for i, (token_id, value) in enumerate(zip(token_ids, log_probs)):
            raw = self._text.bytes_of(int(token_id))
            start = self._chars
            if int(token_id) not in self._text.special:
                self._chars += len(self._decoder.decode(raw))
            alternatives = () if not self.request.top else tuple(
                Alternative(self._text.text(int(a)), self._text.bytes_of(int(a)), _finite(float(v)))
                for a, v in zip(*top[i]))[: self.request.top]
            self._pending.append(TokenLogprob(self._text.text(int(token_id)), raw, _finite(float(value)), start,
                                              self._chars, alternatives))
        self._covered += len(text)
        if final:
            out = [t for t in self._pending if t.start < self._covered]
            self._pending = []
            return out
        n = 0
        while n < len(self._pending) and self._pending[n].end <= self._covered:
            n += 1
        out, self._pending = self._pending[:n], self._pending[n:]
        return out


def _finite(value: float) -> float:
    """JSON has no -inf: a token the processed distribution gave probability 0 (possible only when
    it was forced, e.g. by a grammar's fallback) gets -9999.0, OpenAI's floor."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion (or of one chunk)."""
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
                         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)}
                                          for a in t.top]} for t in tokens], "refusal": None}


def completion_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a completion (or of one chunk): the chosen token is always in
    ``top_logprobs``, as OpenAI returns it ("up to logprobs + 1 elements")."""
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{**{a.token: a.logprob for a in t.top}, t.token: t.logprob} for t in tokens],
            "text_offset": [t.start for t in tokens]}


def attach(event: dict[str, Any], tokens: Sequence[TokenLogprob], chat: bool) -> dict[str, Any]:
    """Put ``tokens`` into the first choice of a response or chunk (``event``, changed in place)."""
    if event.get("choices"):
        event["choices"][0]["logprobs"] = chat_logprobs(tokens) if chat else completion_logprobs(tokens)
    return event


_TEXTS: dict[int, TokenText] = {}


def new_tracker(tokenizer: Any, request: LogprobsRequest | None) -> LogprobTracker | None:
    """A tracker for one response (``None`` when log probabilities were not asked for); the
    token table is built once per tokenizer."""
    if request is None:
        return None
    text = _TEXTS.get(id(tokenizer))
    if text is None or text._tokenizer is not tokenizer:
        text = _TEXTS[id(tokenizer)] = TokenText(tokenizer)
    return LogprobTracker(text, request)


__all__ = ["Alternative", "LogprobTracker", "LogprobsRequest", "MAX_TOP_LOGPROBS", "RETURN_LOG_PROBS_INPUT",
           "TOP_LOG_PROBS_INPUT", "TokenLogprob",
           "TokenText", "attach", "chat_logprobs", "completion_logprobs", "new_tracker", "parse_logprobs"]
