"""A small HTTP guard in front of Triton's HTTP endpoint.

Triton 2.51 (the bundled server) dies with SIGSEGV when its HTTP ``generate`` endpoint gets a
body of ~4.5 MB or more sent as ``application/x-www-form-urlencoded`` (what ``curl -d`` and
urllib send), and it has no option that bounds a request body. So ``specbuild serve`` binds
Triton's HTTP endpoint on loopback, on an internal port, and runs this guard on the public
HTTP port. For each request the guard:

- refuses a body over ``max_body_bytes`` (declared or streamed) with ``413`` before Triton
  sees a byte, and a compressed request body (``Content-Encoding``, which would inflate past
  the bound inside Triton) with ``415``;
- sends form-encoded bodies on as ``application/json`` (Triton's HTTP API reads JSON or its
  binary tensor format only; the form parser is the path that crashes);
- refuses a JSON ``generate`` / ``infer`` body holding an integer its input's type cannot hold
  with ``400`` (Triton's JSON conversion would wrap it silently: ``max_tokens`` 2^32 + 5 was
  served as 5);
- refuses the restricted API groups (:class:`~triton_backend.serving.launch.triton_server.RestrictedApi`)
  without the admin header with ``403`` (Triton checks the same key again behind it);
- streams Triton's answer back as it comes (``generate_stream`` server-sent events included)
  and closes the upstream connection when the client goes away;
- names each JSON ``generate`` / ``generate_stream`` request (a request parameter,
  :data:`~triton_backend.serving.triton.io.CANCEL_ID_PARAM`) and, when its client goes away
  before the answer is complete, cancels it in the serving model through the models'
  cancellation channel (Triton 2.51's HTTP frontend does not tell a model that its client left,
  so an abandoned request ran to its end and held a batch slot);
- answers ``503`` while Triton is not reachable (a restart after a crash), and turns the 400
  that Triton 2.51's ``generate`` endpoint gives every model error into ``503`` (with
  ``Retry-After``) when the model refused the request as overloaded.

Every refusal is JSON, ``{"error": message, "code": code}``, as Triton writes its own errors
(plus the typed code). gRPC and metrics do not pass through the guard.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import aiohttp
from aiohttp import web

from triton_backend.serving.launch.processes import process_group_members
from triton_backend.serving.launch.triton_server import RestrictedApi, ServerError
from triton_backend.core.errors import OVERLOADED_MESSAGE_PREFIX
from triton_backend.serving.limits import unencodable_text
from triton_backend.serving.triton.io import CANCEL_ID_PARAM, cancel_on_server

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # well under the ~4.5 MB that crash Triton 2.51's generate path
UNREACHABLE_LOG_S = 10.0
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "trailers", "transfer-encoding", "upgrade", "host", "content-length"))
_FORM = "application/x-www-form-urlencoded"
_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
_API_GROUPS = (  # Triton's HTTP routes -> its restricted-API group names
    (re.compile(r"^/v2/health/(?:live|ready)$"), "health"),
    (re.compile(rf"^{_MODEL}/ready$"), "health"),
    (re.compile(r"^/v2/repository(?:/.*)?$"), "model-repository"),
    (re.compile(rf"^(?:/v2/models|{_MODEL})/stats$"), "statistics"),
    (re.compile(r"^/v2/(?:system|cuda)sharedmemory(?:/.*)?$"), "shared-memory"),
    (re.compile(rf"^(?:/v2|{_MODEL})/trace/setting$"), "trace"),
    (re.compile(r"^/v2/logging$"), "logging"),
    (re.compile(rf"^{_MODEL}/config$"), "model-config"),
    (re.compile(rf"^{_MODEL}/(?:infer|generate|generate_stream)$"), "inference"),
    (re.compile(rf"^(?:/v2|{_MODEL})$"), "metadata"),
)


def api_group(path: str) -> str | None:
    """Triton's API group of an HTTP path (``None``: not a Triton route)."""
    path = path.rstrip("/") or "/"
    for pattern, group in _API_GROUPS:
        if pattern.match(path):
            return group
    return None


