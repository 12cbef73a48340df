"""specbuild as a drop-in for tensorrtllm_backend clients (its r25.05 interface).

Conformance: the rendered configs carry r25.05's tensors (names, data types, dims, written
down below from ``all_models/inflight_batcher_llm/*/config.pbtxt``); every input is honoured
or refused with an error naming it. Real server: the documented request shapes (HTTP
generate, gRPC streaming as ``end_to_end_grpc_client.py`` sends them, the token-level
``tensorrt_llm`` model as ``inflight_batcher_llm_client.py`` does, preprocessing ->
tensorrt_llm -> postprocessing) answer what the in-process decoder answers.
"""

from __future__ import annotations

import json
import queue
import re
import urllib.error
import urllib.request
from functools import partial

import numpy as np
import pytest
from triton_fixtures import DEPLOYMENT, SERVING, RunningTriton, local_decoder, triton  # noqa: F401 (fixtures)

from builder.stages.model_repository import front_models, render_config_pbtxt, render_front_config
from triton_backend.core.errors import InvalidRequestError
from triton_backend.serving.service import parse_request
from triton_backend.serving.trtllm_interface import REFUSED, SERVED_INPUTS

PROMPT = "The capital of France is"

# r25.05's tensors: name -> (data type, dims). Transcribed from the config.pbtxt files.
_COMMON_TEXT_IN = {
    "text_input": ("TYPE_STRING", "1"), "decoder_text_input": ("TYPE_STRING", "1"), "max_tokens": ("TYPE_INT32", "1"),
    "num_return_sequences": ("TYPE_INT32", "1"), "bad_words": ("TYPE_STRING", "-1"),
    "stop_words": ("TYPE_STRING", "-1"), "exclude_input_in_output": ("TYPE_BOOL", "1"), "end_id": ("TYPE_INT32", "1"),
    "pad_id": ("TYPE_INT32", "1"), "top_k": ("TYPE_INT32", "1"), "top_p": ("TYPE_FP32", "1"),
    "temperature": ("TYPE_FP32", "1"), "length_penalty": ("TYPE_FP32", "1"),
    "repetition_penalty": ("TYPE_FP32", "1"), "min_tokens": ("TYPE_INT32", "1"),
    "presence_penalty": ("TYPE_FP32", "1"), "frequency_penalty": ("TYPE_FP32", "1"), "seed": ("TYPE_UINT64", "1"),
    "return_log_probs": ("TYPE_BOOL", "1"), "return_context_logits": ("TYPE_BOOL", "1"),
    "return_generation_logits": ("TYPE_BOOL", "1"), "return_perf_metrics": ("TYPE_BOOL", "1"),
    "beam_width": ("TYPE_INT32", "1"), "stream": ("TYPE_BOOL", "1"), "prompt_embedding_table": ("TYPE_FP16", "-1, -1"),
    "prompt_table_extra_id": ("TYPE_UINT64", "1"), "prompt_vocab_size": ("TYPE_INT32", "1"),
    "embedding_bias_words": ("TYPE_STRING", "-1"), "embedding_bias_weights": ("TYPE_FP32", "-1"),
    "lora_task_id": ("TYPE_UINT64", "1"), "lora_weights": ("TYPE_FP16", "-1, -1"), "lora_config": ("TYPE_INT32", "-1, 3"),
    "guided_decoding_guide_type": ("TYPE_STRING", "1"), "guided_decoding_guide": ("TYPE_STRING", "1"),
}
_COMMON_OUT = {
    "cum_log_probs": ("TYPE_FP32", "-1"), "output_log_probs": ("TYPE_FP32", "-1, -1"),
    "context_logits": ("TYPE_FP32", "-1, -1"), "generation_logits": ("TYPE_FP32", "-1, -1, -1"),
    "batch_index": ("TYPE_INT32", "1"), "sequence_index": ("TYPE_INT32", "1"),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", "1"), "kv_cache_reused_blocks": ("TYPE_INT32", "1"),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", "1"), "arrival_time_ns": ("TYPE_INT64", "1"),
    "first_scheduled_time_ns": ("TYPE_INT64", "1"), "first_token_time_ns": ("TYPE_INT64", "1"),
    "last_token_time_ns": ("TYPE_INT64", "1"), "acceptance_rate": ("TYPE_FP32", "1"),
    "total_accepted_draft_tokens": ("TYPE_INT32", "1"), "total_draft_tokens": ("TYPE_INT32", "1"),
}
CONTRACT = {
    "ensemble": (_COMMON_TEXT_IN, {"text_output": ("TYPE_STRING", "-1"), **_COMMON_OUT}),
    "tensorrt_llm_bls": ({**_COMMON_TEXT_IN, "image_input": ("TYPE_FP16", "-1, 3, -1, -1"),
                          "image_bytes_input": ("TYPE_UINT8", "-1, -1, -1, -1"), "image_url_input": ("TYPE_STRING", "1"),
                          "video_bytes_input": ("TYPE_UINT8", "-1, -1, -1, -1"), "num_draft_tokens": ("TYPE_INT32", "1"),
                          "use_draft_logits": ("TYPE_BOOL", "1")},
                         {"text_output": ("TYPE_STRING", "-1"), **_COMMON_OUT}),
    "tensorrt_llm": ({
        "input_ids": ("TYPE_INT32", "-1"), "input_lengths": ("TYPE_INT32", "1"), "request_output_len": ("TYPE_INT32", "1"),
        "num_return_sequences": ("TYPE_INT32", "1"), "draft_input_ids": ("TYPE_INT32", "-1"),
        "draft_logits": ("TYPE_FP32", "-1, -1"), "end_id": ("TYPE_INT32", "1"), "pad_id": ("TYPE_INT32", "1"),
        "stop_words_list": ("TYPE_INT32", "2, -1"), "bad_words_list": ("TYPE_INT32", "2, -1"),
        "embedding_bias": ("TYPE_FP32", "-1"), "beam_width": ("TYPE_INT32", "1"), "temperature": ("TYPE_FP32", "1"),
        "runtime_top_k": ("TYPE_INT32", "1"), "runtime_top_p": ("TYPE_FP32", "1"), "len_penalty": ("TYPE_FP32", "1"),
        "repetition_penalty": ("TYPE_FP32", "1"), "min_tokens": ("TYPE_INT32", "1"),
        "presence_penalty": ("TYPE_FP32", "1"), "frequency_penalty": ("TYPE_FP32", "1"), "seed": ("TYPE_UINT64", "1"),
        "return_log_probs": ("TYPE_BOOL", "1"), "return_perf_metrics": ("TYPE_BOOL", "1"),
        "exclude_input_in_output": ("TYPE_BOOL", "1"), "stop": ("TYPE_BOOL", "1"), "streaming": ("TYPE_BOOL", "1"),
        "lora_task_id": ("TYPE_UINT64", "1"), "lora_config": ("TYPE_INT32", "-1, 3"),
        "guided_decoding_guide": ("TYPE_STRING", "1"), "lookahead_window_size": ("TYPE_INT32", "1"),
    }, {"output_ids": ("TYPE_INT32", "-1, -1"), "sequence_length": ("TYPE_INT32", "-1"), **_COMMON_OUT}),
    "preprocessing": ({"QUERY": ("TYPE_STRING", "1"), "REQUEST_OUTPUT_LEN": ("TYPE_INT32", "1"),
                       "BAD_WORDS_DICT": ("TYPE_STRING", "-1"), "STOP_WORDS_DICT": ("TYPE_STRING", "-1"),
                       "END_ID": ("TYPE_INT32", "1"), "PAD_ID": ("TYPE_INT32", "1")},
                      {"INPUT_ID": ("TYPE_INT32", "-1"), "REQUEST_INPUT_LEN": ("TYPE_INT32", "1"),
                       "BAD_WORDS_IDS": ("TYPE_INT32", "2, -1"), "STOP_WORDS_IDS": ("TYPE_INT32", "2, -1"),
                       "REQUEST_OUTPUT_LEN": ("TYPE_INT32", "-1"), "OUT_END_ID": ("TYPE_INT32", "1"),
                       "OUT_PAD_ID": ("TYPE_INT32", "1"), "DECODER_INPUT_ID": ("TYPE_INT32", "-1"),
                       "REQUEST_DECODER_INPUT_LEN": ("TYPE_INT32", "1"), "EMBEDDING_BIAS": ("TYPE_FP32", "-1"),
                       "OUT_PROMPT_TABLE_EXTRA_IDS": ("TYPE_UINT64", "-1"), "PIXEL_VALUES": ("TYPE_FP16", "-1, -1, -1, -1"),
                       "ASPECT_RATIO_IDS": ("TYPE_INT64", "-1"), "ASPECT_RATIO_MASK": ("TYPE_INT64", "-1, -1"),
                       "CROSS_ATTENTION_MASK": ("TYPE_INT64", "-1, -1, -1"), "IMAGE_SIZES": ("TYPE_INT64", "2"),
                       "IS_VIDEO_INPUT": ("TYPE_BOOL", "1"), "ATTENTION_MASK": ("TYPE_INT64", "-1"),
                       "IMAGE_GRID_THW": ("TYPE_INT64", "3"), "VISION_INPUT_ID": ("TYPE_INT32", "-1")}),
    "postprocessing": ({"TOKENS_BATCH": ("TYPE_INT32", "-1, -1"), "SEQUENCE_LENGTH": ("TYPE_INT32", "-1")},
                       {"OUTPUT": ("TYPE_STRING", "-1")}),
}


