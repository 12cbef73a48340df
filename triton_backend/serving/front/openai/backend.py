"""The Triton side of the OpenAI front: gRPC bidirectional streaming to the decoupled ``specdec``
model (``tritonclient.grpc.aio``), so OpenAI requests share the scheduler and in-flight batch of
every other client. One stream per request: closing it (a client gone, a task cancelled)
cancels the request inside Triton.

At start the model's metadata is read once (:class:`~triton_backend.serving.front.openai.openai_request.Capabilities`:
which optional inputs it takes, with their data types) and the target's tokenizer is loaded
(the chat template is rendered here; prompt tokens are counted here, as the model encodes them).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import numpy as np

from triton_backend.serving.front.openai.openai_errors import OpenAIError, server_error
from triton_backend.serving.front.openai.openai_request import Capabilities, Endpoint, GenerationRequest, check_prompt_size

logger = logging.getLogger(__name__)

STAT_NAMES = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "target_passes", "fallback",
              "num_output_tokens", "speculation_method", "finish_reason")
_NUMPY = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
          "FP64": np.float64, "BYTES": np.object_}
_OVERLOADED = ("queue is full", "overloaded", "scheduler is closed")


@dataclass(frozen=True)
class BackendConfig:
    grpc_url: str  # host:port of Triton's gRPC endpoint
    tokenizer: str  # the target model (reference name, Hugging Face directory or .gguf): its tokenizer
    model_name: str = "specdec"
    ready_timeout_s: float = 300.0  # wait this long for the model at start
    request_timeout_s: float = 600.0
    grpc_headers: Mapping[str, str] | None = None  # e.g. the key Triton's inference APIs need (serve --api-key)


@dataclass
class Piece:
    """One response of the served model: a text block and, on the final one, the statistics;
    with ``return_log_probs``, the tokens whose log probabilities it carries and those."""

    text: str
    stats: dict[str, Any]
    final: bool
    token_ids: tuple[int, ...] = ()
    log_probs: tuple[float, ...] = ()
    top_log_probs: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()  # per token: (ids, log probs)


def tokenizer_source(repository: Path, model_name: str = "specdec") -> str:
    """The target model named by a rendered repository's ``<model>/1/deployment.json``."""
    from triton_backend.serving.service import load_deployment

    return str(load_deployment(repository / model_name / "1" / "deployment.json").target)


def offered(declared: Mapping[str, str]) -> Capabilities:
    """The inputs the model honours: those it declares, less those it declares only to refuse
    anything but their absence (tensorrtllm_backend's names specbuild does not implement, e.g.
    guided decoding until the runtime has it: :data:`triton_backend.serving.trtllm_interface.REFUSED`)."""
    from triton_backend.serving.trtllm_interface import REFUSED

    return Capabilities(frozenset(name for name in declared
                                  if name not in REFUSED or REFUSED[name].accepts != "absent"))


def _text(array: np.ndarray) -> str:
    return "".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1))


def _scalar(array: np.ndarray) -> Any:
    item = array.reshape(-1)[0]
    if isinstance(item, (bytes, np.bytes_)):
        return bytes(item).decode("utf-8", "replace")
    return item.item() if hasattr(item, "item") else item


def stream_error(message: str) -> OpenAIError:
    """A Triton error on the stream, as the client should see it: the model's own message
    (its errors are client-safe), 503 when it is overloaded, 400 otherwise (what the front does
    not check itself, the model checks: context length, speculation method, ...)."""
    lowered = message.lower()
    if any(marker in lowered for marker in _OVERLOADED):
        return OpenAIError(message, status=503, type="server_error", code="overloaded")
    if "unavailable" in lowered or "connect" in lowered or "socket" in lowered:
        return server_error(f"the inference server is unavailable: {message}", 503)
    return OpenAIError(message, status=400, code="model_error")


