"""Forced tool calls: ``tools`` (type ``function``) with ``tool_choice`` ``"required"`` or a named
function, parsed into a :class:`ToolCallPlan` -- the JSON schema the answer is decoded under (the
served model's guided decoding) and the instructions that tell the model about the function(s).

- a named function (or ``required`` with one tool): the answer is the function's arguments,
  decoded under its ``parameters`` schema;
- ``required`` with several tools: the answer is ``{"name": ..., "arguments": ...}``, decoded under
  ``anyOf`` one object per function (``name`` a ``const``, ``arguments`` that function's
  ``parameters``, moved under ``$defs`` so its own ``$ref`` pointers still resolve);
- ``"none"``: the tools are ignored (not shown to the model either);
- ``"auto"`` (OpenAI's default when tools are sent): refused. Deciding whether to call needs a
  model with a tool-call chat format; the reference target has none.

The definitions are shown to the model in a system message (:meth:`ToolCallPlan.instructions`,
appended to the request's own system message when it starts with one). A definition or schema
that is malformed, or that the grammar compiler refuses, is a 400 naming the parameter.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from builder.ops.openai.errors import OpenAIError, invalid, unsupported

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_DATA_KEYWORDS = {"const", "enum", "default", "examples"}  # values, not schemas: no $ref rewritten inside
AUTO_REFUSED = ("tool_choice 'auto' (OpenAI's default when tools are sent) is not supported: the served model has "
                "no tool-call chat format to decide whether to call a function. Send tool_choice 'required' or "
                "{'type': 'function', 'function': {'name': ...}} to have the answer decoded as a call, or 'none'.")


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema (an object)


@dataclass(frozen=True)
class ToolCallPlan:
    """The answer must be a call of one of ``tools`` (one: that function's arguments alone)."""

    tools: tuple[FunctionTool, ...]

    @property
    def named(self) -> FunctionTool | None:
        """The function when the call's name is known before decoding, else None."""
        return self.tools[0] if len(self.tools) == 1 else None

    def schema(self) -> dict[str, Any]:
        if self.named is not None:
            return dict(self.named.parameters)
        branches = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/fn_{i}"}},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for i, t in enumerate(self.tools)]
        return {"anyOf": branches, "$defs": {f"fn_{i}": _rebase(t.parameters, f"#/$defs/fn_{i}")
                                             for i, t in enumerate(self.tools)}}

    def guide(self) -> str:
        """The schema as the served model's ``guided_decoding_guide`` (type ``json_schema``)."""
        return json.dumps(self.schema())

    def instructions(self) -> str:
        """The system-message text that describes the function(s) and the expected answer."""
        def entry(tool: FunctionTool) -> str:
            about = f": {tool.description}" if tool.description else ""
            return f"{tool.name}{about}\nArguments (JSON schema): {json.dumps(tool.parameters)}"

        if self.named is not None:
            return (f"Call the function {self.named.name}: answer with its arguments as one JSON object and "
                    f"nothing else.\n\n{entry(self.named)}")
        listed = "\n\n".join(f"- {entry(t)}" for t in self.tools)
        return ('Call one of these functions: answer with one JSON object and nothing else, '
                '{"name": <the function\'s name>, "arguments": <its arguments>}.\n\n' + listed)


def _rebase(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref`` pointers (``#...``) made relative to ``base``."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _DATA_KEYWORDS else _rebase(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(v, base) for v in schema]
    return schema


@functools.lru_cache(maxsize=256)
def _compile_error(schema_text: str) -> str | None:
    """Why the grammar compiler refuses this schema (None: it compiles). Cached: clients send
    the same definitions with every request."""
    from triton_backend.core.errors import InvalidRequestError
    from triton_backend.core.grammar import check_guide
    from triton_backend.core.guide import Guide, GuideType

    try:
        check_guide(Guide(GuideType.JSON_SCHEMA, schema_text))
    except InvalidRequestError as exc:
        return str(exc)
    return None


def _check_schema(schema: Mapping[str, Any], param: str) -> None:
    error = _compile_error(json.dumps(schema, sort_keys=True))
    if error is not None:
        raise invalid(f"'{param}' is not a usable JSON schema: {error}", param, "invalid_tool_schema")


def _function(tool: Any, i: int) -> FunctionTool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", where)
    extra = sorted(set(tool) - _TOOL_KEYS)
    if extra:
        raise invalid(f"Unrecognized argument in '{where}': {extra[0]}", f"{where}.{extra[0]}")
    function = tool["function"]
    extra = sorted(set(function) - _FUNCTION_KEYS)
    if extra:
        raise invalid(f"Unrecognized argument in '{where}.function': {extra[0]}", f"{where}.function.{extra[0]}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'", f"{where}.function.name")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise invalid(f"'{where}.function.description' must be a string", f"{where}.function.description")
    if function.get("strict") is not None and not isinstance(function.get("strict"), bool):
        raise invalid(f"'{where}.function.strict' must be a boolean", f"{where}.function.strict")
    parameters = function.get("parameters", NO_ARGUMENTS)
    if not isinstance(parameters, dict):
        raise invalid(f"'{where}.function.parameters' must be a JSON schema object", f"{where}.function.parameters")
    _check_schema(parameters, f"{where}.function.parameters")
    return FunctionTool(name, description, parameters)


def _tools(raw: Any) -> tuple[FunctionTool, ...]:
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list of function tools", "tools")
    if len(raw) > MAX_TOOLS:
        raise invalid(f"'tools' takes at most {MAX_TOOLS} functions", "tools")
    tools = tuple(_function(tool, i) for i, tool in enumerate(raw))
    names = [t.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise invalid(f"'tools' names the function {duplicate!r} more than once", "tools")
    return tools


def _chosen(choice: Any, tools: tuple[FunctionTool, ...]) -> tuple[FunctionTool, ...] | None:
    """The functions the call may be of; None: no call (``none``)."""
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        raise OpenAIError(AUTO_REFUSED, param="tool_choice", code="unsupported_parameter")
    if choice == "required":
        return tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        match = [t for t in tools if t.name == name]
        if not match:
            raise invalid(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
        return tuple(match)
    if isinstance(choice, dict) and choice.get("type") in ("allowed_tools", "custom"):
        raise unsupported("tool_choice", f"tool_choice of type {choice['type']!r}")
    raise invalid("'tool_choice' must be 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
                  "tool_choice")


def parse_tools(body: Mapping[str, Any]) -> ToolCallPlan | None:
    """The forced call a chat request asks for (None: none), or a 400 :class:`OpenAIError`."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise invalid("'tool_choice' needs 'tools'", "tool_choice")
        return None
    tools = _tools(raw)
    chosen = _chosen(choice, tools)
    if chosen is None:
        return None
    plan = ToolCallPlan(chosen)
    if plan.named is None:
        _check_schema(plan.schema(), "tools")
    return plan


__all__ = ["AUTO_REFUSED", "FunctionTool", "MAX_TOOLS", "ToolCallPlan", "parse_tools"]
