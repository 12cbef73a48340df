"""A client for the served model: tritonclient over gRPC or HTTP, unary or streaming.

Routes (``ServingConfig`` defaults):

- gRPC, streaming: the decoupled model ``specdec`` over gRPC bidirectional streaming;
  one response per verified block, the last carries the statistics.
- gRPC / HTTP, unary: the ``specdec_unary`` entry point through Triton's ``infer`` API
  (``ModelInfer`` / ``POST /v2/models/specdec_unary/infer``).
- HTTP, streaming: Triton's ``generate_stream`` extension (server-sent events) on ``specdec``.
"""

from __future__ import annotations

import enum
import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from triton_backend.core.errors import SpecbuildError
from triton_backend.serving.interface import (
    CHAT, END_ID, IGNORE_EOS, INPUTS, MAX_TOKENS, NUM_DRAFT_TOKENS, OUTPUTS, RANDOM_SEED, SPECULATION, STOP_WORDS, STREAM,
    TEMPERATURE, TEXT_INPUT, TEXT_OUTPUT, TOP_K, TOP_P,
)
from triton_backend.serving.tensors import TritonType

_SPECS = {spec.name: spec for spec in INPUTS}
STAT_OUTPUTS = tuple(spec for spec in OUTPUTS if spec is not TEXT_OUTPUT)


class ClientError(SpecbuildError, RuntimeError):
    """The server answered with an error, or could not be reached."""

    code = "client"


class ClientProtocol(str, enum.Enum):
    GRPC = "grpc"
    HTTP = "http"


@dataclass(frozen=True)
class ClientConfig:
    url: str  # host:port of the protocol's endpoint
    protocol: ClientProtocol = ClientProtocol.GRPC
    model_name: str = "specdec"
    unary_model_name: str = "specdec_unary"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "protocol", ClientProtocol(self.protocol))
        object.__setattr__(self, "url", self.url.removeprefix("http://").removeprefix("https://").rstrip("/"))


@dataclass(frozen=True)
class GenerateRequest:
    """One generation; ``None`` leaves a parameter to the server's default."""

    prompt: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    end_id: int | None = None
    speculation: str | None = None
    num_draft_tokens: int | None = None
    chat: bool = False
    stream: bool = False
    ignore_eos: bool = False

    def arrays(self) -> dict[str, np.ndarray]:
        """The request's input tensors, ``[1, ...]`` batched, typed as the model declares."""
        values: dict[str, Any] = {
            TEXT_INPUT.name: [self.prompt], MAX_TOKENS.name: self.max_tokens, TEMPERATURE.name: self.temperature,
            TOP_K.name: self.top_k, TOP_P.name: self.top_p, RANDOM_SEED.name: self.seed,
            STOP_WORDS.name: list(self.stop) or None, END_ID.name: self.end_id,
            SPECULATION.name: [self.speculation] if self.speculation is not None else None,
            NUM_DRAFT_TOKENS.name: self.num_draft_tokens, CHAT.name: self.chat or None, STREAM.name: self.stream,
            IGNORE_EOS.name: self.ignore_eos or None,
        }
        out = {}
        for name, value in values.items():
            if value is None:
                continue
            spec = _SPECS[name]
            if spec.dtype is TritonType.STRING:
                out[name] = np.array([[v.encode("utf-8") for v in value]], dtype=np.object_)
            else:
                _check_range(name, value, spec.dtype)
                out[name] = np.array([[value]], dtype=spec.dtype.numpy)
        return out


def _check_range(name: str, value: Any, dtype: TritonType) -> None:
    """An integer the tensor cannot hold is refused (numpy would wrap it around silently)."""
    if isinstance(value, int) and not isinstance(value, bool) and np.issubdtype(dtype.numpy, np.integer):
        info = np.iinfo(dtype.numpy)
        if not info.min <= value <= info.max:
            raise ClientError(f"{name}={value} does not fit the model's {dtype.wire} input [{info.min}, {info.max}]")


@dataclass
class RemoteResult:
    text: str
    chunks: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    latency_s: float = 0.0
    time_to_first_chunk_s: float = 0.0

    def summary(self) -> str:
        s = self.stats
        line = (f"{s.get('num_output_tokens', '?')} tokens in {self.latency_s:.2f}s "
                f"(first text after {self.time_to_first_chunk_s:.2f}s), method={s.get('speculation_method', '?')}, "
                f"target passes={s.get('target_passes', '?')}")
        if s.get("total_draft_tokens"):
            line += (f", acceptance={s.get('acceptance_rate', 0.0):.3f} "
                     f"({s.get('total_accepted_draft_tokens')}/{s.get('total_draft_tokens')})")
        if s.get("fallback"):
            line += ", fell back to plain decoding"
        return line + f", finish={s.get('finish_reason', '?')}"


def _scalar(value: Any) -> Any:
    item = np.asarray(value).reshape(-1)[0]
    if isinstance(item, (bytes, np.bytes_)):
        return bytes(item).decode("utf-8")
    return item.item() if hasattr(item, "item") else item


def _text(value: Any) -> str:
    return "".join(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in np.asarray(value).reshape(-1))


