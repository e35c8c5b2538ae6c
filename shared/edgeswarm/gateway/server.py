"""The gateway's HTTP server: an OpenAI-compatible API over the cluster's serve-hmp jobs (the standard library's
threading server, as the dashboard's).

Paths: ``GET /v1/models`` (the decoders being served, each named by its job), ``POST /v1/chat/completions`` and
``POST /v1/completions`` (``openai_api``), whole or streamed as server-sent events (``data: {chunk}``, ending
``data: [DONE]``). Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``). With a token
every request needs ``Authorization: Bearer TOKEN`` (401 otherwise). Limits: ``MAX_CONNECTIONS`` requests at once,
bodies of at most ``MAX_BODY_BYTES`` with a Content-Length, ``READ_TIMEOUT_S`` to send a request. A client that goes
away (its connection closed while it waits, or a stream it stopped reading) has its request cancelled on the
cluster. A failing handler answers 500 in the error shape; no traceback reaches a client.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from pydantic import ValidationError

from edgeswarm.dashboard.auth import offered_token, token_matches
from edgeswarm.dashboard.server import BoundedHTTPServer, http_url, listen, serve_in_thread
from edgeswarm.gateway.backend import Prompt, TextDelta, TextDone, TextEvent, TextFailed, TextModels
from edgeswarm.gateway.openai_api import Answer, ApiError, ChatRequest, CompletionRequest, model_entry
from edgeswarm.logs import RateLimitedLog

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
MAX_BODY_BYTES = 4 << 20
MAX_HEAD_BYTES = 16 * 1024
READ_TIMEOUT_S = 30.0
# An answer's InferError reason -> the HTTP status and error type a client of OpenAI's API expects.
_REASONS: dict[str, tuple[int, str]] = {
    "busy": (429, "rate_limit_error"), "unknown_job": (404, "not_found_error"), "not_serving": (503, "server_error"),
    "bad_shape": (400, "invalid_request_error"), "bad_dtype": (400, "invalid_request_error"),
    "too_large": (400, "invalid_request_error"), "no_tensor": (400, "invalid_request_error"),
    "failed": (500, "server_error"), "timeout": (504, "server_error"), "cancelled": (499, "server_error")}


class Backend(TextModels, Protocol):
    """What the server asks of the cluster (the gateway service, over every kind's text models; a test's stand-in)."""

    def counted(self, what: str) -> None:
        """Count one request (``what``: the endpoint and its outcome) in the service's metrics."""


def _failure(failed: TextFailed) -> ApiError:
    status, kind = _REASONS.get(failed.reason, (500, "server_error"))
    return ApiError(status, failed.detail or failed.reason, kind=kind, code=failed.reason)