def _tensors(pbtxt: str, section: str) -> dict[str, tuple[str, str]]:
    body = re.search(rf"\n{section} \[(.*?)\n\]", pbtxt, re.S).group(1)
    return {m.group(1): (m.group(2), m.group(3).strip())
            for m in re.finditer(r'name: "(\w+)"\s+data_type: (\w+)\s+dims: \[([^\]]*)\]', body)}


def test_rendered_configs_carry_r25_05_tensors() -> None:
    rendered = {m.name: render_front_config(SERVING, m) for m in front_models(SERVING)}
    assert set(rendered) == set(CONTRACT)
    for name, (inputs, outputs) in CONTRACT.items():
        got_in, got_out = _tensors(rendered[name], "input"), _tensors(rendered[name], "output")
        for tensor, typed in inputs.items():
            assert got_in.get(tensor) == typed, (name, tensor)
        for tensor, typed in outputs.items():
            assert got_out.get(tensor) == typed, (name, tensor)
    served = _tensors(render_config_pbtxt(SERVING), "input")  # the serving model takes everything forwarded
    for name, _ in CONTRACT.items():
        if name in ("ensemble", "tensorrt_llm_bls", "tensorrt_llm"):
            assert set(_tensors(rendered[name], "input")) <= set(served)


def _arrays(**values) -> dict[str, np.ndarray]:
    out = {}
    for name, value in values.items():
        arr = np.asarray(value)
        out[name] = arr.reshape(1, *arr.shape) if arr.ndim else arr.reshape(1, 1)
    return out


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_refused_input_is_named_in_its_error(name: str) -> None:
    spec = {s.name: s for s in SERVED_INPUTS}.get(name)
    if spec is None:  # preprocessing's own inputs: checked with preprocess()
        return
    refusal = REFUSED[name]
    value = {"false": True, "true": False}.get(refusal.accepts, None)
    if value is None:
        width = refusal.placeholder_max + 1  # past a decoder-only placeholder
        value = np.array([b"x"], dtype=object) if spec.dtype.value == "TYPE_STRING" else np.full(
            [width if d == -1 else d for d in spec.dims], width, dtype=spec.dtype.numpy)
    with pytest.raises(InvalidRequestError, match=name):
        parse_request({**_arrays(text_input=np.array([PROMPT.encode()], dtype=object)), name: np.asarray(value)[None]},
                      DEPLOYMENT.speculation)


