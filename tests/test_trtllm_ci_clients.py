"""Requests shaped as NVIDIA's r25.05 client scripts send them (``inflight_batcher_llm/client``,
``tools/inflight_batcher_llm``: same tensors, shapes, dtypes and defaults; their code is not
copied), against a real Triton serving a repository rendered with ``decoupled_mode`` false (so
``ensemble`` and ``tensorrt_llm`` answer Triton's plain ``infer``) and
``exclude_input_in_output`` false (what client-side draft-target orchestration needs).

- ``inflight_batcher_llm_client.py``: gRPC infer on ``tensorrt_llm`` with its defaults
  (``runtime_top_k`` 1, ``runtime_top_p`` 0.0, ``temperature`` 1.0, ``return_perf_metrics``).
- ``benchmark_core_model.py``: HTTP infer on ``tensorrt_llm``; it reads the first output as
  ``output_ids``.
- ``end_to_end_test.py``: preprocessing -> tensorrt_llm -> postprocessing equals ``ensemble``,
  with preprocessing's outputs read as r25.05's tritonclient reads them.
- ``e2e_grpc_speculative_decoding_client.py`` / ``speculative_decoding_test.py``: the client
  drafts on one deployment, the target verifies ``draft_input_ids``; the text equals the
  ``ensemble``'s own (greedy) answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from triton_fixtures import DEPLOYMENT, RunningTriton, local_decoder, running_triton  # noqa: F401 (fixture)

from triton_backend.serving.interface import ServingConfig

pytestmark = pytest.mark.slow

SERVING = ServingConfig(max_concurrency=2, unary_instance_count=2, decoupled_mode=False, exclude_input_in_output=False)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    with running_triton(Path(tmp_path_factory.mktemp("ci-clients")), DEPLOYMENT, SERVING) as running:
        yield running


def _grpc(t: RunningTriton):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(t.endpoints.grpc_url)


def _http(t: RunningTriton):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(t.endpoints.http_url.split("://", 1)[-1])


def _tensors(module, arrays: dict[str, np.ndarray]) -> list:
    out = []
    for name, arr in arrays.items():
        tensor = module.InferInput(name, arr.shape, module.np_to_triton_dtype(arr.dtype))
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _as_r25_05_client_reads(arr: np.ndarray) -> np.ndarray:
    """An output as r25.05's tritonclient (2.58) hands it over HTTP: a zero-size binary output
    comes back as ``np.empty(0)`` reshaped, FP64 whatever its declared type (later clients keep
    the type). The scripts pass preprocessing's outputs on with ``np_to_triton_dtype(arr.dtype)``."""
    return arr if arr.size else np.empty(arr.shape)


def _preprocess(t: RunningTriton, prompt: str, output_len: int) -> dict[str, np.ndarray]:
    """preprocessing as the scripts call it: QUERY [1, 1], REQUEST_OUTPUT_LEN [1, 1], empty word lists;
    its outputs as r25.05's client reads them."""
    import tritonclient.http as httpclient

    arrays = {"QUERY": np.array([[prompt]], dtype=object), "BAD_WORDS_DICT": np.array([[""]], dtype=object),
              "STOP_WORDS_DICT": np.array([[""]], dtype=object),
              "REQUEST_OUTPUT_LEN": np.array([[output_len]], np.int32)}
    with _http(t) as client:
        result = client.infer("preprocessing", _tensors(httpclient, arrays))
    return {o["name"]: _as_r25_05_client_reads(result.as_numpy(o["name"])) for o in result.get_response()["outputs"]}


def _ensemble_text(t: RunningTriton, prompt: str, max_tokens: int) -> str:
    """end_to_end_test.py's ensemble request (HTTP infer)."""
    import tritonclient.http as httpclient

    arrays = {"text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[max_tokens]], np.int32),
              "bad_words": np.array([[""]], dtype=object), "stop_words": np.array([[""]], dtype=object)}
    with _http(t) as client:
        result = client.infer("ensemble", _tensors(httpclient, arrays))
    return result.as_numpy("text_output")[0].decode()


def test_inflight_batcher_llm_client_request(server, local_decoder) -> None:
    import tritonclient.grpc as grpcclient

    from triton_backend.core.config import SamplingParams

    ids = local_decoder.encode(PROMPT)
    want = local_decoder.generate(ids, SamplingParams(max_tokens=12), DEPLOYMENT.speculation).token_ids
    base = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
            "request_output_len": np.array([[12]], np.int32), "beam_width": np.array([[1]], np.int32),
            "temperature": np.array([[1.0]], np.float32), "streaming": np.array([[False]]),
            "end_id": np.array([[2]], np.int32), "pad_id": np.array([[2]], np.int32),
            "return_perf_metrics": np.array([[True]])}
    with _grpc(server) as client:
        for top_k in (1, 0):  # the script's default top-k 1; top-k and top-p both 0: greedy, as in TensorRT-LLM
            arrays = {**base, "runtime_top_k": np.array([[top_k]], np.int32),
                      "runtime_top_p": np.array([[0.0]], np.float32)}
            result = client.infer("tensorrt_llm", _tensors(grpcclient, arrays))
            assert result.as_numpy("output_ids")[0][0].tolist() == ids + want, top_k  # exclude_input_in_output false
            for name in ("kv_cache_alloc_new_blocks", "arrival_time_ns", "acceptance_rate", "total_draft_tokens"):
                assert result.as_numpy(name) is not None, name
        refused = {**base, "streaming": np.array([[True]])}
        with pytest.raises(Exception, match="decoupled"):
            client.infer("tensorrt_llm", _tensors(grpcclient, refused))


