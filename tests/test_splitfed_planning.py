"""The SmartSplit planner (spec smartsplit-split-fl.md sections 2, 4, 5.3, 6.3; unit checks U1-U8, U11):
statistics, cost model, objective and decode, solvers, importance scheduling, recomputation decisions, and
plan_round on the paper's 100-device fleet."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgeswarm.errors import InfeasiblePlanError, PlanTooLargeError
from edgeswarm.planning.splitfed.cost import (
    LABEL_BYTES,
    cost_table,
    cut_costs,
    device_memory,
    feasible_cuts,
    iteration_bytes,
    round_time,
    unit_work,
)
from edgeswarm.planning.splitfed.objective import closest_cuts, decode, normalisers
from edgeswarm.planning.splitfed.plan import plan_round
from edgeswarm.planning.splitfed.quality import bo_quality
from edgeswarm.planning.splitfed.recompute import (
    Segment,
    device_segments,
    extra_forwards,
    plan_recompute,
)
from edgeswarm.planning.splitfed.scheduling import fine_select, pick, quotas
from edgeswarm.planning.splitfed.solvers import bayesian, exhaustive, global_oracle, grid
from edgeswarm.planning.splitfed.statistics import dis, stat, stat_from_sums
from edgeswarm.planning.splitfed.synthetic import paper_devices, random_instance
from edgeswarm.planning.splitfed.types import (
    ModelCost,
    SplitDevice,
    SplitMec,
    SplitOptions,
    SplitPlanError,
    UnitCost,
)
from edgeswarm.planning.vocabulary import messages

MB = 10**6


def chain_model(units: int = 10, batch_size: int = 32, classes: int = 10, scale: float = 1.0,
                name: str = "chain") -> ModelCost:
    """A VGG-like chain: early units have large activations and few parameters, late ones the reverse; every
    third unit is cheap (an activation or pooling). ``scale`` multiplies every byte and FLOP count."""
    out = []
    for u in range(units):
        depth = u / max(1, units - 1)
        act = int(scale * batch_size * 4 * 200_000 * (1 - depth) ** 2 + batch_size * 4 * 1000)
        params = int(scale * 4 * 2_000_000 * depth ** 2 + 4 * 1000)
        flops = scale * batch_size * 2e8 * (1.2 - depth)
        cheap = u % 3 == 2
        out.append(UnitCost(name=f"u{u}", flops_fwd=flops * (0.05 if cheap else 1.0),
                            flops_bwd=2 * flops * (0.05 if cheap else 1.0), out_bytes=act,
                            param_bytes=0 if cheap else params, act_bytes=act, backward_bytes=2 * act,
                            expensive=not cheap))
    return ModelCost(name=name, batch_size=batch_size, units=out, optimizer_states=1, classes=classes)


# --- U1, U2: statistics --------------------------------------------------------------------------------


def test_dis_is_kl_from_uniform_in_nats() -> None:
    assert dis([0.1] * 10) == pytest.approx(0.0, abs=1e-12)
    assert dis([1.0] + [0.0] * 9) == pytest.approx(2.302585, abs=1e-6)
    assert dis([0.5, 0.5] + [0.0] * 8) == pytest.approx(1.609438, abs=1e-6)
    assert dis([5, 5] + [0] * 8) == pytest.approx(math.log(5))  # counts normalise like probabilities
    with pytest.raises(ValueError):
        dis([0.5, -0.1, 0.6])


def test_stat_is_size_times_rms_loss() -> None:
    assert stat([1, 1, 1, 1]) == pytest.approx(4.0)
    assert stat([3, 4]) == pytest.approx(7.0711, abs=1e-4)
    assert stat([3, 4]) == pytest.approx(math.sqrt(2 * 25))
    assert stat([]) == 0.0
    assert stat_from_sums(2, 25.0) == pytest.approx(stat([3, 4]))


# --- U3, U4, U11: cost model ---------------------------------------------------------------------------


def _u3_model(memory_mb: list[float] | None = None) -> ModelCost:
    flops = [2e9, 4e9, 4e9, 1e9]
    outs = [4 * MB, 2 * MB, 1 * MB, 1000]
    mem = memory_mb or [0, 0, 0, 0]
    return ModelCost(name="u3", batch_size=1, units=[
        UnitCost(name=f"l{k}", flops_fwd=flops[k], flops_bwd=0.0, out_bytes=outs[k], param_bytes=0,
                 act_bytes=int(mem[k] * MB)) for k in range(4)])


def _u3_device(budget: int = 10**9) -> SplitDevice:
    return SplitDevice(node="d0", mec="m0", speed_flops=1e9, link_bytes_s=1e6, budget_bytes=budget, samples=1)


PAPER = SplitOptions(latency_model="paper", comm_buffers=False)


def test_paper_literal_latency_matches_eq4() -> None:
    model, mec = _u3_model(), SplitMec(node="m0", speed_flops=1e11)
    got = [round_time(model, _u3_device(), mec, j, PAPER) for j in (1, 2, 3, 4)]
    assert got == pytest.approx([6.09, 8.05, 11.01, 11.0])


def test_feasible_cuts_follow_device_memory() -> None:
    model, mec = _u3_model([10, 30, 30, 5]), SplitMec(node="m0", speed_flops=1e11)
    cuts = feasible_cuts(model, _u3_device(45 * MB), PAPER)
    assert cuts == [1, 2]
    best = min(cuts, key=lambda j: round_time(model, _u3_device(45 * MB), mec, j, PAPER))
    assert best == 1
    assert round_time(model, _u3_device(45 * MB), mec, best, PAPER) == pytest.approx(6.09)
    assert feasible_cuts(model, _u3_device(9 * MB), PAPER) == []
    with pytest.raises(InfeasiblePlanError, match="largest budget"):
        plan_round(model, [_u3_device(9 * MB)], [mec], PAPER)


def test_device_memory_counts_front_tail_buffers_and_optimizer_state() -> None:
    units = [UnitCost(name=f"u{k}", flops_fwd=1.0, flops_bwd=2.0, out_bytes=100 * (k + 1), param_bytes=10,
                      act_bytes=1000) for k in range(5)]
    model = ModelCost(name="m", batch_size=4, units=units, optimizer_states=2)
    per_unit = 10 * (2 + 2) + 1000
    # cut 2, tail 1: units 1-2 and 5 on the device, buffers 2 (O(2) + O(4)).
    assert device_memory(model, 2, 1, overhead_bytes=7) == 3 * per_unit + 2 * (200 + 400) + 7
    assert device_memory(model, 4, 1) == 5 * per_unit  # no offload: nothing crosses
    assert device_memory(model, 2, 1, buffers=False) == 3 * per_unit


def test_bytes_per_iteration_by_protocol() -> None:
    model = chain_model(units=6, batch_size=8)
    o = [u.out_bytes for u in model.units]
    assert iteration_bytes(model, 2, 1, "usplit") == 2 * (o[1] + o[4])
    assert iteration_bytes(model, 2, 0, "vanilla") == 2 * o[1] + LABEL_BYTES * 8
    assert iteration_bytes(model, 2, 0, "paper") == o[1]
    assert iteration_bytes(model, 5, 1, "usplit") == 0


def test_round_time_counts_epochs_sync_and_mec_sharing() -> None:
    model = chain_model(units=6, batch_size=8)
    dev = SplitDevice(node="d", mec="m", speed_flops=2e9, link_bytes_s=5e6, budget_bytes=10**10, samples=20)
    mec = SplitMec(node="m", speed_flops=1e11)
    opts = SplitOptions(epochs=3)
    costs = cut_costs(model, opts)
    t1 = round_time(model, dev, mec, 2, opts)
    t2 = round_time(model, dev, mec, 2, opts, sharing=2)
    iters = 3 * 3  # E * ceil(20 / 8)
    assert t2 - t1 == pytest.approx(iters * costs.mec_flops[1] / 1e11)
    sync = 2 * costs.device_params[1] / 5e6
    t_iter = (costs.device_flops[1] / 2e9 + costs.mec_flops[1] / 1e11 + costs.transfer_bytes[1] / 5e6)
    assert t1 == pytest.approx(iters * t_iter + sync)


def test_a_selected_devices_round_is_its_compute_its_transfers_its_mecs_half_and_the_rest() -> None:
    """Each selected device's round, as ``edgeswarm explain`` lines it up: what the device computes, what its
    iterations' tensors take on its link, what its MEC computes for it (shared with the MEC's other device), and the
    rest, its part's weights down and up and its measured setup."""
    model = chain_model(units=6, batch_size=8)
    devices = [SplitDevice(node=f"d{i}", mec="m", speed_flops=2e9 * (i + 1), link_bytes_s=5e6, budget_bytes=10**10,
                           samples=20, setup_s=0.05) for i in range(2)]
    mec = SplitMec(node="m", speed_flops=1e11)
    opts = SplitOptions(epochs=3, participants=2, gamma=1.0, fixed_cut=2)
    costs = cut_costs(model, opts)
    iters = 3 * 3
    sel = plan_round(model, devices, [mec], opts)
    assert [d.node for d in sel.selected] == ["d0", "d1"]
    for i, d in enumerate(sel.selected):
        assert d.compute_s == pytest.approx(iters * costs.device_flops[1] / (2e9 * (i + 1)))
        assert d.transfer_s == pytest.approx(iters * costs.transfer_bytes[1] / 5e6)
        assert d.mec_s == pytest.approx(iters * costs.mec_flops[1] * 2 / 1e11)  # the MEC trains both at once
        rest = d.round_s - d.compute_s - d.transfer_s - d.mec_s
        assert rest == pytest.approx(2 * costs.device_params[1] / 5e6 + 0.05)


