"""The compute profiler: exact sizes for hand-checked models, saved activations, times that behave, runners,
speed-ratio calibration and fingerprints. No absolute speed is asserted: only ratios within one run."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import TypeVar

import pytest
import torch

from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import BatchSizeError, ConfigError, ProfilerError
from edgeswarm.models.sequence import layer_sequence
from edgeswarm.models.zoo import build_model
from edgeswarm.profiling.compute import (
    calibrated_profile,
    device_fingerprint,
    host_fingerprint,
    measure_speed_ratio,
    profile_model,
    validate_batch_sizes,
)
from edgeswarm.values.profiles import CHAIN_BOUNDS, ChainFactors, ComputeProfile, ModelSpec

T = TypeVar("T")
F32 = 4

LENET = ModelSpec(name="lenet5")
# flatten(1x4x4) -> Linear(16, 8) -> ReLU -> Linear(8, 3)
MLP = ModelSpec(name="mlp", config={"image_size": 4, "hidden": 8, "layers": 1, "num_classes": 3})
# A LeNet whose convolutions do enough work per sample that per-call overheads do not hide it.
WIDE_LENET = ModelSpec(name="lenet5", config={"width": 4.0})
CONV_UNITS = (0, 3)


def slow(factor: float) -> Callable[[Callable[[], T]], T]:
    """A runner that makes work look ``factor`` times slower, the way an emulated device does."""
    return DeviceProfile(device_class="test", emulated=True, compute_slowdown=factor, memory_budget_bytes=1 << 30).run


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Time with one intra-op thread: when another process competes for the cores, OpenMP barriers of a
    multi-threaded torch stall for whole scheduler slices and timings stop meaning anything."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lenet_profile() -> tuple:
    return profile_model(LENET, [1, 64], repeats=3)


def test_mlp_sizes_match_a_hand_count() -> None:
    model, compute = profile_model(MLP, [2], repeats=1, warmup=0)
    assert model.input_bytes_per_sample == 16 * F32
    assert [u.name for u in model.units] == ["0", "1", "2", "3"]
    assert [u.ops for u in model.units] == ["flatten", "linear", "relu", "linear"]
    assert [u.output_bytes_per_sample for u in model.units] == [16 * F32, 8 * F32, 8 * F32, 3 * F32]
    assert [u.weight_bytes for u in model.units] == [0, (16 * 8 + 8) * F32, 0, (8 * 3 + 3) * F32]
    assert [u.buffer_bytes for u in model.units] == [0, 0, 0, 0]
    assert [u.flops_per_sample for u in model.units] == [0, 2 * 16 * 8, 0, 2 * 8 * 3]
    # A Linear keeps its input for the weight gradient, a ReLU its output; weights are not activations.
    assert [u.activation_bytes_per_sample for u in model.units] == [0, 16 * F32, 8 * F32, 8 * F32]
    assert all(u.activation_bytes_fixed == 0 for u in model.units)
    assert compute.batch_sizes == [2] and compute.method == "measured"
    assert compute.model_fingerprint == model.fingerprint


def test_lenet_sizes_match_a_hand_count(lenet_profile: tuple) -> None:
    model, _ = lenet_profile
    units = model.units
    assert len(units) == 12
    assert model.input_bytes_per_sample == 32 * 32 * F32
    expected_out = [6 * 28 * 28, 6 * 28 * 28, 6 * 14 * 14, 16 * 10 * 10, 16 * 10 * 10, 16 * 5 * 5, 400,
                    120, 120, 84, 84, 10]
    assert [u.output_bytes_per_sample for u in units] == [n * F32 for n in expected_out]
    expected_weights = {0: 6 * 25 + 6, 3: 16 * 6 * 25 + 16, 7: 400 * 120 + 120, 9: 120 * 84 + 84, 11: 84 * 10 + 10}
    assert [u.weight_bytes for u in units] == [expected_weights.get(i, 0) * F32 for i in range(12)]
    assert units[0].flops_per_sample == 2 * 6 * 28 * 28 * 25
    assert units[3].flops_per_sample == 2 * 16 * 10 * 10 * 6 * 25
    # Convolutions and Linears keep their inputs for backward.
    for i in (0, 3, 7, 9, 11):
        received = units[i - 1].output_bytes_per_sample if i else model.input_bytes_per_sample
        assert units[i].activation_bytes_per_sample == received


@pytest.mark.alone
def test_times_are_positive_and_grow_with_the_batch(lenet_profile: tuple, one_thread: None) -> None:
    _, compute = lenet_profile
    assert compute.batch_sizes == [1, 64]
    assert len(compute.forward_s) == len(compute.backward_s) == 12
    assert compute.inference_s is not None and len(compute.inference_s) == 12
    assert all(t > 0 for row in (*compute.forward_s, *compute.backward_s, *compute.inference_s) for t in row)
    _, wide = profile_model(WIDE_LENET, [1, 64], repeats=3)
    # The convolutions do 64x the work at batch 64; a wide margin covers fixed per-call costs.
    for i in CONV_UNITS:
        assert wide.forward_s[i][1] > 4 * wide.forward_s[i][0]
        assert wide.backward_s[i][1] > 4 * wide.backward_s[i][0]


def test_batch_norm_and_token_models_profile() -> None:
    spec = ModelSpec(name="bert-small", config={"vocab_size": 50, "seq_len": 8, "hidden": 32, "heads": 4,
                                                "layers": 1})
    model, compute = profile_model(spec, [1, 4], repeats=1, warmup=0)
    assert model.input_bytes_per_sample == 8 * 8  # int64 ids
    assert model.units[0].ops == "embedding" and model.units[0].weight_bytes == 50 * 32 * F32
    attention = next(u for u in model.units if "scaled_dot_product_attention" in u.ops)
    # 4 heads x 8 queries x 8 keys x (8 + 8) x 2, plus the QKV and output projections.
    assert attention.flops_per_sample == 2 * 4 * 8 * 8 * 16 + 2 * 8 * 32 * 96 + 2 * 8 * 32 * 32
    assert all(t > 0 for row in compute.forward_s for t in row)

    resnet = ModelSpec(name="resnet18", config={"width": 0.125})
    model, _ = profile_model(resnet, [2], repeats=1, warmup=0)
    bn = model.units[1]
    assert bn.ops == "batchnorm2d"
    channels = 8
    assert bn.weight_bytes == 2 * channels * F32
    assert bn.buffer_bytes == 2 * channels * F32 + 8  # running mean, var and the int64 batch counter
    assert bn.activation_bytes_fixed == 2 * channels * F32  # the batch mean and inverse std it keeps
    assert bn.activation_bytes_per_sample == channels * 32 * 32 * F32
    block = next(u for u in model.units if u.name == "layer1.0")
    # Several same-sized tensors inside the block are kept (conv and BatchNorm inputs, ReLU output).
    assert block.activation_bytes_per_sample >= 3 * block.output_bytes_per_sample


@pytest.mark.alone
def test_a_sleeping_runner_slows_the_measured_times_by_its_factor(one_thread: None) -> None:
    def work(p: ComputeProfile) -> float:
        # The convolutions: long enough that the sleep's own latency does not distort the factor.
        return sum(p.forward_s[i][0] + p.backward_s[i][0] for i in CONV_UNITS)

    # Native and slowed profiles alternate, and the median ratio counts, so that a burst of load from
    # another process on the host skews one pair at most.
    ratios = []
    for _ in range(3):
        _, native = profile_model(WIDE_LENET, [16], repeats=3)
        _, slowed = profile_model(WIDE_LENET, [16], runner=slow(6.0), repeats=3, device_fingerprint="emulated-x6")
        ratios.append(work(slowed) / work(native))
    assert slowed.device_fingerprint == "emulated-x6" and native.device_fingerprint == host_fingerprint()
    assert 2.5 < statistics.median(ratios) < 15.0


def test_the_served_forward_is_timed_in_eval_mode_without_autograd_and_training_resumes() -> None:
    from edgeswarm.profiling import compute

    seen: list[tuple[bool, bool]] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((self.training, torch.is_inference_mode_enabled()))
            return x * 2

    probe = Probe().train()
    x = torch.ones(2, 3, requires_grad=True)
    assert compute._inference_time(probe, x, slow(1.0), repeats=3, warmup=1) > 0
    assert seen == [(False, True)] * 4 and probe.training  # one warm-up and three timed, then back to training


def test_a_call_after_the_device_idled_is_timed_beyond_its_back_to_back_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mechanism on a fake clock: a device whose calls take 1 s back to back and 6 s after it idled (its caches
    and clocks gone cold) pays 5 s a cold call, each timed beside a hot one; never less than nothing."""
    from edgeswarm.profiling import compute

    clock, idled, penalty = [0.0], [False], [5.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        idled[0] = True

    def runner(fn: Callable[[], T]) -> T:
        out = fn()
        clock[0] += 1.0 + (penalty[0] if idled[0] else 0.0)
        idled[0] = False
        return out

    monkeypatch.setattr(compute, "time", SimpleNamespace(perf_counter=lambda: clock[0], sleep=sleep))
    spec = ModelSpec(name="lenet5")
    chain = layer_sequence(build_model(spec).train()).build_stage(0, 12)
    x = compute.example_input(spec, 2)
    gen = torch.Generator().manual_seed(0)
    assert compute._cold_calls(chain, x, runner, 3, gen, None) == (5.0, 5.0, 5.0)
    penalty[0] = -0.5  # faster after an idle: nothing to pay
    assert compute._cold_calls(chain, x, runner, 3, gen, None) == (0.0, 0.0, 0.0)
    assert chain.training and all(p.grad is None for p in chain.parameters())


def test_calibrated_profile_scales_every_time(lenet_profile: tuple) -> None:
    _, native = lenet_profile
    scaled = calibrated_profile(native, 2.5, "device-abc")
    assert scaled.method == "calibrated" and scaled.speed_ratio == 2.5
    assert scaled.device_fingerprint == "device-abc" and scaled.model_fingerprint == native.model_fingerprint
    assert scaled.batch_sizes == native.batch_sizes
    assert scaled.inference_s is not None and native.inference_s is not None
    for mine, theirs in ((scaled.forward_s, native.forward_s), (scaled.backward_s, native.backward_s),
                         (scaled.inference_s, native.inference_s)):
        for row, base in zip(mine, theirs, strict=True):
            assert row == pytest.approx([2.5 * t for t in base], rel=1e-12)
    for field in ("cold_forward_s", "cold_backward_s", "cold_inference_s"):
        assert getattr(scaled, field) == pytest.approx(2.5 * getattr(native, field), rel=1e-12)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ProfilerError, match="positive finite"):
            calibrated_profile(native, bad, "device-abc")


