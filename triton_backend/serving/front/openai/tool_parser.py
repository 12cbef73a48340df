"""The answer of ``tool_choice: "auto"``, parsed as it streams: text, and calls in the format of
:mod:`.tool_format` (``<tool_call>`` + ``{"name": ..., "arguments": ...}`` + ``</tool_call>``), as
vLLM's ``hermes`` tool parser reads them.

:class:`AutoToolDeltas` is fed the model's text block by block and hands out OpenAI's chat stream
deltas: the role first (``content: null``, as OpenAI's first chunk of a call), ``content`` pieces
for the text (a tail that may be the start of ``<tool_call>`` is held
back until the next block tells), and per call ``tool_calls[i]`` deltas: once its name is known
one with ``index``, ``id``, ``type`` and ``function.name`` (``arguments: ""``), then
``function.arguments`` pieces as the arguments are decoded. The non-streamed message is built by
the same parser (:meth:`AutoToolDeltas.message`), so the concatenated deltas equal it.

- Whitespace that ends the text before a call, between calls or at the end is dropped when the
  answer has calls (content that is only whitespace is then null); without calls the content is
  the model's text exactly. (Streamed, trailing whitespace goes out once more text follows.)
- ``finish_reason`` is ``tool_calls`` when the answer has calls, all complete, and the model
  stopped by itself; otherwise the model's reason (``length`` for a call cut short, which keeps
  the arguments decoded so far). A call cut before its name is known is the content when it is
  the answer's only one, and dropped after other calls.
- Under the grammar (guided decoding) the calls are always well formed. Decoded freely (a model
  without guided decoding), a ``<tool_call>`` block that is not a JSON object with ``name`` and
  ``arguments`` is returned as content.
"""

from __future__ import annotations

from typing import Any

from triton_backend.serving.front.openai.tool_calls import ToolCallDeltas, ToolCallText, new_call_id, tool_call_message
from triton_backend.serving.front.openai.tool_format import CALL_CLOSE, CALL_OPEN
from triton_backend.serving.front.openai.tools import ToolCallPlan, ToolPlan


