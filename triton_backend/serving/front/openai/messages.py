"""Chat ``messages`` parsed and checked into the plain turns the chat template renders.

Roles ``system`` (``developer`` is taken as ``system``), ``user``, ``assistant`` with text content
(a string or text parts), and the tool loop's two kinds of turn:

- an ``assistant`` message with ``tool_calls`` (``content`` may be null): each call
  ``{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}``;
- a ``tool`` message with ``tool_call_id`` and ``content``: the result of one of those calls.

They are checked as OpenAI checks them, each failure a 400 in OpenAI's format naming the
message: a ``tool`` message must answer a call of the assistant message just before it (or of
the one before the other ``tool`` messages answering it), once; every call must be answered
before the conversation goes on. Then they are rendered in the call format of
:mod:`.tool_format` (the assistant's calls as ``<tool_call>`` blocks after its text; consecutive
tool results as one ``user`` turn of ``<tool_response>`` blocks), since the reference target's
chat template has no tool turns of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from triton_backend.serving.front.openai.openai_errors import invalid, unsupported
from triton_backend.serving.front.openai.tool_format import render_calls, render_results

_ROLES = ("system", "user", "assistant", "developer", "tool")
_KEYS = {"system": {"role", "content", "name"}, "developer": {"role", "content", "name"},
         "user": {"role", "content", "name"}, "tool": {"role", "content", "tool_call_id", "name"},
         "assistant": {"role", "content", "name", "tool_calls", "refusal", "function_call", "audio", "annotations"}}
_EMPTY_ASSISTANT_KEYS = ("refusal", "function_call", "audio", "annotations")  # what SDKs send back unset


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def content_text(value: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(where, "content parts other than {'type': 'text', 'text': ...}")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"'{where}' must be a string or a list of text parts", where)


def with_instructions(messages: tuple[Message, ...], text: str) -> tuple[Message, ...]:
    """``text`` as the system message: appended to the request's own when it starts with one."""
    if messages and messages[0].role == "system":
        return (Message("system", f"{messages[0].content}\n\n{text}"),) + messages[1:]
    return (Message("system", text),) + messages


def _call(raw: Any, where: str) -> tuple[str, str, Any]:
    """(id, name, decoded arguments) of one call in an assistant message."""
    if not isinstance(raw, dict) or raw.get("type", "function") != "function" or not isinstance(raw.get("function"), dict):
        raise invalid(f"'{where}' must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                      f"'arguments': ...}}}}", where, "invalid_tool_call")
    call_id, function = raw.get("id"), raw["function"]
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{where}.id' must be a non-empty string", f"{where}.id", "invalid_tool_call")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{where}.function.name' must be a non-empty string", f"{where}.function.name",
                      "invalid_tool_call")
    if not isinstance(arguments, str):
        raise invalid(f"'{where}.function.arguments' must be a string (JSON text)", f"{where}.function.arguments",
                      "invalid_tool_call")
    try:
        decoded = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise invalid(f"'{where}.function.arguments' is not valid JSON: {exc.msg} at position {exc.pos}",
                      f"{where}.function.arguments", "invalid_tool_call") from None
    return call_id, name, decoded


def _assistant(message: Mapping[str, Any], where: str) -> tuple[Message, list[str]]:
    """The assistant turn and the ids of the calls it made."""
    for key in _EMPTY_ASSISTANT_KEYS:
        if message.get(key):
            raise unsupported(f"{where}.{key}", f"'{key}' in an assistant message")
    raw_calls = message.get("tool_calls")
    if raw_calls is None or raw_calls == []:
        return Message("assistant", content_text(message.get("content"), f"{where}.content")), []
    if not isinstance(raw_calls, list):
        raise invalid(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls", "invalid_tool_call")
    content = message.get("content")
    text = "" if content is None else content_text(content, f"{where}.content")
    calls = [_call(raw, f"{where}.tool_calls[{j}]") for j, raw in enumerate(raw_calls)]
    ids, seen = [call_id for call_id, _, _ in calls], set()
    for call_id in ids:
        if call_id in seen:
            raise invalid(f"'{where}.tool_calls' has the id {call_id!r} twice", f"{where}.tool_calls",
                          "invalid_tool_call")
        seen.add(call_id)
    return Message("assistant", render_calls(text, [(name, args) for _, name, args in calls])), ids


class _Conversation:
    """The turns so far and the calls of the last assistant message still awaiting results."""

    def __init__(self) -> None:
        self.turns: list[Message] = []
        self.open: dict[str, bool] = {}  # call id -> answered
        self.asked_at: int | None = None  # the index of the assistant message that made them
        self.results: list[str] = []  # consecutive tool results not yet turned into a user turn

    def add(self, message: Message) -> None:
        self._settle()
        self.turns.append(message)

    def calls(self, ids: list[str], at: int) -> None:
        self._settle()
        self.open, self.asked_at = dict.fromkeys(ids, False), at

    def result(self, call_id: Any, content: str, where: str) -> None:
        if self.asked_at is None:
            raise invalid(f"'{where}': a message with role 'tool' must answer a call of the assistant message "
                          "before it (one with 'tool_calls')", f"{where}.role", "tool_message_without_call")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"'{where}.tool_call_id' must be the id of a call (a non-empty string)",
                          f"{where}.tool_call_id", "unknown_tool_call_id")
        if call_id not in self.open:
            raise invalid(f"'{where}.tool_call_id' {call_id!r} is not the id of a call of messages[{self.asked_at}]",
                          f"{where}.tool_call_id", "unknown_tool_call_id")
        if self.open[call_id]:
            raise invalid(f"'{where}.tool_call_id' {call_id!r} was answered already", f"{where}.tool_call_id",
                          "duplicate_tool_result")
        self.open[call_id] = True
        self.results.append(content)

    def _settle(self) -> None:
        """The previous assistant's calls must all be answered before the conversation goes on."""
        if self.asked_at is not None:
            missing = [call_id for call_id, answered in self.open.items() if not answered]
            if missing:
                where = f"messages[{self.asked_at}].tool_calls"
                raise invalid(f"'{where}': every call must be answered by a 'tool' message before the conversation "
                              f"goes on; no result for {', '.join(repr(m) for m in missing[:4])}", where,
                              "missing_tool_result")
        if self.results:
            self.turns.append(Message("user", render_results(self.results)))
        self.open, self.asked_at, self.results = {}, None, []

    def done(self) -> tuple[Message, ...]:
        self._settle()
        return tuple(self.turns)


def parse_messages(raw: Any) -> tuple[Message, ...]:
    """The request's ``messages`` as template turns (see the module doc), or a 400."""
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty list", "messages")
    conversation = _Conversation()
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in _ROLES:
            if role == "function":
                raise unsupported(f"{where}.role", "the deprecated 'function' messages; send 'tool' messages")
            raise invalid(f"'{where}.role' must be one of {', '.join(_ROLES)}", f"{where}.role")
        extra = sorted(set(message) - _KEYS[role])
        if extra:
            raise invalid(f"Unrecognized argument in '{where}': {extra[0]}", f"{where}.{extra[0]}")
        if role == "tool":
            conversation.result(message.get("tool_call_id"), content_text(message.get("content"), f"{where}.content"),
                                where)
        elif role == "assistant":
            turn, ids = _assistant(message, where)
            conversation.add(turn)
            if ids:
                conversation.calls(ids, i)
        else:
            conversation.add(Message("system" if role == "developer" else role,
                                     content_text(message.get("content"), f"{where}.content")))
    return conversation.done()


__all__ = ["Message", "content_text", "parse_messages", "with_instructions"]
