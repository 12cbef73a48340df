"""The OpenAI tool loop on the front (triton_backend/serving/front/openai: tools.py, tool_format.py, tool_parser.py,
messages.py): ``tool_choice: "auto"`` decoded under its grammar (free text, or calls once the model
writes ``<tool_call>``) and parsed into ``content`` / ``tool_calls``, streamed and not;
``parallel_tool_calls``; assistant ``tool_calls`` and ``tool`` messages rendered for the chat
template; bad tool messages refused with typed 400s. Without a server first, then a real two-turn
loop through the official ``openai`` SDK against the session's Triton server."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from triton_backend.serving.front.openai.openai_errors import OpenAIError
from triton_backend.serving.front.openai.messages import parse_messages
from triton_backend.serving.front.openai.openai_request import Capabilities, Endpoint, parse_request
from triton_backend.serving.front.openai.tool_format import CALL_CLOSE, CALL_OPEN, render_call
from triton_backend.serving.front.openai.tool_parser import AutoToolDeltas, tool_message
from triton_backend.serving.front.openai.tools import AutoToolPlan, ToolCallPlan, parse_tools
from openai_fixtures import MODEL, client, front  # noqa: F401 - one front over the session's Triton
from triton_fixtures import triton  # noqa: F401 - the session's real Triton server

GUIDED = Capabilities(frozenset({"text_input", "max_tokens", "guided_decoding_guide_type", "guided_decoding_guide"}))
PLAIN = Capabilities(frozenset({"text_input", "max_tokens", "return_log_probs"}))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a time zone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                   "properties": {"timezone": {"type": "string", "maxLength": 40}}}}}


def _calls(turn: int, *cities: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{turn}_{city}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}} for city in cities]}


def _results(turn: int, **weather: str) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": f"call_{turn}_{city}", "content": text} for city, text in weather.items()]


# Conversations whose earlier turns show the format: the reference target then calls by itself
# (greedy; checked against the real server below).
ONE_CITY = [{"role": "user", "content": "Weather in Paris?"}, _calls(1, "Paris"), *_results(1, Paris="sunny"),
            {"role": "user", "content": "Weather in Rome?"}, _calls(2, "Rome"), *_results(2, Rome="rain"),
            {"role": "user", "content": "Weather in Oslo?"}]
TWO_CITIES = [{"role": "user", "content": "Weather in Paris and Rome?"}, _calls(1, "Paris", "Rome"),
              *_results(1, Paris="sunny", Rome="rain"),
              {"role": "user", "content": "Weather in Madrid and Lisbon?"}, _calls(2, "Madrid", "Lisbon"),
              *_results(2, Madrid="hot", Lisbon="windy"),
              {"role": "user", "content": "Weather in Oslo and Berlin?"}]


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 8, **extra}


# -- tool_choice auto, no server ------------------------------------------------------------
def test_auto_is_the_default_with_tools_and_is_decoded_under_the_call_grammar() -> None:
    for extra in ({}, {"tool_choice": "auto"}):
        parsed = parse_request(_chat(tools=[WEATHER, TIME], **extra), Endpoint.CHAT, GUIDED)
        assert isinstance(parsed.tool_call, AutoToolPlan) and parsed.tool_call.parallel
        assert parsed.inputs["guided_decoding_guide_type"] == "ebnf_grammar"
        grammar = parsed.inputs["guided_decoding_guide"]
        assert "call_start[lazy]" in grammar and '"get_weather"' in grammar and '"get_time"' in grammar
        system, user = parsed.messages
        assert system.role == "system" and CALL_OPEN in system.content and "get_time: Current local time" in system.content
    single = parse_request(_chat(tools=[WEATHER], parallel_tool_calls=False), Endpoint.CHAT, GUIDED)
    assert single.tool_call == AutoToolPlan(single.tool_call.tools, parallel=False)
    assert "at most one function" in single.messages[0].content
    assert "call_body)*" not in single.inputs["guided_decoding_guide"]  # one call block, no repetition
    free = parse_request(_chat(tools=[WEATHER]), Endpoint.CHAT, PLAIN)  # no guided decoding: decoded freely, parsed
    assert isinstance(free.tool_call, AutoToolPlan) and "guided_decoding_guide" not in free.inputs
    forced = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": True})
    assert isinstance(forced, ToolCallPlan)  # a forced call is one call whatever parallel_tool_calls says


@pytest.mark.parametrize("extra, param, code", [
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", None),
    ({"tools": [WEATHER], "logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", None),
    ({"tool_choice": "auto"}, "tool_choice", None),
])
def test_auto_refusals_are_typed_400s(extra: dict, param: str, code: str | None) -> None:
    caps = Capabilities(GUIDED.inputs | {"return_log_probs"})
    with pytest.raises(OpenAIError) as info:
        parse_request(_chat(**extra), Endpoint.CHAT, caps)
    assert (info.value.status, info.value.param, info.value.error_code) == (400, param, code), info.value.message


@pytest.fixture(scope="module")
def matcher_for() -> Any:
    from llguidance import LLMatcher

    from triton_backend.core.grammar import grammar_text, ll_tokenizer
    from triton_backend.core.guide import Guide
    from triton_backend.engines.torch.model_loading import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    lltok = ll_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def make(plan: AutoToolPlan) -> tuple[Any, Any]:
        return LLMatcher(lltok, grammar_text(Guide(*plan.guide())), log_level=0), tokenizer

    return make


def test_the_auto_grammar_leaves_text_free_and_forces_the_call_once_it_starts(matcher_for) -> None:
    tools = parse_tools({"tools": [WEATHER, TIME]}).tools
    call = render_call("get_weather", {"city": "Oslo"})
    matcher, tokenizer = matcher_for(AutoToolPlan(tools))
    text = "Any text at all: <tool> {\"json\": 1}, 日本 🙂\n\n"
    assert matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    matcher, _ = matcher_for(AutoToolPlan(tools))
    assert matcher.consume_tokens(tokenizer.encode("Let me check." + CALL_OPEN, add_special_tokens=False))
    assert tokenizer.decode(matcher.compute_ff_tokens()) == '\n{"name": "get_'  # the call's layout is forced
    for bad in ('{"name": "get_weather", "arguments": {"town": "Oslo"}}', '{"name": "other", "arguments": {}}'):
        probe, _ = matcher_for(AutoToolPlan(tools))
        probe.consume_tokens(tokenizer.encode(CALL_OPEN + "\n", add_special_tokens=False))
        assert probe.validate_tokens(tokenizer.encode(bad, add_special_tokens=False)) < len(
            tokenizer.encode(bad, add_special_tokens=False))
    for parallel in (True, False):
        matcher, _ = matcher_for(AutoToolPlan(tools, parallel))
        assert matcher.consume_tokens(tokenizer.encode(call, add_special_tokens=False)) and matcher.is_accepting()
        second = tokenizer.encode("\n" + call, add_special_tokens=False)
        assert (matcher.validate_tokens(second) == len(second)) is parallel  # one call only without parallel calls


# -- the answer parsed, no server -----------------------------------------------------------
def _pieces(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), k=min(9, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _fold(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The deltas accumulated as the openai SDK's stream helper does."""
    message: dict[str, Any] = {"content": None}
    for delta in deltas:
        if delta.get("content") is not None:
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            calls = message.setdefault("tool_calls", [])
            if call["index"] == len(calls):
                assert set(call) == {"index", "id", "type", "function"} and call["function"]["arguments"] == ""
                calls.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return message


