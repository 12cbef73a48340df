"""The OpenAI-compatible front (triton_backend/serving/front/openai) against a REAL Triton server, through the
official ``openai`` SDK and plain HTTP: greedy output equals Triton's own, streams concatenate
to the full answer, concurrent streams equal each request alone, errors are typed in OpenAI's
format, the API key is enforced, and a client that disconnects cancels its request."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx
import pytest

from triton_backend.serving.front.openai.app import OpenAIConfig
from triton_backend.serving.front.openai.openai_errors import OpenAIError
from triton_backend.serving.front.openai.logprobs import LogprobsRequest, completion_logprobs, new_tracker
from triton_backend.serving.front.openai.openai_request import Capabilities, Endpoint, parse_request, response_format_guide
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
    with pytest.raises(ConfigError, match="needs --openai-port"):
        openai_config(build_parser().parse_args(["serve", "--served-model-name", "m"]))
    from builder.cli.serve import api_key
    from triton_backend.serving.launch.triton_server import InferenceKey

    alone = build_parser().parse_args(["serve", "--api-key", "k"])  # guards Triton's own ports without the front
    assert openai_config(alone) is None and InferenceKey(api_key(alone)).flags() == [
        "--http-restricted-api=inference:authorization=Bearer k", "--grpc-restricted-protocol=inference:authorization=Bearer k"]
    import argparse

    empty = argparse.Namespace(**{s.dest: None for s in SETTINGS})
    env = {"SPECBUILD_OPENAI_PORT": "9000", "SPECBUILD_API_KEY": "secret", "SPECBUILD_HOST": "0.0.0.0"}
    config = config_from_settings(resolve_settings(empty, env)).openai
    assert config == OpenAIConfig(host="0.0.0.0", port=9000, api_key="secret")
    assert config_from_settings(resolve_settings(empty, env)).server.api_key == InferenceKey("secret")
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


def test_parse_logprobs_where_the_model_returns_them() -> None:
    caps = Capabilities(CAPS.inputs | {"return_log_probs", "top_log_probs"})
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}]}
    top = parse_request({**chat, "logprobs": True, "top_logprobs": 20}, Endpoint.CHAT, caps)
    assert top.logprobs == LogprobsRequest(20) and top.inputs["top_log_probs"] == 20
    assert parse_request({"model": "m", "prompt": "p", "logprobs": 5}, Endpoint.COMPLETIONS, caps).inputs[
        "top_log_probs"] == 5
    for extra in ({"logprobs": True}, {"logprobs": True, "top_logprobs": 0}):
        parsed = parse_request({**chat, **extra}, Endpoint.CHAT, caps)
        assert parsed.logprobs == LogprobsRequest(0) and parsed.inputs["return_log_probs"] is True
    assert parse_request({**chat, "logprobs": False}, Endpoint.CHAT, caps).logprobs is None
    assert "return_log_probs" not in parse_request(chat, Endpoint.CHAT, caps).inputs
    completion = {"model": "m", "prompt": "p"}
    assert parse_request({**completion, "logprobs": 0}, Endpoint.COMPLETIONS, caps).logprobs == LogprobsRequest(0)
    for body, endpoint, param, code in (
            ({**chat, "logprobs": True, "top_logprobs": 21}, Endpoint.CHAT, "top_logprobs", None),
            ({**chat, "top_logprobs": 0}, Endpoint.CHAT, "top_logprobs", None),
            ({**chat, "logprobs": 1}, Endpoint.CHAT, "logprobs", None),
            ({**completion, "logprobs": True}, Endpoint.COMPLETIONS, "logprobs", None),
            ({**completion, "logprobs": 6}, Endpoint.COMPLETIONS, "logprobs", None)):
        with pytest.raises(OpenAIError) as info:
            parse_request(body, endpoint, caps)
        assert (info.value.status, info.value.param, info.value.error_code) == (400, param, code), body
    with pytest.raises(OpenAIError, match="does not return log probabilities"):  # a model without the input
        parse_request({**completion, "logprobs": 0}, Endpoint.COMPLETIONS, CAPS)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    guided = Capabilities(caps.inputs | {"guided_decoding_guide_type", "guided_decoding_guide"})
    with pytest.raises(OpenAIError, match="forced tool call") as info:  # the answer is a call, not content
        parse_request({**chat, "logprobs": True, "tools": [tool], "tool_choice": "required"}, Endpoint.CHAT, guided)
    assert info.value.param == "logprobs"
    chosen_only = Capabilities(CAPS.inputs | {"return_log_probs"})  # a model without alternatives
    for body, endpoint, param in (({**chat, "logprobs": True, "top_logprobs": 3}, Endpoint.CHAT, "top_logprobs"),
                                  ({**completion, "logprobs": 2}, Endpoint.COMPLETIONS, "logprobs")):
        with pytest.raises(OpenAIError, match="must be 0") as info:
            parse_request(body, endpoint, chosen_only)
        assert (info.value.param, info.value.error_code) == (param, "unsupported_parameter")


def test_logprob_tracker_lists_tokens_as_the_text_covers_them() -> None:
    from triton_backend.engines.torch.model_loading import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    text = "h\u00e9llo \u65e5\u672c \U0001f642, world"
    ids = tokenizer.encode(text, add_special_tokens=False)
    tracker = new_tracker(tokenizer, LogprobsRequest(0))
    assert tracker.add("", ids[:3], [-0.5] * 3, False) == []  # no text yet: nothing listed
    early = tracker.add(text[:3], ids[3:], [-0.25] * (len(ids) - 3), False)
    late = tracker.add(text[3:], [tokenizer.eos_token_id], [-0.1], True)  # the end token is not listed
    listed = early + late
    assert early and all(t.end <= 3 for t in early)  # listed once the text covers them
    assert len(listed) == len(ids) and b"".join(t.bytes for t in listed).decode() == text
    assert any(t.token.startswith("bytes:\\x") for t in listed)  # a token that is part of a character
    body = completion_logprobs(listed)
    assert body["text_offset"][0] == 0 and body["text_offset"] == sorted(body["text_offset"])
    assert body["top_logprobs"][0] == {listed[0].token: -0.5}
    cut = new_tracker(tokenizer, LogprobsRequest(0)).add(text[:5], ids, [-1.0] * len(ids), True)  # a stop string
    assert b"".join(t.bytes for t in cut).decode("utf-8", "replace").startswith(text[:5]) and len(cut) < len(ids)


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


def _specdec_log_probs(triton, prompt: str, max_tokens: int, chat: bool = False, top: int = 0  # noqa: F811
                       ) -> tuple[str, list[int], list[float], list[list[float]]]:
    """The same request straight to ``specdec`` over gRPC streaming, with ``return_log_probs``
    (and ``top_log_probs``): its text, tokens, their log probabilities and the alternatives'."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    values = {"text_input": ("BYTES", np.array([[prompt.encode()]], dtype=np.object_)),
              "max_tokens": ("INT32", np.array([[max_tokens]], dtype=np.int32)),
              "temperature": ("FP32", np.array([[0.0]], dtype=np.float32)),
              "stream": ("BOOL", np.array([[True]])), "return_log_probs": ("BOOL", np.array([[True]])),
              "apply_chat_template": ("BOOL", np.array([[chat]]))}
    if top:
        values["top_log_probs"] = ("INT32", np.array([[top]], dtype=np.int32))
    inputs = []
    for name, (dtype, array) in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    replies: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.endpoints.grpc_url)
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    try:
        client.async_stream_infer("specdec", inputs, enable_empty_final_response=True)
        text, ids, log_probs, alternatives = [], [], [], []
        while True:
            result, error = replies.get(timeout=120)
            assert error is None, error
            for name, into in (("output_ids", ids), ("output_log_probs", log_probs)):
                array = result.as_numpy(name)
                into.extend(array.reshape(-1).tolist() if array is not None else [])
            array = result.as_numpy("output_top_log_probs")
            alternatives.extend(array.reshape(-1, top).tolist() if array is not None and top else [])
            out = result.as_numpy("text_output")
            text.extend(v.decode() for v in (out.reshape(-1) if out is not None else []))
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return "".join(text), ids, log_probs, alternatives
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.slow
def test_logprobs_are_the_models_and_leave_greedy_output_unchanged(triton, front, client) -> None:  # noqa: F811
    messages = [{"role": "user", "content": PROMPT}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].message.content
    assert content == plain.choices[0].message.content  # greedy output token for token the same
    listed = reply.choices[0].logprobs.content
    values = [t.logprob for t in listed]
    assert listed and all(math.isfinite(v) and v <= 0 for v in values)
    assert bytes(b for t in listed for b in t.bytes).decode() == content
    for t in listed:  # greedy: the chosen token is the most likely one; the rest follow, most likely first
        top = [a.logprob for a in t.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and all(math.isfinite(v) and v <= 0 for v in top)
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
    text, ids, want, alternatives = _specdec_log_probs(triton, PROMPT, 24, chat=True, top=3)  # the same template
    assert text == content and len(ids) == len(want) == len(alternatives) >= len(listed)
    assert values == pytest.approx(want[:len(listed)], abs=1e-5)
    assert [[a.logprob for a in t.top_logprobs] for t in listed] == [pytest.approx(a, abs=1e-5)
                                                                       for a in alternatives[:len(listed)]]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in listed]
    assert [t.logprob for t in streamed] == pytest.approx(values, abs=1e-5)
    assert [[a.token for a in t.top_logprobs] for t in streamed] == [[a.token for a in t.top_logprobs] for t in listed]
    zero = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True)
    assert [t.logprob for t in zero.choices[0].logprobs.content] == pytest.approx(values, abs=1e-5)
    assert all(t.top_logprobs == [] for t in zero.choices[0].logprobs.content)

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0)
    text, ids, want, _ = _specdec_log_probs(triton, PROMPT, 24)
    got = completion.choices[0].logprobs
    assert completion.choices[0].text == text and got.token_logprobs == pytest.approx(want[:len(got.tokens)], abs=1e-5)
    assert "".join(got.tokens) == text and got.text_offset[0] == 0
    assert all(len(d) == 1 and list(d.values())[0] == v for d, v in zip(got.top_logprobs, got.token_logprobs))
    parts = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                                              logprobs=0, stream=True) if c.choices]
    tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
    offsets = [o for p in parts if p.logprobs for o in p.logprobs.text_offset]
    assert tokens == got.tokens and offsets == got.text_offset
    five = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=5)
    assert five.choices[0].text == text and five.choices[0].logprobs.tokens == got.tokens
    for token, value, top in zip(got.tokens, got.token_logprobs, five.choices[0].logprobs.top_logprobs):
        assert 1 <= len(top) <= 6 and top[token] == pytest.approx(value, abs=1e-5)  # the chosen token, always
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: it is the most likely


@pytest.mark.slow
def test_logprobs_with_a_stop_string_sampling_and_refusals(triton, front, client) -> None:  # noqa: F811
    expected, _ = _triton_text(triton, PROMPT, 24)
    cut = expected.split()[3]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[cut], logprobs=0)
    got = reply.choices[0]
    assert got.text == expected[:expected.index(cut)] and "".join(got.logprobs.tokens).startswith(got.text)
    assert max(got.logprobs.text_offset) < len(got.text)  # a token inside the stop string only: not listed
    sampled = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=16, temperature=0.8, seed=5, logprobs=True, top_logprobs=2)
    listed = sampled.choices[0].logprobs.content
    assert listed and all(math.isfinite(t.logprob) and t.logprob <= 0 for t in listed)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-5 for t in listed)  # of the distribution sampled from
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                       top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs" and "[0, 20]" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", logprobs=6)
    assert info.value.body["param"] == "logprobs" and "[0, 5]" in info.value.body["message"]


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