def test_preprocessing_outputs_have_r25_05_types_and_the_decoder_placeholder() -> None:
    """Every array preprocess() returns has its r25.05 config.pbtxt data type, and none that
    end_to_end_test.py passes on to tensorrt_llm is empty (tritonclient <= 2.58 reads an empty
    binary output as FP64, which tensorrt_llm refuses). The decoder prompt is r25.05's
    placeholder [pad_id], which tensorrt_llm accepts and ignores; a real one is refused."""
    from triton_backend.engines.torch.model_loading import load_tokenizer
    from triton_backend.serving.tensors import TritonType
    from triton_backend.serving.triton.tokenizer_models import preprocess

    declared = _tensors(render_front_config(SERVING, next(m for m in front_models(SERVING)
                                                           if m.name == "preprocessing")), "output")
    out = preprocess(load_tokenizer(DEPLOYMENT.target), _arrays(
        QUERY=np.array([PROMPT.encode()], dtype=object), REQUEST_OUTPUT_LEN=np.array([10], np.int32),
        BAD_WORDS_DICT=np.array([b""], dtype=object), STOP_WORDS_DICT=np.array([b""], dtype=object)))
    for name, arr in out.items():
        assert arr.dtype == TritonType(declared[name][0]).numpy, (name, arr.dtype, declared[name])
        assert arr.size or name == "EMBEDDING_BIAS", name  # r25.05's is [1, 0] too; no script passes it on
    assert out["STOP_WORDS_IDS"].tolist() == [[[0], [-1]]] == out["BAD_WORDS_IDS"].tolist()  # [""]: no word
    pad = int(out["OUT_PAD_ID"][0][0])
    assert out["DECODER_INPUT_ID"].tolist() == [[pad]] and out["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1]]
    ids = {"input_ids": out["INPUT_ID"][0], "input_lengths": out["REQUEST_INPUT_LEN"][0],
           "request_output_len": out["REQUEST_OUTPUT_LEN"][0], "pad_id": out["OUT_PAD_ID"][0]}
    placeholder = parse_request({**_arrays(**ids), "decoder_input_ids": out["DECODER_INPUT_ID"],
                                 "decoder_input_lengths": out["REQUEST_DECODER_INPUT_LEN"],
                                 "stop_words_list": out["STOP_WORDS_IDS"], "bad_words_list": out["BAD_WORDS_IDS"]},
                                DEPLOYMENT.speculation)
    assert placeholder.prompt == parse_request(_arrays(**ids), DEPLOYMENT.speculation).prompt
    assert placeholder.sampling.stop_token_ids == () and not placeholder.sampling.bad_token_ids
    for name, value in (("decoder_input_ids", np.array([[pad, pad]], np.int32)),
                        ("decoder_input_lengths", np.array([[2]], np.int32))):
        with pytest.raises(InvalidRequestError, match=name):
            parse_request({**_arrays(**ids), name: value}, DEPLOYMENT.speculation)


@pytest.mark.parametrize("name,value", [("beam_width", 2), ("num_return_sequences", 3),
                                        ("return_context_logits", True), ("use_draft_logits", False),
                                        ("repetition_penalty", 0.0), ("min_tokens", -1),
                                        ("presence_penalty", float("nan"))])
def test_unsupported_values_are_refused_by_name(name: str, value) -> None:
    dtype = {bool: np.bool_, int: np.int32, float: np.float32}[type(value)]
    with pytest.raises(InvalidRequestError, match=name):
        parse_request(_arrays(text_input=np.array([PROMPT.encode()], dtype=object), **{name: np.array([value], dtype)}),
                      DEPLOYMENT.speculation)


def test_nvidia_defaults_are_accepted_and_both_spellings_agree() -> None:
    req = parse_request(_arrays(text_input=np.array([PROMPT.encode()], dtype=object),
                                max_tokens=np.array([7], np.int32), beam_width=np.array([1], np.int32),
                                num_return_sequences=np.array([1], np.int32), length_penalty=np.array([1.0], np.float32),
                                seed=np.array([5], np.uint64), random_seed=np.array([5], np.uint64),
                                return_context_logits=np.array([False]), use_draft_logits=np.array([True]),
                                pad_id=np.array([2], np.int32), bad_words=np.array([b""], dtype=object)),
                        DEPLOYMENT.speculation)
    assert req.sampling.seed == 5 and req.sampling.max_tokens == 7 and not req.token_level
    with pytest.raises(InvalidRequestError, match="seed"):
        parse_request(_arrays(text_input=np.array([PROMPT.encode()], dtype=object), seed=np.array([5], np.uint64),
                              random_seed=np.array([6], np.uint64)), DEPLOYMENT.speculation)
    tokens = parse_request(_arrays(input_ids=np.array([1, 2, 3, 0], np.int32), input_lengths=np.array([3], np.int32),
                                   request_output_len=np.array([4], np.int32),
                                   stop_words_list=np.array([[5, 6, 7], [2, 3, -1]], np.int32)), DEPLOYMENT.speculation)
    assert tokens.prompt == (1, 2, 3) and tokens.token_level and tokens.sampling.max_tokens == 4
    assert tokens.sampling.stop_token_ids == ((5, 6), (7,)) and tokens.include_prompt


def test_penalties_min_tokens_bad_words_and_log_probs_are_read() -> None:
    text = parse_request(_arrays(text_input=np.array([PROMPT.encode()], dtype=object),
                                 repetition_penalty=np.array([1.3], np.float32),
                                 presence_penalty=np.array([0.5], np.float32),
                                 frequency_penalty=np.array([0.25], np.float32), min_tokens=np.array([4], np.int32),
                                 bad_words=np.array([b"Paris", b""], dtype=object),
                                 return_log_probs=np.array([True])), DEPLOYMENT.speculation)
    s = text.sampling
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.min_tokens) == (
        pytest.approx(1.3), 0.5, 0.25, 4)
    assert s.bad_words == ("Paris",) and s.return_log_probs
    tokens = parse_request(_arrays(input_ids=np.array([1, 2, 3], np.int32), input_lengths=np.array([3], np.int32),
                                   request_output_len=np.array([4], np.int32),
                                   bad_words_list=np.array([[5, 6, 7], [2, 3, -1]], np.int32)), DEPLOYMENT.speculation)
    assert tokens.sampling.bad_token_ids == ((5, 6), (7,)) and not tokens.sampling.return_log_probs