def _collect(result: RemoteResult, get: Callable[[str], Any], started: float,
             on_text: Callable[[str], None] | None) -> None:
    text = get(TEXT_OUTPUT.name)
    if text is not None:
        piece = _text(text)
        if piece and not result.chunks:
            result.time_to_first_chunk_s = time.perf_counter() - started
        if piece:
            result.chunks.append(piece)
            if on_text is not None:
                on_text(piece)
    for spec in STAT_OUTPUTS:
        value = get(spec.name)
        if value is not None:
            result.stats[spec.name] = _scalar(value)


def generate(config: ClientConfig, request: GenerateRequest,
             on_text: Callable[[str], None] | None = None) -> RemoteResult:
    """Send one request; ``on_text`` sees each text piece as it arrives."""
    started = time.perf_counter()
    result = RemoteResult(text="")
    if config.protocol is ClientProtocol.GRPC:
        (_grpc_stream if request.stream else _grpc_unary)(config, request, result, started, on_text)
    else:
        (_http_stream if request.stream else _http_unary)(config, request, result, started, on_text)
    result.text = "".join(result.chunks)
    result.latency_s = time.perf_counter() - started
    if not result.chunks:
        result.time_to_first_chunk_s = result.latency_s
    return result


def _infer_inputs(module: Any, arrays: Mapping[str, np.ndarray]) -> list[Any]:
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), _SPECS[name].dtype.wire)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _server_error(exc: Exception) -> ClientError:
    message = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
    return ClientError(f"server error: {message}")


def _grpc_unary(config: ClientConfig, request: GenerateRequest, result: RemoteResult, started: float,
                on_text: Callable[[str], None] | None) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with grpcclient.InferenceServerClient(config.url) as client:
        try:
            reply = client.infer(config.unary_model_name, _infer_inputs(grpcclient, request.arrays()),
                                 client_timeout=config.timeout_s)
        except InferenceServerException as exc:
            raise _server_error(exc) from None
        _collect(result, reply.as_numpy, started, on_text)


def _http_unary(config: ClientConfig, request: GenerateRequest, result: RemoteResult, started: float,
                on_text: Callable[[str], None] | None) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(config.url, network_timeout=config.timeout_s,
                                              connection_timeout=config.timeout_s)
    try:
        reply = client.infer(config.unary_model_name, _infer_inputs(httpclient, request.arrays()))
    except InferenceServerException as exc:
        raise _server_error(exc) from None
    except OSError as exc:
        raise ClientError(f"cannot reach http://{config.url}: {exc}") from None
    finally:
        client.close()
    _collect(result, reply.as_numpy, started, on_text)


def _grpc_stream(config: ClientConfig, request: GenerateRequest, result: RemoteResult, started: float,
                 on_text: Callable[[str], None] | None) -> None:
    import tritonclient.grpc as grpcclient

    from tritonclient.utils import InferenceServerException

    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    done = False
    with grpcclient.InferenceServerClient(config.url) as client:
        client.start_stream(callback=lambda result, error: replies.put((result, error)),
                            stream_timeout=config.timeout_s)
        try:
            try:
                client.async_stream_infer(config.model_name, _infer_inputs(grpcclient, request.arrays()),
                                          enable_empty_final_response=True)
            except InferenceServerException as exc:  # the stream broke already (no server): the callback says why
                raise _stream_error(replies, exc) from None
            for reply in _until_final(replies, config.timeout_s):
                _collect(result, reply.as_numpy, started, on_text)
            done = True
        finally:
            client.stop_stream(cancel_requests=not done)  # an error or Ctrl-C cancels the request on the server


def _stream_error(replies: "queue.Queue[tuple[Any, Any]]", exc: Exception) -> ClientError:
    try:
        _, error = replies.get(timeout=5)
    except queue.Empty:
        error = None
    return _server_error(error if error is not None else exc)


def _until_final(replies: "queue.Queue[tuple[Any, Any]]", timeout_s: float) -> Iterator[Any]:
    while True:
        try:
            reply, error = replies.get(timeout=timeout_s)
        except queue.Empty:
            raise ClientError(f"no response within {timeout_s:.0f}s") from None
        if error is not None:
            raise _server_error(error)
        yield reply
        final = reply.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            return


def _json_body(request: GenerateRequest) -> dict[str, Any]:
    """The request as a ``generate`` extension JSON body: scalars, lists for ``[-1]`` inputs."""
    body: dict[str, Any] = {}
    for name, array in request.arrays().items():
        values = [v.decode("utf-8") if isinstance(v, bytes) else v.item() for v in array.reshape(-1)]
        body[name] = values if _SPECS[name].dims == (-1,) else values[0]
    return body


def _http_stream(config: ClientConfig, request: GenerateRequest, result: RemoteResult, started: float,
                 on_text: Callable[[str], None] | None) -> None:
    body = _json_body(request)
    url = f"http://{config.url}/v2/models/{config.model_name}/generate_stream"
    http_request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                          headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(http_request, timeout=config.timeout_s) as reply:
            for raw in reply:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    raise ClientError(f"server error: {event['error']}")
                _collect(result, event.get, started, on_text)
    except urllib.error.HTTPError as exc:
        raise ClientError(f"server error: {exc.read().decode('utf-8', 'replace')}") from None
    except urllib.error.URLError as exc:
        raise ClientError(f"cannot reach {url}: {exc.reason}") from None


__all__ = ["ClientConfig", "ClientError", "ClientProtocol", "GenerateRequest", "RemoteResult", "generate"]
