"""Serving: request parsing, responses and the request runner.

Plain Python over numpy arrays; Triton stays in :mod:`triton_backend.triton_io` and the
adapters in :mod:`triton_backend.triton_model`. The tensors are declared in
:mod:`triton_backend.interface`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

from triton_backend.config import SamplingParams, SpeculationConfig
from triton_backend.deployment import DeploymentConfig
from triton_backend.errors import InvalidRequestError, SpecbuildError
from triton_backend.generation import GenerationChunk, SpeculativeDecoder
from triton_backend.interface import (
    ACCEPTANCE_RATE, BAD_WORDS, CHAT, END_ID, EXCLUDE_INPUT, IGNORE_EOS, FALLBACK, FINISH_REASON, MAX_TOKENS, METHOD, NUM_DRAFT_TOKENS,
    NUM_OUTPUT_TOKENS, RANDOM_SEED, SPECULATION, STOP_WORDS, STREAM, TARGET_PASSES, TEMPERATURE, TEXT_INPUT,
    TEXT_OUTPUT, TOP_K, TOP_P, TOTAL_ACCEPTED, TOTAL_DRAFT, ServingConfig,
)
from triton_backend.reference_model import REFERENCE_MODELS
from triton_backend.stats import GenerationStats
from triton_backend.triton_io import TritonType as T
from triton_backend.triton_io import read_scalar, read_strings, scalar_tensor, string_tensor

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ServingRequest:
    prompt: str
    sampling: SamplingParams
    speculation: SpeculationConfig
    stream: bool = False
    chat: bool = False
    include_prompt: bool = False  # exclude_input_in_output = false: the text starts with the prompt as sent


def parse_request(arrays: Mapping[str, np.ndarray], speculation: SpeculationConfig,
                  default_max_tokens: int = 64) -> ServingRequest:
    """Typed request from input arrays; raises InvalidRequestError with a short message."""
    prompt = read_scalar(arrays, TEXT_INPUT)
    if not prompt:
        raise InvalidRequestError("text_input is empty")
    if read_strings(arrays, BAD_WORDS):
        raise InvalidRequestError("bad_words is not supported by this model; send it empty or leave it out")
    end_id = read_scalar(arrays, END_ID)
    max_tokens = read_scalar(arrays, MAX_TOKENS)
    sampling = SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=_or(read_scalar(arrays, TEMPERATURE), 0.0),
        top_k=_or(read_scalar(arrays, TOP_K), 0),
        top_p=_or(read_scalar(arrays, TOP_P), 1.0),
        seed=read_scalar(arrays, RANDOM_SEED),
        stop=tuple(read_strings(arrays, STOP_WORDS)),
        stop_token_ids=((end_id,),) if end_id is not None else (),
        ignore_eos=bool(read_scalar(arrays, IGNORE_EOS)),
    )
    spec = speculation.with_overrides(mode=read_scalar(arrays, SPECULATION),
                                      num_draft_tokens=read_scalar(arrays, NUM_DRAFT_TOKENS))
    if spec.min_draft_tokens > max(1, spec.num_draft_tokens):
        spec = spec.with_overrides(min_draft_tokens=max(1, spec.num_draft_tokens))
    exclude_input = read_scalar(arrays, EXCLUDE_INPUT)
    return ServingRequest(prompt, sampling, spec, stream=bool(read_scalar(arrays, STREAM)),
                          chat=bool(read_scalar(arrays, CHAT)),
                          include_prompt=exclude_input is not None and not bool(exclude_input))


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def text_outputs(text: str) -> dict[str, np.ndarray]:
    return {TEXT_OUTPUT.name: string_tensor(text)}


def final_outputs(text: str, chunk: GenerationChunk) -> dict[str, np.ndarray]:
    """The last response: text plus the request's acceptance statistics."""
    stats = chunk.stats or GenerationStats()
    reason = chunk.finish_reason.value if chunk.finish_reason is not None else ""
    return {
        TEXT_OUTPUT.name: string_tensor(text),
        ACCEPTANCE_RATE.name: scalar_tensor(stats.acceptance_rate, T.FP32),
        TOTAL_ACCEPTED.name: scalar_tensor(stats.accepted_tokens, T.INT32),
        TOTAL_DRAFT.name: scalar_tensor(stats.drafted_tokens, T.INT32),
        TARGET_PASSES.name: scalar_tensor(stats.target_passes, T.INT32),
        FALLBACK.name: scalar_tensor(stats.fallback, T.BOOL),
        NUM_OUTPUT_TOKENS.name: scalar_tensor(stats.generated_tokens, T.INT32),
        METHOD.name: string_tensor(stats.method),
        FINISH_REASON.name: string_tensor(reason),
    }