def test_a_part_is_priced_by_its_nodes_profiled_unit_seconds_not_its_flops_share() -> None:
    """A node's speed sets the level of its iteration, its profile's unit shares where a cut falls in it: a device
    whose profile spent half its seconds in the first unit computes half its iteration's seconds at cut 1, whatever
    that unit's share of the FLOPs (LeNet-5's first convolution: a fifth of the FLOPs, three fifths of the
    seconds); the MEC's middle likewise by the MEC's shares; the FLOPs' shares where a profile gave none."""
    model = chain_model(units=6, batch_size=8)
    opts = SplitOptions(epochs=3, participants=2, gamma=1.0, fixed_cut=1)
    total = sum(u.flops_fwd + u.flops_bwd for u in model.units)
    front = [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]
    mec_share = [0.0, 0.4, 0.1, 0.1, 0.2, 0.2]
    shaped = SplitDevice(node="d0", mec="m", speed_flops=2e9, link_bytes_s=5e6, budget_bytes=10**10, samples=20,
                         unit_share=tuple(front))
    plain = shaped.model_copy(update={"node": "d1", "unit_share": ()})
    mec = SplitMec(node="m", speed_flops=1e11, unit_share=tuple(mec_share))
    iters, costs = 3 * 3, cut_costs(model, opts)
    table = cost_table(model, [shaped, plain], [mec], opts)
    # cut 1 keeps the first unit and the tail (the last unit) on the device.
    assert table.compute_s[0, 0] == pytest.approx(iters * total * (0.5 + 0.1) / 2e9)
    assert table.compute_s[1, 0] == pytest.approx(iters * costs.device_flops[0] / 2e9)
    assert table.mec_work[0, 0] == pytest.approx(iters * total * (0.4 + 0.1 + 0.1 + 0.2))
    assert table.mec_work[1, 0] == pytest.approx(table.mec_work[0, 0])  # the MEC's shares, whoever it trains for
    # The whole iteration costs what the speed says, however it is shared out.
    assert cost_table(model, [shaped], [mec], opts.model_copy(update={"fixed_cut": 5})).compute_s[0, 4] == \
        pytest.approx(iters * total / 2e9)
    # round_time prices a device alone the same way as the table.
    sharing_free = round_time(model, shaped, mec, 1, opts)
    assert sharing_free == pytest.approx(float(table.times(np.array([0]), np.array([1]), np.array([1]))[0]))
    assert np.allclose(unit_work(model, [2 * x for x in front]), [total * x for x in front])
    with pytest.raises(SplitPlanError, match="do not fit"):
        unit_work(model, [1.0, 1.0])


