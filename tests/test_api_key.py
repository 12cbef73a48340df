"""``serve --api-key`` guards every inference port (issue 44: with a key set, Triton's HTTP port
through the guard and its gRPC port still served anyone): a REAL Triton with a one-model
repository (an echo model, so it starts in seconds), reached straight, through the HTTP guard,
and over gRPC, with and without the key. Health stays open (probes and load balancers)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_backend.serving.front.http_guard import GuardConfig, HttpGuard
from triton_backend.serving.launch.triton_server import InferenceKey, ServerConfig, ServerError, TritonServer
from reliability_fixtures import post

KEY = InferenceKey("test-key-" + "x" * 16)
CONFIG = """\
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""
MODEL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""
BODY = json.dumps({"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [7]}]}).encode()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    repo = tmp_path_factory.mktemp("keyed") / "repo"
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    server = TritonServer(ServerConfig(repo, api_key=KEY, exit_timeout_s=5, startup_timeout_s=120,
                                       log_file=repo.parent / "triton.log"))
    endpoints = server.start()
    try:
        with HttpGuard(GuardConfig(), endpoints.http_url) as guard:
            yield endpoints, f"http://127.0.0.1:{guard.port}"
    finally:
        server.stop()


def test_the_key_guards_http_straight_and_through_the_guard(keyed) -> None:
    endpoints, guarded = keyed
    for base in (endpoints.http_url, guarded):
        status, answer, _ = post(f"{base}/v2/models/echo/infer", BODY)
        assert status == 403, (base, status, answer)
        status, _, _ = post(f"{base}/v2/models/echo/infer", BODY, {"Authorization": "Bearer wrong-key-xxxxxxxx"})
        assert status == 403
        status, answer, _ = post(f"{base}/v2/models/echo/infer", BODY, {"Authorization": KEY.value})
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [7], answer
        assert post(f"{base}/v2/health/ready", None)[0] == 200  # health stays open


def test_the_key_guards_grpc(keyed) -> None:
    endpoints, _ = keyed
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([7], np.int32))
    with grpcclient.InferenceServerClient(endpoints.grpc_url) as client:
        with pytest.raises(InferenceServerException):
            client.infer("echo", [tensor])
        result = client.infer("echo", [tensor], headers=KEY.grpc_metadata)
        assert result.as_numpy("OUT").tolist() == [7]
        assert client.is_model_ready("echo")


def test_a_key_triton_cannot_hold_is_refused_at_start() -> None:
    for bad in ("", "has space in it", "a:b,c=d-long-enough", "x" * 257):
        with pytest.raises(ServerError):
            InferenceKey(bad)


def test_the_key_guards_grpc_streams_as_the_openai_front_sends_them(keyed) -> None:
    """The OpenAI front's backend streams with ``BackendConfig.grpc_headers`` = the key's metadata."""
    import asyncio

    from tritonclient.grpc.aio import InferenceServerClient

    endpoints, _ = keyed

    async def stream(headers):
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([5], np.int32))

        async def requests():
            yield {"model_name": "echo", "inputs": [tensor]}

        async with InferenceServerClient(endpoints.grpc_url) as client:
            async for result, error in client.stream_infer(requests(), headers=headers):
                return error if error is not None else result.as_numpy("OUT").tolist()

    assert asyncio.run(stream(KEY.grpc_metadata)) == [5]
    import grpc

    # Triton refuses a keyless stream as soon as its headers arrive; when that refusal beats
    # the client's first message, gRPC's core reports its own failed write ("execute_batch")
    # instead of the server's status. That race says nothing about the key, so it is retried;
    # a stream that is served, or refused for any other reason, fails the test.
    for _ in range(5):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(stream(None))
        details = refused.value.details() or ""
        if "restricted" in details:
            break
        assert refused.value.code() == grpc.StatusCode.INTERNAL and "execute_batch" in str(refused.value), str(refused.value)
    else:
        pytest.fail("the keyless stream never got Triton's 'restricted' refusal in five tries")