# -- real server ------------------------------------------------------------------------------
def _generate(t: RunningTriton, model: str, body: dict, stream: bool = False) -> list[dict]:
    url = f"{t.endpoints.http_url}/v2/models/{model}/generate" + ("_stream" if stream else "")
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as reply:
            text = reply.read().decode()
    except urllib.error.HTTPError as exc:
        return [{"error": json.loads(exc.read().decode())["error"]}]
    if not stream:
        return [json.loads(text)]
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.slow
def test_documented_curl_requests_answer_like_the_local_decoder(triton, local_decoder) -> None:
    """The curl request of docs/drop-in.md, and its streaming and refused variants."""
    from triton_backend.core.config import SamplingParams

    want = local_decoder.generate(PROMPT, SamplingParams(max_tokens=12), DEPLOYMENT.speculation)
    body = {"text_input": PROMPT, "max_tokens": 12, "bad_words": "", "stop_words": ""}
    assert _generate(triton, "ensemble", body)[0]["text_output"] == want.text
    streamed = _generate(triton, "ensemble", {**body, "stream": True}, stream=True)
    assert "".join(r["text_output"] for r in streamed) == want.text and len(streamed) >= 1
    assert _generate(triton, "tensorrt_llm_bls", body)[0]["text_output"] == want.text
    refused = _generate(triton, "ensemble", {**body, "beam_width": 2})[0]
    assert "beam_width" in refused["error"]
    refused = _generate(triton, "ensemble", {**body, "lora_task_id": 3})[0]
    assert "lora_task_id" in refused["error"]


