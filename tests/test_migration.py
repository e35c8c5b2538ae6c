"""Replication map and concurrent unit migration (spec 5.3, 5.5; AC-18, AC-19)."""

from __future__ import annotations

import pytest

from edgeswarm.errors import PlanningError
from edgeswarm.planning.hpp.migration import (
    MigrationError,
    UnitTransfer,
    UnrecoverableError,
    backup_map,
    local_restores,
    plan_migration,
    unit_holders,
)
from edgeswarm.planning.hpp.types import CommStepPlan, Plan, PlanOptions, StagePlan

GIB = 1 << 30
MIB = 1 << 20


def links_of(transfers: list[UnitTransfer]) -> dict[tuple[str, str], int]:
    """Bytes per (src, dst) link, sorted by link. Each link sends its units back to back while different
    links run concurrently. Local restores (src == dst) use no link and are left out."""
    links: dict[tuple[str, str], int] = {}
    for t in transfers:
        if t.src != t.dst:
            links[(t.src, t.dst)] = links.get((t.src, t.dst), 0) + t.nbytes
    return dict(sorted(links.items()))


def moved_bytes(transfers: list[UnitTransfer]) -> int:
    """Total bytes sent over links (local restores, src == dst, move nothing)."""
    return sum(t.nbytes for t in transfers if t.src != t.dst)


