"""The OpenAI-compatible front (triton_backend/serving/front/openai) fuzzed: any JSON body parses to a typed
request or a typed OpenAI error, and random HTTP bodies against a REAL Triton server get an
OpenAI error or an answer, never a traceback, with the server still up and nothing in flight."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_backend.serving.front.openai.openai_errors import OpenAIError
from triton_backend.serving.front.openai.openai_request import Capabilities, Endpoint, parse_request
from openai_fixtures import KEY, MODEL, front  # noqa: F401 - one front over the session's Triton
from triton_fixtures import triton  # noqa: F401 - the session's real Triton server

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=6)
_KEYS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                         "top_k", "seed", "stop", "n", "stream", "stream_options", "presence_penalty", "logprobs",
                         "top_logprobs",
                         "response_format", "tools", "tool_choice", "parallel_tool_calls", "ignore_eos", "min_tokens", "speculation",
                         "num_draft_tokens", "echo", "user", "bogus"])

_TOOL_TURNS = [{"role": "user", "content": "Hi"},  # a call and its result replayed (the tool loop)
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "done"}]


def _bodies(max_tokens: st.SearchStrategy[Any]) -> st.SearchStrategy[dict]:
    base = st.fixed_dictionaries({"model": st.sampled_from([MODEL, MODEL, "other", 3]),
                                  "prompt": st.sampled_from(["Hi", "", "x" * 50]),
                                  "messages": st.sampled_from([[{"role": "user", "content": "Hi"}], [], "Hi",
                                                               [{"role": "tool", "content": "x"}], _TOOL_TURNS]),
                                  "max_tokens": max_tokens})
    return st.tuples(base, st.dictionaries(_KEYS, _JSON, max_size=4)).map(lambda pair: {**pair[0], **pair[1]})


@settings(max_examples=200, deadline=None)
@given(body=_bodies(_JSON), endpoint=st.sampled_from(list(Endpoint)))
def test_fuzz_parse_gives_a_typed_request_or_an_openai_error(body: dict, endpoint: Endpoint) -> None:
    full = Capabilities(frozenset({"presence_penalty", "frequency_penalty", "min_tokens", "repetition_penalty",
                                   "return_log_probs", "top_log_probs"}))
    try:
        parsed = parse_request(body, endpoint, full)
    except OpenAIError as exc:
        assert exc.status == 400 and set(exc.body()["error"]) == {"message", "type", "param", "code"}
        assert len(exc.message) < 300
        return
    allowed = {"max_tokens", "temperature", "top_p", "top_k", "random_seed", "stop_words", "ignore_eos",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "speculation",
               "num_draft_tokens", "return_log_probs", "top_log_probs"}
    assert set(parsed.inputs) <= allowed and (parsed.prompt or parsed.messages)
    assert all(isinstance(v, (int, float, str, list)) for v in parsed.inputs.values())


@pytest.mark.slow
def test_fuzz_http_bodies_get_openai_errors_or_answers_and_the_server_stays_up(triton, front) -> None:  # noqa: F811
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses: collections.Counter[int] = collections.Counter()

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=_bodies(st.one_of(st.integers(1, 3), _JSON)), path=st.sampled_from(["completions", "chat/completions"]))
    def probe(body: dict, path: str) -> None:
        for key in ("max_tokens", "max_completion_tokens"):  # answers stay short
            if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                body[key] = max(-5, min(body[key], 3))
        if body.get("max_tokens") is None:
            body["max_tokens"] = 3
        body.pop("ignore_eos", None)
        body.pop("min_tokens", None)
        reply = httpx.post(f"{front.url}/v1/{path}", content=json.dumps(body), headers=headers, timeout=60)
        statuses[reply.status_code] += 1
        assert reply.status_code in (200, 400, 404), reply.text
        if reply.status_code != 200:
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
        elif not body.get("stream"):
            assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert reply.text.rstrip().endswith("data: [DONE]")

    probe()
    assert statuses[400] > 0 and sum(statuses.values()) == 40
    assert httpx.get(front.url + "/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(v for k, v in triton.metrics().items()
                                              if k.startswith("specdec_requests_in_flight")) > 0:
        time.sleep(0.25)
    assert sum(v for k, v in triton.metrics().items() if k.startswith("specdec_requests_in_flight")) == 0
