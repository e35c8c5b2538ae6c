"""Galaxy's planner (spec 3, 4.5, 6.3): C-P1..C-P7, C-M2, the 3.8 table, GQA rounding, the latency model's
consequences as inequalities on the model, and the planner service entry."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeswarm.cli.plan import add_plan_parser
from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry, NetworkDefaults, load_cluster
from edgeswarm.errors import ConfigError, InfeasiblePlanError, PlanningError
from edgeswarm.hmp.cli import run_plan as run_hmp_plan
from edgeswarm.hmp.planner import PLANNER
from edgeswarm.messages.hmp_planning import HmpPlanReply, HmpPlanRequest
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.hmp.algorithm import (
    MemoryProblem,
    algorithm1,
    check_memory,
    equal_shares,
    equal_split,
    lr_round,
)
from edgeswarm.planning.hmp.latency import (
    block_fractions,
    capacity,
    con_s,
    gemm_s,
    logits_s,
    mesh_links,
    mha_s,
    phase_fractions,
    predict,
    sp_blocks_s,
    tp_gemms_s,
)
from edgeswarm.planning.hmp.plan import PRUNE_MARGIN, compare, plan_galaxy, plan_hmp, plan_megatron, request_s
from edgeswarm.planning.hmp.synthetic import synthetic_cluster, synthetic_profile
from edgeswarm.planning.hmp.types import BlockProfile, HmpCluster, HmpOptions, HmpPlan, HmpPlanError
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.values.text_model import PRESETS, TextModelConfig

# Spec 3.8's assumptions: V proportional to the CPU clock; budgets of 5.1; Table I footprints split MHA:MLP = 1:2.
CLOCK = {"L": 1.47, "M": 0.825, "S": 0.403}
HETERO_BUDGET = {"L": 1.5e9, "M": 1.2e9, "S": 0.7e9}
HOMO_BUDGET = 1.5e9
FOOTPRINT = {"distilbert": 0.13e9, "bert-l": 0.68e9, "gpt2-l": 1.6e9, "opt-l": 2.6e9, "opt-xl": 5.4e9}
SHAPE = {"distilbert": (12, 3072), "bert-l": (16, 4096), "gpt2-l": (20, 5120), "opt-l": (32, 8192),
         "opt-xl": (32, 10240)}
ENVS = {"A": "MM", "B": "MMM", "C": "MMMM", "D": "LM", "E": "LS", "F": "LMS"}


def problem(env: str, model: str, heads: int | None = None) -> MemoryProblem:
    kinds = ENVS[env]
    homogeneous = len(set(kinds)) == 1
    n_h, f = SHAPE[model]
    return MemoryProblem(capacity=[CLOCK[k] for k in kinds],
                         budget=[HOMO_BUDGET if homogeneous else HETERO_BUDGET[k] for k in kinds],
                         layers=1, heads=heads or n_h, columns=f, att_bytes=FOOTPRINT[model] / 3,
                         mlp_bytes=2 * FOOTPRINT[model] / 3)


def gb(p: MemoryProblem, heads: list[int], columns: list[int]) -> list[float]:
    return [round(p.memory(d, heads[d], columns[d]) / 1e9, 2) for d in range(len(heads))]


# env, model, heads, columns, GB per device (None: Fail), M-LM fits, SP fits
TABLE_38 = [
    ("A", "opt-l", [16, 16], [4096, 4096], [1.30, 1.30], True, False),
    ("A", "opt-xl", None, None, None, False, False),
    ("B", "bert-l", [6, 5, 5], [1366, 1365, 1365], [0.24, 0.22, 0.22], True, True),
    ("B", "gpt2-l", [7, 7, 6], [1707, 1707, 1706], [0.54, 0.54, 0.52], True, False),
    ("B", "opt-xl", None, None, None, False, False),
    ("C", "opt-xl", [8, 8, 8, 8], [2560] * 4, [1.35] * 4, True, False),
    ("D", "gpt2-l", [13, 7], [3279, 1841], [1.03, 0.57], True, False),
    ("D", "opt-l", [20, 12], [4529, 3663], [1.50, 1.10], False, False),
    ("E", "bert-l", [13, 3], [3215, 881], [0.54, 0.14], True, True),
    ("E", "gpt2-l", [16, 4], [4018, 1102], [1.26, 0.34], False, False),
    ("E", "opt-l", None, None, None, False, False),
    ("F", "gpt2-l", [11, 6, 3], [2790, 1565, 765], [0.88, 0.49, 0.24], True, False),
    ("F", "opt-l", [17, 10, 5], [4463, 2505, 1224], [1.41, 0.80, 0.39], False, False),
    ("F", "opt-xl", None, None, None, False, False),
]


@pytest.mark.parametrize("env,model,heads,columns,mem,mlm,sp", TABLE_38)
def test_c_p5_table_3_8_is_reproduced_exactly(env: str, model: str, heads: list[int] | None,
                                                columns: list[int] | None, mem: list[float] | None, mlm: bool,
                                                sp: bool) -> None:
    p = problem(env, model)
    if heads is None:
        with pytest.raises(HmpPlanError, match="does not fit"):
            algorithm1(p)
    else:
        got_heads, got_columns = algorithm1(p)
        assert (got_heads, got_columns) == (heads, columns)
        assert gb(p, got_heads, got_columns) == pytest.approx(mem, abs=0.011)  # the table prints 1.5 as 1.50
    d = len(p.capacity)
    assert (check_memory(p, *equal_shares(p, d), "M-LM") == "") is mlm
    assert (check_memory(p, [p.heads] * d, [p.columns] * d, "SP") == "") is sp


@pytest.mark.parametrize("heads", [16, 32])
def test_opt_l_with_16_and_32_heads(heads: int) -> None:
    """Spec 7.1: the paper prints 16 heads for OPT-L, the model has 32; the columns do not depend on it."""
    got_heads, got_columns = algorithm1(problem("D", "opt-l", heads))
    assert got_heads == ([10, 6] if heads == 16 else [20, 12]) and got_columns == [4529, 3663]
    assert algorithm1(problem("A", "opt-l", heads))[0] == [heads // 2] * 2


def test_c_p4_columns_move_before_heads() -> None:
    """Env D / OPT-L: the heads stay at the capacity split, only the columns move."""
    p = problem("D", "opt-l")
    heads, columns = algorithm1(p)
    assert heads == lr_round(p.capacity, p.heads)
    assert columns != lr_round(p.capacity, p.columns) and columns == [4529, 3663]


def test_c_m2_oom_pattern_of_table_iv() -> None:
    def galaxy_fits(env: str, model: str) -> bool:
        try:
            algorithm1(problem(env, model))
            return True
        except HmpPlanError:
            return False

    def mlm_fits(env: str, model: str) -> bool:
        p = problem(env, model)
        return check_memory(p, *equal_shares(p, len(p.capacity)), "M-LM") == ""

    def sp_fits(env: str, model: str) -> bool:
        p = problem(env, model)
        d = len(p.capacity)
        return check_memory(p, [p.heads] * d, [p.columns] * d, "SP") == ""

    assert galaxy_fits("A", "opt-l") and mlm_fits("A", "opt-l")
    assert galaxy_fits("C", "opt-xl") and mlm_fits("C", "opt-xl")
    for env in "AB":
        assert not galaxy_fits(env, "opt-xl") and not mlm_fits(env, "opt-xl")
    for env in "ABC":
        for model in ("gpt2-l", "opt-l", "opt-xl"):
            assert not sp_fits(env, model)
        for model in ("distilbert", "bert-l"):
            assert sp_fits(env, model)


def test_c_p1_homogeneous_devices_get_equal_shares() -> None:
    for d in range(1, 9):
        p = MemoryProblem(capacity=[1.0] * d, budget=[1e12] * d, layers=24, heads=32, columns=8192,
                          att_bytes=1e6, mlp_bytes=2e6)
        heads, columns = algorithm1(p)
        rows = equal_split(284, d)
        for share in (heads, columns, rows):
            assert max(share) - min(share) <= 1


def test_c_p1_on_a_synthetic_homogeneous_cluster() -> None:
    cfg = PRESETS["gpt2-large"].model_copy(update={"dtype": "float16"})
    cluster = synthetic_cluster(load_cluster("asteroid-env-a-1000mbps"), cfg, 284)
    plan = plan_galaxy(cluster, HmpOptions(prune=False))
    assert max(plan.shares.heads) - min(plan.shares.heads) <= 1
    assert max(plan.shares.columns) - min(plan.shares.columns) <= 1
    assert max(plan.rows) - min(plan.rows) <= 1 and sum(plan.rows) == 284


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.floats(0.05, 20.0), min_size=1, max_size=8), st.sampled_from([(16, 4096), (20, 5120),
                                                                                    (32, 8192), (12, 3072)]))
def test_c_p2_capacity_proportional_without_memory(caps: list[float], shape: tuple[int, int]) -> None:
    n_h, f = shape
    p = MemoryProblem(capacity=caps, budget=[1e15] * len(caps), layers=1, heads=n_h, columns=f, att_bytes=1.0,
                      mlp_bytes=2.0)
    heads, columns = algorithm1(p)
    total = sum(caps)
    assert sum(heads) == n_h and sum(columns) == f
    for d, v in enumerate(caps):
        assert abs(heads[d] - v / total * n_h) < 1 and abs(columns[d] - v / total * f) < 1


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(0.1, 10.0), st.floats(0.05, 3.0)), min_size=1, max_size=6),
       st.sampled_from(["paper", "water"]), st.floats(0.3, 6.0))
def test_c_p3_every_plan_fits_and_shares_sum(devs: list[tuple[float, float]], shift: str, footprint: float) -> None:
    p = MemoryProblem(capacity=[v for v, _ in devs], budget=[b * 1e9 for _, b in devs], layers=1, heads=32,
                      columns=8192, att_bytes=footprint * 1e9 / 3, mlp_bytes=2 * footprint * 1e9 / 3)
    total_budget = sum(b for _, b in devs) * 1e9
    try:
        heads, columns = algorithm1(p, shift)  # type: ignore[arg-type]
    except HmpPlanError:
        return
    assert footprint * 1e9 <= total_budget + 1  # C-P3: nothing over the total budget ever succeeds
    assert sum(heads) == 32 and sum(columns) == 8192 and min(heads + columns) >= 0
    for d in range(len(devs)):
        assert p.memory(d, heads[d], columns[d]) <= p.budget[d] + 1e-3


def test_c_p3_fail_when_the_total_budget_is_short() -> None:
    p = MemoryProblem(capacity=[1.0, 2.0], budget=[1e9, 1e9], layers=2, heads=16, columns=4096, att_bytes=0.4e9,
                      mlp_bytes=0.7e9)
    with pytest.raises(HmpPlanError) as err:
        algorithm1(p)
    assert isinstance(err.value, InfeasiblePlanError) and isinstance(err.value, PlanningError)
    assert "2.20 GB needed" in str(err.value) and "Add devices" in str(err.value)


def test_water_filling_fits_where_the_paper_shift_overshoots() -> None:
    """Spec A4: proportional shifts can push a fast receiver over; water-filling caps it at its room."""
    p = MemoryProblem(capacity=[1.0, 10.0, 1.0], budget=[0.1e9, 0.5e9, 2.0e9], layers=1, heads=16, columns=4096,
                      att_bytes=0.5e9, mlp_bytes=1.0e9)
    heads, columns = algorithm1(p, "water")
    assert all(p.memory(d, heads[d], columns[d]) <= p.budget[d] for d in range(3))


def test_a_device_with_zero_heads_is_allowed() -> None:
    p = MemoryProblem(capacity=[10.0, 10.0, 0.2], budget=[1e12] * 3, layers=1, heads=8, columns=512,
                      att_bytes=1.0, mlp_bytes=2.0)
    heads, columns = algorithm1(p)
    assert heads[2] == 0 and columns[2] > 0 and sum(heads) == 8


def test_gqa_heads_move_in_whole_kv_groups() -> None:
    p = MemoryProblem(capacity=[3.0, 2.0, 1.0], budget=[1e12, 1e12, 0.3e9], layers=1, heads=32, columns=8192,
                      group=4, att_bytes=0.6e9, mlp_bytes=1.2e9)
    heads, _ = algorithm1(p)
    assert sum(heads) == 32 and all(a % 4 == 0 for a in heads)
    cfg = PRESETS["llama-3.2-1b"].model_copy(update={"dtype": "float16"})
    cluster = synthetic_cluster(load_cluster("asteroid-env-d-1000mbps"), cfg, 128)
    for mode in ("galaxy", "megatron"):
        plan = plan_hmp(cluster, HmpOptions(mode=mode, prune=False))  # type: ignore[arg-type]
        assert sum(plan.shares.heads) == 32 and all(a % cfg.group == 0 for a in plan.shares.heads)


def test_c_p6_planner_time_scales_gently() -> None:
    times = {}
    for d in (4, 16, 64):
        p = MemoryProblem(capacity=[1.0 + (i % 5) for i in range(d)], budget=[0.09e9 + 0.01e9 * (i % 3)
                                                                               for i in range(d)],
                          layers=1, heads=64 * d, columns=256 * d, att_bytes=1e9, mlp_bytes=2e9)
        start = time.perf_counter()
        try:
            algorithm1(p)
        except HmpPlanError:
            pass
        times[d] = time.perf_counter() - start
    assert times[4] < 1.0  # C-P6: well under a second for 4 devices (milliseconds in practice)
    assert times[64] < 5.0  # no worse than O(D^3) with a generous constant (not a speed assertion)


def test_c_p7_rows_are_equal_whatever_the_heterogeneity() -> None:
    cfg = PRESETS["bert-large"].model_copy(update={"dtype": "float16"})
    spec = ClusterSpec(name="x", network=NetworkDefaults(bandwidth_mbps=125),
                       devices=(DeviceEntry(id="fast", **{"class": "edge-server"}),
                                DeviceEntry(id="mid", **{"class": "jetson-tx2"}),
                                DeviceEntry(id="slow", **{"class": "rpi4"})))
    plan = plan_galaxy(synthetic_cluster(spec, cfg, 284), HmpOptions(prune=False))
    assert plan.rows == [95, 95, 94] and plan.shares.heads[0] > plan.shares.heads[2]


def _cluster(kinds: str, model: str = "opt-1.3b", mbps: float = 125.0, seq: int = 284,
             message_s: float = 0.0) -> HmpCluster:
    cfg = PRESETS[model].model_copy(update={"dtype": "float16"})
    slow = {"L": 10.0, "M": 10.0 * 1.47 / 0.825, "S": 10.0 * 1.47 / 0.403}
    devices = [synthetic_profile(f"d{i}", cfg, seq, slowdown=slow[k], budget_bytes=int(64e9))
               for i, k in enumerate(kinds)]
    links = [LinkProfile(src=a.node, dst=b.node, bandwidth_bps=mbps * 1e6 / 8, latency_s=1e-4, message_s=message_s)
             for a in devices for b in devices if a.node != b.node]
    return HmpCluster(model=cfg, model_name=model, seq_len=seq, devices=devices, links=links)


def _ratio(cluster: HmpCluster) -> float:
    opts = HmpOptions(prune=False)
    return plan_megatron(cluster, opts).model.total_s / plan_galaxy(cluster, opts).model.total_s


def test_latency_model_consequences() -> None:
    """Spec 4.5's bullets, as inequalities on the model (never on a clock)."""
    # The advantage over M-LM grows as bandwidth falls (while tau <~ c).
    assert _ratio(_cluster("MMM", mbps=125)) > _ratio(_cluster("MMM", mbps=1000))
    # ... grows with D.
    assert _ratio(_cluster("MMMM", mbps=1000)) > _ratio(_cluster("MM", mbps=1000))
    # ... shrinks for larger models.
    assert _ratio(_cluster("MMM", "bert-large", mbps=1000)) > _ratio(_cluster("MMM", "opt-2.7b", mbps=1000))
    # Overlap saves at most (D - 1) min(c, tau) per collective: never more than the raw communication, never negative.
    c = _cluster("MMM", mbps=125)
    on = plan_galaxy(c, HmpOptions(prune=False))
    off = plan_galaxy(c, HmpOptions(prune=False, overlap=False))
    assert off.layer.total_s >= on.layer.total_s
    assert off.layer.total_s - on.layer.total_s <= on.layer.comm_s + 1e-12
    assert on.layer.total_s == pytest.approx(on.layer.compute_s + on.layer.exposed_s)
    # A heterogeneous cluster gains from the capacity split even with free communication.
    assert _ratio(_cluster("LMS", mbps=1e6)) > 1.3