class TritonBackend:
    """Generation through the running Triton server (see module doc). Use inside one event loop."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.input_types: dict[str, str] = {}
        self.capabilities = Capabilities(frozenset())
        self.tokenizer: Any = None
        self._client: Any = None

    async def start(self) -> None:
        from tritonclient.grpc.aio import InferenceServerClient

        self._client = InferenceServerClient(self.config.grpc_url)
        loop = asyncio.get_running_loop()
        tokenizer = loop.run_in_executor(None, self._load_tokenizer)
        await self._wait_ready()
        metadata = await self._client.get_model_metadata(self.config.model_name, as_json=True)
        self.input_types = {item["name"]: item["datatype"] for item in metadata.get("inputs", [])}
        self.capabilities = offered(self.input_types)
        self.tokenizer = await tokenizer
        logger.info("OpenAI front: model %s at %s (%d inputs offered)", self.config.model_name, self.config.grpc_url,
                    len(self.capabilities.inputs))

    def _load_tokenizer(self) -> Any:
        from triton_backend.engines.torch.model_loading import load_tokenizer

        return load_tokenizer(self.config.tokenizer)

    async def _wait_ready(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.config.ready_timeout_s
        while True:
            try:
                if await self._client.is_model_ready(self.config.model_name):
                    return
            except Exception as exc:  # noqa: BLE001 - not up yet: tritonclient raises its own and grpc's errors
                logger.debug("Triton not ready yet: %s", exc)
            if asyncio.get_running_loop().time() > deadline:
                raise server_error(f"model {self.config.model_name!r} not ready at {self.config.grpc_url} after "
                                   f"{self.config.ready_timeout_s:.0f}s", 503)
            await asyncio.sleep(0.5)

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.config.model_name))
        except Exception:  # noqa: BLE001 - any failure to answer is "not ready"
            return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def prompt(self, request: GenerationRequest) -> str:
        """The text sent to the model: the prompt, or the messages in the target's chat template."""
        if request.endpoint is Endpoint.COMPLETIONS:
            return request.prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError("this model's tokenizer has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - the template's own checks (jinja raise_exception) are the message
            raise OpenAIError(f"the chat template refused these messages: {exc}", param="messages") from None

    def prompt_and_count(self, request: GenerationRequest) -> tuple[str, int]:
        """The prompt text and its length in tokens, as the model encodes it."""
        prompt = self.prompt(request)
        check_prompt_size(prompt, "messages" if request.endpoint is Endpoint.CHAT else "prompt")  # the template's text too
        return prompt, len(self.tokenizer.encode(prompt, add_special_tokens=False))

    def _inputs(self, prompt: str, values: Mapping[str, Any]) -> list[Any]:
        from tritonclient.grpc import InferInput

        arrays = {"text_input": [prompt], "stream": True, **values}
        tensors = []
        for name, value in arrays.items():
            datatype = self.input_types.get(name)
            if datatype is None:
                raise OpenAIError(f"the served model has no input {name!r}", code="unsupported_parameter")
            items = value if isinstance(value, list) else [value]
            if datatype == "BYTES":
                array = np.array([[str(v).encode("utf-8") for v in items]], dtype=np.object_)
            else:
                array = np.array([items], dtype=_NUMPY[datatype])
            tensor = InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    async def generate(self, prompt: str, request: GenerationRequest) -> AsyncIterator[Piece]:
        """The model's responses for ``prompt``; leaving the iteration early cancels the request."""
        inputs = self._inputs(prompt, request.inputs)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.config.model_name, "inputs": inputs}

        call = self._client.stream_infer(requests(), stream_timeout=self.config.request_timeout_s,
                                         headers=dict(self.config.grpc_headers) if self.config.grpc_headers else None)
        finished = False
        try:
            async for result, error in _responses(call):
                if error is not None:
                    raise stream_error(error.message() if hasattr(error, "message") else str(error))
                piece = _piece(result)
                yield piece
                if piece.final:
                    finished = True
                    return
            raise server_error("the inference server closed the stream before the final response", 502)
        finally:
            if not finished:
                call.cancel()


async def _responses(call: Any) -> AsyncIterator[tuple[Any, Any]]:
    import grpc

    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED:
            raise asyncio.CancelledError() from None
        raise server_error(f"the inference server is unavailable: {exc.details()}", 503) from None


def _piece(result: Any) -> Piece:
    text = result.as_numpy("text_output")
    stats = {}
    for name in STAT_NAMES:
        value = result.as_numpy(name)
        if value is not None and value.size:
            stats[name] = _scalar(value)
    final_param = result.get_response().parameters.get("triton_final_response")
    final = bool(final_param.bool_param) if final_param is not None else "finish_reason" in stats
    ids, log_probs = result.as_numpy("output_ids"), result.as_numpy("output_log_probs")
    top_ids, top_values = result.as_numpy("output_top_ids"), result.as_numpy("output_top_log_probs")
    top = ()
    if top_ids is not None and top_values is not None and top_ids.ndim >= 2:
        k = top_ids.shape[-1]
        top = tuple((tuple(i), tuple(v)) for i, v in zip(top_ids.reshape(-1, k).tolist(),
                                                          top_values.reshape(-1, k).tolist()))
    return Piece(_text(text) if text is not None else "", stats, final,
                 tuple(int(i) for i in ids.reshape(-1)) if ids is not None else (),
                 tuple(float(v) for v in log_probs.reshape(-1)) if log_probs is not None else (), top)


__all__ = ["BackendConfig", "Piece", "TritonBackend", "offered", "stream_error", "tokenizer_source"]
