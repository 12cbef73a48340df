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

Bounded, and cancellable: a decoupled front model forwards at most ``max_in_flight``
(parameter) requests at once and refuses more at once with ``overloaded`` (UNAVAILABLE);
a non-decoupled one waits in Triton's bounded queue (its config's ``dynamic_batching``
queue policy) and forwards the requests of one ``execute`` call concurrently. A client that
cancels or goes away has its forwarded request cancelled in the serving model
(:class:`CancelWatch`), which frees its batch slot at the next round. Errors keep their type
across the hop (:func:`~triton_backend.serving.triton.io.forwarded_error`).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from triton_backend.core.errors import InvalidRequestError, OverloadedError
from triton_backend.serving.triton.io import (CANCEL_ID_PARAM, FORWARD_ID_PARAM, CancelChannel, error_response,
                                              forwarded_error, model_parameters, request_parameters)
from triton_backend.serving.batch_rows import split_rows, stack_rows
from triton_backend.serving.limits import check_prompt_bytes
from triton_backend.serving.trtllm_inputs import DEFAULTS_READ, trtllm_request_defaults

logger = logging.getLogger("triton_backend.serving.triton.forward_model")
STREAM_INPUTS = ("stream", "streaming")
TEXT_OUTPUT = "text_output"
PROMPT_INPUT = "text_input"
LAST_RESPONSE_OUTPUT = "finish_reason"  # the serving model's final response always carries it
DEFAULT_MAX_IN_FLIGHT = 64
CANCEL_POLL_S = 0.25
_CLIENT_ID = re.compile(r"^[0-9a-f]{32}$")