def test_a_row_tile_reads_its_whole_weight_and_galaxy_tiles_only_where_the_overlap_pays_for_that() -> None:
    """A GEMM's seconds on m rows lie between its one-row (decode) seconds and its seq_len-row ones, never below
    proportional. On a short prompt over fast links four row tiles cost far more than one GEMM over every row, more
    than the overlap hides: the plan does not tile. On a long prompt over slow links it does."""
    assert gemm_s(1.0, 0.2, 33, 33) == 1.0 and gemm_s(1.0, 0.2, 33, 1) == 0.2
    assert gemm_s(1.0, 0.2, 33, 17) == pytest.approx(0.6) and gemm_s(1.0, 0.2, 33, 0) == 0.0
    assert gemm_s(1.0, 0.001, 33, 1) == pytest.approx(1 / 33)  # a one-row time below proportional: proportional
    short = _cluster("MMMM", mbps=1000, seq=32)
    plan = plan_galaxy(short, HmpOptions(prune=False))
    heads, columns = list(plan.shares.heads), list(plan.shares.columns)
    whole = tp_gemms_s(short.model, short.devices[0], heads[0], columns[0], 32, 32)
    tile = tp_gemms_s(short.model, short.devices[0], heads[0], columns[0], 32, 8)
    assert all(w / 4 < t < w for t, w in zip(tile, whole, strict=True)), (tile, whole)
    tiled = predict(short.model, 32, "galaxy", short.devices, heads, columns, short.links, overlap=True)
    assert not plan.shares.overlap and plan.layer.total_s < tiled.layer.total_s
    assert plan.layer.compute_s < tiled.layer.compute_s
    long = _cluster("MMM", mbps=125)
    assert plan_galaxy(long, HmpOptions(prune=False)).shares.overlap
    assert not plan_galaxy(long, HmpOptions(prune=False, overlap=False)).shares.overlap
    assert not plan_megatron(long, HmpOptions(prune=False)).shares.overlap