def test_every_message_on_the_device_link_is_priced() -> None:
    model = chain_model(units=6, batch_size=8)
    free = SplitDevice(node="d", mec="m", speed_flops=2e9, link_bytes_s=5e6, budget_bytes=10**10, samples=20)
    dev = free.model_copy(update={"link_message_s": 0.004})
    mec = SplitMec(node="m", speed_flops=1e11)
    iters = 3 * 3
    out = [messages(u.out_bytes) for u in model.units]  # one message per 1 MiB chunk of a tensor
    for mode, per_iteration in (("usplit", 2 * out[1] + 2 * out[4]), ("vanilla", 2 * out[1])):
        opts = SplitOptions(epochs=3, latency_model=mode, tail=1 if mode == "usplit" else 0)
        costs = cut_costs(model, opts)
        # Cut 2: a split iteration sends the cut's activations and gets their gradient (and, under U-split, gets the
        # middle's output and sends its gradient); the round's part goes down and comes back once. Local training
        # (the last cut) sends only the part.
        part = messages(costs.device_params[1])
        assert round_time(model, dev, mec, 2, opts) - round_time(model, free, mec, 2, opts) == pytest.approx(
            (iters * per_iteration + 2 * part) * 0.004)
        last = costs.cuts
        assert round_time(model, dev, mec, last, opts) - round_time(model, free, mec, last, opts) == pytest.approx(
            2 * messages(costs.device_params[-1]) * 0.004)
        table = cost_table(model, [dev], [mec], opts)
        assert table.times(np.array([0]), np.array([2]), np.array([1]))[0] == pytest.approx(
            round_time(model, dev, mec, 2, opts))
    # The paper's Eq. 4 prices bytes only.
    paper = SplitOptions(latency_model="paper")
    assert round_time(model, dev, mec, 2, paper) == round_time(model, free, mec, 2, paper)


