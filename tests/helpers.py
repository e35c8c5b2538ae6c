"""Helpers the tests import (fixtures live in conftest.py)."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

# Fast liveness for tests: heartbeats every 0.25 s, suspect after 0.75 s of silence.
# Service processes in tests: failures detected in a couple of seconds, metrics often enough for the dashboard's checks.
# No faster: an idle `up --local` cluster of three devices (17 processes) burns 17% of a core at 0.25 s / 0.5 s, 9% at
# these, and the suite is CPU-bound on two cores.
FAST_ENV = {
    "EDGESWARM_HEARTBEAT_INTERVAL_S": "0.5",
    "EDGESWARM_METRICS_INTERVAL_S": "1.0",
    "EDGESWARM_KEEPALIVE_S": "2",
    "EDGESWARM_LOG_LEVEL": "INFO",
}


def wait_serving(follower: Any, timeout_s: float, message: str = "the job serving") -> Any:
    """Wait until the job ``follower`` follows serves or fails (at most ``timeout_s`` seconds), and assert it serves;
    its state."""
    wait_until(lambda: follower.state is not None and follower.state.status in ("running", "failed"), timeout_s,
               message=message)
    state = follower.state
    assert state is not None and state.status == "running", state
    return state


def wait_for_peers(bus: Any, nodes: Iterable[str], services: Iterable[str],
                   hub_services: Iterable[str] = ("planner", "coordinator"), timeout_s: float = 30.0) -> None:
    """Wait until ``bus`` sees each of ``services`` online on every one of ``nodes``, and ``hub_services`` on the hub
    (``timeout_s`` seconds for each)."""
    for node in nodes:
        for service in services:
            bus.peers.wait_for(node, service, timeout_s=timeout_s)
    for service in hub_services:
        bus.peers.wait_for("hub", service, timeout_s=timeout_s)


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05,
               message: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.1f} s waiting for {message}")


def wait_for_event(events: list[Any], kind: str, starts: str, timeout_s: float = 10.0) -> str:
    """The detail of the last event of ``kind`` in ``events`` (a JobFollower's list) once it starts with ``starts``,
    waiting up to ``timeout_s`` seconds: a job's events and its state go on two topics, which MQTT orders only each
    on its own, so an event the job sent before it ended can arrive after the final state a follower returned on."""

    def last() -> str | None:
        details = [e.detail for e in list(events) if e.kind == kind]
        return details[-1] if details and details[-1].startswith(starts) else None

    wait_until(last, timeout_s, message=f"a {kind} event starting {starts!r}")
    return last() or ""


def reference_weights(job, rounds: int, *, optimizer: bool = False) -> dict:  # type: ignore[no-untyped-def]
    """``job`` (a JobSpec of a classification task) trained for ``rounds`` rounds in this process on one
    device, in the rounds' sample order: the weights (state dict) an uninterrupted distributed run ends with (with
    ``optimizer``, and the optimizer's state as a checkpoint holds it)."""
    import torch

    from edgeswarm.data import open_dataset
    from edgeswarm.data.base import round_sample_ids
    from edgeswarm.hpp.spec import make_optimizer
    from edgeswarm.models.zoo import build_model

    model = build_model(job.model)
    opt = make_optimizer(job.optimizer, model.parameters())
    dataset = open_dataset(job.data, job.model)
    for r in range(rounds):
        x, y = dataset.batch(round_sample_ids(r, job.global_batch, dataset.train_size, job.seed))
        opt.zero_grad()
        (torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / job.global_batch).backward()
        opt.step()
    if optimizer:
        from edgeswarm.state.units import checkpoint_tensors

        return checkpoint_tensors(model, opt)
    return {k: v.detach() for k, v in model.state_dict().items()}


def parse_job_text(text: str, *, source: str = "the job spec") -> Any:
    """A train-hpp JobSpec from the text of a YAML or JSON spec (YAML parses JSON too). Raises ConfigError for bad
    syntax or an invalid spec."""
    from edgeswarm.hpp.spec import parse_job
    from edgeswarm.workloads import spec_data

    return parse_job(spec_data(text, source=source), source=source)


def load_model(folder: Path | str, names: Any = None, dtype: Any = None, device: Any = None,
               layers: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The config and the weights ``names`` (all when None) of a model folder, ready for ``reference.forward``."""
    from edgeswarm.models.text.hf import ModelFolder

    with ModelFolder(folder, dtype, device, layers) as model:
        return model.config, model.load(names)


def stored_weights(store_dir: Path, job_id: str, stages: int, *, optimizer: bool = False) -> dict:  # type: ignore[type-arg]
    """The latest version of every stage of ``job_id`` in the checkpoint store's folder, as one state dict (with
    ``optimizer``, the checkpoints' optimizer entries too, as ``opt:<name>:<field>``)."""
    from edgeswarm.checkpoints.store import CheckpointStore
    from edgeswarm.state.layout import stage_entry
    from edgeswarm.state.units import model_state
    from edgeswarm.values.checkpoints import as_torch

    store = CheckpointStore(store_dir)
    weights = {}
    for s in range(stages):
        tensors = as_torch(*store.get(job_id, stage_entry(s)))
        weights.update(tensors if optimizer else model_state(tensors))
    return weights


def assert_same_weights(weights: dict, reference: dict, tolerance: float = 1e-6) -> float:  # type: ignore[type-arg]
    """Fail unless both hold the same tensors, equal within ``tolerance`` (absolute); returns the worst gap."""
    assert set(weights) == set(reference)
    worst = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
    assert worst <= tolerance, worst
    return worst


def announce(bus: Any, data_url: str | None = None) -> None:
    """Publish a retained online status for the bus's own service, as the service runtime would, so peers know
    where to send it tensors."""
    import edgeswarm.messages as m
    from edgeswarm import topics

    s = bus.sender
    bus.publish(topics.status(s.node, s.service), m.Status(
        state="online", node=s.node, service=s.service, instance=s.instance, version="test", host="h", pid=1,
        device_class="native", memory_budget_bytes=1, free_memory_bytes=1, data_url=data_url or bus.data.url,
        heartbeat_interval_s=1.0, started_at=0.0), retain=True)


@contextmanager
def running(service: Any) -> Iterator[Any]:
    """``service`` (an edgeswarm Service) running on a thread of this process until the block ends."""
    thread = threading.Thread(target=service.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.stop()
        thread.join(15)


def ask_stage_workers(client: Any, messages: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send each node's stage-worker its message as a request, all at once; each node's reply (None on timeout)."""
    from edgeswarm import topics

    expectations = {}
    for node, message in messages.items():
        exp = client.expect()
        expectations[node] = exp
        client.publish(topics.request(node, "stage-worker"), message, correlation_id=exp.correlation_id,
                       reply_to=client.reply_topic, ttl_s=timeout_s)
    return {node: (exp.wait(timeout_s) or None) for node, exp in expectations.items()}


@contextmanager
def native_cluster(devices: int, workdir: Path, env: dict[str, str], role: str,
                   skip_services: tuple[str, ...] = ("tensor-shard-worker",), edges: int = 0,
                   dashboard: bool = False, gateway: bool = False, forks: Any = None) -> Iterator[tuple[Any, Any]]:
    """A local cluster of ``devices`` native devices (no emulated slow-down: profiling and rounds cost what tiny
    models cost) and ``edges`` native edge servers (``edge-0``, ...) in ``workdir`` with ``env``, and a client bus of
    ``role`` on it, once every device, edge server and hub service is online; both stopped (the cluster's processes
    by PID) when the block ends. ``skip_services`` are not started on the devices (by default the
    tensor-shard-worker, which only serve-hmp jobs use). ``dashboard``: the hub runs its dashboard too, on a free
    port (``local.dashboard_url``); ``gateway`` likewise its OpenAI-compatible API (``local.gateway_url``). ``forks``:
    the worker's fork server (conftest's ``forks``), so that the cluster does not wait seconds for one of its own."""
    from edgeswarm.devices.cluster import DeviceEntry, cluster_of
    from edgeswarm.local.launcher import LocalCluster
    from edgeswarm.runtime.client import ClusterWatcher, client_bus, nodes_running, online_devices
    from edgeswarm.settings import Settings

    spec = cluster_of(devices, "native")
    if edges:
        spec = spec.model_copy(update={"edges": tuple(DeviceEntry(id=f"edge-{i}", device_class="native")
                                                      for i in range(edges))})
    local = LocalCluster(spec, workdir=workdir, extra_env=env, skip_services=skip_services,
                         dashboard_port=0 if dashboard else None, gateway_port=0 if gateway else None, forks=forks)
    local.start()
    bus = None
    try:
        bus = client_bus(Settings(hub_url=local.hub_url), role=role, connect_timeout_s=30)
        watcher = ClusterWatcher(bus)

        def ready() -> bool:
            view = watcher.view()[0]
            return (online_devices(view) == devices + edges and len(nodes_running(view, "stage-worker")) == devices
                    and len(nodes_running(view, "mec-manager")) == edges
                    and len(nodes_running(view, "profiler")) == devices + edges
                    and all(nodes_running(view, s) == ["hub"] for s in ("coordinator", "planner", "checkpoint-store"))
                    and (not dashboard or nodes_running(view, "dashboard") == ["hub"])
                    and (not gateway or nodes_running(view, "gateway") == ["hub"]))

        # Generous: every service imports torch, on a host whose cores other work may be using.
        wait_until(ready, 300, interval_s=0.2, message=f"every service of the {role} cluster online")
        yield local, bus
    finally:
        if bus is not None:
            bus.stop()
        local.stop()


def netns_unavailable() -> str | None:
    """Why this machine cannot run a namespace cluster (not root, a tool missing), or None when it can."""
    from edgeswarm.netns import host

    try:
        host.preflight()
    except host.NetnsUnavailableError as exc:
        return str(exc)
    return None


def weighted_bounds(length: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering ``length`` elements, range i about ``length * weights[i] /
    sum(weights)`` long (boundaries at the cumulative shares rounded down; a weight of 0 gives an empty range): the
    uneven slices a collective's tests cut a vector into."""
    total = sum(weights)
    bounds: list[tuple[int, int]] = []
    start, running = 0, 0.0
    for i, w in enumerate(weights):
        running += w
        end = length if i == len(weights) - 1 else min(length, max(start, math.floor(length * running / total)))
        bounds.append((start, end))
        start = end
    return bounds


class Ring:
    """N ranks of a collective (``edgeswarm.runtime.collectives``) in threads over in-memory queues, one per ordered
    pair of ranks (which also checks that both ends of a link agree on which steps carry a tensor). ``sent[r]`` counts
    the elements rank r sent, ``steps[r]`` the steps it sent on, ``messages[r]`` each send's (to, elements)."""

    def __init__(self, n: int, *, mesh: bool = False) -> None:
        self.n = n
        self.mesh = mesh  # direct collectives: any rank sends to any other
        self.boxes: dict[tuple[int, int], queue.Queue[tuple[int, Any]]] = {
            (s, d): queue.Queue() for s in range(n) for d in range(n)}
        self.steps: list[list[int]] = [[] for _ in range(n)]
        self.messages: list[list[tuple[int, int]]] = [[] for _ in range(n)]

    @property
    def sent(self) -> list[int]:
        return [sum(elements for _to, elements in sends) for sends in self.messages]

    def run(self, body: Callable[[int, Any, Any], Any]) -> list[Any]:
        results: list[Any] = [None] * self.n
        errors: list[BaseException] = []

        def worker(rank: int) -> None:
            def send(to: int, step: int, tensor: Any) -> None:
                assert to == (rank + 1) % self.n or (self.mesh and to != rank), "a ring sends to its right neighbour"
                self.steps[rank].append(step)
                self.messages[rank].append((to, tensor.numel()))
                self.boxes[(rank, to)].put((step, tensor))

            def recv(frm: int, step: int) -> Any:
                assert frm == (rank - 1) % self.n or (self.mesh and frm != rank), "a ring receives from the left"
                got_step, tensor = self.boxes[(frm, rank)].get(timeout=5)
                assert got_step == step, (got_step, step)
                return tensor

            try:
                results[rank] = body(rank, send, recv)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors, errors
        assert all(box.empty() for box in self.boxes.values()), "every tensor sent was taken"
        return [r for r in results if r is not None]


def venv_with_wheel(src: Path, tmp: Path, wheel_glob: str) -> tuple[Path, Path]:
    """A fresh virtual environment in ``tmp / "venv"`` with the wheel built from ``src`` (matching ``wheel_glob``)
    installed, its dependencies left out and nothing downloaded: (its python, its site-packages folder). The caller
    makes the dependencies visible (a .pth file in that folder)."""
    import subprocess
    import sys
    import venv

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=120)
    wheel = next((tmp / "dist").glob(wheel_glob))
    venv.create(tmp / "venv", with_pip=False)
    python = tmp / "venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=120)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)
