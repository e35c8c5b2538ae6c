"""Galaxy's profiler on a tensor-shard-worker (spec 1.1) times the blocks as the device computes: on the torch threads
the device computes with, from the worker's first profile on, so the planner's order of device classes holds on a
loaded host. No absolute speed is asserted: only the order of classes whose slow-downs differ several-fold."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
import torch
from pydantic import PrivateAttr

from edgeswarm import topics
from edgeswarm.devices.catalogue import device_class
from edgeswarm.devices.compute import resolve_compute
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.hmp.worker import ShardProgram
from edgeswarm.messages.hmp import ShardProfileReply, ShardProfileRequest
from edgeswarm.metrics import Metrics
from edgeswarm.runtime.ledger import MemoryLedger
from edgeswarm.runtime.program import ComputeGate, WorkerContext
from edgeswarm.service_registry import TENSOR_SHARD_WORKER
from edgeswarm.settings import Settings
from edgeswarm.values.text_model import TextModelSource

T = TypeVar("T")

# A multi-core host's default torch thread count, set before the profiles so that the test means the same on any host
# (threads that have not computed yet take the count last set in the process).
HOST_THREADS = 2
# Fastest to slowest: slow-downs 1.5, 10 and 20.
CLASSES = ("laptop", "jetson-nano", "rpi4")
# Each busy loop ends by itself after this many seconds, should the test's own stop never come.
BUSY_S = 60.0
# One per core this process may run on (a few at most: enough to leave no core idle on a small host).
BUSY_PROCESSES = min(len(os.sched_getaffinity(0)), 8)
_BUSY_LOOP = ("import sys, time\nend = time.monotonic() + float(sys.argv[1])\nprint('busy', flush=True)\n"
              "while time.monotonic() < end:\n    pass\n")


class ObservedDevice(DeviceProfile):
    """A device that records the torch threads the calling thread computes on in each of its runs."""

    _threads: list[int] = PrivateAttr(default_factory=list)

    def run(self, fn: Callable[[], T], **clocks: Any) -> T:
        self._threads.append(torch.get_num_threads())
        return super().run(fn, **clocks)

    @property
    def threads_seen(self) -> set[int]:
        return set(self._threads)


@contextmanager
def busy_host() -> Iterator[None]:
    """One busy-looping process per core for the block (each spinning when it starts), stopped by its PID after it."""
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(BUSY_S)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, text=True) for _ in range(BUSY_PROCESSES)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "busy"
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


@contextmanager
def host_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.alone
def test_a_workers_first_profile_runs_on_the_devices_threads_and_slower_classes_time_slower(
        make_bus: Callable[..., Any]) -> None:
    """A fresh worker of each class profiles a tiny model (its first profile, before any shard set its threads) while
    every core is busy: each timed run computes on the one thread an emulated device computes with, and the classes
    come out in the order of their slow-downs. It runs alone: the busy loops are the load it means; another test's
    load beside them once held the Nano's runs off its core longer than its slow-down (23.2 ms against the
    Raspberry Pi's 20.8 ms, in a clean-clone run). The model is one layer of DistilBERT (random weights, about 12 s
    in all): its operators are long beside a scheduler slice."""
    client = make_bus("client", "coordinator")
    devices: dict[str, ObservedDevice] = {}
    programs: list[ShardProgram] = []
    for name in CLASSES:
        dc = device_class(name)
        device = devices[name] = ObservedDevice(device_class=dc.name, emulated=dc.emulated,
                                                compute_slowdown=dc.compute_slowdown,
                                                memory_budget_bytes=dc.memory_budget_bytes)
        bus = make_bus(name, TENSOR_SHARD_WORKER)
        program = ShardProgram(WorkerContext(bus=bus, node=name, service=TENSOR_SHARD_WORKER, device=device,
                                             metrics=Metrics(), gate=ComputeGate(),
                                             ledger=MemoryLedger(name, dc.memory_budget_bytes)))
        bus.subscribe(topics.request(name, TENSOR_SHARD_WORKER), program.on_request, schemas=program.handles)
        programs.append(program)
    # One DistilBERT layer, not a tiny model: a tiny model's operators take tens of microseconds, and one scheduler
    # slice lost to the busy loops outweighed the slow-downs (a clean-clone run timed the Nano's layer at 10.4 ms and
    # the Raspberry Pi's at 9.1). One DistilBERT layer kept them 7.1x-7.8x and 2.0x-2.4x apart (slow-downs: 6.7x, 2x).
    request = ShardProfileRequest(model=TextModelSource(preset="distilbert", layers=1), seq_len=8)
    layer_s: dict[str, float] = {}
    try:
        with host_threads(HOST_THREADS), busy_host():
            for name in CLASSES:
                reply = client.request(topics.request(name, TENSOR_SHARD_WORKER), request, timeout_s=60).body
                assert isinstance(reply, ShardProfileReply), reply
                p = reply.profile
                assert p.node == name and p.device_class == name
                layer_s[name] = sum(p.mha_s) + sum(p.mlp_s) + sum(p.con_s)
    finally:
        for program in programs:
            program.close()
    for name, device in devices.items():
        assert device.threads_seen == {device.compute_threads} == {1}, \
            f"{name} profiled on {device.threads_seen} torch threads"
    laptop, nano, rpi4 = (layer_s[name] for name in CLASSES)
    assert laptop < nano < rpi4, layer_s


def test_a_decoders_profile_times_its_logits_and_an_encoders_has_none() -> None:
    from edgeswarm.hmp.profiling import profile_blocks
    from edgeswarm.values.text_model import PRESETS

    settings = Settings(device_class="native")
    device = DeviceProfile.from_settings(settings)
    # The one setting (EDGESWARM_COMPUTE) on this machine's native device, as a worker computes.
    compute = resolve_compute(settings.compute, device)
    kw: dict[str, Any] = {"node": "d", "device": device, "compute": compute, "warmup": 0, "repeats": 1}
    assert profile_blocks(PRESETS["gpt2-tiny"], 8, **kw).head_s > 0
    assert profile_blocks(PRESETS["bert-tiny"], 8, **kw).head_s == 0


def test_a_grids_points_are_timed_in_turns_and_more_work_is_never_priced_faster() -> None:
    """The points of a grid take turns, one run each a round (warm-ups first), so a spell of load on the host slows
    one run of every point, not all of a few; each grid of a profile is non-decreasing in its share; the MHA block
    at every head keeps its three phases' times."""
    from edgeswarm.hmp.profiling import _medians, _phase_medians, profile_blocks
    from edgeswarm.values.text_model import PRESETS

    settings = Settings(device_class="native")
    device = DeviceProfile.from_settings(settings)
    compute = resolve_compute(settings.compute, device)  # the one setting, as a worker computes
    order: list[str] = []

    def point(name: str) -> tuple[Callable[[], object], ...]:
        return (lambda: order.append(f"{name}1"), lambda: order.append(f"{name}2"))

    times = _medians([point("a"), point("b")], device=device, compute=compute, warmup=1, repeats=2)
    assert order == ["a1", "a2", "b1", "b2"] * 3 and len(times) == 2 and min(times) >= 0
    order.clear()
    phases = _phase_medians([point("a"), point("b")], device=device, compute=compute, warmup=0, repeats=1)
    assert order == ["a1", "a2", "b1", "b2"] and [len(p) for p in phases] == [2, 2]
    p = profile_blocks(PRESETS["bert-tiny"], 16, node="d", device=device, compute=compute, warmup=0, repeats=1)
    for grid in (p.mha_s, p.mlp_s, p.con_s, p.mha_decode_s, p.mlp_decode_s):
        assert all(a <= b for a, b in zip(grid, grid[1:], strict=False)), grid
    # The MHA block at every head, phase by phase (QKV, core, output projection), on every row and on one.
    assert len(p.mha_phases_s) == 3 and len(p.mha_decode_phases_s) == 3
    assert min(p.mha_phases_s + p.mha_decode_phases_s) > 0