class CancelWatch:
    """Asks Triton every ``CANCEL_POLL_S`` whether each forwarded request's client cancelled
    (one thread for all: a forwarding thread blocks on its child's next response) and, once
    one did, tells the serving model to cancel the child (Triton 2.51's BLS cannot cancel it):
    :class:`~triton_backend.serving.triton.io.CancelChannel`."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel = CancelChannel(target)
        self._live: dict[str, Any] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cancel-watch", daemon=True)
        self._thread.start()

    def add(self, request: Any, client_id: bool = True) -> str:
        """Watch ``request``; the id its forwarded request carries. ``client_id``: the id the
        HTTP guard gave the request (:data:`~triton_backend.serving.triton.io.CANCEL_ID_PARAM`)
        when it has one that is not live, so the guard's cancellation reaches the child."""
        given = request_parameters(request).get(CANCEL_ID_PARAM) if client_id else None
        with self._lock:
            ok = isinstance(given, str) and _CLIENT_ID.match(given) is not None and given not in self._live
            forward_id = given if ok else uuid.uuid4().hex
            self._live[forward_id] = request
        return forward_id

    def remove(self, forward_id: str) -> bool:
        """Forget a request; whether it was cancelled."""
        with self._lock:
            self._live.pop(forward_id, None)
            cancelled = forward_id in self._cancelled
            self._cancelled.discard(forward_id)
        return cancelled

    def _run(self) -> None:
        while not self._stop.wait(CANCEL_POLL_S):
            with self._lock:
                watched = [i for i in self._live if i not in self._cancelled]
            for forward_id in watched:
                try:
                    if self._query(forward_id):
                        logger.info("client cancelled: cancelling forwarded request %s", forward_id)
                        self._cancel_child(forward_id)
                except Exception:  # keep watching the others
                    logger.exception("could not cancel a forwarded request")

    def _query(self, forward_id: str) -> bool:
        """Asks Triton whether a still-live request was cancelled, under the lock: :meth:`remove`
        (which comes before the request's final response) waits for a query in flight, so a
        request is never asked about once its response factory may be gone (asking then crashed
        Triton 2.51's server: ``TRITONBACKEND_ResponseFactoryIsCancelled`` on a freed factory)."""
        with self._lock:
            request = self._live.get(forward_id)
            if request is None or not request.is_cancelled():
                return False
            self._cancelled.add(forward_id)
            return True

    def _cancel_child(self, forward_id: str) -> None:
        if not self._channel.send(forward_id):
            logger.warning("no instance of %s listens for cancellations: %s runs to its end", self.target, forward_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _flat_text(tensor: Any) -> Any:
    """``text_output`` as tensorrtllm_backend sends it: one string per beam, ``[beam]`` (its
    clients read ``output[0].decode()``); every other tensor unchanged."""
    if tensor.name() != TEXT_OUTPUT:
        return tensor
    return pb_utils.Tensor(TEXT_OUTPUT, tensor.as_numpy().reshape(-1))


class ForwardModel:
    def initialize(self, args: dict[str, Any]) -> None:
        if not logging.getLogger().handlers:  # the stub's stderr goes into Triton's log
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = json.loads(args["model_config"])
        self.target = model_parameters(config).get("target_model", "")
        if not self.target:
            raise pb_utils.TritonModelException(f"config.pbtxt of {args['model_name']!r} lacks parameter 'target_model'")
        self.outputs = [out["name"] for out in config.get("output", [])]
        exclude = model_parameters(config).get("exclude_input_in_output")
        self.exclude_input = None if exclude is None else exclude == "true"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.max_in_flight = int(model_parameters(config).get("max_in_flight", DEFAULT_MAX_IN_FLIGHT))
        self._pool = ThreadPoolExecutor(max_workers=self.max_in_flight, thread_name_prefix="forward")
        self._in_flight = 0
        self._lock = threading.Lock()
        self._watch = CancelWatch(self.target)

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if not self.decoupled:
            if len(requests) == 1:
                return [self._unary(requests[0])]
            return list(self._pool.map(self._unary, requests))  # one batch's requests side by side
        for request in requests:
            with self._lock:
                admitted = self._in_flight < self.max_in_flight
                self._in_flight += admitted
            if not admitted:  # at once, never a hidden queue
                request.get_response_sender().send(error_response(OverloadedError(
                    f"{self.max_in_flight} requests are in flight on this model; retry later")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self._pool.submit(self._stream, request)
        return None

    def _inputs(self, request: Any) -> list[list[Any]]:
        """The request's inputs with TensorRT-LLM's defaults made explicit, one list per row of
        its batch (:mod:`triton_backend.serving.batch_rows`; raises InvalidRequestError on a bad
        prompt size, temperature, top-k or top-p)."""
        inputs = list(request.inputs())
        check_prompt_bytes({t.name(): t.as_numpy() for t in inputs if t.name() == PROMPT_INPUT})  # before forwarding
        if all(t.as_numpy().shape[:1] == (1,) for t in inputs):  # batch 1: the inputs as they came
            return [self._with_defaults(inputs, {t.name(): t.as_numpy() for t in inputs if t.name() in DEFAULTS_READ})]
        rows = split_rows({t.name(): t.as_numpy() for t in inputs})
        return [self._with_defaults([pb_utils.Tensor(n, a) for n, a in row.items()],
                                    {n: a for n, a in row.items() if n in DEFAULTS_READ}) for row in rows]

    def _with_defaults(self, inputs: list[Any], arrays: dict[str, Any]) -> list[Any]:
        extra = trtllm_request_defaults(arrays, self.exclude_input)  # a None value: the input is dropped
        return [t for t in inputs if t.name() not in extra] + [pb_utils.Tensor(n, a) for n, a in extra.items()
                                                               if a is not None]

    def _exec(self, forward_id: str, inputs: list[Any]) -> Any:
        names = set(self.outputs) | {LAST_RESPONSE_OUTPUT}
        forwarded = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs, requested_output_names=sorted(names),
                                              parameters={FORWARD_ID_PARAM: forward_id})
        return forwarded.exec(decoupled=True)

    def _response(self, response: Any) -> Any:
        if response.has_error():
            return pb_utils.InferenceResponse(error=forwarded_error(response.error().message()))
        by_name = {t.name(): t for t in response.output_tensors()}
        kept = [_flat_text(by_name[name]) for name in self.outputs if name in by_name]
        return pb_utils.InferenceResponse(output_tensors=kept)

    def _unary(self, request: Any) -> Any:
        try:
            rows = self._inputs(request)
        except InvalidRequestError as exc:
            return error_response(exc)
        streamed = [t.name() for t in rows[0] if t.name() in STREAM_INPUTS and t.as_numpy().any()]
        if streamed:
            return error_response(InvalidRequestError(
                f"{streamed[0]} = true needs a decoupled model (this one answers once); send it false"))
        if len(rows) > 1:
            return self._batched(request, rows)
        inputs, result = rows[0], None
        forward_id = self._watch.add(request)
        try:
            for response in self._exec(forward_id, inputs):
                if response.has_error():
                    return self._response(response)
                if response.output_tensors():
                    result = self._response(response)
        finally:
            self._watch.remove(forward_id)
        return result if result is not None else error_response("the model sent no response")

    def _batched(self, request: Any, rows: list[list[Any]]) -> Any:
        """A batched request: one forwarded request per row, all in flight at once, their final
        answers stacked into one response (an error in any row is the request's error)."""
        ids = [self._watch.add(request, client_id=False) for _ in rows]  # one id per row
        finals: list[Any] = [None] * len(rows)
        error = None
        try:
            answers = [self._exec(forward_id, inputs) for forward_id, inputs in zip(ids, rows)]
            for i, answer in enumerate(answers):  # every answer read to its end
                for response in answer:
                    if response.has_error():
                        error = error or response
                    elif response.output_tensors():
                        finals[i] = response
        finally:
            for forward_id in ids:
                self._watch.remove(forward_id)
        if error is not None:
            return self._response(error)
        if any(final is None for final in finals):
            return error_response("the model sent no response for a row")
        stacked = stack_rows([{t.name(): t.as_numpy() for t in final.output_tensors()} for final in finals],
                             flat=(TEXT_OUTPUT,))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, stacked[name]) for name in self.outputs
                                                          if name in stacked])

    def _stream(self, request: Any) -> None:
        sender = request.get_response_sender()
        forward_id = self._watch.add(request)
        try:
            try:
                rows = self._inputs(request)
                streamed = len(rows) > 1 and any(t.name() in STREAM_INPUTS and t.as_numpy().any() for t in rows[0])
                if streamed:
                    raise InvalidRequestError("streaming needs one prompt per request (batch size 1); send the "
                                              "rows as separate requests, or stream false")
            except InvalidRequestError as exc:
                self._finish(sender, forward_id, error_response(exc))
                return
            if len(rows) > 1:
                self._finish(sender, forward_id, self._batched(request, rows))
                return
            inputs = rows[0]
            for response in self._exec(forward_id, inputs):
                names = {t.name() for t in response.output_tensors()}
                if response.has_error() or LAST_RESPONSE_OUTPUT in names:
                    self._finish(sender, forward_id, self._response(response))
                    return
                if names:
                    sender.send(self._response(response))
            self._finish(sender, forward_id, None)
        except Exception:  # the client gets a short message; the traceback goes to the server log
            logger.exception("forwarding to %s failed", self.target)
            self._finish(sender, forward_id, error_response("internal error while forwarding; see the server log"))
        finally:
            with self._lock:
                self._in_flight -= 1

    def _finish(self, sender: Any, forward_id: str, response: Any) -> None:
        """The final flag, with ``response`` unless the client cancelled (then nothing else)."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        cancelled = self._watch.remove(forward_id)
        if response is None or cancelled:
            sender.send(flags=final)
        else:
            sender.send(response, flags=final)

    def finalize(self) -> None:
        self._watch.close()
        self._pool.shutdown(wait=True)
