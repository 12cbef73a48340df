"""Front models that forward to the serving model (BLS): the tensorrtllm_backend names
(``ensemble``, ``tensorrt_llm_bls``, ``tensorrt_llm``) in front of the one model that holds
the weights. No torch: each is a cheap process.

A decoupled front model streams every response of the serving model back as it comes (the
one carrying ``finish_reason`` is the last); a non-decoupled one asks for one response
(``stream`` / ``streaming`` true is refused there: it needs the decoupled model) and returns
it. Only the outputs the front model declares are passed on, in the order its config.pbtxt
lists them (NVIDIA's order, ours after: some clients read outputs by position); ``text_output``
is flattened to ``[beam]`` as tensorrtllm_backend's clients expect. Before forwarding, a request gets what
TensorRT-LLM would assume (:func:`~triton_backend.serving.trtllm_inputs.trtllm_request_defaults`:
greedy without top-k / top-p, the model's ``exclude_input_in_output`` parameter). The serving model's
``config.pbtxt`` parameter ``target_model`` names the model to forward to.
``model_repo/<model>/1/model.py`` re-exports :class:`ForwardModel`.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from triton_backend.core.errors import InvalidRequestError
from triton_backend.serving.triton.io import error_response, model_parameters
from triton_backend.serving.trtllm_inputs import DEFAULTS_READ, trtllm_request_defaults

logger = logging.getLogger("triton_backend.serving.triton.forward_model")
STREAM_INPUTS = ("stream", "streaming")
TEXT_OUTPUT = "text_output"
LAST_RESPONSE_OUTPUT = "finish_reason"  # the serving model's final response always carries it


def _flat_text(tensor: Any) -> Any:
    """``text_output`` as tensorrtllm_backend sends it: one string per beam, ``[beam]`` (its
    clients read ``output[0].decode()``); every other tensor unchanged."""
    if tensor.name() != TEXT_OUTPUT:
        return tensor
    return pb_utils.Tensor(TEXT_OUTPUT, tensor.as_numpy().reshape(-1))


class ForwardModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        self.target = model_parameters(config).get("target_model", "")
        if not self.target:
            raise pb_utils.TritonModelException(f"config.pbtxt of {args['model_name']!r} lacks parameter 'target_model'")
        self.outputs = [out["name"] for out in config.get("output", [])]
        exclude = model_parameters(config).get("exclude_input_in_output")
        self.exclude_input = None if exclude is None else exclude == "true"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="forward") if self.decoupled else None

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if not self.decoupled:
            return [self._unary(request) for request in requests]
        for request in requests:
            self._pool.submit(self._stream, request)
        return None

    def _inputs(self, request: Any) -> list[Any]:
        """The request's inputs with TensorRT-LLM's defaults made explicit (raises
        InvalidRequestError on a bad top-k / top-p)."""
        inputs = list(request.inputs())
        arrays = {t.name(): t.as_numpy() for t in inputs if t.name() in DEFAULTS_READ}
        extra = trtllm_request_defaults(arrays, self.exclude_input)
        return [t for t in inputs if t.name() not in extra] + [pb_utils.Tensor(n, a) for n, a in extra.items()]

    def _exec(self, request: Any, inputs: list[Any]) -> Any:
        names = set(self.outputs) | {LAST_RESPONSE_OUTPUT}
        forwarded = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs, requested_output_names=sorted(names))
        return forwarded.exec(decoupled=True)

    def _response(self, response: Any) -> Any:
        if response.has_error():
            error = response.error()
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(error.message(), error.code()))
        by_name = {t.name(): t for t in response.output_tensors()}
        kept = [_flat_text(by_name[name]) for name in self.outputs if name in by_name]
        return pb_utils.InferenceResponse(output_tensors=kept)

    def _unary(self, request: Any) -> Any:
        try:
            inputs = self._inputs(request)
        except InvalidRequestError as exc:
            return error_response(exc)
        streamed = [t.name() for t in inputs if t.name() in STREAM_INPUTS and t.as_numpy().any()]
        if streamed:
            return error_response(InvalidRequestError(
                f"{streamed[0]} = true needs a decoupled model (this one answers once); send it false"))
        result = None
        for response in self._exec(request, inputs):
            if response.has_error():
                return self._response(response)
            if response.output_tensors():
                result = self._response(response)
        return result if result is not None else error_response("the model sent no response")

    def _stream(self, request: Any) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            try:
                inputs = self._inputs(request)
            except InvalidRequestError as exc:
                sender.send(error_response(exc), flags=final)
                return
            for response in self._exec(request, inputs):
                names = {t.name() for t in response.output_tensors()}
                if response.has_error() or LAST_RESPONSE_OUTPUT in names:
                    sender.send(self._response(response), flags=final)
                    return
                if names:
                    sender.send(self._response(response))
            sender.send(flags=final)
        except Exception:  # the client gets a short message; the traceback goes to the server log
            logger.exception("forwarding to %s failed", self.target)
            sender.send(error_response("internal error while forwarding; see the server log"), flags=final)

    def finalize(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
