"""r25.05's ``ci/L0_backend_trtllm/base_metrics_verification_tests.py`` (``test_end_to_end``), as
its requests and checks are shaped (none of its code), against a real Triton serving NVIDIA's
layout: ``ensemble_mode`` ``pipeline`` (``ensemble`` a Triton ensemble of preprocessing ->
tensorrt_llm -> postprocessing), ``decoupled_mode`` false, and, as NVIDIA's CI runs it, without
``tensorrt_llm_bls`` (NVIDIA's CI deletes it) or ``specdec_unary``.

The test sends concurrent HTTP ``infer`` requests to ``ensemble`` (``text_input``,
``max_tokens``, empty ``bad_words`` / ``stop_words``; outputs ``text_output``), then reads
``/metrics``: every model reports the same set of ``nv_inference_*`` families and the same
``request_success``, ``request_failure``, ``count``, ``pending_request_count``; ``exec_count``
is the same for every model but preprocessing / postprocessing; the duration sums are positive;
and ``nv_llm_input/output_token_len`` (``model="tensorrt_llm"``) have the buckets of the
requests' token counts.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from triton_fixtures import DEPLOYMENT, RunningTriton, running_triton

from triton_backend.serving.interface import ServingConfig, TrtllmModelNames

pytestmark = pytest.mark.slow

PIPELINE = ServingConfig(max_concurrency=2, unary_instance_count=2, decoupled_mode=False, ensemble_mode="pipeline",
                         unary_model_name=None, trtllm_models=TrtllmModelNames(bls=None))
PROMPTS = ["Summarize: the cat sat on the mat and looked at the rain.", "Name three colours of the rainbow.",
           "Translate to French: good morning.", "Write one sentence about the moon.",
           "What is two plus two?", "Give a synonym for happy."]
OUTPUT_LENS = [6, 9, 5, 12, 4, 7]
BUCKETS = (10, 50, 100, 500, 1000, float("inf"))
COUNT_KEYS = ("request_success", "request_failure", "count", "exec_count", "pending_request_count")
DURATION_KEYS = ("request_duration_us", "compute_input_duration_us", "compute_infer_duration_us",
                 "compute_output_duration_us")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    with running_triton(Path(tmp_path_factory.mktemp("base-metrics")), DEPLOYMENT, PIPELINE) as running:
        yield running


def _tensor(module, name: str, arr: np.ndarray):
    tensor = module.InferInput(name, arr.shape, module.np_to_triton_dtype(arr.dtype))
    tensor.set_data_from_numpy(arr)
    return tensor


def _run_ensemble_requests(t: RunningTriton) -> list[str]:
    """The test's _run_infer: one async HTTP infer per prompt, all in flight at once."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(t.endpoints.http_url.split("://", 1)[-1], concurrency=len(PROMPTS))
    pending = []
    for i, (prompt, output_len) in enumerate(zip(PROMPTS, OUTPUT_LENS)):
        inputs = [_tensor(httpclient, "text_input", np.array([[prompt]], dtype=object)),
                  _tensor(httpclient, "max_tokens", np.array([[output_len]], np.int32)),
                  _tensor(httpclient, "bad_words", np.array([[""]], dtype=object)),
                  _tensor(httpclient, "stop_words", np.array([[""]], dtype=object))]
        pending.append(client.async_infer("ensemble", inputs, outputs=[httpclient.InferRequestedOutput("text_output")],
                                          request_id=str(i)))
    texts = [p.get_result().as_numpy("text_output")[0].decode() for p in pending]
    client.close()
    return texts