def test_speed_ratio_is_the_fastest_call_through_the_runner_over_the_fastest_native_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The mechanism on a fake clock (a measured ratio under another worker's load is noise: `edgeswarm bench`
    measures): the calibration step costs 1 s and a runner adds 2 s to each call, but two timed calls of each kind are
    disturbed (the host busy): the ratio is exactly 3, the fastest of each (a median, a mean or a ratio per pair would
    give 2, 2.1 or 0.75); a native runner's is 1."""
    from edgeswarm.profiling import compute

    clock = [0.0]
    steps = [0]

    def workload() -> Callable[[], None]:
        def work() -> None:
            steps[0] += 1
            # One untimed step first; then per repeat an untimed step, a timed native one and one through the
            # runner, the second repeat in the other order with an untimed step between (native: the 3rd, 8th and
            # 10th steps).
            clock[0] += 4.0 if steps[0] in (3, 8) else 1.0
        return work

    passes = [0]

    def runner(fn: Callable[[], T]) -> T:
        out = fn()
        passes[0] += 1
        clock[0] += 7.0 if passes[0] in (1, 2) else 2.0
        return out

    monkeypatch.setattr(compute, "_calibration_workload", workload)
    monkeypatch.setattr(compute, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert measure_speed_ratio(runner, repeats=3, budget_s=30.0) == pytest.approx(3.0)
    assert passes[0] == 3 and steps[0] == 1 + 3 * 3 + 1
    assert measure_speed_ratio(lambda fn: fn(), repeats=3) == pytest.approx(1.0)
    # Runner timings that reach the budget (8 s + 8 s) are not repeated: the fastest of the two (both disturbed) over
    # the fastest of every native timing (those go on).
    clock[0], steps[0], passes[0] = 0.0, 0, 0
    assert measure_speed_ratio(runner, repeats=3, budget_s=14.0) == pytest.approx(8.0)
    assert passes[0] == 2 and steps[0] == 1 + 3 * 2 + 2 + 1
    with pytest.raises(ConfigError):
        measure_speed_ratio(slow(2.0), repeats=0)


def test_progress_reports_rising_fractions_up_to_one() -> None:
    calls: list[tuple[float, str]] = []
    profile_model(MLP, [1, 2], repeats=1, warmup=0, progress=lambda f, m: calls.append((f, m)))
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    assert len(calls) == 4 * 3 and all(m for _, m in calls)


@pytest.mark.parametrize("grid", [[], [0], [2, -1], [1.5], ["8"], [True], "8", None])
def test_bad_batch_sizes_are_rejected(grid: object) -> None:
    with pytest.raises(BatchSizeError, match="integers >= 1"):
        profile_model(MLP, grid)  # type: ignore[arg-type]


def test_batch_sizes_are_sorted_and_deduplicated() -> None:
    assert validate_batch_sizes([8, 1, 8, 4]) == [1, 4, 8]
    _, compute = profile_model(MLP, [4, 1, 4], repeats=1, warmup=0)
    assert compute.batch_sizes == [1, 4]


def test_bad_repeats_and_specs_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="repeats"):
        profile_model(MLP, [1], repeats=0)
    with pytest.raises(ConfigError, match="warmup"):
        profile_model(MLP, [1], warmup=-1)
    with pytest.raises(ConfigError, match="unknown model"):
        profile_model(ModelSpec(name="nope"), [1])


