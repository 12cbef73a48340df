"""Serving: request parsing, responses and the request runner.

Plain Python over numpy arrays; Triton stays in :mod:`triton_backend.serving.tensors` and the
adapters in :mod:`triton_backend.serving.triton.specdec_model`. The tensors are declared in
:mod:`triton_backend.serving.interface`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

from triton_backend.core.config import SamplingParams, SpeculationConfig
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.core.errors import InvalidRequestError, OverloadedError, SpecbuildError
from triton_backend.speculation.commit import GenerationChunk
from triton_backend.speculation.decoding import Decoder
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.serving.interface import (
    CHAT, END_ID, EXCLUDE_INPUT, IGNORE_EOS, NUM_DRAFT_TOKENS, PREFIX_CACHE_NAMESPACE, SPECULATION, STOP_WORDS,
    TEMPERATURE, ServingConfig,
)
from triton_backend.serving.trtllm_inputs import (
    check_single_sequence, read_max_tokens, read_pad_id, read_prompt, read_seed, read_stream, read_top_k_p,
    read_client_draft, read_guide, read_penalties, read_word_list, refuse_unsupported,
)
from triton_backend.serving.trtllm_interface import RETURN_PERF_METRICS, STOP_WORDS_LIST
from triton_backend.core.reference_model import REFERENCE_MODELS
from triton_backend.serving.limits import check_max_tokens, check_prompt, check_prompt_bytes, check_sampling
from triton_backend.serving.response_pump import ResponsePump
from triton_backend.serving.request import ServingRequest
from triton_backend.serving.responses import ResponseBuilder
from triton_backend.batching.round_stats import RoundObserver
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig, batchable
from triton_backend.core.stats import GenerationStats
from triton_backend.serving.tensors import read_scalar, read_strings

logger = logging.getLogger(__name__)

def parse_request(arrays: Mapping[str, np.ndarray], speculation: SpeculationConfig,
                  default_max_tokens: int = 64) -> ServingRequest:
    """Typed request from input arrays (our tensors, or tensorrtllm_backend's text or token
    level ones); raises InvalidRequestError with a short message naming the input."""
    arrival = time.time_ns()
    refuse_unsupported(arrays)
    check_single_sequence(arrays)
    check_prompt_bytes(arrays)  # before decoding
    prompt = read_prompt(arrays)
    check_prompt(prompt)  # before any tokenizing
    token_level = not isinstance(prompt, str)
    read_pad_id(arrays)
    end_id = read_scalar(arrays, END_ID)
    top_k, top_p = read_top_k_p(arrays)
    stop_ids = read_word_list(arrays, STOP_WORDS_LIST)
    sampling = SamplingParams(
        max_tokens=read_max_tokens(arrays, default_max_tokens),
        temperature=_or(read_scalar(arrays, TEMPERATURE), 0.0),
        top_k=_or(top_k, 0),
        top_p=_or(top_p, 1.0),
        seed=read_seed(arrays),
        stop=tuple(read_strings(arrays, STOP_WORDS)),
        stop_token_ids=stop_ids + (((end_id,),) if end_id is not None else ()),
        ignore_eos=bool(read_scalar(arrays, IGNORE_EOS)),
        guide=read_guide(arrays),
        **read_penalties(arrays),
    )
    check_sampling(sampling)
    spec = speculation.for_request(read_scalar(arrays, SPECULATION), read_scalar(arrays, NUM_DRAFT_TOKENS))
    client_draft = read_client_draft(arrays, token_level)
    stream = read_stream(arrays)
    chat = bool(read_scalar(arrays, CHAT))
    if token_level and chat:
        raise InvalidRequestError("apply_chat_template needs text_input, not input_ids")
    exclude_input = read_scalar(arrays, EXCLUDE_INPUT)
    # text level: absent = new text only; token level (as tensorrt_llm): absent = prompt ids first, unless streaming
    include_prompt = (not stream and not exclude_input) if token_level else (
        exclude_input is not None and not exclude_input)
    return ServingRequest(prompt, sampling, spec, stream=stream, chat=chat, include_prompt=include_prompt,
                          token_level=token_level, return_perf_metrics=bool(read_scalar(arrays, RETURN_PERF_METRICS)),
                          arrival_ns=arrival, client_draft=client_draft, namespace=read_namespace(arrays))


MAX_NAMESPACE_CHARS = 256


def read_namespace(arrays: Mapping[str, np.ndarray]) -> str:
    """``prefix_cache_namespace`` ("" when absent: the shared namespace)."""
    value = read_scalar(arrays, PREFIX_CACHE_NAMESPACE)
    if value is None:
        return ""
    if len(value) > MAX_NAMESPACE_CHARS:
        raise InvalidRequestError(f"input '{PREFIX_CACHE_NAMESPACE.name}' holds at most {MAX_NAMESPACE_CHARS} "
                                  f"characters, got {len(value)}")
    return value


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


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
                   medusa=resolve(config.medusa), eagle=resolve(config.eagle), trtllm=trtllm,
                   target_checkpoint=resolve(config.target_checkpoint), draft_checkpoint=resolve(config.draft_checkpoint))


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


class _Responder:
    """One request's client side: turns generation chunks into responses on its sink (the
    batch scheduler's :class:`~triton_backend.batching.admission.RequestHandle`)."""

    def __init__(self, request: ServingRequest, sink: ResponseSink, observer: RequestObserver, started: float) -> None:
        self.request, self.sink, self.observer, self.started = request, sink, observer, started
        self.responses = ResponseBuilder(request)  # text or token level, streamed or whole
        self.done = False

    def on_chunk(self, chunk: GenerationChunk) -> None:
        if chunk.finished:
            self.done = True
            outputs = self.responses.final(chunk)
            # counted before the last response leaves: a client that reads the metrics
            # after its answer sees its request in them
            self.observer.succeeded(chunk.stats or GenerationStats(), time.perf_counter() - self.started)
            try:
                self.sink.send(outputs, final=True)
            except Exception:  # counted already; the client is gone
                logger.exception("could not send the final response")
        else:
            outputs = self.responses.partial(chunk)
            if outputs is not None:
                self.sink.send(outputs, final=False)

    def on_error(self, exc: BaseException) -> None:
        self.done = True
        if isinstance(exc, SpecbuildError):
            _fail(self.observer, self.sink, exc, exc.code)
        else:  # the client gets a short message; the traceback is in the server log
            _fail(self.observer, self.sink, INTERNAL_ERROR_MESSAGE, "internal")

    def cancelled(self) -> bool:
        return self.sink.cancelled()

    def on_cancelled(self) -> None:
        self.done = True
        self.observer.failed("cancelled")
        try:
            self.sink.close()
        except Exception:  # the client is gone
            logger.exception("could not close a cancelled request")


