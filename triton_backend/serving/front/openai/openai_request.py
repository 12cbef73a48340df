"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) parsed into one typed
:class:`GenerationRequest`, checked against what the served model takes (:class:`Capabilities`).

Honoured: ``model``, ``prompt`` (one string) / ``messages`` (text content), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``n`` = 1, ``stream``,
``stream_options.include_usage``, ``user``; vLLM's ``top_k``, ``ignore_eos``, ``min_tokens``,
``repetition_penalty``; ours ``speculation``, ``num_draft_tokens``. ``presence_penalty`` /
``frequency_penalty`` / ``min_tokens`` / ``repetition_penalty`` other than their no-op value,
``response_format`` other than text, forced tool calls (``tools`` with ``tool_choice``
``required`` or a named function: :mod:`.tools`) and log probabilities are sent only where the
served model declares the matching input, and refused with a 400 otherwise; ``tool_choice``
``auto`` is decoded under its grammar where the model has guided decoding, freely otherwise.
Chat messages, tool calls and tool results included: :mod:`.messages`. Anything else is refused.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from triton_backend.serving.front.openai.openai_errors import OpenAIError, invalid, unsupported
from triton_backend.serving.front.openai.logprobs import LogprobsRequest, parse_logprobs
from triton_backend.serving.front.openai.messages import Message, parse_messages, with_instructions
from triton_backend.serving.front.openai.tools import ToolCallPlan, ToolPlan, parse_tools

MAX_STOP_WORDS = 16
UINT64_MAX = 2 ** 64 - 1
INT32_MAX = 2 ** 31 - 1

GUIDE_TYPE_INPUT = "guided_decoding_guide_type"
GUIDE_INPUT = "guided_decoding_guide"


class Endpoint(str, enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True)
class Capabilities:
    """What the served model takes: its input tensors (from its metadata, read once at start)."""

    inputs: frozenset[str]

    def has(self, *names: str) -> bool:
        return all(name in self.inputs for name in names)


@dataclass(frozen=True)
class GenerationRequest:
    """One request of either endpoint; ``None`` leaves a setting to the served model's default.
    ``inputs``: the served model's optional inputs to send, by tensor name."""

    endpoint: Endpoint
    model: str
    prompt: str = ""  # completions
    messages: tuple[Message, ...] = ()  # chat
    stream: bool = False
    include_usage: bool = False
    inputs: Mapping[str, Any] = field(default_factory=dict)
    tool_call: ToolPlan | None = None  # chat: a forced call (ToolCallPlan) or tool_choice 'auto' (AutoToolPlan)
    logprobs: LogprobsRequest | None = None  # None: not asked for


# keys each endpoint accepts (values checked below); anything else is refused by name
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "user", "ignore_eos",
           "min_tokens", "speculation", "num_draft_tokens", "response_format", "logit_bias", "best_of"}
_KEYS = {Endpoint.COMPLETIONS: _COMMON | {"prompt", "echo", "suffix"},
         Endpoint.CHAT: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                   "parallel_tool_calls", "functions", "function_call"}}
_NO_OP = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"'{key}' must be a number", key)
    if not low <= value <= high:
        raise invalid(f"'{key}' must be in [{low:g}, {high:g}], got {value!r}", key)
    return float(value)


def _sampling(body: Mapping[str, Any], key: str) -> float | None:
    """``temperature`` / ``top_p`` through the one sampling check every path runs
    (:func:`triton_backend.core.config.check_sampling_values`)."""
    from triton_backend.core.config import check_sampling_values
    from triton_backend.core.errors import InvalidRequestError

    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"'{key}' must be a number", key)
    try:
        check_sampling_values(**{key: value})
    except InvalidRequestError as exc:
        raise invalid(str(exc), key) from None
    return float(value)