def test_a_devices_measured_setup_is_priced_in_every_cut_of_its_round() -> None:
    """The seconds a device's earlier rounds took before their first step (its part built, the weights loaded, its
    data read) add to its round whatever the cut, in the table the solvers read and in T_i(j) alike."""
    model = chain_model(units=6, batch_size=8)
    fresh = SplitDevice(node="d", mec="m", speed_flops=2e9, link_bytes_s=5e6, budget_bytes=10**10, samples=20)
    measured = fresh.model_copy(update={"setup_s": 0.06})
    mec = SplitMec(node="m", speed_flops=1e11)
    for mode in ("usplit", "vanilla", "paper"):
        opts = SplitOptions(epochs=3, latency_model=mode, tail=1 if mode == "usplit" else 0)
        before, after = cost_table(model, [fresh], [mec], opts), cost_table(model, [measured], [mec], opts)
        assert after.fixed_s - before.fixed_s == pytest.approx(np.full_like(before.fixed_s, 0.06))
        for cut in range(1, before.fixed_s.shape[1] + 1):
            assert round_time(model, measured, mec, cut, opts) - round_time(model, fresh, mec, cut, opts) == \
                pytest.approx(0.06)


# --- U5: objective, decode and the three solvers -------------------------------------------------------


def _u5() -> tuple[ModelCost, list[SplitDevice], list[SplitMec], SplitOptions]:
    """Four devices, each alone on its MEC with one feasible cut and round times [10, 2, 3, 20] s."""
    model = ModelCost(name="u5", batch_size=1, units=[
        UnitCost(name="a", flops_fwd=1e9, flops_bwd=0.0, out_bytes=0, param_bytes=0, act_bytes=0),
        UnitCost(name="b", flops_fwd=0.0, flops_bwd=0.0, out_bytes=0, param_bytes=0, act_bytes=10**9),
    ])
    dis_ = [0.1, 0.5, 0.2, 0.05]
    times = [10.0, 2.0, 3.0, 20.0]
    devices = [SplitDevice(node=f"d{i}", mec=f"m{i}", speed_flops=1e9 / times[i], link_bytes_s=1e6,
                           budget_bytes=1000, samples=1, dis=dis_[i]) for i in range(4)]
    mecs = [SplitMec(node=f"m{i}", speed_flops=1e12) for i in range(4)]
    opts = SplitOptions(participants=2, gamma=1.0, lam=0.04, normalise=False, tail=0, epochs=1)
    return model, devices, mecs, opts