def test_the_mha_blocks_phases_are_priced_in_the_shares_the_profile_timed_them() -> None:
    """A profile with the MHA block's phases timed splits its QKV, core and output projection as measured (on every
    row, and on one row against the cache), not by FLOPs: a core that took 40% of the block is priced at 40% (half of
    it on a sequence-parallel rank of half the rows), and the GEMMs around it at the rest. A profile without them, or
    timed at another length, keeps the FLOP shares; a profile with other than three is refused."""
    cfg = PRESETS["distilbert"]
    flops = synthetic_profile("d", cfg, 284, slowdown=10.0, budget_bytes=int(64e9))
    timed = flops.model_copy(update={"mha_phases_s": [0.045, 0.04, 0.015], "mha_decode_phases_s": [0.2, 0.5, 0.3]})
    assert phase_fractions(cfg, flops, 284, 284) == block_fractions(cfg, 284, 284)
    fr, one = phase_fractions(cfg, timed, 284, 284), phase_fractions(cfg, timed, 1, 284)
    assert (fr.qkv, fr.core, fr.oproj) == pytest.approx((0.45, 0.4, 0.15))
    assert fr.up == block_fractions(cfg, 284, 284).up
    assert (one.qkv, one.core, one.oproj) == pytest.approx((0.2, 0.5, 0.3))
    assert phase_fractions(cfg, timed, 128, 128) == block_fractions(cfg, 128, 128)
    whole = mha_s(timed, cfg.heads)
    # A sequence-parallel rank of half the rows: half the measured core, beside its output projection's GEMM.
    oproj = tp_gemms_s(cfg, timed, cfg.heads, cfg.ffn, 284, 142)[1]
    assert sp_blocks_s(cfg, timed, 284, 142)[1] - oproj == pytest.approx(0.2 * whole)
    assert tp_gemms_s(cfg, timed, cfg.heads, cfg.ffn, 284, 284)[0] == pytest.approx(0.45 * whole)
    with pytest.raises(ValueError, match="three phases"):
        BlockProfile.model_validate({**flops.model_dump(), "mha_phases_s": [0.1, 0.2]})


