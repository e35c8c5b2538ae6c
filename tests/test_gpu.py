"""Accelerators, on a machine with CUDA (skipped elsewhere; run with ``pytest -m gpu``).

A training round on stage-workers computing on CUDA ends with the weights and optimizer state of the same round on
the CPU (within fp32 tolerance: the kernels differ, so the sums are not bit-identical); the profiler times units on
the GPU and takes its memory budget from the GPU's free memory; and one stage's training step is timed on GPU
against CPU, printed (never asserted on).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeswarm.messages.training import RoundDone, RoundStart, StageAssign, StageReady, StageSave, StageSaved
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec, OptimizerSpec
from helpers import ask_stage_workers, stored_weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda)")]

MLP = ModelSpec(name="mlp", config={"hidden": 64, "layers": 2, "seed": 3})
DATA = DatasetSpec(kind="teacher", size=512, test_size=64)
M, B, ROUNDS = 4, 64, 2
# HPP with uneven groups of two and three devices (AC-13's plan), so activations, gradients and the AllReduce all
# cross the wire between devices.
GROUPS, SHARES, RANGES = [["w0", "w1"], ["w2", "w3", "w4"]], [[40, 24], [32, 16, 16]], [(0, 3), (3, 6)]
# fp32 on different kernels (cuBLAS against the CPU's) over two momentum steps: relative 1e-4, absolute 1e-5 for
# values near zero.
RTOL, ATOL = 1e-4, 1e-5


def _train(mode: str, broker, make_bus, services, tmp_path: Path) -> tuple[dict, list[str]]:
    """Two rounds of the HPP plan on five stage-workers with EDGESWARM_COMPUTE=``mode``: the saved weights and
    optimizer state, and what the workers' statuses say they compute on."""
    store_dir = tmp_path / f"checkpoints-{mode}"
    hub = f"hub-{mode}"
    services.start("checkpoint-store", hub, broker.url, EDGESWARM_CHECKPOINT_DIR=str(store_dir))
    groups = [[f"{mode}-{n}" for n in group] for group in GROUPS]
    for group in groups:
        for node in group:
            services.start("stage-worker", node, broker.url, EDGESWARM_COMPUTE=mode)
    client = make_bus(f"test-{mode}", "cli")
    statuses = [client.peers.wait_for(node, "stage-worker", timeout_s=60) for group in groups for node in group]
    client.peers.wait_for(hub, "checkpoint-store", timeout_s=60)
    assigns = {}
    for p, group in enumerate(groups):
        for r, node in enumerate(group):
            assigns[node] = StageAssign(job_id="j1", epoch=0, stage=p, rank=r, model=MLP, start=RANGES[p][0],
                                        end=RANGES[p][1], groups=groups, shares=SHARES, micro_batches=M,
                                        warmup=min(2 * (len(groups) - p) - 1, M), loss_scale=1.0 / (M * B),
                                        optimizer=OptimizerSpec(name="momentum", lr=0.1), data=DATA)
    ready = ask_stage_workers(client, assigns, 120)
    assert all(isinstance(r.body, StageReady) for r in ready.values()), ready
    for round_index in range(ROUNDS):
        starts = {node: RoundStart(job_id="j1", epoch=0, round=round_index) for node in assigns}
        done = ask_stage_workers(client, starts, 120)
        assert all(isinstance(d.body, RoundDone) for d in done.values()), {n: d.body for n, d in done.items()}
    saved = ask_stage_workers(client, {group[-1]: StageSave(job_id="j1", epoch=0, store_node=hub, version=1)
                              for group in groups}, 60)
    assert all(isinstance(s.body, StageSaved) for s in saved.values()), saved
    return stored_weights(store_dir, "j1", len(groups), optimizer=True), [s.compute for s in statuses]


