"""Shared fixtures: a real Mosquitto on a free loopback port, buses, and service processes.

Everything a test starts is stopped by PID when the test ends; every wait is bounded in time.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from edgeswarm.bus import Bus
from edgeswarm.local.broker import BrokerProcess, mosquitto_binary, start_broker
from edgeswarm.local.forkserver import ForkedProcess, ForkServer
from edgeswarm.settings import Settings
from edgeswarm.wire import Sender
from helpers import FAST_ENV

# The coordinator's closed loop re-plans a job whose devices run at other speeds than profiled: on 2 shared cores
# every emulated device does, unevenly, so a test's plan would change under it. Only the tests of the loop turn it
# on (tests/test_rebalance.py); every process a test starts inherits this.
os.environ.setdefault("EDGESWARM_REBALANCE", "false")

# The slowest test files, slowest first (measured on the 2-core VM on 2026-12-05: 212 s down to 24 s each). `make test`
# hands xdist the files in collection order (--no-loadscope-reorder), and these come first: the long files start
# early and the short ones fill in at the end. xdist's own order, the files with the most tests first, left the files
# of one to three long tests for last, where one worker finished such a file while the others had nothing left. A
# file missing here, or a list out of date, costs only that balance.
SLOWEST_FIRST = ("test_cli", "test_bench_peers", "test_recovery", "test_cli_faults", "test_netns_faults",
                 "test_workload_contract", "test_hmp_serving", "test_plugins", "test_splitfed_cluster",
                 "test_cli_errors", "test_zoo_training", "test_netns_cli", "test_serve_rebalance", "test_security",
                 "test_deploy", "test_serving", "test_rebalance", "test_export", "test_fuzz_handlers", "test_liveness",
                 "test_plan_cli", "test_profiler_compute", "test_netns_shaping", "test_chaos", "test_splitfed_refit",
                 "test_install", "test_profiler_service", "test_dashboard")


def pytest_configure(config: pytest.Config) -> None:
    # Without Mosquitto every broker test would fail on connection errors. Checked in the main process before any
    # xdist worker starts: raised in a worker, the message drowned in an INTERNALERROR and "no tests ran".
    if not hasattr(config, "workerinput") and mosquitto_binary() is None:
        raise pytest.UsageError("the test suite needs mosquitto on PATH: `make test` installs it as root, or "
                                "sudo apt-get install -y mosquitto mosquitto-clients")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's tests keep their order


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, mode)  # released when the file closes
        yield


@contextmanager
def _gate(item: pytest.Item) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` runs while no other worker runs a test (its fixtures included),
    so that what it measures (speed ratios, heartbeat gaps under its own load) is not the other workers' load; the
    others share the gate. The turnstile lets an ``alone`` test in even while the other workers go from test to
    test: it holds the turnstile while it waits, and every test passes the turnstile before it takes its share."""
    # Not the PYTEST_XDIST_WORKER variable: a pytest that a test starts inherits it without being a worker.
    if not hasattr(item.config, "workerinput"):
        yield
        return
    # xdist gives each worker a basetemp inside the session's own, which no other session shares.
    root = Path(item.config.option.basetemp).parent
    turnstile, gate = root / "alone.turnstile", root / "alone.gate"
    if item.get_closest_marker("alone") is not None:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(gate, fcntl.LOCK_EX):
            yield
        return
    with _flock(turnstile, fcntl.LOCK_EX):
        pass
    with _flock(gate, fcntl.LOCK_SH):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # The whole protocol (setup, call, teardown), so that the other workers' module fixtures (clusters) do not
    # start or stop while an ``alone`` test runs.
    with _gate(item):
        yield