def _fail(observer: RequestObserver, sink: ResponseSink, error: BaseException | str, outcome: str) -> None:
    observer.failed(outcome)
    try:
        sink.fail(error)
    except Exception:  # the client is gone: nothing left to tell it
        logger.exception("could not send the error response")


class SpecdecService:
    """Serves requests over one decoder. Torch runtimes: every request joins the batch
    scheduler (continuous batching, one ragged target pass per round). Runtimes that batch
    in flight themselves (TensorRT-LLM's Executor): each request runs its own loop on a
    thread pool of ``max_concurrency`` threads, handed to the Executor concurrently."""

    def __init__(self, decoder: Decoder, config: ServingConfig, speculation: SpeculationConfig,
                 observer: RequestObserver | None = None) -> None:
        self.decoder = decoder
        self.config = config
        self.speculation = speculation
        self.observer: RequestObserver = observer or NullObserver()
        self.scheduler: BatchScheduler | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pump: ResponsePump | None = None
        self._lock = threading.Lock()
        self._pool_requests = 0  # running or waiting on the pool
        if isinstance(decoder, SpeculativeDecoder) and batchable(decoder.target):
            rounds = observer if isinstance(observer, RoundObserver) else None
            # responses, cancellation queries and metrics off the scheduler thread
            self._pump = ResponsePump(flush=rounds.flush if rounds is not None else None)
            self.scheduler = BatchScheduler(decoder, SchedulerConfig(
                max_batch_size=config.max_batch_size, max_queue_size=config.max_queue_size,
                prefill_chunk_tokens=config.prefill_chunk_tokens, policy=config.batch_policy,
                prefix_cache=config.prefix_cache), rounds)
        else:
            self._pool = ThreadPoolExecutor(max_workers=config.max_concurrency, thread_name_prefix="specdec")

    def submit(self, arrays: Mapping[str, np.ndarray], sink: ResponseSink) -> None:
        """Parse and encode now (a bad request, or a full queue, is answered at once); generate
        in the batch (or on the pool)."""
        self.observer.started()
        started = time.perf_counter()
        try:
            request = parse_request(arrays, self.speculation, self.config.default_max_tokens)
            responder = _Responder(request, sink, self.observer, started)
            if self.scheduler is None:
                if request.client_draft is not None:
                    raise InvalidRequestError("draft_input_ids: this deployment's runtime does not verify client "
                                              "drafts (the torch runtime does)")
                self._admit()  # the pool's queue is bounded like the scheduler's
                self._pool.submit(self.run, request, responder)
                return
            check_max_tokens(request.sampling.max_tokens, self.scheduler.target.max_context)
            prompt_ids = self.decoder.encode(self._prompt(request))
            handle = self._pump.wrap(responder)
            try:
                self.scheduler.submit(prompt_ids, request.sampling, request.speculation, handle, request.client_draft,
                                      namespace=request.namespace)
            except BaseException:
                self._pump.discard(handle)
                raise
        except SpecbuildError as exc:
            _fail(self.observer, sink, exc, exc.code)

    def _admit(self) -> None:
        bound = self.config.max_concurrency + self.config.max_queue_size
        with self._lock:
            if self._pool_requests >= bound:
                raise OverloadedError(f"{self._pool_requests} requests are running or waiting (at most {bound}); "
                                      "retry later")
            self._pool_requests += 1

    def run(self, request: ServingRequest, responder: _Responder) -> None:
        """One request's own loop (runtimes that batch on their own)."""
        try:
            self._run(request, responder)
        finally:
            with self._lock:
                self._pool_requests -= 1

    def _run(self, request: ServingRequest, responder: _Responder) -> None:
        try:
            with contextlib.closing(self.decoder.stream(self._prompt(request), request.sampling,
                                                        request.speculation)) as chunks:
                for chunk in chunks:
                    if responder.cancelled():
                        responder.on_cancelled()
                        return
                    responder.on_chunk(chunk)
                    if chunk.finished:
                        return
            raise RuntimeError("generation ended without a final chunk")
        except Exception as exc:
            if not isinstance(exc, SpecbuildError):
                logger.exception("request failed")
            responder.on_error(exc)

    def _prompt(self, request: ServingRequest) -> str:
        if not request.chat:
            return request.prompt
        tokenizer = self.decoder.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("apply_chat_template: this model's tokenizer has no chat template")
        return tokenizer.apply_chat_template([{"role": "user", "content": request.prompt}],
                                             add_generation_prompt=True, tokenize=False)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self._pump is not None:
            self._pump.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = [
    "NullObserver", "RequestObserver", "ResponseSink", "ServingRequest",
    "SpecdecService", "load_deployment", "parse_request",
]