def test_benchmark_core_model_reads_output_ids_first(server) -> None:
    import tritonclient.http as httpclient

    pre = _preprocess(server, PROMPT, 8)
    arrays = {"input_ids": pre["INPUT_ID"], "input_lengths": pre["REQUEST_INPUT_LEN"],
              "request_output_len": pre["REQUEST_OUTPUT_LEN"], "end_id": pre["OUT_END_ID"], "pad_id": pre["OUT_PAD_ID"]}
    with _http(server) as client:
        result = client.infer("tensorrt_llm", _tensors(httpclient, arrays))
    outputs = result.get_response()["outputs"]
    assert outputs[0]["name"] == "output_ids" and outputs[1]["name"] == "sequence_length"
    assert len(outputs[0]["shape"]) == 3 and outputs[0]["shape"][:2] == [1, 1]


@pytest.mark.parametrize("prompt,output_len", [(PROMPT, 10), ("Write a haiku about the sea.", 12),
                                               ("List three prime numbers:", 8)])
def test_end_to_end_test_chain_equals_the_ensemble(server, prompt: str, output_len: int) -> None:
    """end_to_end_test.py --max-input-len=500 (HTTP, decoupled_mode false): preprocessing's
    outputs, as r25.05's client reads them, go to tensorrt_llm unchanged (DECODER_INPUT_ID as
    decoder_input_ids: it must come back INT32), then postprocessing; the text equals the ensemble's."""
    import tritonclient.http as httpclient

    pre = _preprocess(server, prompt, output_len)
    assert {name: arr.dtype for name, arr in pre.items()} == {name: np.dtype(np.int32) for name in pre} | {
        "EMBEDDING_BIAS": np.dtype(np.float64)}  # r25.05's EMBEDDING_BIAS is empty as well; no script sends it back
    arrays = {"input_ids": pre["INPUT_ID"], "decoder_input_ids": pre["DECODER_INPUT_ID"],
              "input_lengths": pre["REQUEST_INPUT_LEN"], "request_output_len": pre["REQUEST_OUTPUT_LEN"],
              "end_id": pre["OUT_END_ID"], "pad_id": pre["OUT_PAD_ID"]}
    with _http(server) as client:
        result = client.infer("tensorrt_llm", _tensors(httpclient, arrays))
        post = {"TOKENS_BATCH": result.as_numpy("output_ids").astype(np.int32),
                "SEQUENCE_LENGTH": result.as_numpy("sequence_length")}
        text = client.infer("postprocessing", _tensors(httpclient, post)).as_numpy("OUTPUT")[0].decode()
    assert text and text == _ensemble_text(server, prompt, output_len)


def _trtllm_call(client, ids: np.ndarray, output_len: int, drafts: list[int] | None, pre) -> np.ndarray:
    """One get_trtllm_inputs-shaped infer on tensorrt_llm; its output_ids (the prompt first)."""
    import tritonclient.grpc as grpcclient

    arrays = {"input_ids": ids[None].astype(np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[output_len]], np.int32), "bad_words_list": pre["BAD_WORDS_IDS"],
              "stop_words_list": pre["STOP_WORDS_IDS"], "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[1.0]], np.float32)}
    if drafts is not None:
        arrays["draft_input_ids"] = np.array([drafts], np.int32)
    arrays.update({"end_id": pre["OUT_END_ID"], "pad_id": pre["OUT_PAD_ID"]})
    result = client.infer("tensorrt_llm", _tensors(grpcclient, arrays))
    return np.squeeze(result.as_numpy("output_ids"), axis=(0, 1)), result


def test_client_side_draft_target_loop_equals_the_targets_answer(server) -> None:
    """The e2e draft-target client's loop (draft deployment = this one; every other draft
    corrupted, so the target both accepts and rejects): its text equals the ensemble's."""
    import tritonclient.http as httpclient

    output_len, k = 14, 4
    pre = _preprocess(server, PROMPT, output_len)
    prompt_ids = pre["INPUT_ID"][0]
    ids, rounds, accepted = prompt_ids, 0, []
    with _grpc(server) as client:
        while len(ids) < len(prompt_ids) + output_len:
            n = min(k, len(prompt_ids) + output_len - len(ids) - 1)
            drafts = None
            if n > 0:
                drafted, _ = _trtllm_call(client, ids, n, None, pre)
                drafts = [int(t) for t in drafted[len(ids):]]
                if rounds % 2:
                    drafts[-1] = (drafts[-1] + 1) % 1000
            out, result = _trtllm_call(client, ids, len(drafts) + 1 if drafts else 1, drafts, pre)
            assert len(out) > len(ids) and out[:len(ids)].tolist() == ids.tolist()
            accepted.append(int(result.as_numpy("total_accepted_draft_tokens")[0][0]))
            ids, rounds = out, rounds + 1
    assert rounds < output_len and max(accepted) > 0  # drafts were accepted: fewer target calls than tokens
    post = {"TOKENS_BATCH": ids[None, None].astype(np.int32), "SEQUENCE_LENGTH": np.array([[len(ids)]], np.int32)}
    with _http(server) as client:
        text = client.infer("postprocessing", _tensors(httpclient, post)).as_numpy("OUTPUT")[0].decode()
    assert text == _ensemble_text(server, PROMPT, output_len)