def _per_model(samples: dict[str, float]) -> dict[str, dict[str, float]]:
    """nv_inference_<key>{model=...} -> {model: {key: value}} (request_failure: summed over reasons)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for name, value in samples.items():
        if not name.startswith("nv_inference_"):
            continue
        key = name.split("{", 1)[0][len("nv_inference_"):]
        model = name.split('model="', 1)[1].split('"', 1)[0]
        out[model][key] = out[model].get(key, 0.0) + value
    return out


def _buckets(values: list[int]) -> list[int]:
    return [sum(v <= edge for v in values) for edge in BUCKETS]


def _histogram(samples: dict[str, float], family: str, kind: str) -> list[int]:
    def edge(le: float) -> str:
        return "+Inf" if le == float("inf") else str(int(le))
    return [int(samples[f'{family}_bucket{{model="tensorrt_llm",response_metric_type="{kind}",version="1",'
                        f'le="{edge(le)}"}}']) for le in BUCKETS]


def test_every_model_counts_each_ensemble_request_once(pipeline) -> None:
    import tritonclient.http as httpclient

    texts = _run_ensemble_requests(pipeline)
    assert len(texts) == len(PROMPTS) and any(texts), texts  # a short answer may decode to nothing
    metrics = _per_model(pipeline.metrics())
    assert set(metrics) == {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "specdec"}
    assert len({frozenset(keys) for keys in metrics.values()}) == 1, {m: sorted(k) for m, k in metrics.items()}
    for key in COUNT_KEYS:
        models = [m for m in metrics if key != "exec_count" or m not in ("preprocessing", "postprocessing")]
        assert len({metrics[m][key] for m in models}) == 1, (key, {m: metrics[m][key] for m in models})
    assert metrics["ensemble"]["request_success"] == metrics["ensemble"]["exec_count"] == len(PROMPTS)
    for key in DURATION_KEYS:
        assert metrics["ensemble"][key] > 0 and sum(metrics[m][key] for m in metrics if m != "ensemble") > 0, key

    # the histograms hold each request's token counts (prompt tokens as preprocessing counts them)
    samples = pipeline.metrics()
    with httpclient.InferenceServerClient(pipeline.endpoints.http_url.split("://", 1)[-1]) as client:
        lengths = [int(client.infer("preprocessing", [
            _tensor(httpclient, "QUERY", np.array([[p]], dtype=object)),
            _tensor(httpclient, "REQUEST_OUTPUT_LEN", np.array([[1]], np.int32))]).as_numpy("REQUEST_INPUT_LEN")[0][0])
            for p in PROMPTS]
    assert _histogram(samples, "nv_llm_input_token_len", "total_input_tokens") == _buckets(lengths)
    assert _histogram(samples, "nv_llm_output_token_len", "total_output_tokens") == _buckets(OUTPUT_LENS)


def test_pipeline_text_equals_the_chain_end_to_end_test_runs(pipeline) -> None:
    """The ensemble's answer is the preprocessing -> tensorrt_llm -> postprocessing chain's, and
    perf outputs pass through it."""
    import tritonclient.http as httpclient

    prompt, output_len = PROMPTS[1], OUTPUT_LENS[1]
    with httpclient.InferenceServerClient(pipeline.endpoints.http_url.split("://", 1)[-1]) as client:
        pre = client.infer("preprocessing", [_tensor(httpclient, "QUERY", np.array([[prompt]], dtype=object)),
                                             _tensor(httpclient, "REQUEST_OUTPUT_LEN",
                                                     np.array([[output_len]], np.int32))])
        token_inputs = {"input_ids": "INPUT_ID", "input_lengths": "REQUEST_INPUT_LEN",
                        "request_output_len": "REQUEST_OUTPUT_LEN", "end_id": "OUT_END_ID", "pad_id": "OUT_PAD_ID"}
        out = client.infer("tensorrt_llm", [_tensor(httpclient, ours, pre.as_numpy(theirs))
                                            for ours, theirs in token_inputs.items()])
        text = client.infer("postprocessing", [
            _tensor(httpclient, "TOKENS_BATCH", out.as_numpy("output_ids")),
            _tensor(httpclient, "SEQUENCE_LENGTH", out.as_numpy("sequence_length"))]).as_numpy("OUTPUT")[0].decode()
        result = client.infer("ensemble", [_tensor(httpclient, "text_input", np.array([[prompt]], dtype=object)),
                                           _tensor(httpclient, "max_tokens", np.array([[output_len]], np.int32)),
                                           _tensor(httpclient, "return_perf_metrics", np.array([[True]]))])
    assert text and result.as_numpy("text_output")[0].decode() == text
    assert result.as_numpy("acceptance_rate") is not None and result.as_numpy("arrival_time_ns")[0][0] > 0
