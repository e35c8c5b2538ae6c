"""A user's mistake never shows a traceback: a bad hub URL, a bad EDGESWARM_* value, output piped into `head`, a port
already taken. Each ends in one actionable line on stderr and a non-zero exit; every command runs as a real process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import edgeswarm.messages as m
from edgeswarm.local.broker import BrokerProcess, free_port
from helpers import FAST_ENV

ENV = {**os.environ, **FAST_ENV, "COLUMNS": "200"}
ES = [sys.executable, "-m", "edgeswarm"]

JOB = """name: mistakes
model: {name: mlp, config: {hidden: 8, layers: 1}}
data: {kind: teacher, size: 64, test_size: 16}
global_batch: 8
micro_batches: 1
optimizer: {name: sgd, lr: 0.1}
rounds: 1
"""


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ES, *args], env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def assert_one_line(result: subprocess.CompletedProcess[str], *says: str) -> None:
    """A non-zero exit, no traceback, and exactly one stderr line that says each of ``says``."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in says:
        assert text in lines[0], lines[0]


@pytest.fixture(scope="module")
def job_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("job") / "job.yaml"
    path.write_text(JOB)
    return str(path)


BAD_URLS = [
    ("foo://x", ("--hub", "is not of the form mqtt://host:port")),
    ("mqtt://host:notaport", ("--hub", "has an invalid port")),
    ("mqtt://no-such-host.invalid:1883", ("no-such-host.invalid", "does not resolve", "--hub")),
    ("REFUSED", ("connection refused", "--hub", "edgeswarm up --local")),
]


@pytest.mark.parametrize("command", ["status", "train", "watch"])
@pytest.mark.parametrize(("url", "says"), BAD_URLS, ids=["scheme", "port", "unresolvable", "refused"])
def test_a_bad_hub_url_is_one_line(command: str, url: str, says: tuple[str, ...], job_file: str) -> None:
    if url == "REFUSED":
        url = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there
    args = [command, job_file] if command == "train" else [command]
    assert_one_line(run(*args, "--hub", url), *says)


@pytest.mark.parametrize("command", [("status",), ("service", "node-agent")], ids=["status", "service"])
@pytest.mark.parametrize(("variable", "value", "expects"), [
    ("EDGESWARM_HEARTBEAT_INTERVAL_S", "abc", "a valid number"),
    ("EDGESWARM_MQTT_PROTOCOL", "7", "'auto', '5' or '3.1.1'"),
    ("EDGESWARM_LOG_LEVEL", "loud", "expected a logging level"),
], ids=["number", "choice", "log-level"])
def test_a_bad_setting_names_the_variable_and_what_it_expects(command: tuple[str, ...], variable: str, value: str,
                                                               expects: str) -> None:
    result = run(*command, env={variable: value, "EDGESWARM_NODE_ID": "n1"})
    assert result.returncode == 2
    assert_one_line(result, f"{variable}={value!r}", expects)


def test_a_secret_setting_is_named_but_not_echoed() -> None:
    result = run("status", env={"EDGESWARM_MQTT_PASSWORD": "hunter2", "EDGESWARM_MQTT_PASSWORD_FILE": "/nowhere"})
    assert_one_line(result, "EDGESWARM_MQTT_PASSWORD")
    assert "hunter2" not in result.stderr


def _closed_pipe_run(*args: str) -> subprocess.CompletedProcess[str]:
    """``args`` with stdout a pipe whose reader has already gone: the first write fails, every time."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([*ES, *args], env=ENV, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)


def _quiet_exit(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 141, result.stderr  # as a process that SIGPIPE ended
    assert result.stderr == "", result.stderr  # no traceback, no "Exception ignored ... BrokenPipeError"


@pytest.mark.parametrize("args", [("topics",), ("topics", "--json")], ids=["table", "json"])
def test_output_into_a_closed_pipe_ends_quietly(args: tuple[str, ...]) -> None:
    _quiet_exit(_closed_pipe_run(*args))


def test_topics_into_head() -> None:
    shell = f"set -o pipefail; {' '.join(ES)} topics --json | head -1"
    result = subprocess.run(["bash", "-c", shell], env=ENV, capture_output=True, text=True, timeout=60)
    assert result.stdout == "[\n" and result.stderr == "", result.stderr
    assert result.returncode in (0, 141)  # 0 when all of it fit the pipe before head left


@pytest.fixture
def chatter(broker: BrokerProcess, make_bus) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """A bus publishing a small message every 50 ms on the test broker until the test ends."""
    bus = make_bus("chatty", "svc")
    stop = threading.Event()

    def talk() -> None:
        seq = 0
        while not stop.wait(0.05):
            bus.publish("edgeswarm/chatter", m.BenchData(run_id="chat", seq=seq), qos=0)
            seq += 1

    thread = threading.Thread(target=talk, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def test_watch_into_head_ends_quietly(broker: BrokerProcess, chatter: None) -> None:
    shell = f"{' '.join(ES)} watch --hub {broker.url} --timeout 60 | head -2; echo \"status=${{PIPESTATUS[0]}}\""
    result = subprocess.run(["bash", "-c", shell], env=ENV, capture_output=True, text=True, timeout=90)
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all("edgeswarm.bench.data" in line for line in lines[:2]), result.stdout
    assert lines[2] == "status=141" and result.stderr == "", result.stderr


def test_up_on_a_port_already_taken_says_to_pick_another() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run("up", "--local", "--devices", "1", "--port", str(port))
    assert result.returncode == 2
    assert_one_line(result, f"port {port}", "already in use", "--port 0")


@pytest.mark.parametrize("command", [("bench", "training"), ("bench", "transport"), ("profile", "--model", "lenet5")],
                         ids=["bench-training", "bench-transport", "profile"])
def test_an_out_file_that_cannot_be_written_is_refused_before_the_work(command: tuple[str, ...],
                                                                        tmp_path: Path) -> None:
    """A bench runs for minutes before it writes its report: an --out that is a folder, or under a file, is refused
    at once (argparse's usage, then its one error line), not after the work with a traceback."""
    (tmp_path / "file").write_text("")
    for out, says in ((tmp_path, "is a folder: give a file name in it"),
                      (tmp_path / "file" / "report.json", "is a file, not a folder")):
        result = run(*command, "--out", str(out), timeout=30)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        error = result.stderr.strip().splitlines()[-1]
        assert f"error: argument --out: {out}" in error and says in error, result.stderr