def test_a_decoders_plans_are_compared_on_the_prefill_and_the_tokens_a_request_generates() -> None:
    """A second device at half the speed shortens a 32-token prefill, but each generated token pays its link's 50 ms
    per message (the layers' direct syncs and the logits' gather): planned for the prompt alone Galaxy uses both
    devices, planned for the prompt and 16 tokens the fast one alone, and so does ``auto``."""
    cfg = PRESETS["llama-3.2-1b"].model_copy(update={"layers": 2})
    devices = [synthetic_profile("fast", cfg, 32, slowdown=10.0, budget_bytes=int(64e9)),
               synthetic_profile("slow", cfg, 32, slowdown=20.0, budget_bytes=int(64e9))]
    c = HmpCluster(model=cfg, model_name="llama-3.2-1b", seq_len=32, devices=devices, links=[
        LinkProfile(src=a.node, dst=b.node, bandwidth_bps=125e6, latency_s=1e-4, message_s=0.05)
        for a in devices for b in devices if a.node != b.node])
    prompt, request = plan_galaxy(c, HmpOptions()), plan_galaxy(c, HmpOptions(new_tokens=16))
    assert prompt.devices == ["fast", "slow"] and request.devices == ["fast"]
    assert prompt.model.total_s < request.model.total_s
    assert request_s(request, 16) < request_s(prompt, 16)
    # The prefill answers the first token: 15 decode steps follow it.
    assert request_s(prompt, 16) == pytest.approx(prompt.model.total_s + 15 * prompt.decode.per_token_s)
    assert request_s(prompt, 1) == prompt.model.total_s
    # A request generating no token never computes the prompt's logits: the split head and its gather's 50 ms.
    assert prompt.logits_s > 0.05 and request_s(prompt, 0) == pytest.approx(prompt.model.total_s - prompt.logits_s)
    assert plan_hmp(c, HmpOptions(mode="auto", new_tokens=16)).devices == ["fast"]


def test_sequence_parallel_slices_of_the_rows_pay_each_gemms_one_row_cost() -> None:
    """SP's ranks each run every weight on their slice of the rows: each GEMM call reads its whole weight, so a
    slice costs its one-row time beside its share (``gemm_s``), more than its share of the whole pass; with a
    one-row time at its rows' share, exactly its share."""
    cfg = PRESETS["distilbert"].model_copy(update={"layers": 1})
    whole = synthetic_profile("a", cfg, 284, slowdown=10.0, budget_bytes=int(64e9))
    twin = whole.model_copy(update={"node": "b"})
    links = [LinkProfile(src="a", dst="b", bandwidth_bps=1e9)]
    heads, columns = [cfg.heads] * 2, [cfg.ffn] * 2

    def sp_compute(profile: BlockProfile) -> float:
        pair = [profile, profile.model_copy(update={"node": "b"})]
        return predict(cfg, 284, "sp", pair, heads, columns, links).layer.compute_s

    cheap = whole.model_copy(update={"mha_decode_s": [t / 284 for t in whole.mha_s],
                                     "mlp_decode_s": [t / 284 for t in whole.mlp_s]})
    dear = whole.model_copy(update={"mha_decode_s": [t * 0.2 for t in whole.mha_s],
                                    "mlp_decode_s": [t * 0.2 for t in whole.mlp_s]})
    share = (whole.mha_s[-1] + whole.mlp_s[-1]) * 142 / 284 + 2 * con_s(whole, 142)
    assert sp_compute(cheap) == pytest.approx(share, rel=1e-3)
    # Every GEMM of the 142-row slice: 0.2 of its whole time, then (1 - 0.2) * 141 / 283 of it for its other rows.
    assert sp_compute(dear) > sp_compute(cheap) * 1.1
    assert predict(cfg, 284, "sp", [whole, twin], heads, columns, links).layer.compute_s > share