ARGS = '{"city": "O}s\\"lo{"}'
ANSWERS = [  # (model text, model reason) -> (content, [(name, arguments)], finish reason)
    (("Hello there <tool and more\n\n", "stop"), ("Hello there <tool and more\n\n", [], "stop")),
    (("", "stop"), ("", [], "stop")),
    ((f'Sure.\n{CALL_OPEN}\n{{"name": "get_weather", "arguments": {ARGS}}}\n{CALL_CLOSE}\n{CALL_OPEN}\n'
      f'{{"name": "get_time", "arguments": {{}}}}\n{CALL_CLOSE}', "stop"),
     ("Sure.", [("get_weather", ARGS), ("get_time", "{}")], "tool_calls")),
    ((f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"ci', "length"),
     (None, [("get_weather", '{"ci')], "length")),
    ((f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{}}}}\n{CALL_CLOSE}\n{CALL_OPEN}\n{{"na', "length"),
     (None, [("get_weather", "{}")], "length")),  # a second call cut before its name: dropped
    ((f'Hi\n{CALL_OPEN}\n{{"na', "length"), (f'Hi\n{CALL_OPEN}\n{{"na', [], "length")),  # the only one: text
    ((f"{CALL_OPEN} not json {CALL_CLOSE} ok", "stop"), (f"{CALL_OPEN} not json {CALL_CLOSE} ok", [], "stop")),
    ((f'{CALL_OPEN}\n{{"x": 1}}\n{CALL_CLOSE}', "stop"), (f'{CALL_OPEN}\n{{"x": 1}}\n{CALL_CLOSE}', [], "stop")),
]


@pytest.mark.parametrize("answer, expected", ANSWERS)
def test_an_auto_answer_parses_into_content_and_calls_and_the_stream_adds_up_to_it(answer, expected) -> None:
    text, reason = answer
    content, calls, finish = expected
    message, got_finish = tool_message(AutoToolPlan(()), text, reason)
    assert (message["content"], got_finish) == (content, finish)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message.get("tool_calls", []))
    for seed in range(12):
        parser = AutoToolDeltas()
        deltas = [d for i, piece in enumerate(_pieces(text, random.Random(seed))) for d in parser.feed(piece, i == 0)]
        rest, streamed_finish = parser.close(reason)
        deltas += rest
        assert deltas[0] == {"role": "assistant", "content": None} and streamed_finish == finish
        folded = _fold(deltas[1:])
        assert folded["content"] == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in folded.get("tool_calls", [])] == calls


