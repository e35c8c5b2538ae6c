"""EDGESWARM_COMPUTE: the setting, its resolution to a torch device, and the moves between the device and host memory,
checked on any machine (CUDA itself is exercised by tests/test_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from edgeswarm.devices import compute as compute_module
from edgeswarm.devices.compute import describe, host_copies, resolve_compute, to_compute, to_host
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import ConfigError
from edgeswarm.messages import Status
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.settings import Settings
from edgeswarm.values.profiles import ComputeProfile, ModelSpec


def _native() -> DeviceProfile:
    return DeviceProfile.from_settings(Settings(device_class="native"))


def test_the_setting_reads_the_environment_and_refuses_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().compute == "auto"
    for value in ("auto", "cpu", "cuda", "mps"):
        monkeypatch.setenv("EDGESWARM_COMPUTE", value)
        assert Settings().compute == value
    monkeypatch.setenv("EDGESWARM_COMPUTE", "tpu")
    with pytest.raises(ValidationError, match="compute"):
        Settings()


def test_auto_takes_cuda_then_mps_then_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(compute_module, "_mps_available", lambda: False)
    assert resolve_compute("auto", _native()) == torch.device("cpu")
    monkeypatch.setattr(compute_module, "_mps_available", lambda: True)
    assert resolve_compute("auto", _native()) == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_compute("auto", _native()) == torch.device("cuda", 0)
    assert resolve_compute("cpu", _native()) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_auto_is_the_cpu_on_a_machine_without_an_accelerator() -> None:
    if compute_module._mps_available():
        pytest.skip("this machine has MPS")
    on = resolve_compute("auto", _native())
    assert on == torch.device("cpu") and describe(on) == "cpu"


def test_cuda_without_cuda_is_a_config_error_that_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="EDGESWARM_COMPUTE=cuda") as raised:
        resolve_compute("cuda", _native())
    assert "EDGESWARM_COMPUTE=auto or cpu" in str(raised.value)
    monkeypatch.setattr(compute_module, "_mps_available", lambda: False)
    with pytest.raises(ConfigError, match="EDGESWARM_COMPUTE=mps"):
        resolve_compute("mps", _native())


def test_an_emulated_device_class_computes_on_the_cpu_whatever_is_asked(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # Even where CUDA is there: an emulated slow-down scales CPU time, which GPU kernels would escape.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compute_module, "_emulated_logged", type(compute_module._emulated_logged)())
    nano = DeviceProfile.from_settings(Settings(device_class="jetson-nano"))
    assert nano.emulated
    caplog.set_level("INFO", logger="edgeswarm.devices.compute")
    for requested in ("cuda", "auto", "mps", "cuda"):
        assert resolve_compute(requested, nano) == torch.device("cpu")
    said = [r for r in caplog.records if "emulated" in r.getMessage()]
    assert len(said) == 1 and "jetson-nano" in said[0].getMessage()


def test_a_cpu_device_keeps_its_host_memory_budget() -> None:
    device = _native()
    assert compute_module.with_accelerator_budget(device, torch.device("cpu"), False) is device
    assert device.accelerator is None and device.free_memory_bytes() > 0


def test_host_copies_and_moves_keep_every_value() -> None:
    gen = torch.Generator().manual_seed(0)
    t = torch.randn((3, 4), generator=gen)
    host, ready = to_host(t[:, 1:])  # a non-contiguous view comes back contiguous
    ready()
    assert host.is_contiguous() and torch.equal(host, t[:, 1:]) and host.device.type == "cpu"
    assert to_compute(t, None) is t and to_compute(t, torch.device("cpu")) is t
    copies = host_copies({"a": t, "step": torch.tensor(3, dtype=torch.int64)})
    assert torch.equal(copies["a"], t) and int(copies["step"]) == 3


def test_the_exchange_hands_tensors_over_on_its_compute_device(make_bus) -> None:
    bus = make_bus("w0", "stage-worker")
    exchange: TensorExchange = TensorExchange(bus, "stage-worker", wait_s=1.0, compute=torch.device("cpu"))

    class Key(tuple):
        scope = 0

    value = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    exchange.put(Key((1,)), value)
    got = exchange.wait(Key((1,)), rows=2)
    assert got.device == torch.device("cpu") and torch.equal(got, value)
    exchange.close(timeout_s=1.0)


def test_old_statuses_and_profiles_without_the_compute_field_still_validate() -> None:
    status = Status(state="online", node="n", service="stage-worker", instance="i", version="v", host="h", pid=1,
                    device_class="native", memory_budget_bytes=1, free_memory_bytes=1, data_url="mqtt://h:1",
                    heartbeat_interval_s=1.0, started_at=0.0)
    assert status.compute == ""
    with pytest.raises(ValidationError):
        Status(**{**status.model_dump(), "compute": "x" * 129})
    profile = ComputeProfile(model_fingerprint="m", device_fingerprint="d", batch_sizes=[1], forward_s=[[0.1]],
                             backward_s=[[0.2]])
    assert profile.compute == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, so the request is valid")
def test_a_service_asked_for_cuda_without_it_exits_with_one_line() -> None:
    env = {**os.environ, "EDGESWARM_NODE_ID": "w0", "EDGESWARM_COMPUTE": "cuda",
           "EDGESWARM_HUB_URL": "mqtt://127.0.0.1:1"}
    done = subprocess.run([sys.executable, "-m", "edgeswarm", "service", "stage-worker"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr and "EDGESWARM_COMPUTE=cuda" in done.stderr
    assert len(lines) == 1, done.stderr


def test_a_bad_compute_value_is_named_without_a_traceback() -> None:
    env = {**os.environ, "EDGESWARM_NODE_ID": "w0", "EDGESWARM_COMPUTE": "gpu"}
    done = subprocess.run([sys.executable, "-m", "edgeswarm", "service", "stage-worker"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "EDGESWARM_COMPUTE" in done.stderr and "Traceback" not in done.stderr


def test_a_cpu_profile_says_cpu_and_keeps_the_fingerprints_of_profiles_from_before() -> None:
    from edgeswarm.profiling.compute import device_fingerprint, host_description, host_fingerprint, profile_model

    cpu = torch.device("cpu")
    assert host_fingerprint(cpu) == host_fingerprint() and "compute" not in host_description(cpu)
    assert device_fingerprint(_native(), cpu) == device_fingerprint(_native())
    _, timings = profile_model(ModelSpec(name="mlp", config={"hidden": 16, "layers": 1}), [2], repeats=1, warmup=0)
    assert timings.compute == "cpu" and timings.device_fingerprint == host_fingerprint()


def test_units_timed_on_an_accelerator_are_another_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from edgeswarm.profiling import compute as timing

    monkeypatch.setattr(timing, "describe", lambda on: "cuda:0 (a GPU)" if on.type == "cuda" else str(on))
    gpu = torch.device("cuda", 0)  # only named here: nothing runs on it
    assert timing.host_description(gpu)["compute"] == "cuda:0 (a GPU)"
    assert timing.host_fingerprint(gpu) != timing.host_fingerprint()
    assert timing.device_fingerprint(_native(), gpu) != timing.device_fingerprint(_native())


def test_the_cluster_view_takes_a_nodes_compute_device_from_the_services_that_compute() -> None:
    from edgeswarm.membership import MembershipTable

    def status(service: str, compute: str = "", state: str = "online") -> Status:
        return Status(state=state, node="jetson-1", service=service, instance=service[:8], version="1", host="h",
                      pid=1, device_class="native", memory_budget_bytes=100, free_memory_bytes=50,
                      data_url="mqtt://x:1", heartbeat_interval_s=1.0, started_at=0.0, compute=compute)

    table = MembershipTable()
    table.apply_status(status("node-agent"), at=1.0)
    assert table.view(1.5).nodes[0].compute == ""
    table.apply_status(status("profiler", "cuda:0 (Orin)", state="offline"), at=1.0)
    table.apply_status(status("stage-worker", "cuda:0 (Orin)"), at=1.0)
    node = table.view(1.5).nodes[0]
    assert node.compute == "cuda:0 (Orin)" and node.device_class == "native"


def test_bench_compute_times_a_stage_here_and_names_a_bad_stage() -> None:
    done = subprocess.run([sys.executable, "-m", "edgeswarm", "bench", "compute", "--model", "resnet18", "--end", "3",
                           "--batch", "2", "--repeats", "2", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["model"], report["start"], report["end"], report["batch"]) == ("resnet18", 0, 3, 2)
    devices = [t["compute"] for t in report["timings"]]
    assert devices[0] == "cpu" and all(t["step_s"] > 0 for t in report["timings"])
    assert (report["speedup"] is None) == (not torch.cuda.is_available())
    bad = subprocess.run([sys.executable, "-m", "edgeswarm", "bench", "compute", "--model", "resnet18", "--start", "5",
                          "--end", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "a stage [5, 3) is not among them" in bad.stderr


@pytest.mark.parametrize("method", ["measured", "calibrated"])
def test_a_profile_not_in_the_cache_is_timed_on_the_device_asked_for(tmp_path, monkeypatch, method: str) -> None:  # type: ignore[no-untyped-def]
    """Found on an H200: the cache look-up once took the name of the compute device, so a GPU profile that missed
    the cache was timed on the CPU. Checked here without a GPU: the timing is stopped where it starts."""
    from edgeswarm.profiling import compute as timing
    from edgeswarm.profiling.cache import ProfileCache
    from edgeswarm.profiling.device import run_device_profile

    asked: list[object] = []

    class Timed(Exception):
        pass

    def fake_profile_model(*_args: object, compute: object = None, **_kwargs: object) -> None:
        asked.append(compute)
        raise Timed

    monkeypatch.setattr(timing, "device_fingerprint", lambda device, compute: f"fp-{compute}")
    monkeypatch.setattr(timing, "host_fingerprint", lambda compute: f"host-{compute}")
    monkeypatch.setattr(timing, "profile_model", fake_profile_model)
    with pytest.raises(Timed):
        run_device_profile(ModelSpec(name="lenet5"), DeviceProfile.from_settings(Settings(node_id="gpu-0")), [1],
                           cache=ProfileCache(tmp_path), method=method, node="gpu-0", compute=torch.device("cuda"))
    assert asked == [torch.device("cuda")]


def test_the_exchange_counts_a_peers_arrivals_by_round_even_when_they_come_before_the_round_began(make_bus) -> None:
    """A peer may send a round's first tensor before this device has begun that round: its arrival still counts for
    that round, and a replayed round's leftovers count for none."""
    from edgeswarm.values.profiles import LinkSample
    from edgeswarm.wire.tensor import Arrival

    exchange: TensorExchange = TensorExchange(make_bus("w1", "stage-worker"), "stage-worker", wait_s=1.0)
    exchange.arrived(3, "a", Arrival(nbytes=1000, chunks=2, seconds=0.01))  # round 3's, early
    exchange.arrived(2, "a", Arrival(nbytes=50, chunks=1, seconds=0.5))  # a replayed round 2's, late
    exchange.arrived(3, "b", None)  # one chunk: says nothing of the link
    exchange.arrived(3, "a", Arrival(nbytes=3000, chunks=3, seconds=0.02))
    exchange.arrived(3, "c", Arrival(nbytes=10, chunks=1, seconds=0.001))
    assert exchange.take_arrivals(3) == [LinkSample(src="a", bytes=4000, chunks=5, seconds=0.03),
                                         LinkSample(src="c", bytes=10, chunks=1, seconds=0.001)]
    assert exchange.take_arrivals(2) == []  # forgotten with round 3's take
    exchange.close(timeout_s=1.0)
