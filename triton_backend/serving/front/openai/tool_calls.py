"""A forced tool call's answer in OpenAI's shape: ``message.tool_calls`` (``content: null``,
``finish_reason: "tool_calls"``), and the same as stream deltas.

The model's text is the call (see :mod:`.tools`; the answer of ``tool_choice: "auto"`` is parsed by
:mod:`.tool_parser`): for a named function its arguments; for
``required`` with several tools ``{"name": ..., "arguments": ...}``. :class:`ToolCallText` splits it
as it streams: once the name is known, a delta opens the call (``id``, ``type``, ``function.name``,
``arguments: ""``), then every text block's argument text goes out as ``function.arguments``
deltas as it comes (the wrapper's closing brace held back by one character). The concatenated
deltas equal the non-streamed ``arguments``.

``finish_reason`` is ``tool_calls`` when the call's JSON is complete; an answer cut short
(``max_tokens``, a stop string) keeps the model's reason (``length`` / ``stop``) with the
arguments decoded so far. When even the name was not reached, the text is returned as
``content`` and no call.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from triton_backend.serving.front.openai.tools import ToolCallPlan

_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallText:
    """The call's name and argument text, fed the model's text block by block."""

    def __init__(self, plan: ToolCallPlan | None = None) -> None:
        """``plan``: a forced call's; None: a call in the ``auto`` format (name and arguments)."""
        named = plan.named if plan is not None else None
        self.wrapped = named is None  # {"name": ..., "arguments": ...}
        self.name: str | None = None if named is None else named.name
        self._text = ""
        self._start: int | None = None if self.wrapped else 0  # where the arguments start
        self._sent = 0  # argument text handed out up to here

    def feed(self, text: str) -> tuple[bool, str]:
        """(whether the name became known with this block, the new argument text)."""
        self._text += text
        opened = False
        if self._start is None:
            match = _HEAD.match(self._text)
            if match is None or match.end() == len(self._text):  # the whitespace before the value may go on
                return False, ""
            self.name, self._start = json.loads(match.group(1)), match.end()
            self._sent, opened = match.end(), True
        end = len(self._text) - (1 if self.wrapped else 0)  # the wrapper's "}" is not an argument
        piece = self._text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return opened, piece

    @property
    def complete(self) -> bool:
        try:
            value = json.loads(self._text)
        except json.JSONDecodeError:
            return False
        return not self.wrapped or (isinstance(value, dict) and set(value) == {"name", "arguments"})

    def rest(self) -> str:
        """The argument text not handed out yet, at the end of the answer."""
        if self._start is None:
            return ""
        end = len(self._text) - (1 if self.wrapped and self.complete else 0)
        piece = self._text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return piece

    @property
    def arguments(self) -> str:
        if self._start is None:
            return ""
        end = len(self._text) - (1 if self.wrapped and self.complete else 0)
        return self._text[self._start:end]

    @property
    def text(self) -> str:
        return self._text

    def finish_reason(self, model_reason: str) -> str:
        return "tool_calls" if self.name is not None and self.complete else model_reason


def tool_call_message(plan: ToolCallPlan, text: str, model_reason: str) -> tuple[dict[str, Any], str]:
    """The non-streamed assistant message and finish reason of a forced call's full ``text``."""
    call = ToolCallText(plan)
    call.feed(text)
    if call.name is None:
        return {"role": "assistant", "content": text}, model_reason
    function = {"name": call.name, "arguments": call.arguments}
    return ({"role": "assistant", "content": None,
             "tool_calls": [{"id": new_call_id(), "type": "function", "function": function}]},
            call.finish_reason(model_reason))


class ToolCallDeltas:
    """The stream deltas of a forced call (see the module doc)."""

    def __init__(self, plan: ToolCallPlan) -> None:
        self.call = ToolCallText(plan)
        self.id = new_call_id()

    def _opening(self) -> dict[str, Any]:
        return {"index": 0, "id": self.id, "type": "function", "function": {"name": self.call.name, "arguments": ""}}

    def feed(self, text: str, first: bool) -> list[dict[str, Any]]:
        """The deltas for one text block (the first block's deltas start with the role)."""
        named_from_start = first and not self.call.wrapped
        opened, piece = self.call.feed(text)
        calls = [self._opening()] if opened or named_from_start else []
        if piece:
            calls.append({"index": 0, "function": {"arguments": piece}})
        deltas = [{"tool_calls": [c]} for c in calls]
        if first:
            head = {"role": "assistant", "content": None}
            deltas = [{**head, **deltas[0]}] + deltas[1:] if deltas else [head]
        return deltas

    def close(self, model_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the finish reason."""
        if self.call.name is None:
            return ([{"content": self.call.text}] if self.call.text else []), model_reason
        rest = self.call.rest()
        deltas = [{"tool_calls": [{"index": 0, "function": {"arguments": rest}}]}] if rest else []
        return deltas, self.call.finish_reason(model_reason)


__all__ = ["ToolCallDeltas", "ToolCallText", "new_call_id", "tool_call_message"]
