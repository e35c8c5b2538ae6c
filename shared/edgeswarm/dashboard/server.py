"""The dashboard's HTTP server (the standard library's ThreadingHTTPServer): the page, its live snapshot, metrics and
traces.

Paths (all GET):

* ``/``: the page (``static/index.html``) and ``/static/NAME`` its script and style, shipped as package data;
* ``/api/events``: Server-Sent Events, one ``snapshot`` event with the whole snapshot (JSON) each time it changes,
  at most one every ``EDGESWARM_DASHBOARD_PUSH_INTERVAL_S``; a comment every ``KEEPALIVE_S`` otherwise. The page
  never polls: the server pushes;
* ``/api/snapshot``: the latest snapshot (JSON);
* ``/metrics``: the cluster's metrics in the Prometheus text format;
* ``/api/trace/JOB``: job JOB's measured spans as Chrome trace JSON (Perfetto opens it);
* ``/favicon.ico``: the page's icon (also ``/static/favicon.svg``), so a browser's own request for it is answered.

With a token, every path needs it (``auth``): 401 otherwise; ``/?token=TOKEN`` sets an HttpOnly cookie and
redirects to ``/``, so the page's own requests carry it. Limits: ``MAX_CONNECTIONS`` requests at once and
``MAX_STREAMS`` of them event streams (503 beyond), request heads of at most ``MAX_HEAD_BYTES``, no request bodies,
``READ_TIMEOUT_S`` to send a request. Every error answer (401, 404, a refused event stream's 503, ...) closes its
connection, so refused clients never keep holding the slots the others need (a scrape of ``/metrics`` among them).
A failing handler answers 500 with one line; no traceback reaches a client.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from edgeswarm.dashboard.auth import offered_token, session_cookie, token_matches
from edgeswarm.errors import ConfigError
from edgeswarm.logs import RateLimitedLog

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
MAX_STREAMS = 16
MAX_HEAD_BYTES = 16 * 1024
READ_TIMEOUT_S = 10.0
KEEPALIVE_S = 15.0
_JOB = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
_SECURITY_HEADERS = {
    # The page loads only its own files and talks only to this server; a token in the URL never leaks as a referrer.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


def static_files() -> dict[str, tuple[bytes, str]]:
    """The page's files shipped in the package: name -> (bytes, content type)."""
    out: dict[str, tuple[bytes, str]] = {}
    folder = resources.files("edgeswarm.dashboard").joinpath("static")
    for item in folder.iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1] if "." in item.name else ""
        if item.is_file() and suffix in _STATIC_TYPES:
            out[item.name] = (item.read_bytes(), _STATIC_TYPES[suffix])
    if "index.html" not in out:
        raise ConfigError("the dashboard's page (edgeswarm/dashboard/static/index.html) is not installed; reinstall "
                          "edgeswarm")
    return out


class Broadcast:
    """The latest snapshot, numbered, for every open event stream to wait on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq = 0
        self._data = b"{}"
        self._closed = False

    def publish(self, data: bytes) -> None:
        with self._cond:
            self._seq += 1
            self._data = data
            self._cond.notify_all()

    def latest(self) -> tuple[int, bytes]:
        with self._cond:
            return self._seq, self._data

    def wait(self, after: int, timeout_s: float) -> tuple[int, bytes | None]:
        """The snapshot after number ``after`` once there is one (``data`` None: ``timeout_s`` passed, or closed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > after or self._closed, timeout_s)
            if self._closed or self._seq <= after:
                return after, None
            return self._seq, self._data

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that takes at most ``max_connections`` requests at once (a short 503 beyond, with no
    thread) and logs a failed connection, rate-limited, on ``app.errors`` (the dashboard's and the gateway's)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], app: Any,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.app = app
        self._slots = threading.BoundedSemaphore(max_connections)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:  # too many at once: a short answer, no thread
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.app.errors.log(logging.WARNING, "connection", "request from %s failed", client_address[0],
                            exc_info=True)


