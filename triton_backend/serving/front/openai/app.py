"""The OpenAI-compatible HTTP server (aiohttp): routes, API key, body limit, errors in OpenAI's
format, and :class:`OpenAIServer`, which runs it on its own thread and event loop.

Routes: ``GET /health`` (open), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events).
A client that disconnects cancels its request (the handler is cancelled; the Triton stream with it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from aiohttp import web

from triton_backend.serving.front.openai.backend import BackendConfig, TritonBackend
from triton_backend.serving.front.openai.openai_errors import OpenAIError, invalid, not_found, unauthorized
from triton_backend.serving.front.openai.logprobs import attach, new_tracker
from triton_backend.serving.front.openai.openai_request import Endpoint, GenerationRequest, parse_request
from triton_backend.serving.limits import unencodable_text
from triton_backend.serving.front.openai.openai_responses import (
    DONE_EVENT, Generation, ResponseIds, chunk, delta_chunk, full_response, models_list, sse, usage_chunk,
)
from triton_backend.serving.front.openai.tool_parser import tool_deltas, tool_message

logger = logging.getLogger(__name__)

API_KEY_ENV = "SPECBUILD_API_KEY"
_STARTED = int(time.time())
_INLINE_CHARS = 8192  # prompts shorter than this are rendered and counted on the event loop
_HTTP_ERRORS = {404: ("not_found", "invalid_request_error"), 405: ("method_not_allowed", "invalid_request_error"),
                413: ("request_too_large", "invalid_request_error")}


@dataclass(frozen=True)
class OpenAIConfig:
    """The front's own settings (what it talks to: :class:`~triton_backend.serving.front.openai.backend.BackendConfig`)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    api_key: str | None = None  # None: the SPECBUILD_API_KEY environment variable, if set
    served_model_name: str | None = None  # None: the target model's name
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout_s: float = 5.0  # at stop: requests in flight get this long, then are cancelled
    # "shared": one prefix cache for every request; "user": each request's ``user`` field is its
    # prefix-cache namespace (the application's end users do not share keys and values, nor learn
    # from a first token's time what others sent: docs/prefix-caching.md)
    prefix_cache_scope: str = "shared"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise OpenAIError(f"port must be in [0, 65535], got {self.port}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise OpenAIError(f"prefix_cache_scope must be one of {list(PREFIX_CACHE_SCOPES)}, "
                              f"got {self.prefix_cache_scope!r}")
        if self.max_body_bytes < 1024:
            raise OpenAIError("max_body_bytes must be at least 1024")

    @property
    def key(self) -> str | None:
        return self.api_key if self.api_key is not None else (os.environ.get(API_KEY_ENV) or None)

    def model_id(self, backend: BackendConfig) -> str:
        return self.served_model_name or Path(backend.tokenizer).name


