"""U13: the device's memory under a budget that changes from round to round. Every budget of a trace either lets
the device train its part with a measured peak within it (recomputing cheap layers when the plan needs to) or makes
it leave before its first mini-batch with a reason that names a shallower cut; never an iteration over budget."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from edgeswarm.devices.compute import resolve_compute, to_compute
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import MemoryBudgetError
from edgeswarm.messages.splitfed import RoundSetup
from edgeswarm.models.zoo import build_model
from edgeswarm.planning.splitfed.cost import device_memory
from edgeswarm.runtime.program import ComputeGate
from edgeswarm.settings import Settings
from edgeswarm.splitfed.compute import DevicePart, MecPart, input_bytes
from edgeswarm.splitfed.profiling import model_cost
from edgeswarm.splitfed.weights import flatten
from edgeswarm.values.federated import LocalTraining, PartitionSpec
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec

# The one setting (EDGESWARM_COMPUTE) on this machine's native device: the device's parts and the MEC's compute there.
_NATIVE = Settings(device_class="native")
COMPUTE = resolve_compute(_NATIVE.compute, DeviceProfile.from_settings(_NATIVE))
MODEL = ModelSpec(name="lenet5", config={"num_classes": 10})
BATCH = 16
CUT = 3
# Spec 10.1's trace: every TRACE_EVERY iterations the round's fraction u of the phone's memory is multiplied by a
# factor drawn from TRACE_STEP and clipped to TRACE_CLIP.
TRACE_STEP = (0.9, 1.1)
TRACE_CLIP = (0.05, 0.5)
TRACE_EVERY = 50


def budget_trace(ram_bytes: int, fraction: float, iterations: int, rng: np.random.Generator) -> list[int]:
    """The budget (bytes) of each block of 50 iterations of a round that starts at ``fraction`` of RAM: each
    block multiplies u by U[0.9, 1.1], clipped to [0.05, 0.5]; the first block keeps the round's u."""
    blocks = max(1, -(-iterations // TRACE_EVERY))
    u = fraction
    out = [int(ram_bytes * u)]
    for _ in range(blocks - 1):
        u = float(np.clip(u * rng.uniform(*TRACE_STEP), *TRACE_CLIP))
        out.append(int(ram_bytes * u))
    return out


# ``always`` recomputes whatever the budget, and needs room for the largest backward step (l_peak) beside the
# weights: its trace sits higher.
@pytest.mark.parametrize(("policy", "fraction"), [("adaptive", 0.25), ("always", 0.45)])
def test_a_budget_trace_never_sees_an_iteration_over_budget(policy: str, fraction: float) -> None:
    setup = RoundSetup(model=MODEL, dataset=DatasetSpec(kind="teacher", size=64, test_size=16),
                       partition=PartitionSpec(devices=2),
                       training=LocalTraining(batch_size=BATCH, recompute=policy))  # type: ignore[arg-type]
    torch.manual_seed(0)
    global_state = build_model(MODEL).state_dict()
    need = device_memory(model_cost(MODEL, BATCH, 1), CUT, 1, input_bytes(MODEL, BATCH))
    # The spec's trace (10.1): a round's fraction of the phone's memory, drifting every 50 iterations; scaled so
    # the trace crosses what the cut needs.
    rng = np.random.default_rng(0)
    trace = [int(b) for b in budget_trace(int(need * 4), fraction, 300, rng)]
    x = to_compute(torch.randn(BATCH, 1, 32, 32, generator=torch.Generator().manual_seed(1)), COMPUTE)
    y = to_compute(torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(2)), COMPUTE)
    trained = left = 0
    for budget in trace:
        part = DevicePart(setup, CUT, compute=COMPUTE, gate=ComputeGate())
        part.load(flatten(global_state, part.layout))
        try:
            part.plan_memory(budget)
        except MemoryBudgetError as exc:
            assert "shallower cut" in str(exc)
            left += 1
            continue
        mec = MecPart(setup, CUT, compute=COMPUTE)
        mec.load(global_state)
        _, tail_gradient = part.tail_step(mec.forward(part.front_forward(x)), y)
        part.front_backward(mec.backward(tail_gradient))
        assert part.peak_bytes <= budget, (budget, part.peak_bytes, part.recompute_summary)
        trained += 1
    assert trained, (left, need, trace)
    if policy == "adaptive":
        assert left, (trained, need, trace)  # the trace dips below what the cut needs


def test_budget_trace_stays_within_the_clip() -> None:
    rng = np.random.default_rng(0)
    trace = budget_trace(8 * 2**30, 0.3, 1000, rng)
    assert len(trace) == 20 and trace[0] == int(8 * 2**30 * 0.3)
    assert all(0.05 * 8 * 2**30 - 1 <= b <= 0.5 * 8 * 2**30 for b in trace)


def test_every_compute_of_the_device_part_runs_as_the_device() -> None:
    # An emulated device's slow-down applies to what its part computes (``run`` is DeviceProfile.run in the worker):
    # each forward, tail step and backward of a split step, and each local step, once.
    setup = RoundSetup(model=MODEL, dataset=DatasetSpec(kind="teacher", size=64, test_size=16),
                       partition=PartitionSpec(devices=2), training=LocalTraining(batch_size=BATCH))
    torch.manual_seed(0)
    global_state = build_model(MODEL).state_dict()
    calls: list[str] = []

    def run(fn: Callable[[], object]) -> object:
        calls.append(getattr(fn, "func", fn).__name__)
        return fn()

    part = DevicePart(setup, CUT, compute=COMPUTE, gate=ComputeGate(), run=run)
    part.load(flatten(global_state, part.layout))
    mec = MecPart(setup, CUT, compute=COMPUTE)
    mec.load(global_state)
    x = to_compute(torch.randn(BATCH, 1, 32, 32, generator=torch.Generator().manual_seed(1)), COMPUTE)
    y = to_compute(torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(2)), COMPUTE)
    _, g_mid = part.tail_step(mec.forward(part.front_forward(x)), y)
    part.front_backward(mec.backward(g_mid))
    assert calls == ["front_forward", "tail_step", "front_backward"]
    assert not part.alone
    last = len(model_cost(MODEL, BATCH, 1).units) - 1  # the U-split's cut that leaves the MEC nothing
    alone = DevicePart(setup, last, compute=COMPUTE, gate=ComputeGate(), run=run)
    alone.load(flatten(global_state, alone.layout))
    assert alone.alone
    alone.local_step(x, y)
    assert calls[3:] == ["step"]