@pytest.mark.parametrize("solver", ["exhaustive", "global", "bo"])
def test_u5_every_solver_selects_devices_0_and_2(solver: str) -> None:
    model, devices, mecs, opts = _u5()
    sel = plan_round(model, devices, mecs, opts.model_copy(update={"solver": solver}))
    assert [d.node for d in sel.selected] == ["d0", "d2"]
    assert sel.objective == pytest.approx(0.70)
    assert sel.t_system_s == pytest.approx(10.0)
    assert all(d.cut == 1 for d in sel.selected)
    # The paper-literal per-device form sum(Dis + lam T_i) reaches 0.82 at the same selection.
    literal = sum(devices[int(d.node[1:])].dis + 0.04 * d.round_s for d in sel.selected)
    assert literal == pytest.approx(0.82)


def test_u5_decode_scores_and_runner_up() -> None:
    model, devices, mecs, opts = _u5()
    table = cost_table(model, devices, mecs, opts)
    norm = normalisers(table, opts)
    score = table.dis + 0.04 * table.best_times()
    assert score == pytest.approx([0.5, 0.58, 0.32, 0.85])
    d = decode(table, 2, 2, opts, norm)  # target beyond every feasible cut: each takes cut 1
    assert sorted(d.rows.tolist()) == [0, 2] and d.objective == pytest.approx(0.70)
    # The runner-up {1, 2}: F = 0.7 + 0.04 * 3.
    runner = table.dis[[1, 2]].sum() + 0.04 * table.best_times()[[1, 2]].max()
    assert runner == pytest.approx(0.82)


def test_decode_ties_to_the_smaller_cut_and_meets_d_threshold_by_swaps() -> None:
    model = chain_model(units=6)
    devices = [SplitDevice(node=f"d{i}", mec="m", speed_flops=1e9, link_bytes_s=1e7, budget_bytes=10**12,
                           samples=s, dis=0.1 * i) for i, s in enumerate([10, 20, 30, 400])]
    mecs = [SplitMec(node="m", speed_flops=1e12)]
    opts = SplitOptions(lam=0.0, d_threshold=420)
    table = cost_table(model, devices, mecs, opts)
    table.feasible[0, :] = [True, False, True, False, False]  # cut 2 is equidistant from 1 and 3
    assert closest_cuts(table, 2)[0] == 1
    norm = normalisers(table, opts)
    d = decode(table, 1, 2, opts, norm)  # lowest Dis {0, 1} hold 30 samples: swap in d3
    assert sorted(d.rows.tolist()) == [1, 3]
    impossible = decode(table, 1, 2, opts.model_copy(update={"d_threshold": 10_000}), norm)
    assert impossible.objective == math.inf


# --- U6: BO quality ------------------------------------------------------------------------------------


def test_bo_reaches_the_exhaustive_optimum_on_random_instances() -> None:
    # A seeded subset of U6's 50 instances (edgeswarm bench splitfed runs all 50).
    q = bo_quality(instances=8, seed=3)
    assert q.space > q.evaluations == 20  # two-dimensional chi: BO is not exhaustive search
    assert q.within >= 0.9
    assert q.worse_than_initial == 0