def load_deployment(path: Path) -> DeploymentConfig:
    """A deployment file; relative model paths in it are relative to the file's folder."""
    if not path.is_file():
        raise InvalidRequestError(f"deployment file {path} not found")
    config = DeploymentConfig.load(path)

    def resolve(source: str | None) -> str | None:
        if source is None or source in REFERENCE_MODELS or Path(source).is_absolute():
            return source
        return str((path.parent / source).resolve())

    from dataclasses import replace

    trtllm = config.trtllm.with_paths(resolve) if config.trtllm is not None else None  # engine folders too
    return replace(config, target=resolve(config.target) or config.target, draft=resolve(config.draft),
                   medusa=resolve(config.medusa), trtllm=trtllm)


class ResponseSink(Protocol):
    """Where one request's responses go (Triton's response sender, or a list in tests)."""

    def send(self, outputs: Mapping[str, np.ndarray], final: bool) -> None: ...
    def fail(self, exc: BaseException | str) -> None: ...
    def cancelled(self) -> bool: ...
    def close(self) -> None: ...


class RequestObserver(Protocol):
    """Told how each request ends (the Prometheus metrics implement it)."""

    def started(self) -> None: ...
    def succeeded(self, stats: GenerationStats, latency_s: float) -> None: ...
    def failed(self, outcome: str) -> None: ...


class NullObserver:
    def started(self) -> None:
        pass

    def succeeded(self, stats: GenerationStats, latency_s: float) -> None:
        pass

    def failed(self, outcome: str) -> None:
        pass


INTERNAL_ERROR_MESSAGE = "internal error while generating; see the server log"


class SpecdecService:
    """Runs requests on a thread pool over one shared decoder; each run has its own KV sessions."""

    def __init__(self, decoder: SpeculativeDecoder, config: ServingConfig, speculation: SpeculationConfig,
                 observer: RequestObserver | None = None) -> None:
        self.decoder = decoder
        self.config = config
        self.speculation = speculation
        self.observer: RequestObserver = observer or NullObserver()
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrency, thread_name_prefix="specdec")

    def submit(self, arrays: Mapping[str, np.ndarray], sink: ResponseSink) -> None:
        """Parse now (a bad request is answered at once), generate on the pool."""
        self.observer.started()
        try:
            request = parse_request(arrays, self.speculation, self.config.default_max_tokens)
        except SpecbuildError as exc:
            self._fail(sink, exc, exc.code)
            return
        self._pool.submit(self.run, request, sink)

    def run(self, request: ServingRequest, sink: ResponseSink) -> None:
        try:
            self._generate(request, sink, time.perf_counter())
        except SpecbuildError as exc:
            self._fail(sink, exc, exc.code)
        except Exception:  # the client gets a short message; the traceback goes to the server log
            logger.exception("request failed")
            self._fail(sink, INTERNAL_ERROR_MESSAGE, "internal")

    def _fail(self, sink: ResponseSink, error: BaseException | str, outcome: str) -> None:
        self.observer.failed(outcome)
        try:
            sink.fail(error)
        except Exception:  # the client is gone: nothing left to tell it
            logger.exception("could not send the error response")

    def _generate(self, request: ServingRequest, sink: ResponseSink, started: float) -> None:
        prompt = self._prompt(request)
        pieces: list[str] = [request.prompt] if request.include_prompt else []
        with contextlib.closing(self.decoder.stream(prompt, request.sampling, request.speculation)) as chunks:
            for chunk in chunks:
                if sink.cancelled():
                    self.observer.failed("cancelled")
                    try:
                        sink.close()
                    except Exception:  # the client is gone
                        logger.exception("could not close a cancelled request")
                    return
                if chunk.finished:
                    text = "".join(pieces) + chunk.text  # streaming: the prompt when nothing was sent yet
                    # counted before the last response leaves: a client that reads the metrics
                    # after its answer sees its request in them
                    self.observer.succeeded(chunk.stats or GenerationStats(), time.perf_counter() - started)
                    try:
                        sink.send(final_outputs(text, chunk), final=True)
                    except Exception:  # counted already; the client is gone
                        logger.exception("could not send the final response")
                    return
                if request.stream:
                    if chunk.text:
                        sink.send(text_outputs("".join(pieces) + chunk.text), final=False)
                        pieces.clear()
                else:
                    pieces.append(chunk.text)
        raise RuntimeError("generation ended without a final chunk")

    def _prompt(self, request: ServingRequest) -> str:
        if not request.chat:
            return request.prompt
        tokenizer = self.decoder.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("apply_chat_template: this model's tokenizer has no chat template")
        return tokenizer.apply_chat_template([{"role": "user", "content": request.prompt}],
                                             add_generation_prompt=True, tokenize=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = [
    "NullObserver", "RequestObserver", "ResponseSink", "ServingRequest",
    "SpecdecService", "final_outputs", "load_deployment", "parse_request", "text_outputs",
]
