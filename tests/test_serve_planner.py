"""The serve-pipeline planner: spec partition-placement-inference A1-A10, R2/R4-R7 at reduced trials, and the
compute-aware extensions of plan_serving (per-node budgets, slow devices, leaving nodes out, brute force)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from edgeswarm.errors import InfeasiblePlanError
from edgeswarm.pipeline_serve.bench_sim import lb_ratio, run_config
from edgeswarm.planning.serve.bandwidth import PATH_LOSS_A, bandwidth_from_positions, random_bandwidths
from edgeswarm.planning.serve.classes import bandwidth_classes, class_edges
from edgeswarm.planning.serve.costs import serve_costs
from edgeswarm.planning.serve.graph import (
    REFERENCE_TRANSFER,
    Layer,
    LayerGraph,
    candidate_points,
    linearise,
    longest_path_depths,
    singletons,
)
from edgeswarm.planning.serve.keras_models import MODELS
from edgeswarm.planning.serve.kpath import ColourCodingKPath, ExactKPath, bottleneck_kpath
from edgeswarm.planning.serve.partition import Status, capacity_fits, part_memories, partition
from edgeswarm.planning.serve.placement import (
    bottleneck,
    lower_bound,
    place_greedy,
    place_kpath,
    place_optimal,
    random_clean,
)
from edgeswarm.planning.serve.plan import Candidate, plan_serving, price
from edgeswarm.planning.serve.types import ServeOptions, ServePlan
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
from edgeswarm.values.profiles import ClusterProfile, ModelSpec

MIB = 2**20
GIB = 2**30


def toy_graph() -> tuple[LayerGraph, list[str]]:
    names = "s a b c e f g h i o".split()
    edges = "s-a a-b b-c c-e a-e e-f f-g f-h g-i h-i i-o".split()
    inputs: dict[str, list[str]] = {n: [] for n in names}
    for e in edges:
        src, dst = e.split("-")
        inputs[dst].append(src)
    return LayerGraph(tuple(Layer(n, tuple(inputs[n]), 10) for n in names)), names


def test_a1_linearisation_on_the_toy_dag() -> None:
    g, names = toy_graph()
    lp = longest_path_depths(g)
    assert dict(zip(names, lp, strict=True)) == {"s": 0, "a": 1, "b": 2, "c": 3, "e": 4, "f": 5, "g": 6, "h": 6,
                                                 "i": 7, "o": 8}
    assert [names[v] for v in singletons(lp)] == ["s", "a", "b", "c", "e", "f", "i", "o"]
    assert [names[v] for v in candidate_points(g)] == ["s", "a", "e", "f", "i", "o"]


A2_T = [5.0, 8.0, 2.0, 6.0, 1.0, 0.0]
A2_M = [30.0] * 5


def test_a2_normative_partition_dp() -> None:
    p = partition(A2_T, A2_M, 70, 3)
    assert (p.status, p.cuts, p.transfers, p.cost, p.parts) == (Status.OK, (2, 4), (2.0, 1.0), 3.0, 3)
    assert partition(A2_T, A2_M, 70, 2).status == Status.INFEASIBLE


def test_a3_reference_mode_reproduces_the_off_by_one() -> None:
    ref = partition(A2_T, A2_M, 70, 3, mode="reference")
    assert (ref.status, ref.cuts, ref.cost, ref.parts) == (Status.OK, (2,), 2.0, 2)
    assert max(part_memories(A2_M, ref.cuts)) == 90 > 70
    assert not capacity_fits(A2_M, 70)(2, 5)  # normative mode rejects the second part
    assert partition(A2_T, A2_M, 70, 3).cuts != ref.cuts


def test_a4_bandwidth_classes() -> None:
    assert class_edges([0, 1, 2, 6, 8], 2).tolist() == [0, 4, 8]
    assert bandwidth_classes([6, 6, 1], [0, 1, 2, 6, 8], 2) == [2, 2, 1]
    assert bandwidth_classes([8], [0, 1, 2, 6, 8], 5, clamp=False) == [6]
    assert bandwidth_classes([8], [0, 1, 2, 6, 8], 5) == [5]


def a5_graph() -> np.ndarray:
    nodes = "ABCDEF"
    bw = np.full((6, 6), np.inf)
    for item in ("A-B 10, A-C 3, A-D 4, A-E 2, A-F 5, B-C 9, B-D 1, B-E 6, B-F 2, C-D 7, C-E 3, C-F 8, D-E 5, "
                 "D-F 2, E-F 4").split(", "):
        pair, value = item.split()
        a, b = (nodes.index(x) for x in pair.split("-"))
        bw[a, b] = bw[b, a] = float(value)
    return bw


def test_a5_kpath_placement_toy() -> None:
    bw = a5_graph()
    t = [6.0, 6.0, 1.0]
    run = bottleneck_kpath(bw, range(6), 3, weights=t[:2])
    assert run.path == (0, 1, 2) and run.theta == 9
    k = place_kpath(t, [2, 2, 1], 2, bw, ExactKPath())
    assert k.nodes == (0, 1, 2, 5) and k.beta == pytest.approx(6 / 9)
    assert place_greedy(t, bw).beta == pytest.approx(6 / 9)
    opt = place_optimal(t, bw)
    assert opt.beta == pytest.approx(6 / 9) and bottleneck(t, (0, 1, 2, 3), bw) == pytest.approx(6 / 9)
    assert lower_bound(t, bw) == pytest.approx(0.6) and k.beta / lower_bound(t, bw) == pytest.approx(10 / 9)


def test_a6_placement_properties() -> None:
    rng = np.random.default_rng(6)
    for _ in range(200):
        bw = random_bandwidths(8, rng)
        q = int(rng.integers(2, 6))
        t = rng.uniform(1, 20, q - 1).tolist()
        all_t = [*t, *rng.uniform(0, 25, 5).tolist()]
        cls = bandwidth_classes(t, all_t, 5)
        k = place_kpath(t, cls, 5, bw, ExactKPath())
        g = place_greedy(t, bw)
        opt = place_optimal(t, bw)
        assert k.status == Status.OK and len(set(k.nodes)) == q
        assert opt.beta <= k.beta + 1e-12 and opt.beta <= g.beta + 1e-12
        assert lower_bound(t, bw) <= opt.beta + 1e-12
        if q == 2:
            assert k.beta == pytest.approx(lower_bound(t, bw)) == pytest.approx(opt.beta)


def test_a6_fixed_endpoints_are_respected() -> None:
    bw = a5_graph()
    # Class 2 fixes partitions 1..2; the class-1 runs on either side must end on those nodes.
    k = place_kpath([1.0, 6.0, 1.0], [1, 2, 1], 2, bw, ExactKPath())
    assert k.nodes[1:3] in ((0, 1), (1, 0)) and len(set(k.nodes)) == 4


def test_a7_colour_coding_agrees_with_exact() -> None:
    rng = np.random.default_rng(7)
    agree = total = 0
    for trial in range(40):
        n = int(rng.integers(6, 13))
        bw = random_bandwidths(n, rng)
        k = int(rng.integers(2, 5))
        exact = bottleneck_kpath(bw, range(n), k, oracle=ExactKPath())
        colour = bottleneck_kpath(bw, range(n), k, oracle=ColourCodingKPath(np.random.default_rng(trial)))
        total += 1
        agree += exact.theta == colour.theta
    assert agree / total >= 0.99


def test_a8_binary_search_threshold_is_the_largest_feasible() -> None:
    rng = np.random.default_rng(8)
    for _ in range(30):
        n = int(rng.integers(4, 8))
        bw = random_bandwidths(n, rng)
        k = int(rng.integers(2, n + 1))
        res = bottleneck_kpath(bw, range(n), k)
        brute = max(min(bw[p[i], p[i + 1]] for i in range(k - 1)) for p in itertools.permutations(range(n), k))
        assert res.theta == brute


def test_a9_bandwidth_generator_statistics() -> None:
    rng = np.random.default_rng(9)
    a = rng.random((100_000, 2)) * 149 + 1
    b = rng.random((100_000, 2)) * 149 + 1
    d2 = ((a - b) ** 2).sum(axis=1)
    bws = np.log2(1 + PATH_LOSS_A / d2)
    assert 5.9 <= bws.mean() <= 6.2 and bws.min() >= 2.88
    pos = np.array([[1.0, 1.0], [4.0, 5.0]])
    assert abs(bandwidth_from_positions(pos)[0, 1] - math.log2(1 + 283230 / 25)) < 1e-12


def test_a10_transfer_size_formula() -> None:
    assert REFERENCE_TRANSFER.mbit(392_000, 1) == pytest.approx(16.6151, abs=5e-5)
    assert REFERENCE_TRANSFER.mbit(133_120, 1) == pytest.approx(5.6424, abs=5e-5)
    assert REFERENCE_TRANSFER.mbit(392_000, 4) == pytest.approx(4 * 16.6151, abs=2e-4)


def test_keras_graphs_match_the_published_parameter_counts_and_irv2_points() -> None:
    counts = {"ResNet50": 25_636_712, "MobileNetV2": 3_538_984, "InceptionResNetV2": 55_873_736,
              "EfficientNetB1": 7_856_239}
    for name, want in counts.items():
        assert sum(ly.params for ly in MODELS[name]().layers) == want, name
    lin = linearise(MODELS["InceptionResNetV2"]())
    assert len(lin.names) == 105
    assert lin.names[:20] == ("input_1", "conv2d", "batch_normalization", "activation", "conv2d_1",
                              "batch_normalization_1", "activation_1", "conv2d_2", "batch_normalization_2",
                              "activation_2", "max_pooling2d", "conv2d_3", "batch_normalization_3", "activation_3",
                              "conv2d_4", "batch_normalization_4", "activation_4", "max_pooling2d_1", "mixed_5b",
                              "block35_1")
    assert lin.names[-7:] == ("block8_9_ac", "block8_10", "conv_7b", "conv_7b_bn", "conv_7b_ac", "avg_pool",
                              "predictions")
    assert 355 < sum(lin.memories) / MIB < 370  # spec 2.2: about 362 MiB


def test_r2_statuses() -> None:
    irv2 = linearise(MODELS["InceptionResNetV2"]())
    r50 = linearise(MODELS["ResNet50"]())
    for mode in ("reference", "normative"):
        assert partition(irv2.transfers, irv2.memories, 64 * MIB, 5, mode).status == Status.INFEASIBLE
        assert partition(irv2.transfers, irv2.memories, 512 * MIB, 5, mode).status == Status.SINGLE_PARTITION
        for cap in (256, 512):
            assert partition(r50.transfers, r50.memories, cap * MIB, 5, mode).status == Status.SINGLE_PARTITION


def test_r4_r5_orderings_at_reduced_trials() -> None:
    for model, cap in (("ResNet50", 64), ("InceptionResNetV2", 128)):
        small = run_config(model, cap, 5, 8)
        big = run_config(model, cap, 50, 8)
        assert big.random.mean / big.kpath.mean >= 4  # type: ignore[operator]
        assert abs(big.kpath.mean - big.greedy.mean) / big.greedy.mean <= 0.15  # type: ignore[operator]
        assert big.kpath.mean < small.kpath.mean and big.greedy.mean < small.greedy.mean  # type: ignore[operator]


def test_r6_lb_ratio_at_reduced_trials() -> None:
    assert lb_ratio("MobileNetV2", 30) == pytest.approx(1.0, abs=0.005)
    assert 1.15 < lb_ratio("ResNet50", 30) < 1.4  # type: ignore[operator]


def test_r7_normative_never_exceeds_capacity() -> None:
    for name in MODELS:
        lin = linearise(MODELS[name]())
        for cap in (64, 128, 256):
            for n in (5, 10, 50):
                p = partition(lin.transfers, lin.memories, cap * MIB, n)
                if p.status != Status.INFEASIBLE:
                    assert max(part_memories(lin.memories, p.cuts)) < cap * MIB
                    assert p.parts <= n


def test_clean_random_baseline_is_feasible() -> None:
    rng = np.random.default_rng(1)
    fits = capacity_fits(A2_M, 70)
    for _ in range(50):
        p = random_clean(A2_T, fits, 5, random_bandwidths(6, rng), rng)
        # 30 MB segments under a 70 MB cap: two per part at most, so 3 to 5 parts on distinct nodes.
        assert p.status == Status.OK and 3 <= len(p.nodes) <= 5 and len(set(p.nodes)) == len(p.nodes)


# --- compute-aware plan_serving -----------------------------------------------------------------------------


def cluster(devices: list[SyntheticDevice], units: int = 12, seed: int = 0, bandwidth_bps: float = 12.5e6,
            bandwidths: dict[tuple[str, str], float] | None = None) -> ClusterProfile:
    return synthetic_cluster(units, devices, bandwidth_bps=bandwidth_bps, seed=seed, bandwidths=bandwidths)


def recomputed_beta(plan: ServePlan) -> float:
    return max(max(s.compute_s for s in plan.stages), max(s.transfer_in_s for s in plan.stages))


def brute_force_beta(cl: ClusterProfile, options: ServeOptions) -> float:
    costs = serve_costs(cl, options.micro_batch_size)
    L = costs.units
    best = math.inf
    for q in range(1, min(costs.n, options.max_stages or costs.n) + 1):
        for cuts in itertools.combinations(range(1, L), q - 1):
            edges = [0, *cuts, L]
            bounds = tuple(zip(edges[:-1], edges[1:], strict=True))
            for devs in itertools.permutations(range(costs.n), q):
                p = price(costs, Candidate(bounds, devs, "brute"))
                if p.fits:
                    best = min(best, p.beta)
    return best


def test_optimal_agrees_with_brute_force_on_small_random_clusters() -> None:
    rng = np.random.default_rng(3)
    for trial in range(12):
        n = int(rng.integers(2, 5))
        devs = [SyntheticDevice(f"d{i}", float(rng.uniform(1, 6)), int(rng.uniform(0.05, 0.6) * GIB))
                for i in range(n)]
        bws = {(f"d{i}", f"d{j}"): float(rng.uniform(1e6, 50e6)) for i in range(n) for j in range(i + 1, n)}
        cl = cluster(devs, units=7, seed=trial, bandwidths=bws)
        options = ServeOptions(method="optimal", micro_batch_size=4)
        want = brute_force_beta(cl, options)
        if math.isinf(want):
            with pytest.raises(InfeasiblePlanError):
                plan_serving(cl, options)
            continue
        plan = plan_serving(cl, options)
        assert plan.bottleneck_s == pytest.approx(want, rel=1e-9)
        auto = plan_serving(cl, options.model_copy(update={"method": "auto"}))
        assert auto.bottleneck_s <= plan.bottleneck_s * (1 + 1e-9)


def test_plan_is_consistent_and_within_every_budget() -> None:
    devs = [SyntheticDevice("big", 1.0, 2 * GIB), SyntheticDevice("mid", 2.0, GIB // 4),
            SyntheticDevice("small", 1.5, GIB // 16), SyntheticDevice("tiny", 1.0, GIB // 64)]
    cl = cluster(devs, units=20)
    for method in ("auto", "kpath", "greedy", "optimal"):
        plan = plan_serving(cl, ServeOptions(method=method, micro_batch_size=8))
        plan.validate_stages(20)
        assert plan.bottleneck_s == pytest.approx(recomputed_beta(plan))
        assert plan.latency_s == pytest.approx(sum(s.compute_s + s.transfer_in_s for s in plan.stages))
        assert plan.throughput_per_s == pytest.approx(8 / plan.bottleneck_s)
        assert all(s.memory_bytes <= s.memory_budget_bytes for s in plan.stages)
        assert plan.stages[0].transfer_in_s == 0.0
        assert ServePlan.model_validate_json(plan.model_dump_json()) == plan


def test_a_slow_device_gets_a_short_stage_or_none() -> None:
    devs = [SyntheticDevice("fast-0", 1.0, GIB), SyntheticDevice("fast-1", 1.0, GIB),
            SyntheticDevice("slow", 8.0, GIB)]
    plan = plan_serving(cluster(devs, units=16, bandwidth_bps=1e9), ServeOptions(micro_batch_size=8))
    lengths = {s.device: s.end - s.start for s in plan.stages}
    assert lengths.get("slow", 0) < min(lengths["fast-0"], lengths["fast-1"])


def test_a_node_is_left_out_when_that_is_faster() -> None:
    devs = [SyntheticDevice("a", 1.0, GIB), SyntheticDevice("b", 1.0, GIB), SyntheticDevice("far", 1.0, GIB)]
    # "far" sits behind a very slow link: any stage on it waits longer than the whole model takes on "a".
    bws = {("a", "far"): 1e3, ("b", "far"): 1e3}
    plan = plan_serving(cluster(devs, units=10, bandwidth_bps=1e9, bandwidths=bws), ServeOptions())
    assert "far" not in plan.devices and len(plan.stages) >= 1


def test_max_stages_and_exclude() -> None:
    devs = [SyntheticDevice(f"d{i}", 1.0, GIB) for i in range(4)]
    cl = cluster(devs, units=12, bandwidth_bps=1e9)
    assert len(plan_serving(cl, ServeOptions(max_stages=2)).stages) <= 2
    assert "d0" not in plan_serving(cl, ServeOptions(exclude=["d0"])).devices


def test_infeasible_says_which_budget_is_short() -> None:
    devs = [SyntheticDevice("a", 1.0, 2 * MIB), SyntheticDevice("b", 1.0, 2 * MIB)]
    with pytest.raises(InfeasiblePlanError, match="short by"):
        plan_serving(cluster(devs, units=10), ServeOptions())


def test_eight_devices_by_a_hundred_units_plans() -> None:
    devs = [SyntheticDevice(f"d{i}", 1.0 + 0.5 * i, (1 + i % 3) * GIB // 4) for i in range(8)]
    plan = plan_serving(cluster(devs, units=100), ServeOptions(micro_batch_size=4))
    plan.validate_stages(100)
    assert plan.bottleneck_s == pytest.approx(recomputed_beta(plan))


def test_plan_serving_on_a_real_zoo_model_profile() -> None:
    from edgeswarm.profiling.compute import profile_model
    from edgeswarm.values.profiles import ComputeProfile, DeviceInfo, DeviceProfileEntry, LinkProfile

    model, compute = profile_model(ModelSpec(name="lenet5"), [1, 8], repeats=1, warmup=0)
    entries = []
    for node, factor in (("fast", 1.0), ("slow", 4.0), ("mid", 2.0)):
        scaled = ComputeProfile(model_fingerprint=compute.model_fingerprint, device_fingerprint=f"{node}-fp",
                                batch_sizes=compute.batch_sizes,
                                forward_s=[[factor * t for t in row] for row in compute.forward_s],
                                backward_s=[[factor * t for t in row] for row in compute.backward_s])
        entries.append(DeviceProfileEntry(device=DeviceInfo(node=node, fingerprint=f"{node}-fp",
                                                            memory_budget_bytes=GIB), compute=scaled))
    links = [LinkProfile(src=a, dst=b, bandwidth_bps=12.5e6, latency_s=1e-3)
             for a, b in itertools.combinations(["fast", "slow", "mid"], 2)]
    cl = ClusterProfile(model=model, devices=entries, links=links)
    plan = plan_serving(cl, ServeOptions(micro_batch_size=8))
    plan.validate_stages(len(model.units))
    assert plan.model_fingerprint == model.fingerprint
    assert plan.bottleneck_s == pytest.approx(recomputed_beta(plan))
    assert plan.bottleneck_s <= plan_serving(cl, ServeOptions(micro_batch_size=8, method="kpath")).bottleneck_s


def test_serving_is_priced_on_the_served_forward_where_the_profile_has_one() -> None:
    """A served stage runs without autograd: the plan prices it on ``inference_s``, training's forward only for a
    profile from before it."""
    devs = [SyntheticDevice("a", 1.0, GIB), SyntheticDevice("b", 2.0, GIB)]
    training = cluster(devs, units=12, bandwidth_bps=1e12)
    served = training.model_copy(update={"devices": [e.model_copy(update={"compute": e.compute.model_copy(update={
        "inference_s": [[t / 2 for t in row] for row in e.compute.forward_s]})}) for e in training.devices]})
    options = ServeOptions(micro_batch_size=8)
    before, after = plan_serving(training, options), plan_serving(served, options)
    assert after.latency_s == pytest.approx(before.latency_s / 2, rel=1e-3)  # the transfers stay
    assert [(s.start, s.end, s.device) for s in after.stages] == [(s.start, s.end, s.device) for s in before.stages]


def test_each_stage_pays_its_devices_cold_call_once_per_micro_batch() -> None:
    """A stage's forward of a micro-batch costs its units plus its device's cold cost (ComputeProfile.
    cold_inference_s) once; the exact search prices it as the brute force does."""
    devs = [SyntheticDevice("a", 1.0, GIB), SyntheticDevice("b", 2.0, GIB), SyntheticDevice("c", 3.0, GIB)]
    plain = cluster(devs, units=7, bandwidth_bps=50e6)
    cold = plain.model_copy(update={"devices": [e.model_copy(update={"compute": e.compute.model_copy(update={
        "cold_inference_s": 0.004 * (i + 1)})}) for i, e in enumerate(plain.devices)]})
    before, after = serve_costs(plain, 4), serve_costs(cold, 4)
    for d in range(3):
        assert after.compute_s(d, 2, 6) == pytest.approx(before.compute_s(d, 2, 6) + 0.004 * (d + 1))
        assert after.compute_s(d, 3, 3) == 0.0
    options = ServeOptions(method="optimal", micro_batch_size=4)
    plan = plan_serving(cold, options)
    assert plan.bottleneck_s == pytest.approx(brute_force_beta(cold, options), rel=1e-9)
    index = {e.device.node: i for i, e in enumerate(cold.devices)}
    for stage in plan.stages:
        d = index[stage.device]
        assert stage.compute_s == pytest.approx(before.compute_s(d, stage.start, stage.end) + 0.004 * (d + 1))
