"""U-split compute (SmartSplit spec 7, U10, U11): one U-split iteration equals one centralised SGD step at every cut,
the vanilla split too; the parts reassemble into the global model's keys; the bytes an iteration sends."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping

import pytest
import torch

from edgeswarm.errors import ConfigError
from edgeswarm.messages.splitfed import RoundSetup
from edgeswarm.models.zoo import build_model, example_input, example_target
from edgeswarm.splitfed.compute import trains_alone
from edgeswarm.splitfed.memory import measure_device_memory
from edgeswarm.splitfed.recompute import find_segments, is_expensive, op_names
from edgeswarm.splitfed.split import (
    SPLITFED_OPTIMIZER,
    DeviceSide,
    MecSide,
    ServerSide,
    SplitPart,
    SplitPoint,
    SplitProtocolError,
    build_parts,
    bytes_per_iteration,
    cut_numel,
    run_usplit_iteration,
    split_loss,
    split_point,
)
from edgeswarm.values.federated import LocalTraining, PartitionSpec
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec

BATCH = 2
MODELS = [ModelSpec(name="lenet5"), ModelSpec(name="resnet18", config={"width": 0.25, "image_size": 16})]


def reassemble(states: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One full-model state dict from the state dicts of disjoint parts (front, middle, tail of one device)."""
    out: dict[str, torch.Tensor] = {}
    for state in states:
        for key, value in state.items():
            assert key not in out, f"{key!r} is in two parts: the parts overlap"
            out[key] = value
    return out


def run_vanilla_iteration(device: DeviceSide, server: ServerSide, x: torch.Tensor, labels: torch.Tensor) -> float:
    """One vanilla-split iteration in one process; returns the batch's mean loss."""
    step = server.step(device.front_forward(x), labels)
    device.front_backward(step.g_j)
    return step.loss


def front_segments(spec: ModelSpec, point: SplitPoint) -> int:
    """How many recomputation segments the device's front has at ``point`` (the length a plan must have)."""
    front = build_parts(spec, point, ("front",))["front"]
    return len(find_segments([is_expensive(op_names(u)) for u in front.units]))


def _central_step(spec: ModelSpec, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model = build_model(spec).eval()  # BatchNorm on its running statistics: deterministic
    opt = torch.optim.SGD(model.parameters(), lr=SPLITFED_OPTIMIZER.lr, momentum=SPLITFED_OPTIMIZER.momentum,
                          weight_decay=SPLITFED_OPTIMIZER.weight_decay)
    split_loss(model(x), y).backward()
    opt.step()
    return model.state_dict()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want) or set(got) == set(want)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        diff = (got[key].double() - value.double()).norm()
        assert diff <= 1e-6 * max(value.double().norm().item(), 1e-12), key


@pytest.mark.parametrize("spec", MODELS, ids=lambda s: s.name)
def test_one_usplit_and_one_vanilla_iteration_equal_one_centralised_step_at_every_cut(spec: ModelSpec) -> None:
    torch.manual_seed(0)
    x, y = example_input(spec, BATCH), example_target(spec, BATCH)
    want = _central_step(spec, x, y)
    units = split_point(spec, 1).units
    for cut in range(1, units):
        point = SplitPoint(units=units, cut=cut, tail=1)
        usplit = {r: p.eval() for r, p in build_parts(spec, point, ("front", "middle", "tail")).items()}
        device, mec = DeviceSide(usplit["front"], usplit["tail"]), MecSide(usplit["middle"])
        loss = run_usplit_iteration(device, mec, x, y)
        assert loss > 0
        _assert_same(reassemble(usplit[r].state_dict() for r in ("front", "middle", "tail")), want)

        vanilla = {r: p.eval() for r, p in build_parts(spec, point, ("front", "server")).items()}
        run_vanilla_iteration(DeviceSide(vanilla["front"]), ServerSide(vanilla["server"]), x, y)
        _assert_same(reassemble(vanilla[r].state_dict() for r in ("front", "server")), want)


def test_parts_built_apart_reassemble_into_the_global_model_and_load_its_state() -> None:
    spec = MODELS[1]
    point = split_point(spec, 4)
    global_state = build_model(spec).state_dict()
    # Built apart, as the device and the MEC do: the device never allocates the middle.
    device_parts = build_parts(spec, point, ("front", "tail"))
    middle = build_parts(spec, point, ("middle",))["middle"]
    assert not set(device_parts["front"].keys()) & set(middle.keys())
    whole = reassemble([device_parts["front"].state_dict(), middle.state_dict(), device_parts["tail"].state_dict()])
    assert list(whole) == sorted(whole, key=list(global_state).index)
    assert set(whole) == set(global_state)
    for key in global_state:
        assert torch.equal(whole[key], global_state[key])

    # From a global state (another round's weights): built without weights, then loaded.
    shifted = {k: v + 1 if v.is_floating_point() else v for k, v in global_state.items()}
    loaded = build_parts(spec, point, ("middle",), state=shifted)["middle"]
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, shifted[key])
    with pytest.raises(ConfigError):
        build_parts(spec, point, ("middle",), state={})["middle"]


