"""A non-decoupled entry point that forwards each request to the decoupled model (BLS).

Triton's ``infer`` API (HTTP ``/v2/models/<m>/infer``, gRPC ``ModelInfer``) does not
accept decoupled models; this model does, and returns the decoupled model's single
``stream=false`` response. It imports no torch: its instances are cheap processes, and
their count bounds how many of these calls run at once.
``model_repo/<unary model>/1/model.py`` re-exports :class:`UnaryModel`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from triton_backend.serving.interface import OUTPUTS, STREAM
from triton_backend.serving.triton.forward_model import CancelWatch
from triton_backend.serving.triton.io import FORWARD_ID_PARAM, error_response, forwarded_error, model_parameters


class UnaryModel:
    def initialize(self, args: dict[str, Any]) -> None:
        params = model_parameters(json.loads(args["model_config"]))
        self.target = params.get("target_model", "")
        if not self.target:
            raise pb_utils.TritonModelException(f"config.pbtxt of {args['model_name']!r} lacks parameter 'target_model'")
        self.outputs = [spec.name for spec in OUTPUTS]
        self._watch = CancelWatch(self.target)
        self._pool = ThreadPoolExecutor(max_workers=int(params.get("max_in_flight", "8")), thread_name_prefix="unary")

    def execute(self, requests: list[Any]) -> list[Any]:
        if len(requests) == 1:
            return [self._forward(requests[0])]
        return list(self._pool.map(self._forward, requests))  # one batch's requests side by side

    def _forward(self, request: Any) -> Any:
        inputs = [t for t in request.inputs() if t.name() != STREAM.name]
        inputs.append(pb_utils.Tensor(STREAM.name, np.array([[False]], dtype=np.bool_)))
        forward_id = self._watch.add(request)
        forwarded = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs, requested_output_names=self.outputs,
                                              parameters={FORWARD_ID_PARAM: forward_id})
        result = None
        try:
            for response in forwarded.exec(decoupled=True):
                if response.has_error():
                    return pb_utils.InferenceResponse(error=forwarded_error(response.error().message()))
                if response.output_tensors():
                    result = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
        finally:
            self._watch.remove(forward_id)
        return result if result is not None else error_response("the model sent no response")

    def finalize(self) -> None:
        self._watch.close()
        self._pool.shutdown(wait=True)