def test_profile_units_follow_the_layer_sequence(lenet_profile: tuple) -> None:
    model, _ = lenet_profile
    seq = layer_sequence(build_model(LENET))
    assert [(u.index, u.name, u.ops) for u in model.units] == [(u.index, u.name, u.ops) for u in seq.units]


def test_fingerprints_are_stable_and_tell_devices_apart() -> None:
    host = host_fingerprint()
    assert host == host_fingerprint() and len(host) == 16
    a = DeviceProfile(device_class="rpi4", emulated=True, compute_slowdown=8.0, memory_budget_bytes=1 << 30)
    same_but_memory = a.model_copy(update={"memory_budget_bytes": 1 << 31})
    b = a.model_copy(update={"compute_slowdown": 4.0})
    c = a.model_copy(update={"device_class": "nano"})
    assert device_fingerprint(a) == device_fingerprint(same_but_memory)
    assert len({host, device_fingerprint(a), device_fingerprint(b), device_fingerprint(c)}) == 4


def test_unit_timings_are_scaled_to_the_whole_model_run_as_one_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch size's column is scaled by what the model's units take in a row (one stage, as a worker builds it)
    over the sum of their timings alone: forward, backward and served forward each by their own factor, clipped."""
    import torch

    from edgeswarm.profiling import compute
    from edgeswarm.values.profiles import ModelSpec

    spec = ModelSpec(name="lenet5")
    real_time_unit = compute._time_unit
    calls: list[int] = []

    def time_unit(stage, x, *args, **kwargs):  # type: ignore[no-untyped-def]
        return 0.001, 0.002, real_time_unit(stage, x, None, 1, 0, torch.Generator())[2]

    real_chain_round = compute._chain_round

    def chain_round(model, rows, grid, times, failed, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(list(grid))
        # The whole model, then its two halves, each on its own input at every batch size.
        params = [len(list(stage.parameters())) for stage, _ in rows]
        assert params[0] == len(list(compute.build_model(spec).parameters())) == params[1] + params[2]
        assert [[int(x.shape[0]) for x in inputs] for _, inputs in rows] == [grid] * 3
        assert rows[2][1][0].shape[1:] != rows[0][1][0].shape[1:]  # the second half's input is the first's output
        for j in range(len(grid)):
            times[j].append([(1.0, 1.0, 1.0), (0.3, 0.3, 0.3), (0.4, 0.4, 0.4)])

    cold_at: list[int] = []

    def cold_calls(chain, x, *args, **kwargs):  # type: ignore[no-untyped-def]
        cold_at.append(int(x.shape[0]))
        return (0.01, 0.02, 0.03)

    monkeypatch.setattr(compute, "_time_unit", time_unit)
    monkeypatch.setattr(compute, "_inference_time", lambda *args, **kwargs: 0.0004)
    monkeypatch.setattr(compute, "_chain_round", chain_round)
    monkeypatch.setattr(compute, "_chain_factors", lambda runs, tables, column: ChainFactors(
        whole=(2.0, 1.0, 0.5), half=(runs[0][1][0] + runs[0][2][0], 1.0, 1.0)))
    monkeypatch.setattr(compute, "_cold_calls", cold_calls)
    _, scaled = compute.profile_model(spec, [2, 4], repeats=1, warmup=0)
    # CHAIN_ROUNDS rounds of every batch size, spread over the two passes.
    assert calls == [[2, 4]] * compute.CHAIN_ROUNDS
    assert {t for row in scaled.forward_s for t in row} == {0.002}
    assert {t for row in scaled.backward_s for t in row} == {0.002}
    assert {t for row in scaled.inference_s or [] for t in row} == {0.0002}
    assert scaled.chain == [ChainFactors(whole=(2.0, 1.0, 0.5), half=(0.7, 1.0, 1.0))] * 2
    # The cold calls are measured once, at the smallest batch size.
    assert cold_at == [2]
    assert (scaled.cold_forward_s, scaled.cold_backward_s, scaled.cold_inference_s) == (0.01, 0.02, 0.03)
    # A model whose units in a row do not fit (only one unit's activations at a time did) keeps its units' timings.

    def out_of_memory(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(compute, "_chain_round", real_chain_round)
    monkeypatch.setattr(compute, "_cold_calls", out_of_memory)
    real_unit = time_unit

    def time_unit_or_oom(stage, x, *args, **kwargs):  # type: ignore[no-untyped-def]
        if len(list(stage.parameters())) == len(list(compute.build_model(spec).parameters())):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_unit(stage, x)

    monkeypatch.setattr(compute, "_time_unit", time_unit_or_oom)
    _, alone = compute.profile_model(spec, [2], repeats=1, warmup=0)
    assert {t for row in alone.forward_s for t in row} == {0.001}
    assert {t for row in alone.inference_s or [] for t in row} == {0.0004}
    assert alone.cold_forward_s == 0.0
    assert alone.chain == [ChainFactors(whole=(1.0, 1.0, 1.0), half=(1.0, 1.0, 1.0))]
    # What the factors are: a ratio of the chain to the units' sum, within CHAIN_BOUNDS; the whole's of the median
    # round, the halves' of the median of their sums.
    monkeypatch.undo()
    high, low = CHAIN_BOUNDS[1], CHAIN_BOUNDS[0]
    tiny, ones = [[1e-12] for _ in range(12)], [[0.5], [0.5]]
    factors = compute._chain_factors([[(1.0, 1.0, 1.0), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)]], [tiny, tiny, tiny], 0)
    assert factors == ChainFactors(whole=(high, high, high), half=(high, high, high))
    rounds = [[(1.5, 0.1, 1.0), (0.4, 0.4, 0.4), (0.5, 0.5, 0.5)], [(9.0, 0.1, 1.0), (0.4, 0.4, 0.4), (0.3, 0.3, 0.3)],
              [(1.4, 0.1, 1.0), (0.4, 0.4, 0.4), (0.5, 0.5, 0.5)]]
    assert compute._chain_factors(rounds, [ones, ones, ones], 0) == ChainFactors(whole=(1.5, low, 1.0),
                                                                                 half=(0.9, 0.9, 0.9))
    # A model of one unit has no halves: a stage of it is the whole.
    assert compute._chain_factors([[(1.5, 1.5, 1.5)]], [ones, ones, ones], 0).half == (1.5, 1.5, 1.5)
    # Each batch size's column by its own chain.
    two = [[0.5, 1.0], [0.5, 1.0]]
    assert compute._chain_factors([[(1.5, 1.5, 1.5), (0.6, 0.6, 0.6), (0.6, 0.6, 0.6)]], [two, two, two],
                                  1) == ChainFactors(whole=(0.75, 0.75, 0.75), half=(0.6, 0.6, 0.6))


def test_the_halves_run_on_their_own_inputs_or_not_at_all(caplog: pytest.LogCaptureFixture) -> None:
    """The model's halves by units, the second on the first's output at every batch size; none for a model of one
    unit, nor where the first half cannot run (a stage of the model is then priced as the whole)."""
    from edgeswarm.profiling import compute

    spec = ModelSpec(name="lenet5")
    seq = layer_sequence(build_model(spec).train())
    inputs = [compute.example_input(spec, b) for b in (1, 3)]
    head, tail = compute._halves("lenet5", seq, inputs)
    assert head[1] is inputs and [int(x.shape[0]) for x in tail[1]] == [1, 3]
    with torch.no_grad():
        whole = seq.build_stage(0, len(seq))(inputs[1])
        torch.testing.assert_close(tail[0](tail[1][1]), whole)
    assert compute._halves("lenet5", layer_sequence(build_model(spec).train()), [torch.zeros(2, 5)]) == []
    assert "first half could not run" in caplog.text


def test_rounds_of_the_units_in_a_row_are_spread_over_the_passes() -> None:
    """The chain's rounds follow the passes evenly, the last after the last pass, whatever the grid's length."""
    from edgeswarm.profiling.compute import _round_points

    assert _round_points(5, 5) == [1, 1, 1, 1, 1]
    assert _round_points(1, 5) == [5]
    assert _round_points(2, 5) == [2, 3]
    assert _round_points(10, 5) == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]
    assert all(sum(_round_points(n, 5)) == 5 and _round_points(n, 5)[-1] >= 1 for n in range(1, 65))


def test_a_slow_moment_during_the_profile_does_not_set_a_batch_sizes_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host slowed 2x while one round of the units in a row ran (a slow moment at the end of the profile, as
    right after a venv build): the median of the rounds keeps every batch size's column at its usual time."""
    import torch

    from edgeswarm.profiling import compute
    from edgeswarm.values.profiles import ModelSpec

    spec = ModelSpec(name="lenet5")
    real_time_unit = compute._time_unit
    rounds: list[int] = []

    def time_unit(stage, x, runner, repeats, warmup, gen, *args, **kwargs):  # type: ignore[no-untyped-def]
        whole = len(list(stage.parameters())) == len(list(compute.build_model(spec).parameters()))
        slow = 2.0 if whole and len(rounds) == compute.CHAIN_ROUNDS else 1.0  # the last round runs slow
        base = 0.01 if whole else 0.001
        return base * slow, base * slow, real_time_unit(stage, x, None, 1, 0, torch.Generator())[2]

    real_round = compute._chain_round

    def chain_round(*args, **kwargs):  # type: ignore[no-untyped-def]
        rounds.append(1)
        real_round(*args, **kwargs)

    monkeypatch.setattr(compute, "_time_unit", time_unit)
    monkeypatch.setattr(compute, "_inference_time", lambda *args, **kwargs: 0.0004)
    monkeypatch.setattr(compute, "_chain_round", chain_round)
    monkeypatch.setattr(compute, "_cold_calls", lambda *args, **kwargs: (0.0, 0.0, 0.0))
    _, profile = compute.profile_model(spec, [1, 2, 4, 8, 16], repeats=1, warmup=0)
    units = len(profile.forward_s)
    for j in range(5):
        assert sum(row[j] for row in profile.forward_s) == pytest.approx(min(2.0, 0.01 / (0.001 * units)) * 0.001
                                                                          * units)