def _integer(body: Mapping[str, Any], key: str, low: int, high: int = INT32_MAX) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{key}' must be an integer", key)
    if not low <= value <= high:
        raise invalid(f"'{key}' must be in [{low}, {high}], got {value}", key)
    return value


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"'{key}' must be a boolean", key)
    return bool(value)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    words = [value] if isinstance(value, str) else value
    if words is None:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    if len(words) > MAX_STOP_WORDS:
        raise invalid(f"'stop' takes at most {MAX_STOP_WORDS} strings", "stop")
    if any(not w for w in words):
        raise invalid("'stop' strings must not be empty", "stop")
    return tuple(words)


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise unsupported("prompt", "one prompt per request (send a string)")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise unsupported("prompt", "token-id prompts; send text")
    if not isinstance(prompt, str) or not prompt:
        raise invalid("'prompt' must be a non-empty string", "prompt")
    return prompt


def response_format_guide(response_format: Any) -> tuple[str, str | None] | None:
    """``response_format`` as the served model's guided-decoding inputs: ``(guide type, guide)``,
    ``None`` for plain text. ``json_object`` -> ``json`` (no guide), ``json_schema`` ->
    ``json_schema`` with the schema's JSON text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise invalid("'response_format' must be an object with a 'type'", "response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("'response_format.json_schema.schema' must be a JSON schema object",
                          "response_format.json_schema")
        return "json_schema", json.dumps(schema)
    raise invalid(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                  "response_format.type")


def _guide_inputs(body: Mapping[str, Any], caps: Capabilities, tool_call: ToolPlan | None) -> dict[str, Any]:
    guide = response_format_guide(body.get("response_format"))
    guided = caps.has(GUIDE_TYPE_INPUT, GUIDE_INPUT)
    if tool_call is not None:
        forced = isinstance(tool_call, ToolCallPlan)
        if guide is not None and forced:
            raise invalid("'response_format' cannot be combined with a forced tool call (the call's schema "
                          "decides the answer's format)", "response_format")
        if guide is not None:
            raise unsupported("response_format", "a response format with tools the model may call "
                              "(tool_choice 'auto'); send tool_choice 'none' or leave the format out")
        if not guided and forced:
            raise unsupported("tool_choice", "the served model has no guided decoding to decode a call under")
        if not guided:  # auto, as vLLM does it: the answer is decoded freely and parsed
            return {}
        kind, text = tool_call.guide()
        return {GUIDE_TYPE_INPUT: kind, GUIDE_INPUT: text}
    if guide is None:
        return {}
    if not caps.has(GUIDE_TYPE_INPUT, GUIDE_INPUT):
        raise unsupported("response_format", "the served model has no guided decoding")
    kind, text = guide
    return {GUIDE_TYPE_INPUT: kind} if text is None else {GUIDE_TYPE_INPUT: kind, GUIDE_INPUT: text}


def _refuse_unsupported(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    if body.get("functions"):
        raise unsupported("functions", "the deprecated 'functions'; send 'tools'")
    if body.get("function_call") not in (None, "none"):
        raise unsupported("function_call", "the deprecated 'function_call'; send 'tool_choice'")
    if body.get("n") not in (None, 1):
        raise unsupported("n", "one choice per request (n = 1)")
    if body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "one candidate per request")
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "no logit bias")
    if body.get("echo"):
        raise unsupported("echo", "the prompt is not echoed")
    if body.get("suffix"):
        raise unsupported("suffix", "no insertion (suffix)")


def _optional_inputs(body: Mapping[str, Any], caps: Capabilities) -> dict[str, Any]:
    """Penalties and ``min_tokens``: sent when set to anything but their no-op value, and only
    where the served model has the input."""
    values = {"presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
              "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
              "repetition_penalty": _number(body, "repetition_penalty", 1e-6, 100.0),
              "min_tokens": _integer(body, "min_tokens", 0)}
    out = {}
    for name, value in values.items():
        if value is None or value == _NO_OP[name]:
            continue
        if not caps.has(name):
            raise unsupported(name, "the served model has no such input")
        out[name] = value
    return out


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("'stream_options' takes only 'include_usage'", "stream_options")
    return _flag(options, "include_usage")


def _max_tokens(body: Mapping[str, Any], endpoint: Endpoint) -> int | None:
    value = _integer(body, "max_tokens", 1)
    if endpoint is Endpoint.CHAT:
        newer = _integer(body, "max_completion_tokens", 1)
        if newer is not None and value is not None and newer != value:
            raise invalid("'max_tokens' and 'max_completion_tokens' disagree", "max_completion_tokens")
        value = newer if newer is not None else value
    return value


def _speculation_inputs(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    method = body.get("speculation")
    if method is not None:
        if not isinstance(method, str) or not method:
            raise invalid("'speculation' must be a method name (auto, draft, ngram, medusa, eagle, off)", "speculation")
        out["speculation"] = method
    k = _integer(body, "num_draft_tokens", 0, 64)
    if k is not None:
        out["num_draft_tokens"] = k
    return out


def check_prompt_size(text: str, param: str) -> None:
    """The prompt's text within the serving limits in characters and bytes, and valid Unicode
    (:func:`triton_backend.serving.limits.check_text`): refused before anything tokenizes it."""
    from triton_backend.core.errors import InvalidRequestError
    from triton_backend.serving.limits import check_text

    try:
        check_text(text, f"'{param}'")
    except InvalidRequestError as exc:
        raise invalid(str(exc), param) from None


def parse_request(body: Any, endpoint: Endpoint, caps: Capabilities) -> GenerationRequest:
    """The typed request, or an :class:`OpenAIError` (400) naming the first parameter at fault."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    extra = sorted(set(body) - _KEYS[endpoint])
    if extra:
        raise invalid(f"Unrecognized request argument supplied: {extra[0]}", extra[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required (a name from GET /v1/models)", "model")
    if body.get("user") is not None and not isinstance(body.get("user"), str):
        raise invalid("'user' must be a string", "user")
    _refuse_unsupported(body, endpoint)
    stream = _flag(body, "stream")
    tool_call = parse_tools(body) if endpoint is Endpoint.CHAT else None
    inputs: dict[str, Any] = {
        "max_tokens": _max_tokens(body, endpoint), "temperature": _sampling(body, "temperature"),
        "top_p": _sampling(body, "top_p"), "top_k": _integer(body, "top_k", -1),
        "random_seed": _integer(body, "seed", 0, UINT64_MAX), "stop_words": list(_stop(body)) or None,
        "ignore_eos": _flag(body, "ignore_eos") or None,
    }
    if inputs["top_k"] == -1:  # vLLM's spelling of "no top-k filter"
        inputs["top_k"] = 0
    inputs.update(_optional_inputs(body, caps))
    inputs.update(_guide_inputs(body, caps, tool_call))
    inputs.update(_speculation_inputs(body))
    logprobs = parse_logprobs(body, endpoint is Endpoint.CHAT, caps.inputs)
    if logprobs is not None:
        if isinstance(tool_call, ToolCallPlan):  # the answer is a tool call, not content they would annotate
            raise unsupported("logprobs", "log probabilities of a forced tool call")
        if tool_call is not None:
            raise unsupported("logprobs", "log probabilities with tools the model may call (tool_choice 'auto')")
        inputs.update(logprobs.inputs())
    inputs = {name: value for name, value in inputs.items() if value is not None}
    prompt, messages = ("", parse_messages(body.get("messages"))) if endpoint is Endpoint.CHAT else (_prompt(body), ())
    check_prompt_size(prompt if endpoint is Endpoint.COMPLETIONS else "".join(m.content for m in messages),
                      "prompt" if endpoint is Endpoint.COMPLETIONS else "messages")
    if tool_call is not None:
        messages = with_instructions(messages, tool_call.instructions())
    return GenerationRequest(endpoint=endpoint, model=model, prompt=prompt, messages=messages, stream=stream,
                             include_usage=_stream_options(body, stream), inputs=inputs, tool_call=tool_call,
                             logprobs=logprobs)


__all__ = ["Capabilities", "Endpoint", "GenerationRequest", "Message", "OpenAIError", "check_prompt_size", "parse_request",
           "response_format_guide"]