@pytest.mark.slow
def test_seed_is_honoured_over_http_generate(triton) -> None:
    body = {"text_input": PROMPT, "max_tokens": 8, "temperature": 1.0, "top_k": 50}
    same = {_generate(triton, "ensemble", {**body, "seed": 11})[0]["text_output"] for _ in range(3)}
    assert len(same) == 1
    other = {_generate(triton, "ensemble", {**body, "seed": s})[0]["text_output"] for s in range(12, 18)}
    assert len(other | same) > 1  # different seeds reach different samples
    assert _generate(triton, "ensemble", {**body, "random_seed": 11})[0]["text_output"] in same


@pytest.mark.slow
def test_end_to_end_grpc_client_request_with_perf_metrics(triton, local_decoder) -> None:
    import tritonclient.grpc as grpcclient

    from triton_backend.core.config import SamplingParams

    want = local_decoder.generate(PROMPT, SamplingParams(max_tokens=10), DEPLOYMENT.speculation)
    inputs = {"text_input": np.array([[PROMPT]], dtype=object), "max_tokens": np.array([[10]], np.int32),
              "stream": np.array([[True]]), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[0.0]], np.float32), "return_perf_metrics": np.array([[True]])}
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(triton.endpoints.grpc_url) as client:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), results))
        tensors = []
        for name, arr in inputs.items():
            tensor = grpcclient.InferInput(name, arr.shape, grpcclient.np_to_triton_dtype(arr.dtype))
            tensor.set_data_from_numpy(arr)
            tensors.append(tensor)
        client.async_stream_infer("ensemble", tensors)
        client.stop_stream()
    responses = [results.get_nowait() for _ in range(results.qsize())]
    assert all(not isinstance(r, Exception) for r in responses), responses
    # as end_to_end_grpc_client.py reads it: output[0].decode() (text_output is [beam])
    assert "".join(r.as_numpy("text_output")[0].decode() for r in responses) == want.text
    for r in responses:  # as TensorRT-LLM: the perf outputs on every streamed response
        assert r.as_numpy("kv_cache_alloc_new_blocks") is not None and r.as_numpy("acceptance_rate") is not None
    drafted = [int(r.as_numpy("total_draft_tokens")[0][0]) for r in responses]
    assert drafted == sorted(drafted)  # counts so far
    last = responses[-1]
    assert last.as_numpy("batch_index")[0][0] == 0 and last.as_numpy("sequence_index")[0][0] == 0
    arrival, first, done = (int(last.as_numpy(n)[0][0]) for n in ("arrival_time_ns", "first_token_time_ns",
                                                                 "last_token_time_ns"))
    assert 0 < arrival <= first <= done
    assert last.as_numpy("total_draft_tokens")[0][0] == want.stats.drafted_tokens
    assert last.as_numpy("total_accepted_draft_tokens")[0][0] == want.stats.accepted_tokens


