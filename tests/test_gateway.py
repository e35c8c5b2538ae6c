"""The gateway's HTTP side on its own (``gateway.server`` over a stand-in backend, no cluster): who may use it, the
OpenAI request checks and error shape, what a stream writes, and a client that goes away cancelling its request.
The whole path over a cluster is in ``test_hmp_serving.py``."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from edgeswarm.dashboard.auth import check_exposure
from edgeswarm.errors import ConfigError
from edgeswarm.gateway.backend import Prompt, TextDelta, TextDone, TextEvent, TextFailed
from edgeswarm.gateway.server import GatewayServer
from edgeswarm.values.sampling import Sampling

TOKEN = "t" * 32


class Backend:
    """One model, "m", answering "hello world" in two deltas; records what it was asked and whether the client was
    still there at each step."""

    def __init__(self, steps: int = 2, step_s: float = 0.0, fail: str | None = None) -> None:
        self.steps, self.step_s, self.fail = steps, step_s, fail
        self.asked: list[tuple[Prompt, Sampling, list[str], int | None]] = []
        self.alive: list[bool] = []
        self.closed = threading.Event()
        self.counts: list[str] = []

    def models(self) -> list[tuple[str, float]]:
        return [("m", 1700000000.0)]

    def counted(self, what: str) -> None:
        self.counts.append(what)

    def generate(self, model: str, prompt: Prompt, *, request_id: str, new_tokens: int | None, sampling: Sampling,
                 stop: list[str], alive: Callable[[], bool]) -> Generator[TextEvent, None, None]:
        self.asked.append((prompt, sampling, stop, new_tokens))
        try:
            if self.fail:
                yield TextFailed(reason=self.fail, detail=f"it failed: {self.fail}")
                return
            text = ""
            for k in range(self.steps):
                time.sleep(self.step_s)
                self.alive.append(alive())
                if not self.alive[-1]:
                    yield TextFailed(reason="cancelled", detail="the caller went away")
                    return
                piece = "hello" if k == 0 else " world" if k == 1 else "!"
                yield TextDelta(offset=len(text), text=piece)
                text += piece
            yield TextDone(text=text, finish="length", prompt_tokens=3, completion_tokens=self.steps)
        finally:
            self.closed.set()


def serving(backend: Backend, token: str | None = None) -> Iterator[str]:
    server = GatewayServer("127.0.0.1", 0, token, backend)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def api() -> Iterator[tuple[str, Backend]]:
    backend = Backend()
    for url in serving(backend):
        yield url, backend


def call(url: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
            return resp.status, json.loads(text) if resp.headers.get("Content-Type") == "application/json" else text
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


CHAT = {"model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}


def test_models_and_a_whole_chat_answer_in_openai_shape(api: tuple[str, Backend]) -> None:
    url, backend = api
    assert call(url, "/models") == (200, {"object": "list", "data": [
        {"id": "m", "object": "model", "created": 1700000000, "owned_by": "edgeswarm"}]})
    status, answer = call(url, "/chat/completions", {**CHAT, "max_tokens": 2, "temperature": 0, "stop": "END",
                                                    "top_k": 5, "seed": 9})
    assert status == 200 and answer["object"] == "chat.completion" and answer["model"] == "m"
    assert answer["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None,
                                  "message": {"role": "assistant", "content": "hello world"}}]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    prompt, sampling, stop, new = backend.asked[-1]
    assert [(m.role, m.content) for m in prompt] == [("system", "Be brief."), ("user", "Hi")]  # type: ignore[union-attr]
    assert (sampling.temperature, sampling.top_k, sampling.seed, stop, new) == (0.0, 5, 9, ["END"], 2)
    # OpenAI's defaults: sampling at temperature 1, a seed of its own each request.
    call(url, "/completions", {"model": "m", "prompt": [1, 2, 3]})
    call(url, "/completions", {"model": "m", "prompt": "x"})
    (_, first, _, new), (_, second, _, _) = backend.asked[-2:]
    assert first.temperature == 1.0 and new == 16 and first.seed != second.seed
    assert backend.counts.count("chat.ok") == 1 and backend.counts.count("completions.ok") == 2


def test_a_stream_is_server_sent_events_ending_done(api: tuple[str, Backend]) -> None:
    url, _ = api
    status, text = call(url, "/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    events = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["total_tokens"] == 5
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    status, text = call(url, "/completions", {"model": "m", "prompt": "x", "stream": True})
    pieces = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line and "[DONE]" not in line]
    assert "".join(p["choices"][0]["text"] for p in pieces) == "hello world"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({**CHAT, "model": "nope"}, 404, None),
    ({**CHAT, "temperature": 2.5}, 400, "temperature"),
    ({**CHAT, "n": 2}, 400, "n"),
    ({**CHAT, "logprobs": True}, 400, "logprobs"),
    ({**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "m"}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
])
def test_requests_it_cannot_answer_are_refused_in_openais_error_shape(api: tuple[str, Backend], body: Any,
                                                                      status: int, param: str | None) -> None:
    url, backend = api
    got, answer = call(url, "/chat/completions", body)
    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["param"] == param or (param and answer["error"]["param"].startswith(param)), answer
    assert not backend.asked  # nothing reached the cluster


def test_bodies_paths_and_failures(api: tuple[str, Backend]) -> None:
    url, _ = api
    assert call(url, "/chat/completions", raw=b"{not json")[0] == 400
    assert call(url, "/embeddings", {"model": "m"})[0] == 404
    assert call(url, "/nothing")[0] == 404
    # A body above the cap is refused from its Content-Length, before it is read.
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (5 << 20))
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
    for reason, status in (("busy", 429), ("failed", 500), ("not_serving", 503)):
        backend = Backend(fail=reason)
        for other in serving(backend):
            got, answer = call(other, "/completions", {"model": "m", "prompt": "x"})
            assert got == status and answer["error"]["code"] == reason, answer


def test_beyond_loopback_it_needs_a_token_and_then_asks_every_request_for_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gateway would listen on '0.0.0.0'.*EDGESWARM_GATEWAY_TOKEN_FILE"):
        check_exposure("0.0.0.0", None, what="the gateway", setting="EDGESWARM_GATEWAY_TOKEN_FILE")
    backend = Backend()
    for url in serving(backend, TOKEN):
        status, answer = call(url, "/models")
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        assert call(url, "/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(url, "/models", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200


def test_a_client_that_closes_its_connection_stops_its_request() -> None:
    """Mid-stream (and while a whole answer is awaited), the backend hears the client is gone and the generator is
    closed: the cluster's request is cancelled, not left running."""
    for stream in (True, False):
        backend = Backend(steps=50, step_s=0.05)
        for url in serving(backend):
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            body = json.dumps({"model": "m", "prompt": "x", "stream": stream}).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                if stream:
                    got = b""
                    while b"data: " not in got:
                        got += sock.recv(4096)
                else:
                    time.sleep(0.2)
            assert backend.closed.wait(10), stream
            assert len(backend.alive) < 25, (stream, backend.alive)  # stopped within about a second, not at 50