def test_a_pass_pays_its_embeddings_on_every_rows_rank_and_sp_on_its_slice() -> None:
    """Galaxy, Megatron-TP and Local embed every row of the prompt on every rank; SP each rank its slice."""
    cfg = PRESETS["distilbert"].model_copy(update={"layers": 1})
    plain = [synthetic_profile(n, cfg, 284, slowdown=10.0, budget_bytes=int(64e9)) for n in ("a", "b")]
    embedding = [p.model_copy(update={"embed_s": 0.01}) for p in plain]
    links = [LinkProfile(src="a", dst="b", bandwidth_bps=1e9)]
    for mode, extra in (("galaxy", 0.01), ("megatron", 0.01), ("local", 0.01), ("sp", 0.005)):
        options = HmpOptions(mode=mode, prune=False)  # type: ignore[arg-type]
        before, after = (plan_hmp(HmpCluster(model=cfg, seq_len=284, devices=d, links=links), options)
                         for d in (plain, embedding))
        assert after.model.total_s - before.model.total_s == pytest.approx(extra), mode
        assert after.model.compute_s - before.model.compute_s == pytest.approx(extra), mode


def test_a_request_pays_a_round_trip_with_the_coordinator_for_its_admission_and_each_pass() -> None:
    """The profilers' request round trip (``request_s``, the slowest of the plan's devices) is paid twice by a
    prefill (the request's admission and its pass) and once by each decode step."""
    cfg = PRESETS["gpt2-tiny"]
    devices = [synthetic_profile(n, cfg, 16, slowdown=10.0, budget_bytes=int(64e9)) for n in ("a", "b")]

    def planned(request_s: tuple[float, float]) -> HmpPlan:
        links = [LinkProfile(src="a", dst="b", bandwidth_bps=1e8, request_s=request_s[0]),
                 LinkProfile(src="b", dst="a", bandwidth_bps=1e8, request_s=request_s[1])]
        return plan_galaxy(HmpCluster(model=cfg, seq_len=16, devices=devices, links=links), HmpOptions(prune=False))

    free, paid = planned((0.0, 0.0)), planned((0.003, 0.005))
    assert paid.devices == free.devices == ["a", "b"] and paid.decode is not None and free.decode is not None
    assert paid.model.total_s - free.model.total_s == pytest.approx(2 * 0.005)
    assert paid.model.exposed_s - free.model.exposed_s == pytest.approx(2 * 0.005)
    assert paid.decode.per_token_s - free.decode.per_token_s == pytest.approx(0.005)
    # A plan on one device pays its own round trips, measured on its links to the others.
    links = [LinkProfile(src="a", dst="b", bandwidth_bps=1e8, request_s=0.003)]
    alone = HmpCluster(model=cfg, seq_len=16, devices=devices, links=links)
    local = plan_hmp(alone, HmpOptions(mode="local", prune=False))
    bare = plan_hmp(alone.model_copy(update={"links": [links[0].model_copy(update={"request_s": 0.0})]}),
                    HmpOptions(mode="local", prune=False))
    assert local.devices == ["a"] and local.model.total_s - bare.model.total_s == pytest.approx(2 * 0.003)


def test_per_layer_communication_counts_messages_bytes_and_broker_hops() -> None:
    c = _cluster("MMMM", "bert-large", mbps=125, seq=284, message_s=2e-3)
    cmp = compare(c, HmpOptions(prune=False))
    g, m, sp, local = (cmp.of(k).plan for k in ("galaxy", "megatron", "sp", "local"))
    assert g is not None and m is not None and sp is not None and local is not None
    assert g.comm.messages == m.comm.messages == 4 * 3 and sp.comm.messages == 2 * 3 and local.comm.messages == 0
    assert g.comm.broker_hops == g.comm.messages
    assert g.comm.bytes == 4 * (284 - 71) * 1024 * 2 and sp.comm.bytes == g.comm.bytes // 2
    assert g.comm.tau_s == pytest.approx(2e-3 + 1e-4 + 71 * 1024 * 2 / (125e6 / 8))
    # More per-message cost costs more predicted latency.
    assert plan_galaxy(_cluster("MMMM", "bert-large", message_s=2e-2), HmpOptions(prune=False)).model.total_s > \
        g.model.total_s


def test_devices_that_do_not_pay_are_left_out() -> None:
    c = _cluster("LLS", mbps=1000)
    fast = c.devices[0]
    crawl = synthetic_profile("crawl", c.model, c.seq_len, slowdown=5000.0, budget_bytes=int(64e9))
    cluster = c.model_copy(update={"devices": [fast, c.devices[1], crawl],
                                   "links": [*c.links, *(LinkProfile(src="crawl", dst=d.node, bandwidth_bps=1e6,
                                                                     message_s=0.05) for d in c.devices[:2])]})
    pruned = plan_galaxy(cluster, HmpOptions())
    kept = plan_galaxy(cluster, HmpOptions(prune=False))
    assert "crawl" in pruned.left_out and pruned.model.total_s <= kept.model.total_s


def _fast_and_slow(message_s: float) -> HmpCluster:
    """Two devices, one six times slower than the other, their links' messages at ``message_s`` seconds."""
    cfg = PRESETS["llama-3.2-1b"].model_copy(update={"layers": 2})
    devices = [synthetic_profile("fast", cfg, 32, slowdown=10.0, budget_bytes=int(64e9)),
               synthetic_profile("slow", cfg, 32, slowdown=60.0, budget_bytes=int(64e9))]
    return HmpCluster(model=cfg, model_name="llama-3.2-1b", seq_len=32, devices=devices, links=[
        LinkProfile(src=a.node, dst=b.node, bandwidth_bps=125e6, latency_s=1e-4, message_s=message_s)
        for a in devices for b in devices if a.node != b.node])


@pytest.mark.parametrize(("message_s", "kept"), [(0.02, ["fast", "slow"]), (0.025, ["fast"])])
def test_a_device_is_kept_only_where_it_is_predicted_to_save_more_than_the_margin(message_s: float,
                                                                                    kept: list[str]) -> None:
    """A device six times slower than the other, its links' messages at 20 ms: a request of one token on both is
    predicted 5.6% faster than on the fast one alone, both kept; at 25 ms 3.5% faster, inside PRUNE_MARGIN (a tie in
    the model's error): the fast one alone. Without pruning both are used either way."""
    c = _fast_and_slow(message_s)
    both = plan_galaxy(c, HmpOptions(prune=False, new_tokens=1))
    alone = plan_galaxy(c, HmpOptions(exclude=["slow"], new_tokens=1))
    gain = request_s(alone, 1) / request_s(both, 1) - 1
    assert both.devices == ["fast", "slow"] and 0 < gain and (gain > PRUNE_MARGIN) == (len(kept) == 2), gain
    assert plan_galaxy(c, HmpOptions(new_tokens=1)).devices == kept