# -- conversations with tool calls and results ----------------------------------------------
def test_calls_and_results_are_rendered_in_the_call_format_for_the_chat_template() -> None:
    turns = parse_messages([{"role": "user", "content": "Weather in Paris and Rome?"},
                            {**_calls(1, "Paris", "Rome"), "content": "Checking.", "refusal": None},
                            *_results(1, Paris="sunny", Rome="rain"),
                            {"role": "assistant", "content": [{"type": "text", "text": "Sunny and rainy."}]}])
    assert [t.role for t in turns] == ["user", "assistant", "user", "assistant"]
    assert turns[1].content == ("Checking.\n" + render_call("get_weather", {"city": "Paris"}) + "\n"
                                + render_call("get_weather", {"city": "Rome"}))
    assert turns[1].content.count(CALL_OPEN) == 2 and '{"name": "get_weather", "arguments": {"city": "Rome"}}' in turns[1].content
    assert turns[2].content == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    parsed = parse_request({"model": "m", "messages": ONE_CITY, "tools": [WEATHER], "tool_choice": "none"},
                           Endpoint.CHAT, GUIDED)  # replayed under 'none' too: the tools are not shown
    assert [t.role for t in parsed.messages] == ["user", "assistant", "user"] * 2 + ["user"]


BAD_MESSAGES = [
    ([{"role": "tool", "tool_call_id": "x", "content": "r"}], "messages[0].role", "tool_message_without_call"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
      {"role": "tool", "tool_call_id": "call_1_Oslo", "content": "r"}], "messages[2].role", "tool_message_without_call"),
    ([_calls(1, "Oslo"), {"role": "tool", "tool_call_id": "call_9", "content": "r"}],
     "messages[1].tool_call_id", "unknown_tool_call_id"),
    ([_calls(1, "Oslo"), {"role": "tool", "content": "r"}], "messages[1].tool_call_id", "unknown_tool_call_id"),
    ([_calls(1, "Oslo"), *_results(1, Oslo="r"), *_results(1, Oslo="again")],
     "messages[2].tool_call_id", "duplicate_tool_result"),
    ([_calls(1, "Oslo", "Rome"), *_results(1, Oslo="r"), {"role": "user", "content": "q"}],
     "messages[0].tool_calls", "missing_tool_result"),
    ([{"role": "user", "content": "q"}, _calls(1, "Oslo")], "messages[1].tool_calls", "missing_tool_result"),
    ([{"role": "assistant", "tool_calls": {"id": "c"}}], "messages[0].tool_calls", "invalid_tool_call"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].id", "invalid_tool_call"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}],
     "messages[0].tool_calls[0].function.arguments", "invalid_tool_call"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments", "invalid_tool_call"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "code", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0]", "invalid_tool_call"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name", "invalid_tool_call"),
    ([{**_calls(1, "Oslo"), "tool_calls": _calls(1, "Oslo")["tool_calls"] * 2}], "messages[0].tool_calls",
     "invalid_tool_call"),
    ([{"role": "function", "name": "f", "content": "r"}], "messages[0].role", "unsupported_parameter"),
    ([{"role": "user", "content": "q", "tool_call_id": "c"}], "messages[0].tool_call_id", None),
    ([{"role": "assistant", "content": None}], "messages[0].content", None),
]


