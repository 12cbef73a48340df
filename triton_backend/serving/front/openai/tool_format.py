"""The text format of tool calls and tool results, in the prompt and in the model's answer.

The reference target (SmolLM2-135M-Instruct) has no tool-call format in its chat template, so the
front defines one: the Hermes format (Qwen2.5's chat template writes it, vLLM's ``hermes`` tool
parser reads it). A call is one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

the JSON in the canonical layout of structured output (``", "`` and ``": "``, no other
whitespace: :data:`triton_backend.core.guide.JSON_LAYOUT`); several calls follow each other,
separated by a new line. A tool's result goes back to the model in a ``user`` turn as::

    <tool_response>
    ...the tool message's content...
    </tool_response>

(consecutive tool messages in one such turn, in order). The chat template then renders these
turns like any other.

:func:`call_grammar` is the grammar of an ``auto`` answer for llguidance (Lark syntax, guided
decoding type ``ebnf_grammar``): any text, or text that ends with ``<tool_call>`` (a lazy lexeme:
the call starts at the first ``<tool_call>`` the model writes) followed by the call's JSON under
its schema, the closing tag, and with parallel calls more blocks; after the last call only the end
of the answer. Free text is left unconstrained; once a call starts, its name, keys and punctuation
are forced tokens a speculative round drafts for free.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from triton_backend.core.guide import JSON_LAYOUT

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESULT_OPEN = "<tool_response>"
RESULT_CLOSE = "</tool_response>"


def render_call(name: str, arguments: Any) -> str:
    """One call as the model writes it (``arguments``: the decoded JSON value)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def render_calls(content: str, calls: Iterable[tuple[str, Any]]) -> str:
    """An assistant turn that called functions: its text (if any), then one block per call."""
    blocks = "\n".join(render_call(name, arguments) for name, arguments in calls)
    return f"{content}\n{blocks}" if content else blocks


def render_results(contents: Iterable[str]) -> str:
    """The user turn that hands consecutive tool results back to the model."""
    return "\n".join(f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}" for content in contents)


def format_instructions(parallel: bool) -> str:
    """How the model is told to call (``auto``), before the list of functions."""
    how_many = ("To call several, write one such block per call, one after the other." if parallel
                else "Call at most one function per answer.")
    return ("You may call functions to answer. To call a function, write exactly\n"
            f"{CALL_OPEN}\n"
            '{"name": <the function\'s name>, "arguments": <its arguments as one JSON object>}\n'
            f"{CALL_CLOSE}\n"
            f"{how_many} End your answer after the last call. When no function is needed, answer in plain text. "
            f"Function results come back to you between {RESULT_OPEN} and {RESULT_CLOSE}.")


def call_grammar(call_schema: Mapping[str, Any], parallel: bool) -> str:
    """The Lark grammar of an ``auto`` answer whose calls are valid for ``call_schema`` (the
    schema of one ``{"name": ..., "arguments": ...}`` object; see the module doc)."""
    schema = {**call_schema, "x-guidance": dict(JSON_LAYOUT)}
    more = f' ("\\n" "{CALL_OPEN}" call_body)*' if parallel else ""
    return "\n".join([
        "%llguidance {}",
        "start: TEXT | calls",
        f"calls: call_start call_body{more}",
        f'call_start[lazy]: TEXT "{CALL_OPEN}"',
        f'call_body: "\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}"',
        r"TEXT: /(.|\n)*/",
        "",
    ])


__all__ = ["CALL_CLOSE", "CALL_OPEN", "RESULT_CLOSE", "RESULT_OPEN", "call_grammar", "format_instructions",
           "render_call", "render_calls", "render_results"]
