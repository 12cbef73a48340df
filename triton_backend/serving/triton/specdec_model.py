"""The decoupled Triton Python-backend model: a thin adapter over :mod:`triton_backend.serving.service`.

``execute`` reads each request's tensors, hands them to the service (which answers a bad
request, or one that finds the queue full, at once and puts a good one into the batch
scheduler's next round; :mod:`triton_backend.batching.scheduler`) and returns; responses (one per
verified block when streaming, else one) go out through the request's response sender.
``model_repo/<model>/1/model.py`` re-exports :class:`SpecdecModel` as ``TritonPythonModel``.
The runtime (torch, transformers) is imported in ``initialize``, so Triton's config
auto-completion does not pay for it. Importable only inside Triton's Python backend stub.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import weakref
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from triton_backend.serving.interface import TRTLLM_METRICS_MODEL, ServingConfig
from triton_backend.serving.triton.io import (CANCEL_ID_PARAM, FORWARD_ID_PARAM, CancelChannel, TritonResponseSink, model_parameters,
                                              request_arrays, request_parameters)
from triton_backend.serving.trtllm_interface import SERVED_INPUTS

logger = logging.getLogger("triton_backend.serving.triton.specdec_model")
EARLY_CANCELS_KEPT = 4096  # cancellations of forwarded requests that had not arrived yet


def configure_logging() -> None:
    """Log lines go to the stub's stderr, which Triton copies into its own log."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class SpecdecModel:
    """Decoupled speculative-decoding model."""

    def initialize(self, args: dict[str, Any]) -> None:
        configure_logging()
        from triton_backend.deployment.torch_deployment import build_decoder
        from triton_backend.serving.service import SpecdecService, load_deployment
        from triton_backend.serving.triton.metrics import TritonMetrics

        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(f"model {args['model_name']!r} must be decoupled")
        params = model_parameters(model_config)
        config = ServingConfig.from_parameters(args["model_name"], params)
        deployment = load_deployment(Path(args["model_repository"]) / args["model_version"] / config.deployment_file)
        logger.info("%s: serving %s", args["model_instance_name"], " ".join(deployment.to_json().split()))
        decoder = build_decoder(deployment)
        from triton_backend.serving.triton.trtllm_metrics import Observers, TrtllmMetrics

        # specdec_* and, beside them, TensorRT-LLM's nv_trt_llm_* names
        self.metrics = Observers(TritonMetrics(pb_utils, args["model_name"]),
                                 TrtllmMetrics(pb_utils, params.get(TRTLLM_METRICS_MODEL, args["model_name"]),
                                               config.max_batch_size))
        self.service = SpecdecService(decoder, config, deployment.speculation, self.metrics)
        # forwarded requests by their front model's id, while they live (see io.FORWARD_ID_PARAM)
        self._forwarded: weakref.WeakValueDictionary[str, TritonResponseSink] = weakref.WeakValueDictionary()
        self._early_cancels: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._cancel_lock = threading.Lock()
        self._cancels = CancelChannel(args["model_name"])  # a front model's client went away
        self._cancels.listen(self._cancel_forwarded)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            parameters = request_parameters(request)
            forward_id = parameters.get(FORWARD_ID_PARAM)
            sink = TritonResponseSink(request, forwarded=forward_id is not None)
            cancel_id = forward_id if forward_id is not None else parameters.get(CANCEL_ID_PARAM)  # the HTTP guard's
            if cancel_id is not None:
                with self._cancel_lock:
                    self._forwarded[str(cancel_id)] = sink
                    if str(cancel_id) in self._early_cancels:  # cancelled before it arrived
                        del self._early_cancels[str(cancel_id)]
                        sink.cancel()
            self.service.submit(request_arrays(request, SERVED_INPUTS), sink)
        return None

    def _cancel_forwarded(self, forward_id: str) -> None:
        """A front model's client went away. Its forwarded request may not have reached
        ``execute`` yet (it waits in Triton's queue while the instance is busy): remembered then."""
        with self._cancel_lock:
            sink = self._forwarded.get(forward_id)
            if sink is None:
                self._early_cancels[forward_id] = None
                while len(self._early_cancels) > EARLY_CANCELS_KEPT:
                    self._early_cancels.popitem(last=False)
        logger.info("cancelling forwarded request %s (%s)", forward_id, "live" if sink is not None else "not arrived")
        if sink is not None:
            sink.cancel()

    def finalize(self) -> None:
        self._cancels.close()
        self.service.shutdown()
        self.metrics.close()