@pytest.mark.parametrize(("message_s", "mode"), [(0.02, "galaxy"), (0.025, "local")])
def test_auto_takes_a_mode_on_more_devices_only_where_it_is_predicted_faster_by_more_than_the_margin(
        message_s: float, mode: str) -> None:
    """The same two devices and one-token requests, Galaxy unpruned: at 20 ms a message its split is predicted 5.6%
    faster than the fast device alone and ``auto`` takes it; at 25 ms, 3.5% faster, ``auto`` takes the fast device
    alone (``local``), the lowest prediction but for less than PRUNE_MARGIN."""
    c = _fast_and_slow(message_s)
    options = HmpOptions(prune=False, new_tokens=1)
    found = [v.plan for v in compare(c, options).verdicts if v.plan is not None]
    lowest = min(request_s(p, 1) for p in found)
    picked = plan_hmp(c, options.model_copy(update={"mode": "auto"}))
    assert picked.mode == mode and request_s(picked, 1) <= lowest * (1 + PRUNE_MARGIN), [
        (p.mode, request_s(p, 1)) for p in found]
    assert (request_s(picked, 1) == lowest) == (mode == "galaxy")
    assert picked.devices == (["fast", "slow"] if mode == "galaxy" else ["fast"])


def test_baselines_give_reasons_a_user_can_act_on() -> None:
    cfg = PRESETS["opt-1.3b"].model_copy(update={"dtype": "float16"})
    spec = ClusterSpec(name="x", network=NetworkDefaults(bandwidth_mbps=125),
                       devices=tuple(DeviceEntry(id=f"n{i}", **{"class": "jetson-nano"}) for i in range(2)))
    cluster = synthetic_cluster(spec, cfg, 284)
    small = cluster.model_copy(update={"devices": [d.model_copy(update={"memory_budget_bytes": int(1.5e9)})
                                                   for d in cluster.devices]})
    cmp = compare(small, HmpOptions(paper=True))
    assert cmp.of("galaxy").feasible and cmp.of("megatron").feasible
    assert not cmp.of("sp").feasible and "SP" in cmp.of("sp").reason and "GB" in cmp.of("sp").reason
    assert not cmp.of("local").feasible and "no single device" in cmp.of("local").reason
    # The reserved bytes (embeddings, activations, a KV cache of 2048 tokens) count unless paper mode.
    real = plan_galaxy(small.model_copy(update={"devices": [d.model_copy(update={"memory_budget_bytes": int(3e9)})
                                                            for d in small.devices]}),
                       HmpOptions(max_tokens=2048, prune=False))
    paper = plan_galaxy(small, HmpOptions(paper=True, prune=False))
    assert min(real.memory_bytes) > max(paper.memory_bytes)


def test_decode_prediction_for_decoders() -> None:
    c = _cluster("MMMM", "opt-1.3b", mbps=1000, message_s=1e-3)
    plan = plan_galaxy(c, HmpOptions(prune=False, decode_cache=512))
    assert plan.decode is not None and plan.decode.cache_tokens == 512
    assert 0 < plan.decode.network_s < plan.decode.per_token_s
    assert plan.decode.network_share == pytest.approx(plan.decode.network_s / plan.decode.per_token_s)
    local = plan_hmp(c, HmpOptions(mode="local"))
    assert local.decode is not None and local.decode.network_s == 0
    assert plan_galaxy(_cluster("MM", "bert-large"), HmpOptions(prune=False)).decode is None


def test_decode_network_is_two_direct_rounds_of_one_row_per_layer() -> None:
    """The runtime syncs a decode step with two direct AllReduces per layer (one round of D - 1 parallel
    messages each): message_s + latency_s + one row's bytes over the bandwidth per round, whatever D; then one
    direct AllGather of the logits, each rank's share of the vocabulary to the D - 1 others."""
    cfg = PRESETS["opt-1.3b"]
    row_s = 1e-3 + 1e-4 + cfg.hidden * 2 / (1000e6 / 8)  # float16 rows on 1 Gbps links

    def logits_s(plan: HmpPlan) -> float:
        widest = max(b - a for a, b in plan.shares.vocab_bounds(cfg.vocab))
        return 1e-3 + 1e-4 + (len(plan.shares.devices) - 1) * widest * 2 / (1000e6 / 8)

    for kinds in ("MM", "MMM", "MMMM"):
        for plan in (plan_galaxy(_cluster(kinds, mbps=1000, message_s=1e-3), HmpOptions(prune=False)),
                     plan_megatron(_cluster(kinds, mbps=1000, message_s=1e-3), HmpOptions(prune=False))):
            assert plan.decode is not None
            assert plan.decode.network_s == pytest.approx(cfg.layers * 2 * row_s + logits_s(plan))
    sp = plan_hmp(_cluster("MMM", mbps=1000, message_s=1e-3), HmpOptions(mode="sp", paper=True))
    assert sp.decode is not None
    kv_s = 1e-3 + 1e-4 + cfg.n_kv * cfg.head_dim * 2 / (1000e6 / 8)
    assert sp.decode.network_s == pytest.approx(cfg.layers * 2 * kv_s)
    # The slowest link of the mesh paces a round, not only the ring's links.
    c = _cluster("MMMM", mbps=1000, message_s=1e-3)
    slow = [lk.model_copy(update={"message_s": 5e-3}) if {lk.src, lk.dst} == {"d0", "d2"} else lk for lk in c.links]
    plan = plan_galaxy(c.model_copy(update={"links": slow}), HmpOptions(prune=False))
    assert plan.decode is not None
    assert plan.decode.network_s == pytest.approx(cfg.layers * 2 * (row_s + 4e-3) + logits_s(plan) + 4e-3)


def test_capacity_is_eq_6() -> None:
    cfg = PRESETS["bert-large"]
    p = synthetic_profile("a", cfg, 128, slowdown=2.0, budget_bytes=1)
    assert capacity(p, cfg) == pytest.approx(1 / (p.mha_s[-1] + p.mlp_s[-1]))