def test_bo_starts_at_the_previous_best_and_is_seeded() -> None:
    model, devs, mecs = random_instance(np.random.default_rng(5), devices=40)
    opts = SplitOptions(n_min=8, n_max=14, previous_best=(3, 9))
    table = cost_table(model, devs, mecs, opts)
    norm = normalisers(table, opts)
    points = grid(table.feasible.shape[1], 8, 14)
    a = bayesian(table, points, opts, norm, np.random.default_rng(1))
    b = bayesian(table, points, opts, norm, np.random.default_rng(1))
    assert a.point == b.point and a.decoded.objective == b.decoded.objective
    best = exhaustive(table, points, opts, norm)
    assert a.decoded.objective >= best.decoded.objective
    assert a.decoded.objective <= decode(table, 3, 9, opts, norm).objective


def test_global_oracle_is_no_worse_than_decode_without_contention() -> None:
    model, devs, _ = random_instance(np.random.default_rng(7), devices=30)
    # One MEC per device: no sharing, so the oracle is exact and bounds every decode.
    devs = [d.model_copy(update={"mec": f"x{k}"}) for k, d in enumerate(devs)]
    mecs = [SplitMec(node=f"x{k}", speed_flops=5e11) for k in range(len(devs))]
    opts = SplitOptions(n_min=6, n_max=6)
    table = cost_table(model, devs, mecs, opts)
    norm = normalisers(table, opts)
    oracle = global_oracle(table, 6, opts, norm)
    best = exhaustive(table, grid(table.feasible.shape[1], 6, 6), opts, norm)
    assert oracle.decoded.objective <= best.decoded.objective + 1e-12


# --- U7: Algorithm 2 -----------------------------------------------------------------------------------


def test_quotas_sum_to_k_by_largest_remainder() -> None:
    assert quotas([4, 4, 4, 4, 4], 10) == [2, 2, 2, 2, 2]
    assert quotas([5, 3, 2], 4) == [2, 1, 1]
    assert sum(quotas([7, 1, 3, 9, 0], 10)) == 10
    assert quotas([1, 1, 1], 2) == [1, 1, 0]  # ties to the lower MEC
    assert sum(quotas([2, 1], 10)) == 3


def test_greedy_pick_is_top_k_by_stat_with_ties_to_lower_id() -> None:
    rng = np.random.default_rng(0)
    got = pick([1.0, 5.0, 3.0, 5.0, 0.5], 3, 0.0, rng)
    assert got.chosen == (1, 2, 3) and not got.explored
    assert pick([2.0, 2.0, 2.0], 2, 0.0, rng).chosen == (0, 1)


def test_random_pick_is_uniform_and_explores_at_rate_epsilon() -> None:
    rng = np.random.default_rng(42)
    calls, n, k = 10_000, 10, 3
    counts = np.zeros(n)
    for _ in range(calls):
        for i in pick(list(range(n)), k, 1.0, rng).chosen:
            counts[i] += 1
    p = k / n
    sigma = math.sqrt(calls * p * (1 - p))
    assert np.all(np.abs(counts - calls * p) <= 3 * sigma)
    explored = sum(pick(list(range(n)), k, 0.1, rng).explored for _ in range(calls))
    assert 0.09 <= explored / calls <= 0.11


def test_fine_select_keeps_k_of_the_candidates_by_mec_quota() -> None:
    rng = np.random.default_rng(0)
    devs, mecs = paper_devices(rng)
    sel = plan_round(chain_model(), devs, mecs, SplitOptions(participants=10, gamma=2.0, solver="exhaustive"))
    assert sel.count == 20
    fine = fine_select(sel.selected, devs, 10, 0.0, np.random.default_rng(1))
    assert len(fine) == 10 and {d.node for d in fine} <= {d.node for d in sel.selected}
    stat = {d.node: d.stat for d in devs}
    for mec in {d.mec for d in sel.selected}:
        kept = [stat[d.node] for d in fine if d.mec == mec]
        dropped = [stat[d.node] for d in sel.selected if d.mec == mec and d not in fine]
        assert not kept or not dropped or min(kept) >= max(dropped)


# --- U8: Algorithm 3 -----------------------------------------------------------------------------------

