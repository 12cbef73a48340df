"""A non-decoupled entry point that forwards each request to the decoupled model (BLS).

Triton's ``infer`` API (HTTP ``/v2/models/<m>/infer``, gRPC ``ModelInfer``) does not
accept decoupled models; this model does, and returns the decoupled model's single
``stream=false`` response. It imports no torch: its instances are cheap processes, and
their count bounds how many of these calls run at once.
``model_repo/<unary model>/1/model.py`` re-exports :class:`UnaryModel`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from triton_backend.serving.interface import OUTPUTS, STREAM
from triton_backend.serving.triton.io import error_response, model_parameters


class UnaryModel:
    def initialize(self, args: dict[str, Any]) -> None:
        params = model_parameters(json.loads(args["model_config"]))
        self.target = params.get("target_model", "")
        if not self.target:
            raise pb_utils.TritonModelException(f"config.pbtxt of {args['model_name']!r} lacks parameter 'target_model'")
        self.outputs = [spec.name for spec in OUTPUTS]

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._forward(request) for request in requests]

    def _forward(self, request: Any) -> Any:
        inputs = [t for t in request.inputs() if t.name() != STREAM.name]
        inputs.append(pb_utils.Tensor(STREAM.name, np.array([[False]], dtype=np.bool_)))
        forwarded = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs,
                                              requested_output_names=self.outputs)
        result = None
        for response in forwarded.exec(decoupled=True):
            if response.has_error():
                error = response.error()
                return pb_utils.InferenceResponse(error=pb_utils.TritonError(error.message(), error.code()))
            if response.output_tensors():
                result = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
        return result if result is not None else error_response("the model sent no response")

    def finalize(self) -> None:
        pass