def _infer(t: RunningTriton, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import tritonclient.http as httpclient

    tensors = []
    for name, arr in arrays.items():
        tensor = httpclient.InferInput(name, arr.shape, httpclient.np_to_triton_dtype(arr.dtype))
        tensor.set_data_from_numpy(arr)
        tensors.append(tensor)
    with httpclient.InferenceServerClient(t.endpoints.http_url.split("://", 1)[-1]) as client:
        result = client.infer(model, tensors)
    return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response()["outputs"]}


@pytest.mark.slow
def test_token_level_model_through_preprocessing_and_postprocessing(triton, local_decoder) -> None:
    """inflight_batcher_llm_client.py's path: ids in, ids out, streamed; and pre/post as the ensemble chains them."""
    import tritonclient.grpc as grpcclient

    from triton_backend.core.config import SamplingParams

    pre = _infer(triton, "preprocessing", {"QUERY": np.array([[PROMPT]], dtype=object),
                                           "REQUEST_OUTPUT_LEN": np.array([[9]], np.int32)})
    ids = pre["INPUT_ID"][0].tolist()
    assert ids == local_decoder.encode(PROMPT) and pre["REQUEST_INPUT_LEN"][0][0] == len(ids)
    want = local_decoder.generate(ids, SamplingParams(max_tokens=9), DEPLOYMENT.speculation)
    inputs = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[9]], np.int32), "end_id": pre["OUT_END_ID"],
              "pad_id": pre["OUT_PAD_ID"], "beam_width": np.array([[1]], np.int32)}
    for streaming in (False, True):
        results: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(triton.endpoints.grpc_url) as client:
            client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), results))
            tensors = []
            for name, arr in {**inputs, "streaming": np.array([[streaming]])}.items():
                tensor = grpcclient.InferInput(name, arr.shape, grpcclient.np_to_triton_dtype(arr.dtype))
                tensor.set_data_from_numpy(arr)
                tensors.append(tensor)
            client.async_stream_infer("tensorrt_llm", tensors)
            client.stop_stream()
        responses = [results.get_nowait() for _ in range(results.qsize())]
        assert all(not isinstance(r, Exception) for r in responses), responses
        got = [int(t) for r in responses for t in r.as_numpy("output_ids")[0][0]]
        assert got == want.token_ids, streaming  # exclude_input_in_output: the model's parameter (true)
        assert responses[-1].as_numpy("sequence_length")[0][0] == len(responses[-1].as_numpy("output_ids")[0][0])
    post = _infer(triton, "postprocessing", {"TOKENS_BATCH": np.array([[want.token_ids]], np.int32),
                                             "SEQUENCE_LENGTH": np.array([[len(want.token_ids)]], np.int32)})
    assert post["OUTPUT"].shape == (1,) and post["OUTPUT"][0].decode() == local_decoder.tokenizer.decode(want.token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_penalties_min_tokens_bad_words_and_log_probs_over_http(triton, local_decoder) -> None:
    """The ensemble honours them as the in-process decoder does; log probs come per output
    token with their sum; bad words never appear; min_tokens holds back the end token."""
    from triton_backend.core.config import SamplingParams

    settings = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.3, "min_tokens": 6}
    plain = local_decoder.generate(PROMPT, SamplingParams(max_tokens=10), DEPLOYMENT.speculation)
    banned = plain.text.split()[0]  # the plain answer's first word becomes a bad word
    params = SamplingParams(max_tokens=10, bad_words=(banned, " " + banned), return_log_probs=True, **settings)
    want = local_decoder.generate(PROMPT, params, DEPLOYMENT.speculation)
    assert want.token_ids != plain.token_ids
    body = {"text_input": PROMPT, "max_tokens": 10, "bad_words": [banned, " " + banned], "return_log_probs": True,
            **settings}
    got = _generate(triton, "ensemble", body)[0]
    assert got["text_output"] == want.text and banned not in got["text_output"]
    log_probs = np.asarray(got["output_log_probs"], np.float32).reshape(-1)
    assert len(log_probs) == len(want.token_ids) and (log_probs <= 0).all()
    assert float(np.asarray(got["cum_log_probs"]).reshape(-1)[0]) == pytest.approx(float(log_probs.sum()), abs=1e-3)
    streamed = _generate(triton, "ensemble", {**body, "stream": True}, stream=True)
    assert "".join(r["text_output"] for r in streamed) == want.text
    streamed_lp = [x for r in streamed for x in np.asarray(r.get("output_log_probs", []), np.float32).reshape(-1)]
    assert np.allclose(streamed_lp, log_probs, atol=1e-4)
    ends = {"text_input": PROMPT, "max_tokens": 10, "end_id": int(plain.token_ids[0])}
    count = lambda reply: int(np.asarray(reply["num_output_tokens"]).reshape(-1)[0])  # noqa: E731
    assert count(_generate(triton, "ensemble", ends)[0]) == 0  # ends at once without min_tokens
    assert count(_generate(triton, "ensemble", {**ends, "min_tokens": 3})[0]) >= 3
