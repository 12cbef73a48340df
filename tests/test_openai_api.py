"""The OpenAI-compatible front (builder/ops/openai) against a REAL Triton server, through the
official ``openai`` SDK and plain HTTP: greedy output equals Triton's own, streams concatenate
to the full answer, concurrent streams equal each request alone, errors are typed in OpenAI's
format, the API key is enforced, and a client that disconnects cancels its request."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.ops.openai.app import OpenAIConfig
from builder.ops.openai.errors import OpenAIError
from builder.ops.openai.protocol import Capabilities, Endpoint, parse_request, response_format_guide
from builder.ops.triton_client import ClientConfig, GenerateRequest, generate
from triton_backend.core.errors import ConfigError
from openai_fixtures import KEY, MODEL, client, front  # noqa: F401 - one front over the session's Triton
from triton_fixtures import triton  # noqa: F401 - the session's real Triton server

openai = pytest.importorskip("openai")

PROMPT = "Rewrite in the past tense: The cat sits on the mat and looks at the birds."
CAPS = Capabilities(frozenset({"text_input", "max_tokens", "temperature"}))


def _triton_text(triton, prompt: str, max_tokens: int, chat: bool = False) -> tuple[str, dict]:  # noqa: F811
    result = generate(ClientConfig(url=triton.endpoints.grpc_url),
                      GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True, chat=chat))
    return result.text, result.stats


# -- parsing, no server ---------------------------------------------------------------------
def test_parse_maps_parameters_and_refuses_the_rest() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "seed": 3, "stop": "x",
            "top_k": -1, "presence_penalty": 0, "ignore_eos": True}
    parsed = parse_request(body, Endpoint.COMPLETIONS, CAPS)
    assert dict(parsed.inputs) == {"max_tokens": 5, "temperature": 0.0, "random_seed": 3, "stop_words": ["x"],
                                   "top_k": 0, "ignore_eos": True}
    for bad, param, status in (({"n": 2}, "n", 400), ({"frobnicate": 1}, "frobnicate", 400),
                               ({"presence_penalty": 0.5}, "presence_penalty", 400),
                               ({"temperature": 3}, "temperature", 400), ({"logprobs": 2}, "logprobs", 400),
                               ({"max_tokens": 0}, "max_tokens", 400), ({"prompt": [1, 2]}, "prompt", 400),
                               ({"response_format": {"type": "json_object"}}, "response_format", 400)):
        with pytest.raises(OpenAIError) as info:
            parse_request({**body, **bad}, Endpoint.COMPLETIONS, CAPS)
        assert (info.value.param, info.value.status) == (param, status)
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "max_completion_tokens": 4}
    assert parse_request(chat, Endpoint.CHAT, CAPS).inputs["max_tokens"] == 4
    with pytest.raises(OpenAIError) as info:  # tools: tests/test_openai_tools.py
        parse_request({**chat, "tools": [{"type": "function"}]}, Endpoint.CHAT, CAPS)
    assert info.value.param == "tools[0]"


def test_response_format_maps_to_guided_decoding_inputs() -> None:
    assert response_format_guide({"type": "text"}) is None
    assert response_format_guide({"type": "json_object"}) == ("json", None)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    kind, text = response_format_guide({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert kind == "json_schema" and json.loads(text) == schema
    guided = Capabilities(CAPS.inputs | {"guided_decoding_guide_type", "guided_decoding_guide"})
    parsed = parse_request({"model": "m", "prompt": "p", "response_format": {"type": "json_object"}},
                           Endpoint.COMPLETIONS, guided)
    assert parsed.inputs == {"guided_decoding_guide_type": "json"}


def test_serve_and_deploy_flags_make_the_front_config() -> None:
    from builder.cli.deploy import SETTINGS, config_from_settings, resolve_settings
    from builder.cli.main import build_parser
    from builder.cli.serve import openai_config

    args = build_parser().parse_args(["serve", "--openai-port", "0", "--api-key", "k", "--served-model-name", "m"])
    assert openai_config(args) == OpenAIConfig(host="127.0.0.1", port=0, api_key="k", served_model_name="m")
    assert openai_config(build_parser().parse_args(["serve"])) is None
    with pytest.raises(ConfigError, match="need --openai-port"):
        openai_config(build_parser().parse_args(["serve", "--api-key", "k"]))
    import argparse

    empty = argparse.Namespace(**{s.dest: None for s in SETTINGS})
    env = {"SPECBUILD_OPENAI_PORT": "9000", "SPECBUILD_API_KEY": "secret", "SPECBUILD_HOST": "0.0.0.0"}
    config = config_from_settings(resolve_settings(empty, env)).openai
    assert config == OpenAIConfig(host="0.0.0.0", port=9000, api_key="secret")
    assert config_from_settings(resolve_settings(empty, {})).openai is None


def test_bench_summary_takes_the_worse_p50_ratio_and_only_when_the_texts_match() -> None:
    from builder.bench.concurrency import ConcurrencyConfig, LevelResult
    from builder.bench.openai_api import summarize

    def level(api: str, c: int, latencies: list[float], text: str = "same") -> LevelResult:
        return LevelResult(api, c, len(latencies), 10 * len(latencies), 1.0, latencies_s=latencies,
                           ttft_s=latencies, texts={0: text})

    config = ConcurrencyConfig(concurrency=(1, 8), requests_per_level=8)
    levels = [level("grpc", 1, [1.0, 1.0, 3.0]), level("grpc", 8, [2.0, 2.0, 2.0]),
              level("openai", 1, [1.02, 1.02, 1.0]), level("openai", 8, [2.2, 2.2, 2.2])]
    summary = summarize(levels, config)
    assert summary["headline"] == {"openai_latency_x_grpc": pytest.approx(1.1)}
    assert all(r["identical_to_grpc"] for r in summary["rows"])
    levels[-1] = level("openai", 8, [2.2, 2.2, 2.2], text="different")
    assert summarize(levels, config)["headline"] == {}  # a text that differs: no headline figure


# -- against the real server ----------------------------------------------------------------
@pytest.mark.slow
def test_greedy_completion_equals_triton_and_counts_tokens(triton, front, client) -> None:  # noqa: F811
    expected, stats = _triton_text(triton, PROMPT, 24)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert reply.choices[0].text == expected and expected
    assert reply.choices[0].finish_reason == ("length" if stats["finish_reason"] == "length" else "stop")
    usage = reply.usage
    assert usage.completion_tokens == stats["num_output_tokens"]
    from triton_backend.engines.torch.model_loading import load_tokenizer

    assert usage.prompt_tokens == len(load_tokenizer(MODEL).encode(PROMPT, add_special_tokens=False))
    spec = usage.model_extra["speculation"]
    assert spec["method"] == stats["speculation_method"] and spec["target_passes"] == stats["target_passes"]


@pytest.mark.slow
def test_chat_uses_the_target_chat_template_and_streams_the_same_text(triton, front, client) -> None:  # noqa: F811
    expected, _ = _triton_text(triton, PROMPT, 24, chat=True)  # the model's own template, one user message
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert text == _triton_text(triton, PROMPT, 24)[0]


@pytest.mark.slow
def test_sampling_stop_and_penalties_reach_the_model(triton, front, client) -> None:  # noqa: F811
    expected, _ = _triton_text(triton, PROMPT, 24)
    cut = expected.split()[2]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[cut])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == expected[:expected.index(cut)]
    sampled = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9,
                                         seed=seed).choices[0].text for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1]  # seeded: reproducible
    penalised = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.0)
    assert penalised.choices[0].text != expected  # the penalties are applied by the model, not dropped


@pytest.mark.slow
def test_concurrent_streams_equal_each_request_alone(front) -> None:
    prompts = ["Count from one to ten:", "The three primary colors are", PROMPT]

    async def one(client: "openai.AsyncOpenAI", prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=front.url + "/v1", api_key=KEY, max_retries=0) as client:
            alone = [await one(client, p) for p in prompts]
            together = await asyncio.gather(*(one(client, p) for p in prompts))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone and all(alone)


@pytest.mark.slow
def test_errors_are_typed_in_openai_format(front, client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", n=2)
    assert info.value.body["param"] == "n" and info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert info.value.body["param"].startswith("response_format"), info.value.body  # a schema is required
    with pytest.raises(openai.BadRequestError) as info:  # checked by the model itself, as an error response
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=4)
    assert "context" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"speculation": "nonsense"})
    assert [m.id for m in client.models.list()] == [MODEL]
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path, body, status in (("POST", "/v1/completions", b"{not json", 400),
                                       ("POST", "/v1/completions", b'{"prompt": "' + b"x" * 70000 + b'"}', 413),
                                       ("GET", "/v1/nowhere", None, 404), ("GET", "/v1/completions", None, 405)):
        reply = httpx.request(method, front.url + path, content=body, headers=headers, timeout=30)
        error = reply.json()["error"]
        assert reply.status_code == status and set(error) == {"message", "type", "param", "code"}, reply.text
        assert "Traceback" not in error["message"]


@pytest.mark.slow
def test_response_format_json_schema_is_decoded_under_its_grammar(client) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Alice is 31 years old. Give her name and age as JSON."}],
        max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(reply.choices[0].message.content)  # the grammar forces a complete, valid object
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
    loose = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=32, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), (dict, list))


@pytest.mark.slow
def test_api_key_guards_v1_but_not_health(front) -> None:
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        reply = httpx.get(front.url + "/v1/models", headers=headers, timeout=30)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=front.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(front.url + "/health", timeout=30).json() == {"status": "ok"}


def _cancelled(triton) -> float:  # noqa: F811
    return sum(v for k, v in triton.metrics().items()
               if k.startswith("specdec_requests_total") and 'outcome="cancelled"' in k)


@pytest.mark.slow
def test_a_client_disconnecting_mid_stream_cancels_its_request(triton, front) -> None:  # noqa: F811
    before = _cancelled(triton)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got  # then the client goes away mid-stream
    deadline = time.monotonic() + 30
    while _cancelled(triton) <= before and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _cancelled(triton) == before + 1
    in_flight = [v for k, v in triton.metrics().items() if k.startswith("specdec_requests_in_flight")]
    assert in_flight and sum(in_flight) == 0


# -- fuzz: typed errors only, the server stays up -------------------------------------------
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=6)
_KEYS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                         "top_k", "seed", "stop", "n", "stream", "stream_options", "presence_penalty", "logprobs",
                         "response_format", "tools", "tool_choice", "ignore_eos", "min_tokens", "speculation",
                         "num_draft_tokens", "echo", "user", "bogus"])


def _bodies(max_tokens: st.SearchStrategy[Any]) -> st.SearchStrategy[dict]:
    base = st.fixed_dictionaries({"model": st.sampled_from([MODEL, MODEL, "other", 3]),
                                  "prompt": st.sampled_from(["Hi", "", "x" * 50]),
                                  "messages": st.sampled_from([[{"role": "user", "content": "Hi"}], [], "Hi",
                                                               [{"role": "tool", "content": "x"}]]),
                                  "max_tokens": max_tokens})
    return st.tuples(base, st.dictionaries(_KEYS, _JSON, max_size=4)).map(lambda pair: {**pair[0], **pair[1]})


@settings(max_examples=200, deadline=None)
@given(body=_bodies(_JSON), endpoint=st.sampled_from(list(Endpoint)))
def test_fuzz_parse_gives_a_typed_request_or_an_openai_error(body: dict, endpoint: Endpoint) -> None:
    full = Capabilities(frozenset({"presence_penalty", "frequency_penalty", "min_tokens", "repetition_penalty"}))
    try:
        parsed = parse_request(body, endpoint, full)
    except OpenAIError as exc:
        assert exc.status == 400 and set(exc.body()["error"]) == {"message", "type", "param", "code"}
        assert len(exc.message) < 300
        return
    allowed = {"max_tokens", "temperature", "top_p", "top_k", "random_seed", "stop_words", "ignore_eos",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "speculation",
               "num_draft_tokens"}
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