class _Handler(BaseHTTPRequestHandler):
    server: BoundedHTTPServer
    timeout = READ_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "edgeswarm-gateway"
    sys_version = ""

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.client_address[0], *args)

    @property
    def app(self) -> GatewayServer:
        app: GatewayServer = self.server.app
        return app

    def do_GET(self) -> None:
        self._dispatch(self._get)

    def do_POST(self) -> None:
        self._dispatch(self._post)

    def _dispatch(self, route: Callable[[], None]) -> None:
        try:
            if sum(len(k) + len(v) for k, v in self.headers.items()) > MAX_HEAD_BYTES:
                raise ApiError(431, "request headers too large")
            token = self.app.token
            if token is not None and not token_matches(token, offered_token(self.headers.get("Authorization"),
                                                                             None)):
                raise ApiError(401, "this API needs its token: send 'Authorization: Bearer TOKEN' (the OpenAI client's "
                                    "api_key; EDGESWARM_GATEWAY_TOKEN_FILE holds it)",
                               kind="authentication_error", code="invalid_api_key")
            route()
        except ApiError as exc:
            self.app.backend.counted(f"refused.{exc.status}")
            self._json(exc.status, exc.body())
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception:
            self.app.errors.log(logging.ERROR, "handler", "gateway: %s %s failed", self.command, self.path[:200],
                                exc_info=True)
            try:
                self._json(500, ApiError(500, "internal error (see the gateway's log)", kind="server_error").body())
            except OSError:
                self.close_connection = True

    # --- routes ----------------------------------------------------------------------------------------------

    def _get(self) -> None:
        if self.path.split("?", 1)[0].rstrip("/") != "/v1/models":
            raise ApiError(404, f"no such path: {self.path[:200]}", kind="not_found_error")
        models = [model_entry(name, created) for name, created in self.app.backend.models()]
        self._json(200, {"object": "list", "data": models})

    def _post(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in ("/v1/chat/completions", "/v1/completions"):
            raise ApiError(404, f"no such path: {self.path[:200]}", kind="not_found_error")
        chat = path == "/v1/chat/completions"
        body = self._body()
        try:
            request: ChatRequest | CompletionRequest = (ChatRequest if chat else CompletionRequest).model_validate(
                body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            raise ApiError(400, f"{param or 'request'}: {first.get('msg', 'invalid')}", param=param) from None
        if request.model not in {name for name, _ in self.app.backend.models()}:
            raise ApiError(404, f"the model {request.model!r} does not exist: GET /v1/models lists the models being "
                                "served (a serve-hmp job's name)", kind="not_found_error", code="model_not_found")
        prompt: Prompt = request.conversation() if isinstance(request, ChatRequest) else request.prompt
        kind = "chat" if chat else "completions"
        answer = Answer(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model=request.model, chat=chat)
        events = self.app.backend.generate(request.model, prompt, request_id=answer.id[-32:],
                                           new_tokens=request.new_tokens(), sampling=request.sampling(),
                                           stop=request.stops(), alive=self._alive)
        try:  # closed however it ends: a request the client left mid-stream is cancelled on the cluster
            if request.stream:
                self._stream(answer, events, request.usage_in_stream, kind)
                return
            final = next(e for e in events if not isinstance(e, TextDelta))
            if isinstance(final, TextFailed):
                raise _failure(final)
            assert isinstance(final, TextDone)
            self.app.backend.counted(f"{kind}.ok")
            self._json(200, answer.whole(final.text, final.finish, final.prompt_tokens, final.completion_tokens))
        finally:
            events.close()

    def _stream(self, answer: Answer, events: Iterator[TextEvent], usage: bool, kind: str) -> None:
        first = next(events)  # the request's first token, or why there is none, before any header goes out
        if isinstance(first, TextFailed):
            raise _failure(first)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent, whole = 0, True  # characters written; False once a delta was lost (the answer has the rest)
        if answer.chat:
            self._event(answer.chunk("", first=True))
        for event in _chain(first, events):
            if isinstance(event, TextDelta):
                whole = whole and event.offset == sent
                if whole and event.text:
                    self._event(answer.chunk(event.text))
                    sent += len(event.text)
                continue
            if isinstance(event, TextFailed):  # failed after it began: the error in OpenAI's shape, as an event
                self._event(_failure(event).body())
                break
            if len(event.text) > sent:
                self._event(answer.chunk(event.text[sent:]))
            self._event(answer.chunk(None, event.finish))
            if usage:
                self._event(answer.usage_chunk(event.prompt_tokens, event.completion_tokens))
            self.app.backend.counted(f"{kind}.ok")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    # --- input and output ---------------------------------------------------------------------------------

    def _body(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            raise ApiError(411, "send the request body with a Content-Length, not chunked")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a request body needs a Content-Length") from None
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, f"a request body holds at most {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"the body is not JSON: {exc}") from None

    def _alive(self) -> bool:
        """Whether the client is still there: its socket has not been closed (the whole request was read, so
        anything readable now is the end of it)."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return not readable or sock.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False

    def _event(self, data: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, data: dict[str, Any]) -> None:
        body = json.dumps(data, ensure_ascii=False).encode()
        self.send_response(status)
        if status >= 400:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _chain(first: TextEvent, rest: Iterator[TextEvent]) -> Iterator[TextEvent]:
    yield first
    yield from rest


class GatewayServer:
    """The HTTP side of the gateway over ``backend`` (called on request threads: it must be thread-safe). Raises
    ConfigError from ``bind`` when it cannot listen."""

    def __init__(self, host: str, port: int, token: str | None, backend: Backend) -> None:
        self.host, self.port, self.token, self.backend = host, port, token, backend
        self.errors = RateLimitedLog(log, what="failed requests")
        self._httpd: BoundedHTTPServer | None = None

    def bind(self) -> None:
        """Take the address (port 0: a free one), answering nothing yet."""
        if self._httpd is not None:
            return
        self._httpd = listen(self.host, self.port, _Handler, self, what="the gateway",
                             setting="EDGESWARM_GATEWAY_PORT", max_connections=MAX_CONNECTIONS)
        self.port = self._httpd.server_address[1]

    def start(self) -> None:
        self.bind()
        assert self._httpd is not None
        serve_in_thread(self._httpd, "gateway-http")

    @property
    def url(self) -> str:
        """The API's base address, as an OpenAI client takes it (``.../v1``)."""
        return http_url(self.host, self.port, "/v1")

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