PREFIX_CACHE_SCOPES = ("shared", "user")
MAX_USER_CHARS = 250  # with its "user:" prefix, within the served model's namespace limit
_BACKEND = web.AppKey("backend", TritonBackend)
_CONFIG = web.AppKey("config", OpenAIConfig)
_MODEL_ID = web.AppKey("model_id", str)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """Every failure as an OpenAI error body; tracebacks only in the server log."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        code, kind = _HTTP_ERRORS.get(exc.status, (None, "invalid_request_error"))
        error = OpenAIError(exc.reason if exc.status != 404 else f"no route {request.method} {request.path}",
                            status=exc.status, type=kind, code=code)
        return web.json_response(error.body(), status=exc.status)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - the edge: log it, answer a short typed error
        logger.exception("OpenAI front: %s %s failed", request.method, request.path)
        error = OpenAIError("internal server error", status=500, type="server_error", code="internal")
        return web.json_response(error.body(), status=500)


@web.middleware
async def _auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                ) -> web.StreamResponse:
    key = request.app[_CONFIG].key
    if key is not None and request.path.startswith("/v1"):
        sent = request.headers.get("Authorization", "")
        if not (sent.startswith("Bearer ") and hmac.compare_digest(sent[len("Bearer "):].encode(), key.encode())):
            raise unauthorized()
    return await handler(request)


async def _health(request: web.Request) -> web.Response:
    ready = await request.app[_BACKEND].ready()
    return web.json_response({"status": "ok" if ready else "unavailable"}, status=200 if ready else 503)


async def _models(request: web.Request) -> web.Response:
    return web.json_response(models_list([request.app[_MODEL_ID]], _STARTED))


async def _model(request: web.Request) -> web.Response:
    model_id = request.app[_MODEL_ID]
    if request.match_info["model"] != model_id:
        raise not_found(f"The model '{request.match_info['model']}' does not exist", "model_not_found")
    return web.json_response(models_list([model_id], _STARTED)["data"][0])


async def _body(request: web.Request) -> Any:
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits (Python's int conversion limit)
        raise invalid(f"the request body holds a value that cannot be read: {str(exc).splitlines()[0][:200]}") from None
    _check_unicode(body)
    return body


def _check_unicode(body: Any) -> None:
    """Every string (and key) of the body encodes as UTF-8: JSON lets a lone surrogate through
    (``"\\ud800"``), which no tokenizer or Triton tensor takes."""
    exc = unencodable_text(body)
    if exc is not None:
        raise invalid(f"the request body holds text that is not valid Unicode ({exc.reason} at "
                      f"character {exc.start} of a string)")


def scoped(parsed: GenerationRequest, body: Mapping[str, Any], config: OpenAIConfig) -> GenerationRequest:
    """The request with its prefix-cache namespace under the ``user`` scope (the served model's
    ``prefix_cache_namespace``: ``user:`` and the field, or ``user:`` alone when it is absent)."""
    if config.prefix_cache_scope != "user":
        return parsed
    if len(body.get("user") or "") > MAX_USER_CHARS:
        raise invalid(f"'user' holds at most {MAX_USER_CHARS} characters", "user")
    return replace(parsed, inputs={**parsed.inputs, "prefix_cache_namespace": "user:" + (body.get("user") or "")})


def _handler(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        backend, model_id = request.app[_BACKEND], request.app[_MODEL_ID]
        body = await _body(request)
        parsed = scoped(parse_request(body, endpoint, backend.capabilities), body, request.app[_CONFIG])
        if parsed.model != model_id:
            raise not_found(f"The model '{parsed.model}' does not exist (this server serves '{model_id}')",
                            "model_not_found")
        if len(parsed.prompt) + sum(len(m.content) for m in parsed.messages) < _INLINE_CHARS:
            prompt, prompt_tokens = backend.prompt_and_count(parsed)
        else:  # a long prompt is tokenized off the event loop
            prompt, prompt_tokens = await asyncio.get_running_loop().run_in_executor(None, backend.prompt_and_count,
                                                                                     parsed)
        generation = Generation(prompt_tokens=prompt_tokens)
        ids = ResponseIds.new(endpoint, model_id)
        if parsed.stream:
            return await _stream(request, backend, parsed, prompt, generation, ids)
        pieces, tracker, listed = [], new_tracker(backend.tokenizer, parsed.logprobs), []
        async for piece in backend.generate(prompt, parsed):
            pieces.append(piece.text)
            generation.stats.update(piece.stats)
            if tracker is not None:
                listed += tracker.take(piece)
        generation.text = "".join(pieces)
        if parsed.tool_call is not None:
            message, finish = tool_message(parsed.tool_call, generation.text, generation.finish_reason)
            return web.json_response(full_response(ids, generation, message=message, finish=finish))
        response = full_response(ids, generation)
        return web.json_response(attach(response, listed, endpoint is Endpoint.CHAT) if tracker else response)

    return handle


async def _stream(request: web.Request, backend: TritonBackend, parsed: GenerationRequest, prompt: str,
                  generation: Generation, ids: ResponseIds) -> web.StreamResponse:
    """Server-sent events. The first response is awaited before the headers go out, so a request
    the model refuses gets its error status; a later failure is an ``error`` event."""
    pieces = backend.generate(prompt, parsed)
    calls = tool_deltas(parsed.tool_call) if parsed.tool_call is not None else None
    usage = parsed.include_usage
    try:
        piece = await pieces.__anext__()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        first, tracker, listed = True, new_tracker(backend.tokenizer, parsed.logprobs), []
        chat = parsed.endpoint is Endpoint.CHAT
        try:
            while True:
                generation.stats.update(piece.stats)
                if tracker is not None:
                    listed += tracker.take(piece)
                if calls is not None:
                    for delta in calls.feed(piece.text, first):
                        await response.write(sse(delta_chunk(ids, delta, include_usage=usage)))
                    first = False
                elif piece.text or first:
                    event = chunk(ids, piece.text, first=first, include_usage=usage)
                    await response.write(sse(attach(event, listed, chat) if tracker else event))
                    first, listed = False, []
                if piece.final:
                    break
                piece = await pieces.__anext__()
            finish = generation.finish_reason
            if calls is not None:
                deltas, finish = calls.close(finish)
                for delta in deltas:
                    await response.write(sse(delta_chunk(ids, delta, include_usage=usage)))
            event = chunk(ids, "", finish, include_usage=usage)
            await response.write(sse(attach(event, listed, chat) if listed else event))
            if parsed.include_usage:
                await response.write(sse(usage_chunk(ids, generation)))
        except OpenAIError as exc:
            await response.write(sse(exc.body()))
        except ConnectionError:  # the client went away: the finally below cancels its request
            logger.info("OpenAI front: client gone mid-stream (%s)", ids.id)
            return response
        except Exception:  # noqa: BLE001 - the headers are out: an error event, the traceback to the log
            logger.exception("OpenAI front: stream failed")
            await response.write(sse(OpenAIError("internal server error", status=500, type="server_error",
                                                 code="internal").body()))
        await response.write(DONE_EVENT)
        await response.write_eof()
        return response
    finally:
        await pieces.aclose()  # a client gone mid-stream: cancels the Triton request




def build_app(config: OpenAIConfig, backend: TritonBackend) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth], client_max_size=config.max_body_bytes)
    app[_BACKEND] = backend
    app[_CONFIG] = config
    app[_MODEL_ID] = config.model_id(backend.config)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_post("/v1/completions", _handler(Endpoint.COMPLETIONS))
    app.router.add_post("/v1/chat/completions", _handler(Endpoint.CHAT))
    return app


class OpenAIServer:
    """The front on its own thread and event loop: :meth:`start` returns once it listens (or raises
    why it could not start); :meth:`stop` closes it (cancelling requests in flight)."""

    def __init__(self, config: OpenAIConfig, backend: BackendConfig) -> None:
        self.config = config
        self.backend = backend
        self.port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self, timeout_s: float | None = None) -> str:
        self._thread = threading.Thread(target=self._run, name="openai-front", daemon=True)
        self._thread.start()
        wait = timeout_s if timeout_s is not None else self.backend.ready_timeout_s + 60
        if not self._started.wait(wait):
            raise OpenAIError(f"the OpenAI front did not start within {wait:.0f}s", status=503)
        if self._error is not None:
            raise self._error
        return self.url

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop listening, give requests in flight ``shutdown_timeout_s``, close. Safe to call twice."""
        if self._loop is not None and self._stop is not None and self.alive():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop closed meanwhile: stopped already
                pass
        if self._thread is not None:
            self._thread.join(timeout=self.config.shutdown_timeout_s + 15)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - handed to start(), or logged when it comes later
            self._error = exc
            if self._started.is_set():
                logger.exception("the OpenAI front stopped")
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        backend = TritonBackend(self.backend)
        runner = web.AppRunner(build_app(self.config, backend), handler_cancellation=True, access_log=None,
                               shutdown_timeout=self.config.shutdown_timeout_s)
        try:
            await backend.start()
            await runner.setup()
            site = web.TCPSite(runner, self.config.host, self.config.port)
            await site.start()
            self.port = runner.addresses[0][1]
            logger.info("OpenAI API on %s (model %r)", self.url, self.config.model_id(self.backend))
            self._started.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await backend.close()


__all__ = ["API_KEY_ENV", "OpenAIConfig", "OpenAIServer", "build_app"]