def test_auto_picks_the_fastest_that_fits() -> None:
    c = _cluster("LMS", "bert-large", mbps=125)
    auto = plan_hmp(c, HmpOptions(mode="auto"))
    feasible = [v.plan for v in compare(c, HmpOptions()).verdicts if v.plan is not None]
    assert auto.model.total_s == min(p.model.total_s for p in feasible)
    # A job that names no mode is planned this way: never slower than a baseline it could run (issue 33, item 3).
    from edgeswarm.hmp.spec import HmpSpec

    assert HmpSpec.model_validate({"kind": "serve-hmp", "name": "j", "model": {"preset": "gpt2-tiny"}}).mode == "auto"


def test_planner_entry_answers_a_request() -> None:
    c = _cluster("LM", "gpt2-tiny", seq=16)
    req = HmpPlanRequest(cluster=c, options=HmpOptions(), compare=True, epoch=3)
    assert PLANNER.estimate(req).cells > 0
    reply = PLANNER.plan(req, Deadline.after(10.0))
    assert isinstance(reply, HmpPlanReply) and reply.plan.epoch == 3 and reply.comparison is not None
    back = HmpPlanRequest.model_validate_json(req.model_dump_json())
    assert back == req
    assert "gpt2-tiny" in PLANNER.describe(req, reply, 0.01)


@pytest.mark.parametrize("field", ["mha_s", "head_s"])
def test_a_profile_time_no_device_measures_is_refused_before_its_sums_overflow(field: str) -> None:
    """A block profile's times are at most MAX_PROFILED_S: a finite 1e300 seconds of lm_head once made a decode step's
    prediction infinite, and the planner service failed on it instead of refusing it."""
    from pydantic import ValidationError

    from edgeswarm.planning.hmp.types import MAX_PROFILED_S, BlockProfile

    good = synthetic_profile("a", PRESETS["gpt2-tiny"], 8, slowdown=1.0, budget_bytes=10**9)
    huge = [1e300] * len(good.mha_s) if field == "mha_s" else 1e300
    with pytest.raises(ValidationError, match="less than or equal"):
        BlockProfile.model_validate({**good.model_dump(), field: huge})
    edge = [MAX_PROFILED_S] * len(good.mha_s) if field == "mha_s" else MAX_PROFILED_S
    assert getattr(BlockProfile.model_validate({**good.model_dump(), field: edge}), field) == edge


def test_profiles_at_another_length_are_refused() -> None:
    c = _cluster("LM", "gpt2-tiny", seq=16)
    with pytest.raises(PlanningError, match="deployment sequence length"):
        plan_galaxy(c.model_copy(update={"seq_len": 32}), HmpOptions())


def test_a_tiny_config_validates_end_to_end() -> None:
    cfg = TextModelConfig.model_validate(PRESETS["llama-tiny"].model_dump())
    plan = plan_hmp(_cluster("LMS", "llama-tiny", seq=24), HmpOptions(mode="auto"))
    assert sum(plan.shares.heads) == cfg.heads


def _plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    return parser.parse_args(["plan", "--kind", "serve-hmp", *argv])


def _plan(args: argparse.Namespace) -> int:
    """``edgeswarm plan --kind serve-hmp`` as the command line runs it: the kind's plan_cli with its tools."""
    from edgeswarm.cli.kind_commands import command_tools

    return run_hmp_plan(args, None, command_tools(args))


def test_plan_cli_prints_the_plan_and_the_comparison(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ("--model", "opt-1.3b", "--config", "dtype=float16", "--cluster", "asteroid-env-d-100mbps")
    assert _plan(_plan_args(*base, "--compare")) == 0
    out = capsys.readouterr().out
    for text in ("Galaxy", "Megatron-TP", "SP", "Local", "exposed comm", "speed-up"):
        assert text in out
    assert _plan(_plan_args(*base, "--json", "--exclude", "nano-2", "--save-profiles", str(tmp_path))) == 0
    plan = HmpPlan.model_validate_json(capsys.readouterr().out)
    assert "nano-2" not in plan.shares.devices and sum(plan.shares.heads) == 32
    saved = next(tmp_path.glob("*.json"))
    assert _plan(_plan_args("--model", "opt-1.3b", "--profiles", str(saved), "--hmp-mode", "megatron")) == 0
    assert "serve-hmp megatron plan" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="preset"):
        _plan(_plan_args("--model", "resnet18", "--cluster", "asteroid-env-d-100mbps"))


def test_profiler_measures_one_layer_through_the_device() -> None:
    import torch

    from edgeswarm.devices.emulation import DeviceProfile
    from edgeswarm.hmp.profiling import profile_blocks

    device = DeviceProfile(device_class="test", emulated=True, compute_slowdown=1.0, memory_budget_bytes=10**9)
    for name in ("bert-tiny", "llama-tiny"):
        cfg = PRESETS[name]
        p = profile_blocks(cfg, 12, node="n0", device=device, compute=torch.device("cpu"), warmup=1, repeats=2)
        assert p.heads[-1] == cfg.heads and p.columns[-1] == cfg.ffn and all(a % cfg.group == 0 for a in p.heads)
        assert min(p.mha_s + p.mlp_s + p.con_s) > 0 and p.memory_budget_bytes == 10**9
        # One row for every model (a slice of the rows pays each GEMM's one-row cost), the logits for decoders.
        assert len(p.mha_decode_s) == len(p.heads) and len(p.mlp_decode_s) == len(p.columns)
        assert min(p.mha_decode_s + p.mlp_decode_s) > 0 and (p.head_s > 0) is cfg.decoder and p.embed_s > 0
        cluster = HmpCluster(model=cfg, seq_len=12, devices=[p, p.model_copy(update={"node": "n1"})],
                             links=[LinkProfile(src="n0", dst="n1", bandwidth_bps=1e8)])
        assert sum(plan_hmp(cluster, HmpOptions(prune=False)).shares.heads) == cfg.heads