def listen(host: str, port: int, handler: type[BaseHTTPRequestHandler], app: Any, *, what: str, setting: str,
           max_connections: int = MAX_CONNECTIONS) -> BoundedHTTPServer:
    """A server for ``app`` bound to ``host``:``port`` (0: a free port), answering nothing yet. Raises ConfigError
    naming ``what`` and its port ``setting`` when it cannot: another program holds the port, or the host is not this
    machine's."""
    try:
        return BoundedHTTPServer((host, port), handler, app, max_connections)
    except OSError as exc:
        raise ConfigError(f"{what} cannot listen on {host}:{port}: {exc.strerror or exc}; choose another {setting} "
                          "or stop what holds it") from None


def serve_in_thread(httpd: BoundedHTTPServer, name: str) -> threading.Thread:
    """Answer ``httpd``'s requests on a daemon thread of its own (started)."""
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.5}, name=name, daemon=True)
    thread.start()
    return thread


def http_url(host: str, port: int, path: str) -> str:
    """The address of ``path`` on a listener: a loopback one's as its address, an all-interfaces one's as this
    host's name."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


class _Handler(BaseHTTPRequestHandler):
    server: BoundedHTTPServer
    timeout = READ_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "edgeswarm-dashboard"
    sys_version = ""

    def version_string(self) -> str:
        return self.server_version  # no Python version for a stranger to look up

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.client_address[0], *args)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _dispatch(self, *, head: bool) -> None:
        try:
            self._route(head)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception:
            self.server.app.errors.log(logging.ERROR, "handler", "dashboard: %s %s failed", self.command,
                                       self.path[:200], exc_info=True)
            self.close_connection = True
            try:
                self._plain(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see the dashboard's log)\n", head)
            except OSError:
                pass

    # --- routing -------------------------------------------------------------------------------------------

    def _route(self, head: bool) -> None:
        app = self.server.app
        if sum(len(k) + len(v) for k, v in self.headers.items()) > MAX_HEAD_BYTES:
            self._plain(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request headers too large\n", head)
            return
        if self.headers.get("Content-Length", "0").strip() not in ("", "0") or self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._plain(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "requests carry no body\n", head)
            return
        parts = urlsplit(self.path)
        path = parts.path
        if app.token is not None:
            query_token = parse_qs(parts.query).get("token", [None])[0] if parts.query else None
            if path in ("/", "/index.html") and query_token is not None:
                if token_matches(app.token, query_token):
                    self.send_response(HTTPStatus.SEE_OTHER)
                    self.send_header("Set-Cookie", session_cookie(app.token))
                    self.send_header("Location", "/")
                    self._common_headers(0)
                    self.end_headers()
                    return
                self._unauthorized(head)
                return
            if not token_matches(app.token, offered_token(self.headers.get("Authorization"),
                                                          self.headers.get("Cookie"))):
                self._unauthorized(head)
                return
        if path in ("/", "/index.html"):
            self._static("index.html", head)
        elif path == "/favicon.ico":
            self._static("favicon.svg", head)
        elif path.startswith("/static/"):
            self._static(path.removeprefix("/static/"), head)
        elif path == "/api/snapshot":
            self._send(HTTPStatus.OK, app.broadcast.latest()[1], "application/json", head)
        elif path == "/api/events":
            self._events(head)
        elif path == "/metrics":
            self._send(HTTPStatus.OK, app.metrics(), app.metrics_type, head)
        elif path.startswith("/api/trace/"):
            job = path.removeprefix("/api/trace/")
            if not _JOB.fullmatch(job):
                self._plain(HTTPStatus.BAD_REQUEST, "a job id is 1-64 letters, digits, '.', '_' or '-'\n", head)
                return
            try:
                body = app.trace(job)
            except KeyError:
                self._plain(HTTPStatus.NOT_FOUND, f"no spans of job {job} (yet)\n", head)
                return
            self._send(HTTPStatus.OK, body, "application/json", head,
                       extra={"Content-Disposition": f'attachment; filename="{job}.trace.json"'})
        else:
            self._plain(HTTPStatus.NOT_FOUND, "not found\n", head)

    def _events(self, head: bool) -> None:
        app = self.server.app
        if not app.streams.acquire(blocking=False):
            self._plain(HTTPStatus.SERVICE_UNAVAILABLE, "too many open dashboards; close one\n", head)
            return
        try:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("X-Accel-Buffering", "no")
            self._common_headers(None)
            self.end_headers()
            self.close_connection = True
            if head:
                return
            seq = -1
            self.wfile.write(b"retry: 2000\n\n")
            while not app.broadcast.closed:
                seq, data = app.broadcast.wait(seq, KEEPALIVE_S)
                if data is None:
                    self.wfile.write(b": keepalive\n\n")
                else:
                    self.wfile.write(b"id: %d\nevent: snapshot\ndata: %s\n\n" % (seq, data))
                self.wfile.flush()
        finally:
            app.streams.release()

    # --- answers -------------------------------------------------------------------------------------------

    def _common_headers(self, length: int | None) -> None:
        for key, value in _SECURITY_HEADERS.items():
            self.send_header(key, value)
        if length is not None:
            self.send_header("Content-Length", str(length))

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, head: bool,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if status >= 400:
            self._closing()
        self.send_header("Content-Type", content_type)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self._common_headers(len(body))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _plain(self, status: HTTPStatus, text: str, head: bool) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8", head)

    def _closing(self) -> None:
        # A kept-alive connection holds its slot while it idles for the next request (up to READ_TIMEOUT_S): one that
        # was refused has nothing more to ask.
        self.close_connection = True
        self.send_header("Connection", "close")

    def _unauthorized(self, head: bool) -> None:
        self.send_response(HTTPStatus.UNAUTHORIZED)
        self._closing()
        self.send_header("WWW-Authenticate", 'Bearer realm="edgeswarm dashboard"')
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        body = (b"this dashboard needs its token: open /?token=TOKEN once, or send 'Authorization: Bearer TOKEN' "
                b"(EDGESWARM_DASHBOARD_TOKEN_FILE holds it)\n")
        self._common_headers(len(body))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _static(self, name: str, head: bool) -> None:
        found = self.server.app.files.get(name)
        if found is None:
            self._plain(HTTPStatus.NOT_FOUND, "not found\n", head)
            return
        self._send(HTTPStatus.OK, found[0], found[1], head)


class DashboardServer:
    """The HTTP side of the dashboard. ``metrics`` and ``trace`` are called on request threads: they must be
    thread-safe (the collectors' are). Raises ConfigError from ``start`` when it cannot listen."""

    def __init__(self, host: str, port: int, token: str | None, *, metrics: Callable[[], bytes], metrics_type: str,
                 trace: Callable[[str], bytes]) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.metrics = metrics
        self.metrics_type = metrics_type
        self.trace = trace
        self.broadcast = Broadcast()
        self.streams = threading.BoundedSemaphore(MAX_STREAMS)
        self.files = static_files()
        self.errors = RateLimitedLog(log, what="failed requests")
        self._httpd: BoundedHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def bind(self) -> None:
        """Take the address (and with port 0, a free port), answering nothing yet. Raises ConfigError when it
        cannot: another program holds the port, or the host is not this machine's."""
        if self._httpd is not None:
            return
        self._httpd = listen(self.host, self.port, _Handler, self, what="the dashboard",
                             setting="EDGESWARM_DASHBOARD_PORT (--port)")
        self.port = self._httpd.server_address[1]

    def start(self) -> None:
        """Bind (unless done) and answer requests on a thread of its own."""
        self.bind()
        assert self._httpd is not None
        self._thread = serve_in_thread(self._httpd, "dashboard-http")

    @property
    def url(self) -> str:
        """The page's address (a loopback listener's as 127.0.0.1; an all-interfaces one's as this host's name)."""
        return http_url(self.host, self.port, "/")

    def publish(self, snapshot_json: bytes) -> None:
        self.broadcast.publish(snapshot_json)

    def stop(self) -> None:
        self.broadcast.close()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