@dataclass(frozen=True)
class GuardConfig:
    """Where the guard listens and what it refuses. ``port`` ``None``: a free one."""

    host: str = "127.0.0.1"
    port: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    restricted: RestrictedApi | None = None
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ServerError(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ServerError(f"guard port must be in 1..65535, got {self.port}")


_INT_RANGES = {"INT8": 8, "INT16": 16, "INT32": 32, "INT64": 64, "UINT8": -8, "UINT16": -16, "UINT32": -32,
               "UINT64": -64}  # bits; negative: unsigned
_UINT64_FIELDS = ("seed", "random_seed")  # every other integer field of the served models is INT32


def _fits(value: object, bits: int) -> bool:
    if not isinstance(value, int) or isinstance(value, bool):
        return True  # not an integer: Triton judges it
    if bits < 0:
        return 0 <= value < 1 << -bits
    return -(1 << (bits - 1)) <= value < 1 << (bits - 1)


def _integers(value: object) -> list[object]:
    if isinstance(value, list):
        return [v for item in value for v in _integers(item)]
    return [value]


def integer_problem(path: str, body: bytes) -> str | None:
    """Why a JSON ``generate`` / ``infer`` body holds an integer its input's type cannot hold
    (Triton 2.51 would wrap it: ``max_tokens`` 2^32 + 5 became 5) or text that is not Unicode (a
    lone surrogate escape such as ``"\\ud800"``: Triton 2.51 answered 500), or ``None``."""
    if not path.endswith(("/generate", "/generate_stream", "/infer")):
        return None
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # Triton answers a body that does not parse
    except ValueError:  # parsed, but an integer has more digits than Python converts (4,300): no input holds it
        return "a number has too many digits for any input type"
    if not isinstance(request, dict):
        return None
    if b"\\u" in body.lower() and unencodable_text(request) is not None:
        return "a string holds a lone surrogate (\\ud800-\\udfff without its pair): not valid Unicode text"
    if path.endswith("/infer"):
        fields = [(t.get("name"), _INT_RANGES.get(str(t.get("datatype")).upper()), t.get("data"))
                  for t in request.get("inputs", []) if isinstance(t, dict)]
    else:
        fields = [(name, -64 if name in _UINT64_FIELDS else 32, value) for name, value in request.items()]
    for name, bits, value in fields:
        if bits is not None and not all(_fits(v, bits) for v in _integers(value)):
            kind = f"{'UINT' if bits < 0 else 'INT'}{abs(bits)}"
            return f"{name}: a value does not fit its type {kind}"
    return None


def with_cancel_id(path: str, body: bytes) -> tuple[bytes, str | None]:
    """A JSON ``generate`` / ``generate_stream`` body with a fresh cancellation id as its first
    member (Triton passes a member that is no input on as a request parameter), and the id;
    any other body as it is, and ``None``. The client's bytes are kept as they came."""
    if not path.endswith(("/generate", "/generate_stream")):
        return body, None
    stripped = body.lstrip()
    if not stripped.startswith(b"{"):
        return body, None
    try:
        request = json.loads(body)
    except ValueError:
        return body, None
    if not isinstance(request, dict) or CANCEL_ID_PARAM in request:
        return body, None
    cancel_id = uuid.uuid4().hex
    member = json.dumps({CANCEL_ID_PARAM: cancel_id})[:-1].encode()  # '{"specbuild_cancel_id": "..."'
    return member + (b", " if request else b"") + stripped[1:], cancel_id


def _overloaded(body: bytes) -> bool:
    try:
        error = json.loads(body).get("error", "")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, str) and error.startswith(OVERLOADED_MESSAGE_PREFIX)


def refusal(status: int, code: str, message: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": message, "code": code}),
                        content_type="application/json")


