"""The coordinator's closed loop on real stage-workers: a job planned on a profile that is wrong about one device
(it computes 3x slower than profiled) refits that device's speed from its measured rounds and re-plans itself at a
snapshot round, moving only the units whose owner changes; training goes on as if nothing happened (the final
weights equal those of the same rounds trained without a re-plan). What it measured is saved, so the next job on
the same devices starts from the measured speeds. Likewise a link five times slower than profiled is fitted from how
its tensors arrive, and the job re-plans off it; that too is saved for the next job."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from edgeswarm.bus import Bus
from edgeswarm.values.profiles import ClusterProfile, DeviceInfo, DeviceProfileEntry, LinkProfile, ModelSpec
from helpers import assert_same_weights, reference_weights, stored_weights
from test_recovery import GLOBAL_BATCH, NODES, _job, train

# Wide enough that computing, not the runtime's per-call overheads, is most of a micro-batch's time: the profile
# then prices the devices right, but for the one it is wrong about.
MODEL = ModelSpec(name="mlp", config={"in_channels": 3, "image_size": 32, "hidden": 768, "layers": 3, "seed": 3})
SLOWDOWN = 10.0
ROUNDS = 12  # the loop needs 3 rounds on a plan and 3 checks in a row: room for a loaded machine's noisy rounds


def profiled(batch_sizes: list[int]) -> ClusterProfile:
    """The four devices as one profile of this machine, SLOWDOWN times slower, says they are: right about b, c and
    d up to a common factor (what the runtime adds around a unit's compute; the loop fits that too), wrong about
    a."""
    from edgeswarm.profiling.compute import profile_model, torch_threads

    # Each unit's fastest of three profiles: a busy machine (the suite's other tests) slows a one-off profile unit by
    # unit, by more than the 3x this test is about; its fastest runs are the ones it did not slow.
    with torch_threads(1):
        runs = [profile_model(MODEL, batch_sizes, repeats=3, warmup=1) for _ in range(3)]
    model, compute = runs[0]

    def fastest(rows: str) -> list[list[float]]:
        tables = [getattr(c, rows) for _, c in runs]
        return [[SLOWDOWN * min(t[u][k] for t in tables) for k in range(len(tables[0][u]))]
                for u in range(len(tables[0]))]

    compute = compute.model_copy(update={"forward_s": fastest("forward_s"), "backward_s": fastest("backward_s")})
    entries = [DeviceProfileEntry(device=DeviceInfo(node=n, fingerprint=n, memory_budget_bytes=2**30), compute=compute)
               for n in NODES]
    links = [LinkProfile(src=x, dst=y, bandwidth_bps=12.5e6) for i, x in enumerate(NODES) for y in NODES[i + 1:]]
    return ClusterProfile(model=model, devices=entries, links=links)


def start_workers(broker, make_bus, services, store_dir: Path, profiles: Path,  # type: ignore[no-untyped-def]
                  env: Callable[[str], dict[str, str]]) -> Bus:
    """A checkpoint store and a stage-worker on each of NODES (with ``env(node)``), and a client that re-balances
    with its profile cache in ``profiles``, once every service is up."""
    services.start("checkpoint-store", "hub", broker.url, EDGESWARM_CHECKPOINT_DIR=str(store_dir))
    for node in NODES:
        services.start("stage-worker", node, broker.url, **env(node))
    client = make_bus("coordinator-test", "cli", hub_url=broker.url, rebalance=True, profile_dir=profiles)
    for node in NODES:
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    client.peers.wait_for("hub", "checkpoint-store", timeout_s=30)
    return client


def test_a_device_slower_than_its_profile_is_refitted_and_the_job_replans_around_it(
        broker, make_bus, services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgeswarm.hpp import coordinator
    from edgeswarm.hpp.coordinator import HppCoordinator, JobObserver, profile_batch_sizes
    from edgeswarm.planning.hpp.compare import plan_best
    from edgeswarm.planning.hpp.refit import predicted_compute_s
    from edgeswarm.planning.refit import scaled
    from edgeswarm.profiling.cache import ProfileCache
    from edgeswarm.profiling.refits import saved_scales

    job = _job("rebalance", spec=MODEL, rounds=ROUNDS)
    cluster = profiled(profile_batch_sizes(job))  # before the services start, which would slow it
    store_dir, profiles = tmp_path / "checkpoints", tmp_path / "profiles"
    # "a" computes 3x slower than the others, which its profile does not say.
    client = start_workers(broker, make_bus, services, store_dir, profiles,
                           lambda node: {"EDGESWARM_COMPUTE_SLOWDOWN": str(SLOWDOWN * (3 if node == "a" else 1))})
    plan = plan_best("hpp", cluster, GLOBAL_BATCH, micro_batches=4, optimizer="momentum")
    events: list[str] = []

    refits: list[str] = []

    class Observer(JobObserver):
        def rebalanced(self, report, detail: str) -> None:
            events.append(detail)

        def refitted(self, detail: str) -> None:
            refits.append(detail)

    result = train(client, job, plan, cluster, Observer(), rounds=ROUNDS)
    # A busy machine skews a one-off profile from unit to unit, which one scale per device cannot fit: the loop may
    # move again (at most four times an hour); the first move is the one the slow device calls for.
    assert result.recoveries and len(events) == len(result.recoveries), (result.recoveries, events)
    assert all(r.mode == "rebalance" and not r.failed for r in result.recoveries), result.recoveries
    report = result.recoveries[0]
    assert "a " in events[0] and "faster" in events[0], events
    # The new plan is the best one on the measured speeds: it gives a less of every micro-batch's compute (as the
    # profile prices it) than the plan it replaces.
    new = report.plan
    assert new.epoch == plan.epoch + 1
    before, after = predicted_compute_s(plan, cluster), predicted_compute_s(new, cluster)
    assert after.get("a", 0.0) < before["a"], (plan.stages, new.stages)
    # Every round ran once and the state moved intact: the weights are those of training without a re-plan.
    assert [r.round for r in result.rounds] == list(range(ROUNDS))
    weights = stored_weights(store_dir, job.name, len(result.plan.stages), optimizer=True)
    assert_same_weights(weights, reference_weights(_job("ref", spec=MODEL, rounds=ROUNDS), ROUNDS, optimizer=True))


    # The speeds it measured are saved (measured over profiled) for the devices it fitted, as its last refit event
    # says. (What the scales are is not asserted: under load this test's one-off profile is itself skewed from unit
    # to unit, and a device with a small share measures mostly the runtime's per-call costs.)
    saved = saved_scales(ProfileCache(profiles), cluster, "train")
    assert refits and refits[-1].startswith("saved the measured speeds for the next job: "), refits
    listed = dict(part.rsplit(" ", 1) for part in refits[-1].split(": ", 1)[1].split(" (")[0].split(", "))
    assert saved and set(saved) == set(listed), (saved, refits)
    assert all(abs(saved[n] - float(listed[n].rstrip("x"))) <= 0.0051 for n in saved), (saved, refits)
    # The next job's coordinator plans on that: the devices profile as before (the same fingerprints), and it scales
    # each profile by what was saved, and says so.
    monkeypatch.setattr(coordinator, "profile_cluster", lambda *args, **kwargs: cluster)
    nxt_job = HppCoordinator(client, _job("next", spec=MODEL, rounds=1), loss_terms=GLOBAL_BATCH, total=1,
                             store_node=None, observer=Observer())
    assert nxt_job.profile(list(NODES)) == scaled(cluster, saved)
    assert refits[-1].startswith("starts from the speeds earlier jobs measured: "), refits


def test_each_device_reports_how_its_peers_tensors_of_several_chunks_arrived(broker, make_bus, services) -> None:
    """What the closed loop fits a link from: a round's report says, per peer, the bytes after each tensor's first
    chunk, those chunks and the seconds they took, for the activations and gradients that peer sent it."""
    from edgeswarm.hpp.driver import JobDriver
    from test_recovery import M, _cluster_and_plan

    chunk = 1024  # the smallest chunk: this test's tensors of a few KiB travel as several
    for node in NODES:
        services.start("stage-worker", node, broker.url, EDGESWARM_CHUNK_BYTES=str(chunk))
    client = make_bus("coordinator-test", "cli", hub_url=broker.url)
    for node in NODES:
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    cluster, plan = _cluster_and_plan()  # a | b, c | d
    driver = JobDriver(client, _job("arrivals", rounds=1), plan, loss_terms=GLOBAL_BATCH, timeout_s=60)
    driver.deploy()
    report = driver.run_round(0)
    cut = plan.stages[0].end
    row_bytes = cluster.model.units[cut - 1].output_bytes_per_sample
    for node, rows in zip(plan.stages[1].devices, plan.stages[1].shares, strict=True):
        size = rows * row_bytes  # one micro-batch's activation from a to this device, and its gradient back
        expected = (M * (size - chunk), M * (-(-size // chunk) - 1))
        got = {s.src: s for s in report.devices[node].arrivals}
        assert (got["a"].bytes, got["a"].chunks) == expected, (node, got)
        back = {s.src: s for s in report.devices["a"].arrivals}[node]
        assert (back.bytes, back.chunks) == expected, (node, report.devices["a"].arrivals)
        assert got["a"].seconds > 0 and back.seconds > 0
    # The group's AllReduce slices count too: b and c, one ring, each got the other's.
    b, c = plan.stages[1].devices
    assert {s.src: s for s in report.devices[b].arrivals}[c].bytes > 0, report.devices[b].arrivals
    assert {s.src: s for s in report.devices[c].arrivals}[b].bytes > 0, report.devices[c].arrivals


# Alone: another test's load beside it once had the loop measure a device at 1.81x and two healthy links at
# 1.45x-1.94x their profile, and re-plan on those before it had fitted the slow link (a clean-clone run).
@pytest.mark.alone
def test_a_link_slower_than_its_profile_is_refitted_and_the_job_replans_around_it(
        broker, make_bus, services, tmp_path: Path) -> None:
    """The profile prices every link at 12.5 MB/s, and the workers' links carry that, but for one pair of
    neighbouring stages' devices whose link carries a fifth of it (or less, where the profile makes links cheap): the
    loop fits that link from how its tensors arrive and re-plans off it."""
    import json
    import re

    from edgeswarm.hpp.coordinator import JobObserver, profile_batch_sizes
    from edgeswarm.planning.hpp.compare import plan_best
    from edgeswarm.planning.hpp.refit import reprice
    from edgeswarm.planning.refit import link_key, link_nodes, scaled
    from edgeswarm.profiling.cache import ProfileCache
    from edgeswarm.profiling.refits import saved_scales

    job = _job("slow-link", spec=MODEL, rounds=ROUNDS)
    cluster = profiled(profile_batch_sizes(job))
    plan = plan_best("hpp", cluster, GLOBAL_BATCH, micro_batches=4, optimizer="momentum")
    # The link to make slow: of the pairs the plan's cut tensors cross, the one the right profile gains most from
    # re-planning around (the plan depends on this machine's profile, so the pair is chosen here).
    cuts = zip(plan.stages, plan.stages[1:], strict=False)
    pairs = {link_key(x, y) for s, t in cuts for x in s.devices for y in t.devices}

    def gain(key: str, factor: float) -> float:
        truth = scaled(cluster, {key: factor})
        best = plan_best("hpp", truth, GLOBAL_BATCH, micro_batches=4, optimizer="momentum")
        return 1.0 - reprice(best, truth).round_latency_s / reprice(plan, truth).round_latency_s

    # Five times slower gains 28-40% on an idle machine's profile; a profile measured under load prices compute
    # higher and so the links lower (2% once in CI), and then it takes a slower link to make re-planning pay.
    for factor in (5.0, 10.0, 20.0):
        gains = {key: gain(key, factor) for key in sorted(pairs)}  # each a planner search: once per pair
        slow = max(gains, key=gains.__getitem__)
        if gains[slow] > 0.25:  # well beyond the loop's 15% margin
            break
    assert gains[slow] > 0.25, (plan.stages, slow, factor, gains)
    pair = link_nodes(slow)
    assert pair is not None
    a, b = pair
    chunk = 16 * 1024  # the cut tensors (about 100 KB) travel as several chunks: what a link is fitted from

    def env(node: str) -> dict[str, str]:
        links = {peer: {"bandwidth_bps": 12.5e6 / factor if {node, peer} == {a, b} else 12.5e6, "latency_s": 0.0}
                 for peer in NODES if peer != node}
        return {"EDGESWARM_COMPUTE_SLOWDOWN": str(SLOWDOWN), "EDGESWARM_CHUNK_BYTES": str(chunk),
                "EDGESWARM_LINKS": json.dumps(links)}

    client = start_workers(broker, make_bus, services, tmp_path / "checkpoints", tmp_path / "p", env)
    events: list[str] = []

    class Observer(JobObserver):
        def rebalanced(self, report, detail: str) -> None:
            events.append(detail)

    result = train(client, job, plan, cluster, Observer(), rounds=ROUNDS)
    assert result.recoveries and all(r.mode == "rebalance" for r in result.recoveries), (result.recoveries, events)
    # The first move names the slow link among what moved, fitted about ``factor`` times slower than profiled (more,
    # with the per-chunk costs the profile leaves out), and the plan it moves to is faster on the true links.
    fitted = re.search(rf"{slow} ([0-9.]+)x", events[0])
    assert fitted is not None and float(fitted.group(1)) > 0.7 * factor, (slow, factor, events)
    truth = scaled(cluster, {slow: factor})
    new = result.recoveries[0].plan
    assert reprice(new, truth).round_latency_s < 0.85 * reprice(plan, truth).round_latency_s, (plan.stages,
                                                                                               new.stages)
    assert [r.round for r in result.rounds] == list(range(ROUNDS))
    # What it measured of the link is saved, so the next job over these devices prices it so from the start.
    assert saved_scales(ProfileCache(tmp_path / "p"), cluster, "train").get(slow, 1.0) > 0.7 * factor


def test_a_plans_first_round_is_not_fitted(make_bus) -> None:  # type: ignore[no-untyped-def]
    """A plan's first round is its stages' first (allocators grow, threads start): its compute, whatever it is, does
    not enter the fit, and the rounds after it do. A re-plan's first round is left out the same way."""
    from types import SimpleNamespace

    from edgeswarm.hpp.coordinator import HppCoordinator, JobObserver
    from edgeswarm.hpp.driver import RoundReport
    from edgeswarm.messages.training import RoundDone
    from edgeswarm.planning.hpp.compare import plan_best
    from edgeswarm.planning.hpp.refit import predicted_compute_s
    from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster

    cluster = synthetic_cluster(12, [SyntheticDevice("a", 1.0, 4 << 30), SyntheticDevice("b", 2.0, 4 << 30)])
    plan = plan_best("dp", cluster, 16, micro_batches=2)
    coordinator = HppCoordinator(make_bus("fit-coordinator", "coordinator"), _job("fit", spec=MODEL, rounds=9),
                                 loss_terms=16, total=9, store_node=None, observer=JobObserver())
    coordinator.cluster = cluster
    coordinator.driver = SimpleNamespace(plan=plan)  # type: ignore[assignment]
    predicted = predicted_compute_s(plan, cluster)

    def round_(index: int, slower: float) -> RoundReport:
        # Every device computes ``slower`` times what the profile prices for its share of each micro-batch.
        done = {node: RoundDone(job_id="fit", epoch=plan.epoch, round=index, stage=0, rank=rank, compute_s=1.0,
                                wait_s=0.0, allreduce_s=0.0, peak_live=1, forward_s=[slower * predicted[node] / 2] * 2,
                                backward_s=[slower * predicted[node] / 2] * 2)
                for rank, node in enumerate(plan.stages[0].devices)}
        return RoundReport(round=index, loss=1.0, accuracy=0.0, round_s=1.0, devices=done)

    coordinator._refit(round_(0, 3.0))
    assert coordinator.fit.rounds() == {}
    coordinator._refit(round_(1, 1.5))
    coordinator._refit(round_(2, 1.5))
    assert set(coordinator.fit.rounds().values()) == {2}
    assert all(abs(s - 1.5) < 1e-9 for s in coordinator.fit.scales().values()), coordinator.fit.scales()
    coordinator.driver = SimpleNamespace(plan=plan.model_copy(update={"epoch": plan.epoch + 1}))  # type: ignore
    coordinator._refit(round_(3, 3.0))
    assert set(coordinator.fit.rounds().values()) == {2}