@pytest.fixture(autouse=True, scope="session")
def _no_home_folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Whatever a test or a service it starts caches or keeps by default (profiles, saved speeds, checkpoints) goes to
    a temporary folder, never the home directory's; and what it keeps in the system's temporary folder (a cluster's
    logs, the nodes' heartbeats and memory ledgers) goes to one of the session's, which pytest prunes, not /tmp."""
    base = tmp_path_factory.mktemp("xdg")
    (base / "tmp").mkdir()
    names = ("XDG_CACHE_HOME", "XDG_DATA_HOME", "TMPDIR")
    saved = {k: os.environ.get(k) for k in names}
    saved_tempdir = tempfile.tempdir
    for key, folder in zip(names, ("cache", "data", "tmp"), strict=True):
        os.environ[key] = str(base / folder)
    tempfile.tempdir = str(base / "tmp")  # this process's gettempdir() was cached before the variable changed
    yield
    tempfile.tempdir = saved_tempdir
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _cli_log_handlers() -> Iterator[None]:
    """A command run in-process (``main([...])``) points the root logger at the test's captured stderr, which pytest
    closes when the test ends: a later record from a thread still running (a module's cluster going down) would hit
    the closed file. Drop the plain stderr handlers a test added."""
    root = logging.getLogger()
    before = set(root.handlers)
    yield
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A Mosquitto on a free port of 127.0.0.1, stopped after the test."""
    proc = start_broker("mosquitto", workdir=tmp_path / "broker")
    try:
        yield proc
    finally:
        proc.stop()


def bus_settings(hub_url: str, **overrides: object) -> Settings:
    """Settings for an in-test bus: the hub, small timeouts."""
    values: dict[str, object] = {"hub_url": hub_url, "request_timeout_s": 5.0, "publish_timeout_s": 10.0,
                                 "heartbeat_interval_s": 0.25, "keepalive_s": 2}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def make_bus(broker: BrokerProcess) -> Iterator[Callable[..., Bus]]:
    """``make_bus(node, service="svc", **settings)``: a started Bus on the test broker, stopped after the test."""
    buses: list[Bus] = []

    def make(node: str, service: str = "svc", **overrides: object) -> Bus:
        settings = bus_settings(str(overrides.pop("hub_url", broker.url)), **overrides)
        bus = Bus(settings, Sender(node=node, service=service, instance=uuid.uuid4().hex[:12]))
        bus.start(timeout_s=10)
        buses.append(bus)
        return bus

    try:
        yield make
    finally:
        for bus in buses:
            bus.stop()


class ServiceProcesses:
    """Starts ``edgeswarm service NAME`` processes (forked by this worker's fork server, as a local cluster's are)
    and stops every one of them by PID."""

    def __init__(self, tmp_path: Path, forks: ForkServer) -> None:
        self._tmp = tmp_path
        self._forks = forks
        self.procs: list[ForkedProcess] = []

    def start(self, service: str, node: str, hub_url: str, **env: str) -> ForkedProcess:
        full = dict(os.environ)
        full.update(FAST_ENV)
        full.update({"EDGESWARM_NODE_ID": node, "EDGESWARM_HUB_URL": hub_url})
        full.update(env)
        proc = self._forks.spawn(service, full, self._tmp / f"{node}.{service}.{len(self.procs)}.log")
        self.procs.append(proc)
        return proc

    def log_of(self, proc: ForkedProcess) -> str:
        index = self.procs.index(proc)
        found = list(self._tmp.glob(f"*.{index}.log"))
        return found[0].read_text(errors="replace") if found else ""

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, 18)  # SIGCONT, in case a test stopped it
                except ProcessLookupError:
                    pass
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture(scope="session")
def forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This worker's fork server: edgeswarm and torch imported once for every service process a test starts."""
    server = ForkServer(tmp_path_factory.mktemp("forkserver") / "forkserver.log")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def up() -> Iterator[list[Any]]:
    """Where a test puts the ``edgeswarm up`` clusters it starts (tests/test_cli.py's ``Up``): each is stopped after
    the test, by SIGTERM to its PID."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for cluster in started:
            cluster.stop()


@pytest.fixture
def services(tmp_path: Path, forks: ForkServer) -> Iterator[ServiceProcesses]:
    """Service processes, all stopped (SIGTERM, then SIGKILL) after the test."""
    procs = ServiceProcesses(tmp_path, forks)
    try:
        yield procs
    finally:
        procs.stop_all()
