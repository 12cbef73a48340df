"""Tool definitions (``tools``, type ``function``) and what ``tool_choice`` makes of them:

- a named function (or ``required`` with one tool): a forced call, :class:`ToolCallPlan`; the answer
  is the function's arguments, decoded under its ``parameters`` schema;
- ``required`` with several tools: a forced call whose answer is ``{"name": ..., "arguments": ...}``,
  decoded under ``anyOf`` one object per function (``name`` a ``const``, ``arguments`` that
  function's ``parameters``, moved under ``$defs`` so its own ``$ref`` pointers still resolve);
- ``"auto"`` (OpenAI's default when tools are sent): :class:`AutoToolPlan`; the model answers or
  calls, in the call format of :mod:`.tool_format` (``<tool_call>`` + that same object +
  ``</tool_call>``, one block per call); under guided decoding the text is free until the model
  writes ``<tool_call>``, then the call is decoded under the grammar;
- ``"none"``: the tools are ignored (not shown to the model either).

The definitions are shown to the model in a system message (the plans' ``instructions()``,
appended to the request's own system message when it starts with one). A definition or schema
that is malformed, or that the grammar compiler refuses, is a 400 naming the parameter.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Union

from triton_backend.serving.front.openai.openai_errors import invalid, unsupported
from triton_backend.serving.front.openai.tool_format import call_grammar, format_instructions

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_DATA_KEYWORDS = {"const", "enum", "default", "examples"}  # values, not schemas: no $ref rewritten inside


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema (an object)

    def entry(self) -> str:
        """The function as the model is shown it."""
        about = f": {self.description}" if self.description else ""
        return f"{self.name}{about}\nArguments (JSON schema): {json.dumps(self.parameters)}"


def call_schema(tools: tuple[FunctionTool, ...]) -> dict[str, Any]:
    """The schema of one ``{"name": ..., "arguments": ...}`` call of one of ``tools``."""
    branches = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/fn_{i}"}},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for i, t in enumerate(tools)]
    return {"anyOf": branches, "$defs": {f"fn_{i}": _rebase(t.parameters, f"#/$defs/fn_{i}")
                                         for i, t in enumerate(tools)}}


@dataclass(frozen=True)
class ToolCallPlan:
    """A forced call: the answer must be a call of one of ``tools`` (one: that function's
    arguments alone), decoded under :meth:`schema` as the served model's ``json_schema`` guide."""

    tools: tuple[FunctionTool, ...]

    @property
    def named(self) -> FunctionTool | None:
        """The function when the call's name is known before decoding, else None."""
        return self.tools[0] if len(self.tools) == 1 else None

    def schema(self) -> dict[str, Any]:
        return dict(self.named.parameters) if self.named is not None else call_schema(self.tools)

    def guide(self) -> tuple[str, str]:
        """The served model's guided-decoding inputs: (guide type, guide)."""
        return "json_schema", json.dumps(self.schema())

    def instructions(self) -> str:
        """The system-message text that describes the function(s) and the expected answer."""
        if self.named is not None:
            return (f"Call the function {self.named.name}: answer with its arguments as one JSON object and "
                    f"nothing else.\n\n{self.named.entry()}")
        listed = "\n\n".join(f"- {t.entry()}" for t in self.tools)
        return ('Call one of these functions: answer with one JSON object and nothing else, '
                '{"name": <the function\'s name>, "arguments": <its arguments>}.\n\n' + listed)


@dataclass(frozen=True)
class AutoToolPlan:
    """``tool_choice: "auto"``: the model answers in text or calls one or more of ``tools`` (at
    most one unless ``parallel``) in the format of :mod:`.tool_format`."""

    tools: tuple[FunctionTool, ...]
    parallel: bool = True

    def guide(self) -> tuple[str, str]:
        """The served model's guided-decoding inputs: free text, or calls valid for their schemas."""
        return "ebnf_grammar", call_grammar(call_schema(self.tools), self.parallel)

    def instructions(self) -> str:
        listed = "\n\n".join(f"- {t.entry()}" for t in self.tools)
        return f"{format_instructions(self.parallel)}\n\nFunctions:\n\n{listed}"


def _rebase(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref`` pointers (``#...``) made relative to ``base``."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _DATA_KEYWORDS else _rebase(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(v, base) for v in schema]
    return schema


@functools.lru_cache(maxsize=256)
def _compile_error(kind: str, text: str) -> str | None:
    """Why the grammar compiler refuses this guide (None: it compiles). Cached: clients send
    the same definitions with every request."""
    from triton_backend.core.errors import InvalidRequestError
    from triton_backend.core.grammar import check_guide
    from triton_backend.core.guide import Guide

    try:
        check_guide(Guide(kind, text))
    except InvalidRequestError as exc:
        return str(exc)
    return None


def _check_schema(schema: Mapping[str, Any], param: str) -> None:
    error = _compile_error("json_schema", json.dumps(schema, sort_keys=True))
    if error is not None:
        raise invalid(f"'{param}' is not a usable JSON schema: {error}", param, "invalid_tool_schema")


def _check_guide(plan: "ToolCallPlan | AutoToolPlan") -> None:
    """The whole guide of a plan with several tools compiles (each tool's schema did alone)."""
    error = _compile_error(*plan.guide())
    if error is not None:
        raise invalid(f"'tools' together are not a usable guide: {error}", "tools", "invalid_tool_schema")


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


ToolPlan = Union[ToolCallPlan, AutoToolPlan]


def _parallel(body: Mapping[str, Any]) -> bool:
    value = body.get("parallel_tool_calls")
    if value is not None and not isinstance(value, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return value is not False  # OpenAI's default: true


def _plan(choice: Any, tools: tuple[FunctionTool, ...], parallel: bool) -> ToolPlan | None:
    """What ``tool_choice`` asks for; None: no call (``none``)."""
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        return AutoToolPlan(tools, parallel)
    if choice == "required":
        return ToolCallPlan(tools)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        match = [t for t in tools if t.name == name]
        if not match:
            raise invalid(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
        return ToolCallPlan(tuple(match))
    if isinstance(choice, dict) and choice.get("type") in ("allowed_tools", "custom"):
        raise unsupported("tool_choice", f"tool_choice of type {choice['type']!r}")
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                  "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def parse_tools(body: Mapping[str, Any]) -> ToolPlan | None:
    """What a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` ask for (None:
    no tools, or ``none``), or a 400 :class:`OpenAIError`."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = _parallel(body)
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise invalid("'tool_choice' needs 'tools'", "tool_choice")
        return None
    plan = _plan(choice, _tools(raw), parallel)
    if plan is not None and (isinstance(plan, AutoToolPlan) or plan.named is None):
        _check_guide(plan)
    return plan


__all__ = ["AutoToolPlan", "FunctionTool", "MAX_TOOLS", "ToolCallPlan", "ToolPlan", "call_schema", "parse_tools"]