SEG_A = Segment(units=[0, 1, 2], fwd_bytes=[10 * MB, 20 * MB, 30 * MB], bwd_bytes=[0, 0, 40 * MB],
                fwd_flops=[1.0, 2.0, 3.0])
SEG_B = Segment(units=[4, 5], fwd_bytes=[5 * MB, 5 * MB], bwd_bytes=[0, 10 * MB], fwd_flops=[4.0, 5.0])


def test_cost_aware_decisions_match_u8() -> None:
    plan = plan_recompute([SEG_A, SEG_B], 60 * MB, "peak", "always", l_peak_bytes=50 * MB)
    assert plan.outcome == "recompute" and plan.strategies == ["memory", "speed"]
    assert plan.theta_bytes == 50 * MB
    assert plan.extra_forwards == 3 + 1  # memory-centric k = 3: 3; speed-centric k = 2: 1
    assert plan.extra_flops == pytest.approx((1.0 * 2 + 2.0) + 4.0)
    budget = plan_recompute([SEG_A, SEG_B], 120 * MB, "budget", "always", l_peak_bytes=50 * MB)
    assert budget.strategies == ["speed", "speed"]
    short = plan_recompute([SEG_A, SEG_B], 45 * MB, "peak", "adaptive", l_peak_bytes=50 * MB)
    assert short.outcome == "infeasible"
    roomy = plan_recompute([SEG_A, SEG_B], 200 * MB, "peak", "adaptive", l_peak_bytes=50 * MB)
    assert roomy.outcome == "none" and roomy.extra_forwards == 0


def test_extra_forward_counts_match_the_paper_example() -> None:
    assert extra_forwards(4, "speed") == 3
    assert extra_forwards(4, "memory") == 6
    assert extra_forwards(1, "memory") == 0


def test_segments_are_runs_of_cheap_units_after_a_checkpoint() -> None:
    model = chain_model(units=9)  # units 2, 5, 8 are cheap
    segs = device_segments(model, 6, 1)  # front 0..5, tail 8
    assert [s.units for s in segs] == [[2], [5], [8]]
    cheap = [UnitCost(name=f"c{k}", flops_fwd=1.0, flops_bwd=1.0, out_bytes=1, param_bytes=0, act_bytes=1,
                      expensive=k in (0, 4)) for k in range(7)]
    run = ModelCost(name="r", batch_size=1, units=cheap)
    assert [s.units for s in device_segments(run, 6, 0)] == [[1, 2, 3], [5]]
    lead = [u.model_copy(update={"expensive": k == 2}) for k, u in enumerate(cheap)]
    run = ModelCost(name="r", batch_size=1, units=lead)
    assert [s.units for s in device_segments(run, 4, 1)] == [[0, 1], [3], [6]]  # front 0..3, tail 6


# --- plan_round on the paper's fleet -------------------------------------------------------------------


def test_plan_round_on_the_paper_fleet() -> None:
    rng = np.random.default_rng(11)
    devs, mecs = paper_devices(rng)
    assert len(devs) == 100 and len({d.mec for d in devs}) == 5
    model = chain_model(scale=20)
    by_node = {d.node: d for d in devs}
    for solver in ("exhaustive", "bo", "global"):
        sel = plan_round(model, devs, mecs, SplitOptions(solver=solver, seed=2))
        assert sel.count == 20 == len(sel.selected)
        for d in sel.selected:
            assert d.memory_bytes <= by_node[d.node].budget_bytes
            assert d.mec == by_node[d.node].mec
        assert sel.t_system_s == pytest.approx(max(d.round_s for d in sel.selected))
        assert not set(sel.infeasible) & {d.node for d in sel.selected}
    fedavg = plan_round(model, devs, mecs, SplitOptions(local_only=True, seed=2))
    whole = len(model.units) - 1
    assert all(d.cut == whole for d in fedavg.selected)
    assert len(fedavg.infeasible) > len(sel.infeasible)  # splitting lets small phones train
    splitfed = plan_round(model, devs, mecs, SplitOptions(fixed_cut=2, latency_model="vanilla", seed=2))
    assert {d.cut for d in splitfed.selected} == {2}
    again = plan_round(model, devs, mecs, SplitOptions(fixed_cut=2, latency_model="vanilla", seed=2))
    assert again == splitfed