def _held(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class _JsonEnd:
    """Where a JSON object that the text starts with (after whitespace) ends, found incrementally."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """The index just past the object's closing brace in ``text`` (fed in order), None if not
        yet; -1 when the text does not start with an object."""
        for i, char in enumerate(text):
            if not self.started:
                if char.isspace():
                    continue
                if char != "{":
                    return -1
                self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class _Call:
    def __init__(self) -> None:
        self.text = ToolCallText()  # {"name": ..., "arguments": ...}
        self.end = _JsonEnd()
        self.raw = ""  # the block's text after <tool_call>, as the model wrote it
        self.index: int | None = None  # set once the name is known
        self.id = new_call_id()
        self.arguments = ""
        self.complete = False


class AutoToolDeltas:
    """The stream deltas and the message of an ``auto`` answer (see the module doc)."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet handed out
        self._state = "text"  # text -> call -> closing -> text ...
        self._call: _Call | None = None
        self._calls: list[_Call] = []
        self._space = ""  # whitespace-only content held back
        self.content = ""

    def feed(self, text: str, first: bool) -> list[dict[str, Any]]:
        """The deltas for one text block (the first block's deltas start with the role)."""
        self._buffer += text
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": None}] if first else []
        while self._buffer:
            step = {"text": self._text, "call": self._in_call, "closing": self._closing}[self._state]
            if not step(deltas):
                break
        return deltas

    def _text(self, deltas: list[dict[str, Any]]) -> bool:
        at = self._buffer.find(CALL_OPEN)
        if at < 0:
            keep = _held(self._buffer, CALL_OPEN)
            self._say(self._buffer[:len(self._buffer) - keep], deltas)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._say(self._buffer[:at], deltas)
        self._buffer = self._buffer[at + len(CALL_OPEN):]
        self._call, self._state = _Call(), "call"
        return True

    def _in_call(self, deltas: list[dict[str, Any]]) -> bool:
        call = self._call
        end = call.end.scan(self._buffer)
        if end == -1:  # not a JSON object: the block is text after all
            self._abandon(deltas)
            return True
        piece = self._buffer if end is None else self._buffer[:end]
        self._buffer = "" if end is None else self._buffer[end:]
        call.raw += piece
        opened, arguments = call.text.feed(piece.lstrip() if not call.text.text else piece)
        self._announce(call, opened, arguments, deltas)
        if end is None:
            return False
        if call.text.name is None:  # a complete object without name and arguments
            self._abandon(deltas)
            return True
        self._announce(call, False, call.text.rest(), deltas)
        call.complete, self._state = call.text.complete, "closing"
        return True

    def _closing(self, deltas: list[dict[str, Any]]) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(CALL_CLOSE):
            self._buffer, self._state = rest[len(CALL_CLOSE):], "text"
            return True
        if CALL_CLOSE.startswith(rest):  # more to come (or only whitespace so far)
            return False
        self._state = "text"  # freely decoded: no closing tag; what follows is text
        return True

    def _announce(self, call: _Call, opened: bool, arguments: str, deltas: list[dict[str, Any]]) -> None:
        if opened:
            self._space = ""  # the whitespace before a call is not content
            call.index = len(self._calls)
            self._calls.append(call)
            deltas.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                           "function": {"name": call.text.name, "arguments": ""}}]})
        if arguments:
            call.arguments += arguments
            deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": arguments}}]})

    def _abandon(self, deltas: list[dict[str, Any]]) -> None:
        """A ``<tool_call>`` block that is no call, before its name was announced: text."""
        call = self._call
        self._buffer = CALL_OPEN + call.raw + self._buffer
        self._call, self._state = None, "text"
        at = len(CALL_OPEN)  # hand the tag out as text, then look for the next one
        self._say(self._buffer[:at], deltas)
        self._buffer = self._buffer[at:]

    def _say(self, text: str, deltas: list[dict[str, Any]]) -> None:
        """Content, its trailing whitespace held back until more text follows."""
        body = text.rstrip()
        if body:
            body, self._space = self._space + body, ""
            self.content += body
            deltas.append({"content": body})
        self._space += text[len(text.rstrip()):]

    def close(self, model_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the finish reason."""
        deltas: list[dict[str, Any]] = []
        call = self._call if self._state == "call" else None
        if call is not None and call.index is not None:  # cut short: the arguments so far
            self._announce(call, False, call.text.rest(), deltas)
        elif call is not None and not self._calls:  # cut before its name, the only call: text
            self._say(CALL_OPEN + call.raw, deltas)
        elif self._state == "text":
            self._say(self._buffer, deltas)
        self._buffer = ""
        if not self._calls and (self._space or not self.content):  # an answer of whitespace, or none, too
            self.content += self._space
            deltas.append({"content": self._space})
        self._space = ""
        done = self._calls and all(c.complete for c in self._calls) and model_reason == "stop"
        return deltas, "tool_calls" if done else model_reason

    def message(self) -> dict[str, Any]:
        """The non-streamed assistant message of everything fed (after :meth:`close`)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not self._calls
                                   else None}
        if self._calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.text.name, "arguments": c.arguments}}
                                     for c in self._calls]
        return message


def tool_deltas(plan: ToolPlan) -> ToolCallDeltas | AutoToolDeltas:
    """The stream deltas of a request with tools: a forced call's or an ``auto`` answer's."""
    return ToolCallDeltas(plan) if isinstance(plan, ToolCallPlan) else AutoToolDeltas()


def tool_message(plan: ToolPlan, text: str, model_reason: str) -> tuple[dict[str, Any], str]:
    """The non-streamed assistant message and finish reason of a request with tools."""
    if isinstance(plan, ToolCallPlan):
        return tool_call_message(plan, text, model_reason)
    parser = AutoToolDeltas()
    parser.feed(text, True)
    _, finish = parser.close(model_reason)
    return parser.message(), finish


__all__ = ["AutoToolDeltas", "tool_deltas", "tool_message"]
