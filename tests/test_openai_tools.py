"""Forced tool calls on the OpenAI front (triton_backend/serving/front/openai/tools.py, tool_calls.py): ``tools`` with
``tool_choice`` ``required`` or a named function decoded under the function's JSON schema and
returned as ``tool_calls``; bad definitions refused (``auto`` and the tool loop:
tests/test_openai_tool_loop.py). Parsing and shaping without a
server, then through the official ``openai`` SDK against the session's real Triton server."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from triton_backend.serving.front.openai.openai_errors import OpenAIError
from triton_backend.serving.front.openai.openai_request import Capabilities, Endpoint, parse_request
from triton_backend.serving.front.openai.tool_calls import ToolCallDeltas, ToolCallText, tool_call_message
from triton_backend.serving.front.openai.tools import ToolCallPlan, parse_tools
from openai_fixtures import MODEL, client, front  # noqa: F401 - one front over the session's Triton
from triton_fixtures import triton  # noqa: F401 - the session's real Triton server

GUIDED = Capabilities(frozenset({"text_input", "max_tokens", "guided_decoding_guide_type", "guided_decoding_guide"}))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"$ref": "#/$defs/unit"}},
                   "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a time zone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                   "properties": {"timezone": {"type": "string", "maxLength": 40}}}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}]


def _chat(**extra) -> dict:
    return {"model": "m", "messages": ASK, "max_tokens": 8, **extra}


def _function_schema(tool: dict) -> dict:
    return tool["function"]["parameters"]


# -- parsing, no server ---------------------------------------------------------------------
def test_a_named_function_is_decoded_under_its_parameters_with_the_definition_in_a_system_message() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    parsed = parse_request(_chat(tools=[WEATHER, TIME], tool_choice=choice), Endpoint.CHAT, GUIDED)
    assert parsed.inputs["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(parsed.inputs["guided_decoding_guide"]) == _function_schema(WEATHER)
    system, user = parsed.messages
    assert system.role == "system" and "get_weather" in system.content and "get_time" not in system.content
    assert json.dumps(_function_schema(WEATHER)) in system.content and user.content == ASK[0]["content"]
    own = [{"role": "system", "content": "Be brief."}, *ASK]
    merged = parse_request(_chat(messages=own, tools=[WEATHER], tool_choice="required"), Endpoint.CHAT, GUIDED)
    assert len(merged.messages) == 2 and merged.messages[0].content.startswith("Be brief.\n\nCall the function")
    assert merged.tool_call.named.name == "get_weather"  # required with one tool: that function


def test_required_with_several_tools_is_any_of_name_and_arguments_with_refs_rebased() -> None:
    plan = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert plan is not None and plan.named is None
    schema = plan.schema()
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, schema)
    jsonschema.validate({"name": "get_time", "arguments": {"timezone": "CET"}}, schema)
    for bad in ({"name": "get_weather", "arguments": {"timezone": "CET"}},
                {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}, {"name": "other"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "get_weather" in plan.instructions() and "get_time" in plan.instructions()


def test_none_ignores_the_tools() -> None:  # auto: tests/test_openai_tool_loop.py
    parsed = parse_request(_chat(tools=[WEATHER], tool_choice="none"), Endpoint.CHAT, GUIDED)
    assert parsed.tool_call is None and "guided_decoding_guide" not in parsed.inputs and len(parsed.messages) == 1


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": {"get_weather": {}}, "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[("}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "oops": 1}}], "tool_choice": "required"},
     "tools[0].function.oops"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_definitions_and_choices_are_typed_400s(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_request(_chat(**body), Endpoint.CHAT, GUIDED)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}
    if param.endswith("parameters") and isinstance(body["tools"][-1]["function"]["parameters"], dict):
        assert info.value.error_code == "invalid_tool_schema"


def test_a_model_without_guided_decoding_refuses_a_forced_call() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_request(_chat(tools=[WEATHER], tool_choice="required"), Endpoint.CHAT,
                      Capabilities(frozenset({"text_input", "max_tokens"})))
    assert info.value.param == "tool_choice" and info.value.error_code == "unsupported_parameter"


# -- the answer's shape, no server ----------------------------------------------------------
def _split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("seed", range(5))
def test_streamed_deltas_add_up_to_the_message_for_both_shapes(seed: int) -> None:
    rng = random.Random(seed)
    wrapped = ToolCallPlan(parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).tools)
    named = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    arguments = '{"city": "Oslo", "unit": "celsius"}'
    for plan, text in ((wrapped, '{"name": "get_weather", "arguments": ' + arguments + "}"), (named, arguments)):
        message, finish = tool_call_message(plan, text, "stop")
        call = message["tool_calls"][0]
        assert (message["content"], finish, call["type"]) == (None, "tool_calls", "function")
        assert call["function"] == {"name": "get_weather", "arguments": arguments} and call["id"].startswith("call_")
        deltas = ToolCallDeltas(plan)
        chunks = [d for i, piece in enumerate(_split(text, rng)) for d in deltas.feed(piece, i == 0)]
        rest, finish = deltas.close("stop")
        chunks += rest
        assert chunks[0]["role"] == "assistant" and finish == "tool_calls"
        calls = [c for d in chunks for c in d.get("tool_calls", [])]
        assert calls[0]["id"] == deltas.id and calls[0]["function"]["name"] == "get_weather"
        assert sum(1 for c in calls if "id" in c) == 1
        assert "".join(c["function"]["arguments"] for c in calls) == arguments


def test_a_call_cut_short_keeps_the_model_reason_and_the_arguments_so_far() -> None:
    plan = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    message, finish = tool_call_message(plan, '{"name": "get_time", "arguments": {"timez', "length")
    assert finish == "length" and message["tool_calls"][0]["function"] == {"name": "get_time",
                                                                           "arguments": '{"timez'}
    message, finish = tool_call_message(plan, '{"name": "get_t', "length")  # no name yet: the text as content
    assert message == {"role": "assistant", "content": '{"name": "get_t'} and finish == "length"
    text = ToolCallText(plan)
    assert text.feed('{"name": "get_time", "arguments": {"t') == (True, '{"')  # the last character held back
    assert text.rest() == "t" and not text.complete


# -- against the real server ----------------------------------------------------------------
@pytest.mark.slow
def test_a_named_function_call_returns_valid_arguments_streamed_and_not(client) -> None:  # noqa: F811
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                           max_tokens=48, temperature=0)
    answer = reply.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), _function_schema(WEATHER))
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                                 max_tokens=48, temperature=0, stream=True))
    calls = [c for chunk in chunks if chunk.choices for c in (chunk.choices[0].delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.slow
def test_required_with_two_tools_calls_one_of_them_with_valid_arguments(client) -> None:  # noqa: F811
    asks = [ASK, [{"role": "user", "content": "What time is it now in the Europe/Paris time zone?"}]]
    for messages in asks:
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                               tool_choice="required", max_tokens=48, temperature=0)
        (call,) = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls"
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), _function_schema(tool))
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                                     tool_choice="required", max_tokens=48, temperature=0,
                                                     stream=True))
        calls = [c for chunk in chunks if chunk.choices for c in (chunk.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == call.function.name
        assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments


@pytest.mark.slow
def test_a_bad_schema_is_refused_in_openai_format(client) -> None:  # noqa: F811
    openai = pytest.importorskip("openai")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}
    for extra in ({"tool_choice": "required"}, {"tool_choice": "auto"}, {}):  # auto: OpenAI's default
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=[bad], max_tokens=8, **extra)
        assert info.value.body["param"] == "tools[0].function.parameters"
        assert info.value.body["code"] == "invalid_tool_schema" and "strin" in info.value.body["message"]
