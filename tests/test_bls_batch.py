"""A batched request to a tensorrtllm_backend front model (issue 44: ``tensorrt_llm_bls`` with
``text_input`` and ``max_tokens`` both batch 8 answered 500 "batch size does not match"): one
forwarded request per row, the rows' answers stacked into one response, each row's text that of
the same prompt alone."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from reliability_fixtures import stream_request
from triton_backend.core.config import SamplingParams
from triton_backend.core.errors import InvalidRequestError
from triton_backend.serving.batch_rows import split_rows, stack_rows
from triton_fixtures import local_decoder, triton  # noqa: F401 (fixtures)


def test_rows_split_and_stack_back() -> None:
    arrays = {"text_input": np.array([[b"a"], [b"b"], [b"c"]], dtype=np.object_),
              "max_tokens": np.array([[4], [5], [6]], np.int32)}
    rows = split_rows(arrays)
    assert [r["text_input"].shape for r in rows] == [(1, 1)] * 3 and int(rows[2]["max_tokens"][0, 0]) == 6
    answers = [{"text_output": np.array([b"x" * (i + 1)], dtype=np.object_),
                "output_log_probs": np.full((1, 1, i + 1), -0.5, np.float32)} for i in range(3)]
    stacked = stack_rows(answers, flat=("text_output",))
    assert stacked["text_output"].tolist() == [b"x", b"xx", b"xxx"]
    assert stacked["output_log_probs"].shape == (3, 1, 3) and stacked["output_log_probs"][0, 0, 1] == 0
    with pytest.raises(InvalidRequestError, match="batch sizes differ"):
        split_rows({"a": np.zeros((2, 1)), "b": np.zeros((3, 1))})


@pytest.mark.slow
def test_a_batch_of_eight_to_the_bls_model_is_served_row_by_row(triton, local_decoder) -> None:  # noqa: F811
    from triton_fixtures import DEPLOYMENT

    prompts = [f"Fact {i}: the capital of France is" for i in range(8)]
    texts = grpcclient.InferInput("text_input", [8, 1], "BYTES")
    texts.set_data_from_numpy(np.array([[p.encode()] for p in prompts], dtype=np.object_))
    lengths = grpcclient.InferInput("max_tokens", [8, 1], "INT32")
    lengths.set_data_from_numpy(np.full((8, 1), 6, np.int32))
    outcome = stream_request(triton.endpoints.grpc_url, [texts, lengths], model="tensorrt_llm_bls")
    assert outcome.error is None, outcome.error
    got = [t.decode() for t in outcome.responses[-1]["text_output"].reshape(-1)]
    want = [local_decoder.generate(p, SamplingParams(max_tokens=6), DEPLOYMENT.speculation).text for p in prompts]
    assert got == want