def test_the_planner_service_answers_hmp_requests_over_mosquitto(broker, make_bus, monkeypatch,  # type: ignore[no-untyped-def]
                                                                  tmp_path: Path) -> None:
    """The real planner service (in this process, its entries narrowed to this workload's) on a real broker."""
    import threading

    from conftest import bus_settings
    from edgeswarm import topics
    from edgeswarm.messages.planning import PlanFailed
    from edgeswarm.services.planner import service as planner_service

    monkeypatch.setattr(planner_service, "planner_entries", lambda: {HmpPlanRequest: PLANNER})
    svc = planner_service.PlannerService(bus_settings(broker.url, node_id="plan-hmp", health_dir=tmp_path))
    runner = threading.Thread(target=svc.run, kwargs={"install_signals": False}, daemon=True)
    runner.start()
    try:
        client = make_bus("tester", "cli")
        client.peers.wait_for("plan-hmp", "planner", timeout_s=10)
        topic = topics.request("plan-hmp", "planner")
        cluster = _cluster("LMS", "gpt2-tiny", seq=16)
        reply = client.request(topic, HmpPlanRequest(cluster=cluster, compare=True, epoch=2), timeout_s=10).body
        assert isinstance(reply, HmpPlanReply) and reply.plan.epoch == 2 and reply.planning_s >= 0
        assert sum(reply.plan.shares.heads) == 4 and reply.comparison is not None
        tiny = cluster.model_copy(update={"devices": [d.model_copy(update={"memory_budget_bytes": 1000})
                                                      for d in cluster.devices]})
        failed = client.request(topic, HmpPlanRequest(cluster=tiny), timeout_s=10).body
        assert isinstance(failed, PlanFailed) and failed.reason == "infeasible" and "GB" in failed.detail
    finally:
        svc.stop()
        runner.join(10)
    assert not runner.is_alive()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(1.0, 40.0), st.floats(0.2, 4.0)), min_size=1, max_size=5),
       st.sampled_from(["bert-large", "opt-1.3b", "llama-3.2-1b"]), st.sampled_from(["paper", "water"]),
       st.integers(0, 4096))
def test_cluster_plans_fit_and_cover_the_model(devs: list[tuple[float, float]], model: str, shift: str,
                                               max_tokens: int) -> None:
    cfg = PRESETS[model].model_copy(update={"dtype": "float16"})
    devices = [synthetic_profile(f"d{i}", cfg, 128, slowdown=s, budget_bytes=int(b * 1e9))
               for i, (s, b) in enumerate(devs)]
    cluster = HmpCluster(model=cfg, seq_len=128, devices=devices,
                         links=[LinkProfile(src=a.node, dst=b.node, bandwidth_bps=12.5e6, message_s=1e-3)
                                for a in devices for b in devices if a.node != b.node])
    try:
        plan = plan_galaxy(cluster, HmpOptions(shift=shift, max_tokens=max_tokens))  # type: ignore[arg-type]
    except HmpPlanError as exc:
        assert "does not fit" in str(exc)
        return
    assert sum(plan.shares.heads) == cfg.heads and sum(plan.shares.columns) == cfg.ffn
    assert all(a % cfg.group == 0 for a in plan.shares.heads) and sum(plan.rows) == 128
    assert all(m <= b for m, b in zip(plan.memory_bytes, plan.memory_budget_bytes, strict=True))
    assert set(plan.shares.devices) | set(plan.left_out) == {d.node for d in devices}
    # The layers, and a decoder's logits of the prompt's last row: split over two or more devices, each rank's
    # share of the vocabulary (synthetic profiles time no head) gathered after the row reaches every rank.
    by = {p.node: p for p in devices}
    used = [by[d] for d in plan.shares.devices]
    head, net = logits_s(cfg, "galaxy", used, plan.shares.columns, mesh_links(cluster.links, plan.shares.devices),
                         128, True)
    assert head == 0 and (net > 0) == (cfg.decoder and len(used) > 1)
    assert plan.model.total_s == pytest.approx(cfg.layers * plan.layer.total_s + net)


@pytest.mark.parametrize("env,galaxy_heads,mlm", [("d", [21, 11], False), ("f", [17, 10, 5], False),
                                                  ("a", [16, 16], True)])
def test_galaxy_cluster_files_in_paper_mode(env: str, galaxy_heads: list[int], mlm: bool) -> None:
    """OPT-1.3B (fp16, the real config's weights) on the bundled Galaxy environments: Galaxy fits where the equal
    split and the full copy do not (spec 5.5, 6.3 C-M2)."""
    cfg = PRESETS["opt-1.3b"].model_copy(update={"dtype": "float16"})
    cluster = synthetic_cluster(load_cluster(f"galaxy-env-{env}-125mbps"), cfg, 284, "opt-1.3b")
    cmp = compare(cluster, HmpOptions(paper=True, prune=False))
    galaxy = cmp.of("galaxy").plan
    assert galaxy is not None and galaxy.shares.heads == galaxy_heads
    assert cmp.of("megatron").feasible is mlm and not cmp.of("sp").feasible and not cmp.of("local").feasible


def test_a_decoders_logits_are_split_by_vocabulary_and_priced_by_the_slowest_share() -> None:
    # The lm_head runs once a pass, for the prompt's last row and for every generated token's; over two or more
    # devices each computes its share of the vocabulary (HmpShares.vocab_bounds), the slowest share paces it: its
    # seconds are added to the model's prediction, not to a layer's. Without direct syncs the rank holding the row
    # computes all of it: the last rank for the prompt's (the last of the equal row split), the first for a token's.
    cfg = PRESETS["gpt2-large"].model_copy(update={"dtype": "float16"})
    cluster = synthetic_cluster(load_cluster("asteroid-env-a-1000mbps"), cfg, 284)
    heads = {p.node: 0.01 * (i + 1) for i, p in enumerate(cluster.devices)}
    with_head = cluster.model_copy(update={"devices": [p.model_copy(update={"head_s": heads[p.node]})
                                                       for p in cluster.devices]})
    for direct in (True, False):
        options = HmpOptions(prune=False, direct_syncs=direct)
        plain, plan = plan_galaxy(cluster, options), plan_galaxy(with_head, options)
        assert plan.shares == plain.shares and plan.layer == plain.layer
        assert plain.decode is not None and plan.decode is not None
        first, last = plan.shares.devices[0], plan.shares.devices[-1]
        if direct:
            shares = zip(plan.shares.devices, plan.shares.vocab_bounds(cfg.vocab), strict=True)
            slowest = max(heads[node] * (b - a) / cfg.vocab for node, (a, b) in shares)
            assert slowest < max(heads.values()) / 2
            prompt = token = slowest
        else:
            prompt, token = heads[last], heads[first]
        assert plan.model.total_s == pytest.approx(plain.model.total_s + prompt)
        assert plan.model.compute_s == pytest.approx(plain.model.compute_s + prompt)
        assert plan.decode.per_token_s == pytest.approx(plain.decode.per_token_s + token)