class HttpGuard:
    """The guard's server, on its own event loop in a daemon thread: ``start()`` binds the
    public port (raises :class:`ServerError` when taken), ``stop()`` closes it."""

    def __init__(self, config: GuardConfig, upstream_url: str,
                 server_pid: Callable[[], int | None] | None = None) -> None:
        self.config = config
        self.server_pid = server_pid  # the Triton server behind (its models' cancellation channels); None: none
        self.upstream_url = upstream_url.rstrip("/")
        self.port: int | None = None
        self.refused: dict[str, int] = {}  # code -> count
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._unreachable_logged = -UNREACHABLE_LOG_S
        self.in_flight = 0  # requests being handled now (read by the drain at a stop)
        self.cancelled = 0  # requests cancelled because their client went away

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> int:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-guard", daemon=True)
        self._thread.start()
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        except OSError as exc:
            self.stop()
            raise ServerError(f"HTTP port {self.config.port} on {self.config.host} is not available "
                              f"({exc.strerror or exc}); pick another port or leave it out to use a free one") from None
        logger.info("HTTP guard on %s:%d -> %s (bodies up to %d bytes)", self.config.host, self.port,
                    self.upstream_url, self.config.max_body_bytes)
        return self.port

    async def _start(self) -> int:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        # no idle keep-alive connections to Triton: on SIGTERM Triton waits for every open HTTP
        # connection before it exits, and an idle one would hold it to its exit timeout
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                              connector=aiohttp.TCPConnector(limit=0, force_close=True))
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port or 0, reuse_address=True)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def stop_accepting(self) -> None:
        """Close the listening socket (the port is free at once for a new server); requests
        already in flight go on. Part of a stop: :attr:`in_flight` tells when they are done."""
        if self._loop is None or not self._loop.is_running() or self._runner is None:
            return

        async def close_sites() -> None:
            assert self._runner is not None
            for site in list(self._runner.sites):
                await site.stop()

        try:
            asyncio.run_coroutine_threadsafe(close_sites(), self._loop).result(timeout=5)
        except (TimeoutError, RuntimeError, OSError):
            logger.warning("the HTTP guard did not close its port cleanly")
        logger.info("HTTP guard: no longer accepting connections (%d request(s) in flight)", self.in_flight)

    def stop(self) -> None:
        if self._loop is None:
            return
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=15)
            except (TimeoutError, RuntimeError, OSError):
                logger.warning("the HTTP guard did not close cleanly")
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=15)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> "HttpGuard":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests -----------------------------------------------------------------------------
    def _refuse(self, status: int, code: str, message: str) -> web.Response:
        self.refused[code] = self.refused.get(code, 0) + 1
        return refusal(status, code, message)

    def _check(self, request: web.Request) -> web.Response | None:
        """A refusal for what can be judged from the request line and headers, else ``None``."""
        restricted = self.config.restricted
        if restricted is not None and api_group(request.path) in restricted.apis:
            given = request.headers.get(restricted.header, "")
            if not hmac.compare_digest(given.encode(), restricted.key.encode()):
                return self._refuse(403, "forbidden", f"this API is restricted: send the header '{restricted.header}'")
        if request.headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity"):
            return self._refuse(415, "unsupported_encoding", "compressed request bodies are not accepted here")
        length = request.content_length
        if length is not None and length > self.config.max_body_bytes:
            return self._refuse(413, "request_too_large", f"request body of {length} bytes is over the limit of "
                                f"{self.config.max_body_bytes} bytes")
        return None

    async def _body(self, request: web.Request) -> bytes | None:
        """The whole body, or ``None`` once it passes the bound (a chunked body has no length)."""
        chunks, size = [], 0
        async for chunk in request.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1  # only the guard's event loop thread touches it
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        refused = self._check(request)
        if refused is not None:
            return refused
        body = await self._body(request)
        if body is None:
            return self._refuse(413, "request_too_large",
                                f"request body is over the limit of {self.config.max_body_bytes} bytes")
        if "Inference-Header-Content-Length" not in request.headers:  # a JSON body, not binary tensors
            problem = integer_problem(request.path, body)
            if problem is not None:
                return self._refuse(400, "invalid_request", problem)
            body, cancel_id = with_cancel_id(request.path, body) if self.server_pid else (body, None)
        else:
            cancel_id = None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        if headers.get("Content-Type", "").split(";")[0].strip().lower() == _FORM:
            headers["Content-Type"] = "application/json"
        assert self._session is not None
        try:
            async with self._session.request(request.method, self.upstream_url + request.path_qs, data=body,
                                             headers=headers, allow_redirects=False) as upstream:
                return await self._relay(request, upstream, cancel_id)
        except asyncio.CancelledError:  # the client went away (aiohttp cancels its handler)
            if cancel_id is not None:
                self._cancel(cancel_id)
            raise
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
            now = time.monotonic()
            if now - self._unreachable_logged > UNREACHABLE_LOG_S:  # once in a while, not per request
                self._unreachable_logged = now
                logger.warning("Triton is not reachable at %s: %s", self.upstream_url, exc)
            return self._refuse(503, "unavailable", "the server is not available right now (restarting?); retry later")

    def _error_answer(self, body: bytes, upstream: aiohttp.ClientResponse) -> web.Response:
        """A whole 400 answer from Triton: as is, unless the model refused the request as
        overloaded (Triton 2.51's generate endpoint answers every model error with 400)."""
        if _overloaded(body):
            refused = self._refuse(503, "overloaded", json.loads(body)["error"])
            refused.headers["Retry-After"] = "1"
            return refused
        return web.Response(status=400, body=body, content_type=upstream.content_type)

    def _cancel(self, cancel_id: str) -> None:
        """Cancel the request named ``cancel_id`` in whichever model of the current server holds it."""
        pid = self.server_pid() if self.server_pid is not None else None
        if pid is None:
            return
        reached = cancel_on_server(pid, cancel_id)
        if not reached:  # a server launched through a wrapper (mpirun): its tritonserver is in its group
            reached = sum(cancel_on_server(member, cancel_id) for member in process_group_members(pid) if member != pid)
        self.cancelled += 1
        logger.info("HTTP client went away: cancelled request %s (%d model instance(s) told)", cancel_id, reached)

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse,
                     cancel_id: str | None = None) -> web.StreamResponse:
        head = b""
        if upstream.status == 400 and (upstream.content_length or 0) < 1 << 16:
            while not upstream.content.at_eof() and len(head) < 1 << 16:
                head += await upstream.content.read((1 << 16) - len(head))
            if upstream.content.at_eof():
                return self._error_answer(head, upstream)
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in upstream.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                response.headers.add(name, value)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        else:
            response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            if head:
                await response.write(head)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (ConnectionResetError, aiohttp.ClientPayloadError) as exc:  # one side went away mid-answer
            logger.info("relay ended early: %s", exc)
            if isinstance(exc, ConnectionResetError) and cancel_id is not None:  # the client's side
                self._cancel(cancel_id)
            upstream.close()
            return response
        await response.write_eof()
        return response


__all__ = ["DEFAULT_MAX_BODY_BYTES", "GuardConfig", "HttpGuard", "api_group", "integer_problem", "refusal",
           "with_cancel_id"]