def test_plan_round_rejects_impossible_options() -> None:
    devs, mecs = paper_devices(np.random.default_rng(0), per_type=1)
    model = chain_model(units=5)
    with pytest.raises(SplitPlanError, match="fixed cut 9"):
        plan_round(model, devs, mecs, SplitOptions(fixed_cut=9))
    with pytest.raises(SplitPlanError, match="no devices"):
        plan_round(model, [], mecs, SplitOptions())
    gone = [d.model_copy(update={"available": False}) for d in devs]
    with pytest.raises(SplitPlanError, match="available"):
        plan_round(model, gone, mecs, SplitOptions())
    with pytest.raises(SplitPlanError, match="MECs"):
        plan_round(model, devs, mecs[:1], SplitOptions())
    # A request naming a device or an edge server twice (a hostile one came through the planner's fuzz test) is
    # refused as such, not answered with a selection that names the device twice.
    with pytest.raises(SplitPlanError, match=rf"each device is listed once; \['{devs[0].node}'\]"):
        plan_round(model, [*devs, devs[0].model_copy(update={"samples": 7})], mecs, SplitOptions())
    with pytest.raises(SplitPlanError, match="each MEC is listed once"):
        plan_round(model, devs, [*mecs, mecs[0]], SplitOptions())


def test_planning_with_recompute_admits_tighter_budgets_at_a_time_cost() -> None:
    # conv, norm, relu blocks with equal activations: the norm and relu outputs can be rebuilt.
    units = [UnitCost(name=f"u{k}", flops_fwd=1e8, flops_bwd=2e8, out_bytes=10 * MB, param_bytes=MB,
                      act_bytes=10 * MB, backward_bytes=20 * MB, expensive=k % 3 == 0) for k in range(9)]
    model = ModelCost(name="blocks", batch_size=32, units=units)
    opts = SplitOptions(plan_with_recompute=True)
    plain = cut_costs(model, SplitOptions())
    costs = cut_costs(model, opts)
    # Cut 6: front 0..5 and tail 8 keep five cheap outputs (50 MB), l_peak is 20 MB.
    assert costs.lean_memory[5] == plain.memory[5] - 50 * MB + 20 * MB
    assert costs.recompute_flops[5] == pytest.approx(2 * 1e8)  # two k=2 segments: 1 forward each either way
    budget = int((costs.lean_memory[5] + plain.memory[5]) / 2)  # cut 6 fits only by recomputing
    dev = SplitDevice(node="d", mec="m", speed_flops=1e9, link_bytes_s=1e7, budget_bytes=budget, samples=64)
    assert 6 not in feasible_cuts(model, dev, SplitOptions())
    assert 6 in feasible_cuts(model, dev, opts)
    mec = [SplitMec(node="m", speed_flops=1e12)]
    lean = cost_table(model, [dev], mec, opts)
    full = cost_table(model, [dev.model_copy(update={"budget_bytes": 10**12})], mec, opts)
    assert lean.memory[0, 5] == costs.lean_memory[5] <= budget
    extra = lean.fixed_s[0, 5] - full.fixed_s[0, 5]
    assert extra == pytest.approx(5 * 2 * costs.recompute_flops[5] / 1e9)  # E = 5 epochs x 2 batches


def test_plan_round_refuses_searches_beyond_its_work_caps() -> None:
    devs, mecs = paper_devices(np.random.default_rng(0))
    model = chain_model(units=8)
    with pytest.raises(PlanTooLargeError, match="bo_budget"):  # 7 cuts x 60 counts: 420 evaluations
        plan_round(model, devs, mecs, SplitOptions(bo_budget=500, n_min=1, n_max=60))
    assert plan_round(model, devs, mecs, SplitOptions(bo_budget=500)).count == 20  # |chi| = 7: exhaustive
