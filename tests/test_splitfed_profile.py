"""SmartSplit's model profile (spec 4.1): per-unit FLOPs, bytes and the expensive flag, for the planner."""

from __future__ import annotations

import pytest

from edgeswarm.errors import ConfigError
from edgeswarm.models.zoo import unit_count
from edgeswarm.splitfed.profiling import model_cost
from edgeswarm.values.profiles import LinkProfile, ModelSpec


@pytest.mark.parametrize("name", ["lenet5", "mlp", "vgg16", "resnet18"])
def test_every_unit_is_profiled_and_scales_with_the_batch(name: str) -> None:
    spec = ModelSpec(name=name)
    small, large = model_cost(spec, 4), model_cost(spec, 8, optimizer_states=2)
    assert len(small.units) == unit_count(spec) and small.optimizer_states == 1 and large.optimizer_states == 2
    for a, b in zip(small.units, large.units, strict=True):
        assert b.out_bytes == 2 * a.out_bytes > 0
        assert b.flops_fwd == pytest.approx(2 * a.flops_fwd)
        assert a.flops_bwd == pytest.approx(2 * a.flops_fwd)
        assert a.param_bytes == b.param_bytes
        assert a.backward_bytes >= a.act_bytes + 2 * a.out_bytes
    assert small.units[-1].expensive and small.classes == 10


def test_lenet5_units_match_hand_counts() -> None:
    cost = model_cost(ModelSpec(name="lenet5"), 2)
    assert [u.expensive for u in cost.units] == [True, False, False, True, False, False, False, True, False, True,
                                                False, True]
    conv1 = cost.units[0]
    assert conv1.out_bytes == 2 * 6 * 28 * 28 * 4
    assert conv1.flops_fwd == 2 * (2 * 6 * 28 * 28 * 25)  # 2 FLOPs per multiply-add, batch 2
    assert conv1.param_bytes == (6 * 25 + 6) * 4
    assert conv1.act_bytes == 2 * 32 * 32 * 4  # the convolution saves its input


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigError):
        model_cost(ModelSpec(name="lenet5"), 0)
    with pytest.raises(ConfigError):
        model_cost(ModelSpec(name="lenet5"), 2, optimizer_states=3)


def test_a_nodes_speed_is_its_measured_seconds_for_the_models_flops_never_its_class() -> None:
    """What the central manager plans a device with: an iteration's FLOPs over the seconds the device's own
    profiler measured for the model's units at the job's batch size."""
    from edgeswarm.errors import ProfileError
    from edgeswarm.splitfed.gather import Measured, training_flops_per_s, unit_shares
    from edgeswarm.values.profiles import ComputeProfile, DeviceInfo, DeviceProfileEntry

    cost = model_cost(ModelSpec(name="lenet5"), 8)
    units = len(cost.units)

    def entry(seconds_per_unit: float, batch_sizes: list[int]) -> DeviceProfileEntry:
        rows = [[seconds_per_unit * b / 8 for b in batch_sizes] for _ in range(units)]
        compute = ComputeProfile(model_fingerprint="m", device_fingerprint="d", batch_sizes=batch_sizes,
                                 forward_s=rows, backward_s=[[2 * t for t in row] for row in rows])
        return DeviceProfileEntry(device=DeviceInfo(node="pi", fingerprint="d", memory_budget_bytes=1 << 30),
                                  compute=compute)

    flops = sum(u.flops_fwd + u.flops_bwd for u in cost.units)
    assert training_flops_per_s(cost, entry(0.001, [4, 8])) == pytest.approx(flops / (units * 0.003))
    # Three times the seconds, a third of the speed.
    assert training_flops_per_s(cost, entry(0.003, [8])) == pytest.approx(flops / (units * 0.009))
    with pytest.raises(ProfileError, match="batch sizes"):
        training_flops_per_s(cost, entry(0.001, [4]))
    # Each unit's share of the iteration's seconds at the job's batch size: what the planner prices a part by.
    plain = entry(0.001, [4, 8])
    forward = [list(row) for row in plain.compute.forward_s]
    forward[0][1] = 0.006  # the first unit's forward at batch 8: 0.005 s more than the others'
    skewed = plain.model_copy(update={"compute": plain.compute.model_copy(update={"forward_s": forward})})
    shares = unit_shares(cost, skewed)
    assert sum(shares) == pytest.approx(1.0)
    assert shares[0] == pytest.approx(0.008 / (units * 0.003 + 0.005))
    assert shares[1] == pytest.approx(0.003 / (units * 0.003 + 0.005))
    # A round asks only for what was not measured yet: a new device, a new MEC, a device under another MEC.
    links = {(d, "m0"): LinkProfile(src=d, dst="m0", bandwidth_bps=1.0) for d in ("d0", "d1")}
    measured = Measured(speeds={"d0": 1.0, "d1": 1.0, "m0": 1.0}, links=links)
    assert measured.missing(["d0", "d1"], ["m0"], {"d0": "m0", "d1": "m0"}) == ([], [])
    assert measured.missing(["d0", "d1", "d2"], ["m0", "m1"], {"d0": "m0", "d1": "m1", "d2": "m0"}) == (
        ["d2", "m1"], [("d1", "m1"), ("d2", "m0")])