def test_a_round_on_cuda_ends_with_the_weights_of_the_same_round_on_the_cpu(broker, make_bus, services,
                                                                            tmp_path: Path) -> None:
    on_cpu, cpu_says = _train("cpu", broker, make_bus, services, tmp_path)
    on_gpu, gpu_says = _train("cuda", broker, make_bus, services, tmp_path)
    assert set(cpu_says) == {"cpu"}
    assert all(s.startswith("cuda:") for s in gpu_says), gpu_says
    assert set(on_gpu) == set(on_cpu) and any(k.startswith("opt:") for k in on_cpu)
    worst = 0.0
    for name, want in on_cpu.items():
        got = on_gpu[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL), name
        worst = max(worst, float((got.double() - want.double()).abs().max()))
    print(f"\nCUDA against CPU after {ROUNDS} rounds: largest difference {worst:.3g} over {len(on_cpu)} tensors")


def test_the_profiler_times_units_on_the_gpu_with_the_gpus_memory_budget(tmp_path: Path) -> None:
    from edgeswarm.profiling.cache import ProfileCache
    from edgeswarm.profiling.device import run_device_profile
    from edgeswarm.services.profiler.service import ProfilerService
    from edgeswarm.settings import Settings

    service = ProfilerService(Settings(node_id="gpu-0", compute="cuda", profile_dir=tmp_path / "profiles"))
    assert service.compute is not None and service.compute.type == "cuda"
    assert service.compute_description.startswith("cuda:")
    free, total = torch.cuda.mem_get_info(service.compute)
    assert 0 < service.device.memory_budget_bytes <= total
    assert service.device.accelerator == str(service.compute)
    assert 0 <= service.device.free_memory_bytes() <= service.device.memory_budget_bytes
    assert service.status_message("online").compute == service.compute_description

    cache = ProfileCache(tmp_path / "profiles")
    spec = ModelSpec(name="lenet5")
    gpu = run_device_profile(spec, service.device, [1, 8, 32], cache=cache, method="measured", node="gpu-0",
                             compute=service.compute)
    assert not gpu.cache_hit and gpu.compute.compute.startswith("cuda:")
    assert all(t > 0 for row in gpu.compute.forward_s for t in row)
    assert all(t >= 0 for row in gpu.compute.backward_s for t in row) and sum(map(sum, gpu.compute.backward_s)) > 0
    assert gpu.device.memory_budget_bytes == service.device.memory_budget_bytes
    # The CPU's figures of the same node are another cache entry: neither is taken for the other.
    cpu = run_device_profile(spec, service.device, [1, 8, 32], cache=cache, method="measured", node="gpu-0",
                             compute=torch.device("cpu"))
    assert not cpu.cache_hit and cpu.compute.compute == "cpu"
    assert cpu.compute.device_fingerprint != gpu.compute.device_fingerprint
    again = run_device_profile(spec, service.device, [1, 8, 32], cache=cache, method="measured", node="gpu-0",
                               compute=service.compute)
    assert again.cache_hit and again.compute.compute == gpu.compute.compute
    print(f"\nlenet5 profiled on {gpu.compute.compute}: {gpu.device.compute_flops / 1e9:.2f} GFLOP/s training "
          f"(CPU {cpu.device.compute_flops / 1e9:.2f}); memory budget {gpu.device.memory_budget_bytes / 2**30:.1f} "
          f"GiB of {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)")


@pytest.mark.parametrize("model, start, end, batch", [("mobilenetv2", 0, 10, 32), ("resnet18", 0, None, 32)])
def test_one_stage_on_the_gpu_against_the_cpu(model: str, start: int, end: int | None, batch: int) -> None:
    from edgeswarm.hpp.bench_compute import stage_speed, summary

    speed = stage_speed(ModelSpec(name=model), start, end, batch, torch.device("cuda", torch.cuda.current_device()),
                        repeats=5, warmup=3)
    assert [t.compute.split(" ")[0] for t in speed.timings] == ["cpu", f"cuda:{torch.cuda.current_device()}"]
    assert all(t.step_s > 0 for t in speed.timings) and speed.speedup is not None
    print("\n" + summary(speed))