def test_local_cut_leaves_the_middle_empty_and_sends_nothing() -> None:
    spec = MODELS[0]
    units = split_point(spec, 1).units
    point = split_point(spec, units - 1)
    assert not point.offloaded
    middle = build_parts(spec, point, ("middle",))["middle"]
    assert isinstance(middle, SplitPart) and len(middle) == 0
    x = torch.ones(2, 3)
    assert middle(x) is x
    assert bytes_per_iteration(spec, point, 8).total == 0
    with pytest.raises(ConfigError):
        split_point(spec, units)
    # That cut trains on the device alone under the U-split (no tensor through an identity middle); the vanilla
    # split's server always computes the loss.
    setup = RoundSetup(model=spec, dataset=DatasetSpec(kind="digits", size=64),
                       partition=PartitionSpec(kind="iid", devices=2, seed=0),
                       training=LocalTraining(epochs=1, batch_size=8, lr=0.05))
    assert trains_alone(setup, point)
    assert not trains_alone(setup, split_point(spec, units - 2))
    vanilla = setup.model_copy(update={"training": setup.training.model_copy(update={"mode": "vanilla"})})
    assert not trains_alone(vanilla, SplitPoint(units=units, cut=units, tail=0))


def test_bytes_per_iteration_follow_u11() -> None:
    spec = MODELS[0]
    point = split_point(spec, 2)
    n_j, n_mid = cut_numel(spec, point)
    # Measured against a real run: a_j and a_mid as the parts produce them.
    parts = build_parts(spec, point, ("front", "middle"))
    with torch.no_grad():
        a_j = parts["front"](example_input(spec, 1))
        a_mid = parts["middle"](a_j)
    assert (n_j, n_mid) == (a_j.numel(), a_mid.numel())
    b = 32
    usplit = bytes_per_iteration(spec, point, b)
    assert usplit.total == 8 * b * (n_j + n_mid)
    assert usplit.up == usplit.down and usplit.labels == 0
    vanilla = bytes_per_iteration(spec, point, b, vanilla=True)
    assert vanilla.labels == 8 * b  # int64 labels
    assert vanilla.total == 8 * b * n_j + vanilla.labels


def test_the_mec_never_takes_labels_and_refuses_steps_out_of_order() -> None:
    assert list(inspect.signature(MecSide.forward).parameters) == ["self", "a_j"]
    assert list(inspect.signature(MecSide.backward).parameters) == ["self", "g_mid"]
    spec = MODELS[0]
    point = split_point(spec, 3)
    parts = build_parts(spec, point, ("front", "middle", "tail"))
    mec = MecSide(parts["middle"])
    with pytest.raises(SplitProtocolError):
        mec.backward(torch.zeros(1))
    device = DeviceSide(parts["front"])
    with pytest.raises(SplitProtocolError):
        device.tail_step(torch.zeros(1), torch.zeros(1, dtype=torch.long))
    a_mid = mec.forward(device.front_forward(example_input(spec, 2)))
    with pytest.raises(SplitProtocolError):
        mec.backward(torch.zeros(a_mid.shape[0] + 1))


def test_device_memory_is_measured_and_smaller_than_whole_model_training() -> None:
    spec = ModelSpec(name="vgg11", config={"width": 0.25})
    units = split_point(spec, 1).units
    peaks = {}
    for cut in (1, 8, units - 1):
        memory = measure_device_memory(spec, split_point(spec, cut), 4)
        parts = build_parts(spec, split_point(spec, cut), ("front", "tail"))
        assert memory.persistent_bytes >= 2 * (parts["front"].param_bytes() + parts["tail"].param_bytes())
        peaks[cut] = memory.peak_bytes
    assert peaks[1] * 4 < peaks[units - 1]
    point = split_point(spec, 8)  # two segments (BatchNorm, ReLU, max pool) in the front
    memory_centric = measure_device_memory(spec, point, 4, plan=["memory"] * front_segments(spec, point))
    assert memory_centric.peak_bytes < peaks[8]
