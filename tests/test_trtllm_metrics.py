"""TensorRT-LLM's metric families (``nv_trt_llm_*``, ``nv_llm_*_token_len``) on a real Triton
server's /metrics, with the values of a request just served."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from triton_fixtures import SERVING, triton  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow


def _samples(t, name: str, **labels: str) -> list[float]:
    """Values of ``name`` whose labels include ``labels`` (whatever order Triton writes them in)."""
    out = []
    for key, value in t.metrics().items():
        match = re.match(r"^(\w+)\{(.*)\}$", key)
        if not match or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if all(have.get(k) == v for k, v in labels.items()):
            out.append(value)
    return out


def _one(t, name: str, **labels: str) -> float:
    values = _samples(t, name, model=SERVING.trtllm_metrics_model, **labels)  # "tensorrt_llm", as TensorRT-LLM
    assert len(values) == 1, (name, labels, values)
    return values[0]


def test_trtllm_metric_families_after_a_request(triton) -> None:
    before_rounds = _one(triton, "nv_trt_llm_general_metrics", general_type="iteration_counter")
    before_count = _one(triton, "nv_llm_output_token_len_count", response_metric_type="total_output_tokens")
    before_sum = _one(triton, "nv_llm_output_token_len_sum", response_metric_type="total_output_tokens")
    before_in = _one(triton, "nv_llm_input_token_len_sum", response_metric_type="total_input_tokens")
    body = {"text_input": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    url = f"{triton.endpoints.http_url}/v2/models/ensemble/generate"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = json.loads(reply.read().decode())
    generated = int(answer["num_output_tokens"])
    assert generated == 6
    deadline = time.time() + 10  # the last response can reach the client just before the observer runs
    while _one(triton, "nv_llm_output_token_len_count", response_metric_type="total_output_tokens") == before_count:
        assert time.time() < deadline, "the request was not counted"
        time.sleep(0.1)
    assert _one(triton, "nv_llm_output_token_len_sum", response_metric_type="total_output_tokens") - before_sum == generated
    assert _one(triton, "nv_llm_input_token_len_sum", response_metric_type="total_input_tokens") > before_in
    assert _one(triton, "nv_trt_llm_general_metrics", general_type="iteration_counter") > before_rounds
    stamp_us = _one(triton, "nv_trt_llm_general_metrics", general_type="timestamp")
    assert abs(stamp_us / 1e6 - time.time()) < 120
    assert _one(triton, "nv_trt_llm_request_metrics", request_type="max") == SERVING.max_batch_size
    assert _one(triton, "nv_trt_llm_request_metrics", request_type="active") == 0
    assert _one(triton, "nv_trt_llm_request_metrics", request_type="waiting") == 0
    assert _one(triton, "nv_trt_llm_request_metrics", request_type="scheduled") >= 1
    assert _one(triton, "nv_trt_llm_inflight_batcher_metrics",
                inflight_batcher_specific_metric="generation_requests") >= 1
