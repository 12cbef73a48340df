"""Malformed values are 400s, checked the same way on every path (issue 44): one sampling check
(temperature, top_p, top_k) for Triton's tensors, the tensorrtllm_backend front models and the
OpenAI front; prompt size limits in characters and bytes before anything decodes or tokenizes
it; integers too long to read, and lone surrogates, refused as bad requests."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from triton_backend.serving.front.http_guard import integer_problem
from triton_backend.serving.front.openai.openai_errors import OpenAIError
from triton_backend.serving.front.openai.openai_request import Capabilities, Endpoint, parse_request as parse_openai
from triton_backend.core.config import SpeculationConfig, check_sampling_values
from triton_backend.core.errors import InvalidRequestError
from triton_backend.serving.limits import LIMITS, RequestLimits, check_prompt_bytes, check_text
from triton_backend.serving.service import parse_request
from triton_backend.serving.trtllm_inputs import trtllm_request_defaults

BAD_TEMPERATURES = [math.nan, -1.0, math.inf, -math.inf, 1e30, 2.5]
CAPS = Capabilities(frozenset({"text_input", "max_tokens", "temperature", "top_p", "top_k", "random_seed",
                               "stop_words", "ignore_eos", "stream"}))


def _one(value, dtype):
    return np.array([[value]], dtype=dtype)


def _tensors(**values) -> dict[str, np.ndarray]:
    arrays = {"text_input": np.array([[b"hello"]], dtype=np.object_)}
    for name, value in values.items():
        arrays[name] = _one(value, np.int32 if isinstance(value, int) else np.float32)
    return arrays


@pytest.mark.parametrize("temperature", BAD_TEMPERATURES)
def test_a_bad_temperature_is_refused_on_every_path(temperature: float) -> None:
    with pytest.raises(InvalidRequestError, match="temperature"):
        check_sampling_values(temperature=temperature)
    with pytest.raises(InvalidRequestError, match="temperature"):  # specdec's tensors
        parse_request(_tensors(temperature=temperature), SpeculationConfig())
    with pytest.raises(InvalidRequestError, match="temperature"):  # front models: before the greedy default
        trtllm_request_defaults({"temperature": _one(temperature, np.float32)}, None)
    if math.isfinite(temperature):  # (JSON has no NaN / inf: the OpenAI front never sees them as numbers)
        with pytest.raises(OpenAIError) as info:
            parse_openai({"model": "m", "prompt": "hi", "temperature": temperature}, Endpoint.COMPLETIONS, CAPS)
        assert (info.value.param, info.value.status) == ("temperature", 400)


def test_top_p_zero_is_refused_except_as_tensorrt_llms_off() -> None:
    with pytest.raises(InvalidRequestError, match="top_p"):
        parse_request(_tensors(top_p=0.0), SpeculationConfig())
    with pytest.raises(OpenAIError) as info:
        parse_openai({"model": "m", "prompt": "hi", "top_p": 0}, Endpoint.COMPLETIONS, CAPS)
    assert info.value.param == "top_p"
    # TensorRT-LLM's runtime_top_p 0 means "off" (NVIDIA's clients send it); the front models drop a top_p 0
    assert parse_request(_tensors(runtime_top_p=0.0), SpeculationConfig()).sampling.top_p == 1.0
    assert trtllm_request_defaults({"top_p": _one(0.0, np.float32)}, None)["top_p"] is None


def test_valid_sampling_values_keep_their_meaning() -> None:
    for temperature, top_p in ((0.0, 1.0), (0.7, 0.9), (2.0, 0.05), (1, 1)):
        check_sampling_values(temperature, top_p, 0)
        parsed = parse_openai({"model": "m", "prompt": "hi", "temperature": temperature, "top_p": top_p},
                              Endpoint.COMPLETIONS, CAPS)
        assert parsed.inputs["temperature"] == temperature and parsed.inputs["top_p"] == top_p
        sampling = parse_request(_tensors(temperature=float(temperature), top_p=float(top_p)), SpeculationConfig()).sampling
        assert math.isclose(sampling.temperature, temperature, rel_tol=1e-6)
        assert math.isclose(sampling.top_p, top_p, rel_tol=1e-6)
    assert "temperature" in trtllm_request_defaults({"temperature": _one(1.0, np.float32)}, None)  # greedy default kept


def test_oversized_prompts_are_refused_before_decoding_or_tokenizing() -> None:
    huge = "x" * (4 * 1024 * 1024)  # 4 MiB, as the 3.9 MB chat message
    arrays = {"text_input": np.array([[huge.encode()]], dtype=np.object_)}
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="bytes, over the limit"):
        check_prompt_bytes(arrays)
    with pytest.raises(InvalidRequestError, match="over the limit"):
        parse_request(arrays, SpeculationConfig())
    with pytest.raises(OpenAIError) as info:
        parse_openai({"model": "m", "messages": [{"role": "user", "content": huge}]}, Endpoint.CHAT, CAPS)
    assert info.value.param == "messages" and "over the limit" in str(info.value)
    assert time.perf_counter() - started < 1.0
    check_text("x" * LIMITS.max_prompt_chars)
    with pytest.raises(InvalidRequestError, match="bytes of UTF-8"):  # within the characters, over the bytes
        check_text("\U0001F600" * 6, limits=RequestLimits(max_prompt_chars=10, max_prompt_bytes=20))


def test_lone_surrogates_and_unreadable_integers_are_bad_requests() -> None:
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        check_text("hi \ud800")
    with pytest.raises(OpenAIError) as info:
        parse_openai({"model": "m", "messages": [{"role": "user", "content": "hi \ud800"}]}, Endpoint.CHAT, CAPS)
    assert info.value.status == 400
    digits = b'{"text_input": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    assert "too many digits" in integer_problem("/v2/models/ensemble/generate", digits)
    lone = b'{"text_input": "Hi \\ud800", "max_tokens": 4}'  # what Triton 2.51 answered with 500
    assert "lone surrogate" in integer_problem("/v2/models/ensemble/generate", lone)
    paired = json.dumps({"text_input": "Hi \U0001F600", "max_tokens": 4}).encode()  # escaped as a valid pair
    assert integer_problem("/v2/models/ensemble/generate", paired) is None


def test_the_openai_front_answers_400_for_a_lone_surrogate_and_a_5000_digit_integer() -> None:
    import asyncio

    from aiohttp.test_utils import make_mocked_request

    from triton_backend.serving.front.openai.app import _body

    async def read(raw: bytes):
        request = make_mocked_request("POST", "/v1/chat/completions")
        request._read_bytes = raw  # the body aiohttp read off the wire
        return await _body(request)

    for raw in (b'{"model": "m", "max_tokens": ' + b"7" * 5000 + b"}",
                json.dumps({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}).encode()):
        with pytest.raises(OpenAIError) as info:
            asyncio.run(read(raw))
        assert info.value.status == 400


def test_the_openai_user_scope_names_each_end_users_prefix_cache_namespace() -> None:
    from triton_backend.serving.front.openai.app import OpenAIConfig, scoped

    body = {"model": "m", "prompt": "hi", "user": "alice"}
    parsed = parse_openai(body, Endpoint.COMPLETIONS, CAPS)
    assert "prefix_cache_namespace" not in scoped(parsed, body, OpenAIConfig()).inputs  # shared: one cache
    per_user = OpenAIConfig(prefix_cache_scope="user")
    assert scoped(parsed, body, per_user).inputs["prefix_cache_namespace"] == "user:alice"
    anonymous = {"model": "m", "prompt": "hi"}
    assert scoped(parse_openai(anonymous, Endpoint.COMPLETIONS, CAPS), anonymous, per_user).inputs[
        "prefix_cache_namespace"] == "user:"
    with pytest.raises(OpenAIError, match="'user'"):
        scoped(parsed, {**body, "user": "u" * 251}, per_user)
    with pytest.raises(OpenAIError, match="prefix_cache_scope"):
        OpenAIConfig(prefix_cache_scope="tenant")