@pytest.mark.parametrize("messages, param, code", BAD_MESSAGES)
def test_bad_tool_messages_are_typed_400s_naming_the_message(messages: list, param: str, code: str | None) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_request({"model": "m", "messages": messages}, Endpoint.CHAT, GUIDED)
    assert (info.value.status, info.value.param, info.value.error_code) == (400, param, code), info.value.message
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"} and len(info.value.message) < 300


# -- against the real server ----------------------------------------------------------------
def _streamed(client, **request: Any) -> tuple[Any, list[Any]]:  # noqa: F811
    """The SDK's own accumulation of a stream (its ``stream`` helper) and the raw chunks."""
    chunks = []
    with client.chat.completions.stream(**request) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        return stream.get_final_completion(), chunks


def _same_message(a: Any, b: Any) -> None:
    """Two answers' messages equal but for the calls' ids."""
    assert a.content == b.content
    assert [(c.type, c.function.name, c.function.arguments) for c in a.tool_calls or []] == \
        [(c.type, c.function.name, c.function.arguments) for c in b.tool_calls or []]


@pytest.mark.slow
def test_a_two_turn_tool_loop_through_the_sdk_streamed_and_not(client) -> None:  # noqa: F811
    request = {"model": MODEL, "tools": [WEATHER, TIME], "max_tokens": 48, "temperature": 0}
    reply = client.chat.completions.create(messages=ONE_CITY, **request)
    answer = reply.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    plain = client.chat.completions.create(messages=ONE_CITY, extra_body={"speculation": "off"}, **request)
    _same_message(plain.choices[0].message, answer.message)  # exact: speculation does not change the answer
    final, chunks = _streamed(client, messages=ONE_CITY, **request)
    _same_message(final.choices[0].message, answer.message)
    assert final.choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 1

    # turn 2: the SDK's own message object sent back, with the tool's result
    followup = ONE_CITY + [answer.message, {"role": "tool", "tool_call_id": call.id, "content": "cloudy, 12 C"}]
    second = client.chat.completions.create(messages=followup, **request)
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None
    assert "12 C" in second.choices[0].message.content  # the answer (the tiny target quotes the result)
    final, _ = _streamed(client, messages=followup, **request)
    _same_message(final.choices[0].message, second.choices[0].message)
    plain = client.chat.completions.create(messages=followup, extra_body={"speculation": "off"}, **request)
    _same_message(plain.choices[0].message, second.choices[0].message)
    assert second.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result reached the prompt


@pytest.mark.slow
def test_parallel_calls_and_parallel_tool_calls_false(client) -> None:  # noqa: F811
    request = {"model": MODEL, "messages": TWO_CITIES, "tools": [WEATHER], "max_tokens": 64, "temperature": 0}
    both = client.chat.completions.create(**request)
    assert both.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in both.choices[0].message.tool_calls] == [{"city": "Oslo"},
                                                                                            {"city": "Berlin"}]
    final, chunks = _streamed(client, **request)
    _same_message(final.choices[0].message, both.choices[0].message)
    opened = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or [] if d.id]
    assert [d.index for d in opened] == [0, 1] and len({d.id for d in opened}) == 2
    one = client.chat.completions.create(parallel_tool_calls=False, **request)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    assert json.loads(one.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}


@pytest.mark.slow
def test_auto_text_answers_equal_plain_decoding_and_bad_tool_messages_are_refused(client) -> None:  # noqa: F811
    openai = pytest.importorskip("openai")
    ask = [{"role": "user", "content": "Say hello."}]
    request = {"model": MODEL, "messages": ask, "tools": [WEATHER], "max_tokens": 24, "temperature": 0}
    reply = client.chat.completions.create(**request)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.tool_calls is None
    plain = client.chat.completions.create(extra_body={"speculation": "off"}, **request)
    assert plain.choices[0].message.content == reply.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **request))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content and chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    for messages, param, code in BAD_MESSAGES[:3] + BAD_MESSAGES[5:6]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4)
        assert (info.value.body["param"], info.value.body["code"]) == (param, code)


def test_forced_calls_accept_a_conversation_with_earlier_calls() -> None:
    parsed = parse_request({"model": "m", "messages": ONE_CITY, "tools": [WEATHER], "tool_choice": "required"},
                           Endpoint.CHAT, GUIDED)
    assert parsed.messages[0].content.startswith("Call the function get_weather")
    assert CALL_OPEN in parsed.messages[2].content and parsed.inputs["guided_decoding_guide_type"] == "json_schema"
    jsonschema.validate({"city": "Oslo"}, json.loads(parsed.inputs["guided_decoding_guide"]))