def make_plan(stages: list[tuple[list[str], int, int]], *, budget: dict[str, int] | None = None,
              used: dict[str, int] | None = None, epoch: int = 0) -> Plan:
    """A plan from (devices, start, end) per stage with plausible predictions: 4 GiB budgets and 1 GiB used
    unless ``budget`` / ``used`` say otherwise, micro-batch 32 split evenly, M = 8."""
    budget = budget or {}
    used = used or {}
    n = len(stages)
    m = 8
    plans = []
    for p, (devices, start, end) in enumerate(stages):
        g = len(devices)
        shares = [32 // g + (1 if i < 32 % g else 0) for i in range(g)]
        plans.append(StagePlan(
            index=p, start=start, end=end, devices=devices, shares=shares, warmup=min(n - p, m),
            forward_s=0.01 * (end - start) / g, backward_s=0.02 * (end - start) / g,
            allreduce_s=0.0 if g == 1 else 0.005 * (end - start),
            memory_bytes=[used.get(d, GIB) for d in devices],
            memory_budget_bytes=[budget.get(d, 4 * GIB) for d in devices]))
    comms = [CommStepPlan(after=p, bytes_per_microbatch=32 * 64 * 1024, bandwidth_bps=12.5e6,
                          forward_s=32 * 64 * 1024 / 12.5e6, backward_s=32 * 64 * 1024 / 12.5e6)
             for p in range(n - 1)]
    return Plan(strategy="hpp", model_fingerprint="test-model", units=stages[-1][2],
                options=PlanOptions(micro_batch_size=32, micro_batches=m), stages=plans, comm_steps=comms,
                dominant_step=0, round_latency_s=1.0, throughput_sps=256.0, epoch=epoch)


FIG9 = [(["A"], 0, 3), (["B", "C"], 3, 6), (["D"], 6, 9)]
# Different sizes per unit so that a wrong unit in a sum shows.
UNIT_BYTES = [(u + 1) * MIB for u in range(9)]


def owners(plan: Plan) -> dict[int, set[str]]:
    return {u: set(s.devices) for s in plan.stages for u in range(s.start, s.end)}


def check_invariants(old: Plan, new: Plan, failed: set[str], backups: dict[str, str],
                     transfers: list[UnitTransfer], unit_bytes: list[int] = UNIT_BYTES) -> None:
    """Nobody is sent what it already has, failed devices take no part, the output is sorted by (unit, dst)
    with one transfer per (unit, dst), and every owner in ``new`` ends with state of each of its units:
    held live before, received, or restored locally from a backup it holds."""
    old_own, new_own = owners(old), owners(new)
    keys = [(t.unit, t.dst) for t in transfers]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    for t in transfers:
        assert t.src not in failed and t.dst not in failed and t.src != t.dst
        assert t.dst in new_own[t.unit]
        assert t.dst not in old_own[t.unit] - failed, f"unit {t.unit} sent to {t.dst}, which already holds it"
        assert t.nbytes == unit_bytes[t.unit]
    restored = {(r.unit, r.dst) for r in local_restores(old, new, failed, backups, unit_bytes)}
    assert not restored & set(keys)
    for u, devs in new_own.items():
        for d in devs:
            assert d in old_own[u] - failed or (u, d) in set(keys) | restored, f"{d} never gets unit {u}"


# --- AC-18: replication map ------------------------------------------------------------------------------


def test_fig9_backup_map() -> None:
    """AC-18: in [A] -> [B, C] -> [D], A backs up into {B, C}, D (last) backs up to A, B and C have none."""
    backups = backup_map(make_plan(FIG9))
    assert set(backups) == {"A", "D"}
    assert backups["A"] in {"B", "C"} and backups["D"] == "A"
    # The target with the most free memory wins: C has 3 GiB free against B's 1 GiB.
    assert backup_map(make_plan(FIG9, used={"B": 3 * GIB}))["A"] == "C"
    assert backup_map(make_plan(FIG9, used={"C": 3 * GIB}))["A"] == "B"
    # Live free-memory readings override the plan's prediction; missing nodes fall back to it.
    assert backup_map(make_plan(FIG9, used={"C": 3 * GIB}), {"C": 8 * GIB})["A"] == "C"
    assert backup_map(make_plan(FIG9), {"B": 5 * GIB})["A"] == "B"


def test_backup_map_edge_cases() -> None:
    assert backup_map(make_plan([(["A"], 0, 9)])) == {}  # one device: nowhere to replicate
    assert backup_map(make_plan([(["A", "B"], 0, 9)])) == {}  # one stage, replicas restore each other
    assert backup_map(make_plan([(["A", "B"], 0, 4), (["C", "D"], 4, 9)])) == {}  # all multi-device
    assert backup_map(make_plan([(["A"], 0, 4), (["B"], 4, 9)])) == {"A": "B", "B": "A"}
    ring = backup_map(make_plan([(["A"], 0, 3), (["B"], 3, 6), (["C"], 6, 9)]))
    assert ring == {"A": "B", "B": "C", "C": "A"}
    for src, dst in ring.items():
        assert src != dst
    # [A] -> [B] -> [C, D]: A -> B; B -> the roomier of C and D (name on a tie); C, D need none.
    tail = [(["A"], 0, 3), (["B"], 3, 6), (["C", "D"], 6, 9)]
    assert backup_map(make_plan(tail)) == {"A": "B", "B": "C"}
    assert backup_map(make_plan(tail, budget={"D": 6 * GIB})) == {"A": "B", "B": "D"}


def test_backup_map_refuses_a_device_listed_twice() -> None:
    with pytest.raises(MigrationError, match="lists device A twice"):
        backup_map(make_plan([(["A"], 0, 4), (["A"], 4, 9)]))


# --- AC-19: migration ------------------------------------------------------------------------------------


def test_fig9_recovery_after_d_fails() -> None:
    """AC-19: D fails, [A: 0-3] -> [B, C: 3-6] -> [D: 6-9] becomes [A: 0-4] -> [B, C: 4-9]."""
    old = make_plan(FIG9)
    new = make_plan([(["A"], 0, 4), (["B", "C"], 4, 9)], epoch=1)
    backups = backup_map(old)
    holders = unit_holders(old, {"D"}, backups)
    assert holders[3] == [("B", None), ("C", None)] and holders[7] == [("A", "D")] and holders[0] == [("A", None)]

    transfers = plan_migration(old, new, frozenset({"D"}), backups, UNIT_BYTES)
    check_invariants(old, new, {"D"}, backups, transfers)
    # Unit 3 moves from {B, C} to A (own state); D's units 6-8 go to B and C from A's backup of D.
    assert [(t.unit, t.dst) for t in transfers] == [(3, "A"), (6, "B"), (6, "C"), (7, "B"), (7, "C"), (8, "B"),
                                                    (8, "C")]
    first = transfers[0]
    assert first.src in {"B", "C"} and first.from_backup_of is None
    assert all(t.src == "A" and t.from_backup_of == "D" for t in transfers[1:])
    # Units 0-2 stay on A, 4-5 stay on B and C: nothing is sent for them.
    assert not {t.unit for t in transfers} & {0, 1, 2, 4, 5}
    # Bytes: each moved unit once per receiving device.
    assert moved_bytes(transfers) == UNIT_BYTES[3] + 2 * (UNIT_BYTES[6] + UNIT_BYTES[7] + UNIT_BYTES[8])
    assert links_of(transfers) == {(first.src, "A"): UNIT_BYTES[3],
                                   ("A", "B"): UNIT_BYTES[6] + UNIT_BYTES[7] + UNIT_BYTES[8],
                                   ("A", "C"): UNIT_BYTES[6] + UNIT_BYTES[7] + UNIT_BYTES[8]}
    assert local_restores(old, new, {"D"}, backups, UNIT_BYTES) == []


def test_losing_a_replica_moves_nothing_or_only_boundary_units() -> None:
    old = make_plan(FIG9)
    backups = backup_map(old)
    same_cuts = make_plan([(["A"], 0, 3), (["B"], 3, 6), (["D"], 6, 9)])
    assert plan_migration(old, same_cuts, {"C"}, backups, UNIT_BYTES) == []
    moved = make_plan([(["A"], 0, 2), (["B"], 2, 7), (["D"], 7, 9)])
    transfers = plan_migration(old, moved, {"C"}, backups, UNIT_BYTES)
    check_invariants(old, moved, {"C"}, backups, transfers)
    assert [(t.unit, t.src, t.dst, t.from_backup_of) for t in transfers] == [(2, "A", "B", None),
                                                                            (6, "D", "B", None)]
    assert links_of(transfers) == {("A", "B"): UNIT_BYTES[2], ("D", "B"): UNIT_BYTES[6]}


def test_pure_recut_without_failure() -> None:
    old = make_plan(FIG9)
    new = make_plan([(["A"], 0, 4), (["B", "C"], 4, 7), (["D"], 7, 9)])
    transfers = plan_migration(old, new, set(), backup_map(old), UNIT_BYTES)
    check_invariants(old, new, set(), backup_map(old), transfers)
    assert [(t.unit, t.dst) for t in transfers] == [(3, "A"), (6, "B"), (6, "C")]
    assert transfers[1].src == transfers[2].src == "D"


def test_join_receives_its_stage_from_the_holders() -> None:
    """A new device E joins the last stage: it gets all of that stage's units from D, the only holder."""
    old = make_plan(FIG9)
    new = make_plan([(["A"], 0, 3), (["B", "C"], 3, 6), (["D", "E"], 6, 9)], epoch=1)
    transfers = plan_migration(old, new, set(), backup_map(old), UNIT_BYTES)
    check_invariants(old, new, set(), backup_map(old), transfers)
    assert [(t.unit, t.src, t.dst, t.from_backup_of) for t in transfers] == [
        (6, "D", "E", None), (7, "D", "E", None), (8, "D", "E", None)]
    assert links_of(transfers) == {("D", "E"): sum(UNIT_BYTES[6:9])}


def test_balancing_spreads_a_group_over_its_holders() -> None:
    """Four equal units from [B, C] to a newcomer E: two from B and two from C, on two concurrent links."""
    old = make_plan([(["A"], 0, 2), (["B", "C"], 2, 6)])
    new = make_plan([(["A"], 0, 2), (["B", "C", "E"], 2, 6)])
    equal = [10 * MIB] * 6
    transfers = plan_migration(old, new, set(), backup_map(old), equal)
    assert [t.unit for t in transfers] == [2, 3, 4, 5] and {t.dst for t in transfers} == {"E"}
    assert links_of(transfers) == {("B", "E"): 20 * MIB, ("C", "E"): 20 * MIB}
    assert [t.src for t in transfers] == ["B", "C", "B", "C"]  # deterministic tie-break by name
    # Unequal sizes: the big unit's holder is spared the next ones.
    sizes = [MIB, MIB, 30 * MIB, 10 * MIB, 10 * MIB, 10 * MIB]
    uneven = plan_migration(old, new, set(), backup_map(old), sizes)
    assert links_of(uneven) == {("B", "E"): 30 * MIB, ("C", "E"): 30 * MIB}


def test_tie_prefers_a_holder_next_to_the_destination() -> None:
    """Equal queues: a holder in the destination's new stage or a neighbouring one beats a far one, even
    when the far one sorts first by name; between two near holders the name decides."""
    old = make_plan([(["F", "N"], 0, 2), (["B"], 2, 4), (["C"], 4, 6), (["D"], 6, 8)])
    # F moves to the last stage (far from stage 0), N stays; newcomer E joins stage 0 and needs units 0-1.
    new = make_plan([(["E", "N"], 0, 2), (["B"], 2, 4), (["C"], 4, 6), (["F"], 6, 8)])
    transfers = plan_migration(old, new, set(), backup_map(old), [MIB] * 8)
    # Unit 0: F and N both queued 0, N is near, so N despite the name; unit 1: N is busier, so F.
    assert [(t.unit, t.src) for t in transfers if t.dst == "E"] == [(0, "N"), (1, "F")]
    old2 = make_plan([(["Y", "A"], 0, 2), (["B"], 2, 8)])
    # D needs unit 0; holders A (next stage) and Y (D's stage) are both near: the name decides (A).
    new2 = make_plan([(["Y", "D"], 0, 1), (["A"], 1, 2), (["B"], 2, 8)])
    assert [(t.unit, t.src, t.dst) for t in plan_migration(old2, new2, set(), {}, [MIB] * 8)][0] == (0, "A", "D")
    # With A two stages away from D, Y wins.
    new3 = make_plan([(["Y", "D"], 0, 1), (["B"], 1, 2), (["A"], 2, 8)])
    t3 = [t for t in plan_migration(old2, new3, set(), {}, [MIB] * 8) if t.unit == 0]
    assert [(t.src, t.dst) for t in t3] == [("Y", "D")]


def test_middle_stage_failure_restores_locally_from_the_backup() -> None:
    """[A] -> [B] -> [C], B fails; B's backup is on C. Units of B that land on C are a local restore."""
    old = make_plan([(["A"], 0, 3), (["B"], 3, 6), (["C"], 6, 9)])
    backups = backup_map(old)
    assert backups == {"A": "B", "B": "C", "C": "A"}
    new = make_plan([(["A"], 0, 5), (["C"], 5, 9)], epoch=1)
    transfers = plan_migration(old, new, {"B"}, backups, UNIT_BYTES)
    check_invariants(old, new, {"B"}, backups, transfers)
    assert [(t.unit, t.src, t.dst, t.from_backup_of) for t in transfers] == [(3, "C", "A", "B"),
                                                                            (4, "C", "A", "B")]
    restores = local_restores(old, new, {"B"}, backups, UNIT_BYTES)
    assert [(t.unit, t.src, t.dst, t.from_backup_of) for t in restores] == [(5, "C", "C", "B")]
    assert moved_bytes(restores) == 0 and links_of(restores) == {}
    assert moved_bytes(transfers + restores) == UNIT_BYTES[3] + UNIT_BYTES[4]


def test_graceful_leave_hands_over_its_own_units() -> None:
    """A LEAVE is not a failure: the leaving device is still a holder, so it sends its units itself."""
    old = make_plan(FIG9)
    new = make_plan([(["A"], 0, 4), (["B", "C"], 4, 9)])
    transfers = plan_migration(old, new, set(), backup_map(old), UNIT_BYTES)
    assert [(t.unit, t.src, t.from_backup_of) for t in transfers if t.unit >= 6] == [
        (6, "D", None), (6, "D", None), (7, "D", None), (7, "D", None), (8, "D", None), (8, "D", None)]


def test_unrecoverable_losses_name_units_and_devices() -> None:
    old = make_plan([(["A"], 0, 3), (["B"], 3, 6), (["C"], 6, 9)])
    backups = backup_map(old)
    # B and its backup holder C both fail: B's units are lost (C's own units survive on A's backup of C).
    with pytest.raises(UnrecoverableError, match=r"units 3-5 of stage 1 \(B\).*backup holder C failed") as err:
        unit_holders(old, {"B", "C"}, backups)
    assert err.value.units == [3, 4, 5] and err.value.devices == ["B"]
    assert isinstance(err.value, PlanningError)
    new = make_plan([(["A"], 0, 9)])
    with pytest.raises(UnrecoverableError, match="external checkpoint"):
        plan_migration(old, new, {"B", "C"}, backups, UNIT_BYTES)
    # No backup at all.
    with pytest.raises(UnrecoverableError, match="D had no backup"):
        unit_holders(make_plan(FIG9), {"D"}, {})
    # A whole multi-device stage fails at once (spec 5.3: that case needs external checkpoints).
    with pytest.raises(UnrecoverableError) as both:
        unit_holders(make_plan(FIG9), {"B", "C"}, backup_map(make_plan(FIG9)))
    assert both.value.units == [3, 4, 5] and both.value.devices == ["B", "C"]


def test_invalid_migrations_are_refused() -> None:
    old = make_plan(FIG9)
    backups = backup_map(old)
    with pytest.raises(MigrationError, match="9 units and the new one 8"):
        plan_migration(old, make_plan([(["A"], 0, 4), (["B", "C"], 4, 8)]), {"D"}, backups, UNIT_BYTES)
    with pytest.raises(MigrationError, match="still contains failed device"):
        plan_migration(old, old, {"D"}, backups, UNIT_BYTES)
    with pytest.raises(MigrationError, match="unit_bytes needs 9"):
        plan_migration(old, old, set(), backups, UNIT_BYTES[:-1])
    with pytest.raises(MigrationError, match="lists device B twice"):
        plan_migration(old, make_plan([(["A", "B"], 0, 4), (["B", "C"], 4, 9)]), {"D"}, backups, UNIT_BYTES)
    with pytest.raises(ValueError, match="its own live state"):
        UnitTransfer(unit=0, src="A", dst="A", nbytes=1)


def test_light_replan_result_migrates() -> None:
    """Fig. 9 on a synthetic cluster: light_replan after D fails, then the migration of its result."""
    from edgeswarm.planning.hpp.assemble import assemble_plan
    from edgeswarm.planning.hpp.costmodel import CostModel
    from edgeswarm.planning.hpp.replan import light_replan
    from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
    from edgeswarm.values.profiles import OPTIMIZER_STATE_FACTOR

    devs = [SyntheticDevice("A", 1.0, 6 * GIB), SyntheticDevice("B", 2.0, 5 * GIB),
            SyntheticDevice("C", 2.0, 5 * GIB), SyntheticDevice("D", 1.0, 4 * GIB)]
    cluster = synthetic_cluster(30, devs, bandwidth_bps=125e6)
    options = PlanOptions(micro_batch_size=32, micro_batches=8, optimizer="momentum")
    old = assemble_plan(CostModel(cluster, options), [(0, 10, (0,)), (10, 20, (1, 2)), (20, 30, (3,))], "hpp")
    new = light_replan(old, cluster, "D")
    backups = backup_map(old)
    assert backups["D"] == "A" and backups["A"] in {"B", "C"}
    state = [u.weight_bytes * (1 + OPTIMIZER_STATE_FACTOR[options.optimizer]) for u in cluster.model.units]
    transfers = plan_migration(old, new, {"D"}, backups, state)
    old_own, new_own = owners(old), owners(new)
    expected = sum(state[u] * len(new_own[u] - (old_own[u] - {"D"})) for u in range(30))
    assert moved_bytes(transfers) == expected > 0
    # D's units all come from A's backup; everything else from live owners; D takes no part.
    for t in transfers:
        assert "D" not in (t.src, t.dst)
        assert (t.from_backup_of == "D") == (t.unit >= 20)
        assert t.src == "A" if t.unit >= 20 else t.src in old_own[t.unit]
    # [A] -> [B, C]: D's units end on both B and C, each sent once to each.
    assert all(new_own[u] == {"B", "C"} for u in range(20, 30))
    assert sorted((t.unit, t.dst) for t in transfers if t.unit >= 20) == [
        (u, d) for u in range(20, 30) for d in ("B", "C")]


@pytest.mark.parametrize("layout", [
    [(0, 10, (0,)), (10, 20, (1, 2)), (20, 30, (3,))],
    [(0, 8, (0,)), (8, 16, (1,)), (16, 23, (2,)), (23, 30, (3,))],
    [(0, 15, (0, 1)), (15, 30, (2, 3))],
])
def test_every_light_replan_failure_migrates(layout: list[tuple[int, int, tuple[int, ...]]]) -> None:
    """Drop each device in turn (AC-20 style): the migration plus local restores give every new owner its
    units, moving exactly the bytes of (unit, new owner) pairs that held no live state."""
    from edgeswarm.planning.hpp.assemble import assemble_plan
    from edgeswarm.planning.hpp.costmodel import CostModel
    from edgeswarm.planning.hpp.replan import light_replan
    from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster

    devs = [SyntheticDevice(name, slow, 6 * GIB) for name, slow in zip("ABCD", (1.0, 2.0, 2.0, 1.0), strict=True)]
    cluster = synthetic_cluster(30, devs, bandwidth_bps=125e6)
    old = assemble_plan(CostModel(cluster, PlanOptions(micro_batch_size=32, micro_batches=8)), layout, "hpp")
    backups = backup_map(old)
    state = [u.weight_bytes for u in cluster.model.units]
    for failed in old.devices:
        new = light_replan(old, cluster, failed)
        transfers = plan_migration(old, new, {failed}, backups, state)
        check_invariants(old, new, {failed}, backups, transfers, state)
        restores = local_restores(old, new, {failed}, backups, state)
        old_own, new_own = owners(old), owners(new)
        missing = sum(state[u] * len(new_own[u] - (old_own[u] - {failed})) for u in range(30))
        assert moved_bytes(transfers) + sum(r.nbytes for r in restores) == missing
