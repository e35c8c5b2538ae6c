"""A serve-pipeline plan's prediction under load (planning.serve.load), against a discrete-event simulation of the
same chain of servers: Poisson arrivals (open loop) and a client keeping requests outstanding (closed loop)."""

from __future__ import annotations

import heapq
import random

import pytest

from edgeswarm.planning.serve.load import at_measured_load, at_offered_load, at_outstanding
from edgeswarm.planning.serve.types import ServePlan, ServeStagePlan

MICRO_BATCH = 4


def _plan(stages: list[tuple[float, float]]) -> ServePlan:
    """A plan of (transfer in, compute) seconds per stage, one unit each."""
    servers = [t for s in stages for t in s]
    return ServePlan(
        model_fingerprint="m", micro_batch_size=MICRO_BATCH, method="test", units=len(stages),
        stages=[ServeStagePlan(index=i, start=i, end=i + 1, device=f"d{i}", compute_s=c, transfer_in_s=t,
                               input_bytes=0, memory_bytes=0, memory_budget_bytes=0)
                for i, (t, c) in enumerate(stages)],
        bottleneck_s=max(servers), throughput_per_s=MICRO_BATCH / max(servers), latency_s=sum(servers))


PLAN = _plan([(0.0, 0.010), (0.004, 0.020), (0.002, 0.008)])  # bottleneck: stage 1's 20 ms


def _chain(plan: ServePlan) -> list[float]:
    return [t for s in plan.stages for t in (s.transfer_in_s, s.compute_s) if t > 0]


def _open_loop(plan: ServePlan, items_per_s: float, count: int, seed: int) -> float:
    """Mean seconds from arrival to answer of ``count`` Poisson arrivals through the chain (FIFO servers)."""
    rng = random.Random(seed)
    free = [0.0] * len(_chain(plan))
    t, total = 0.0, 0.0
    for _ in range(count):
        t += rng.expovariate(items_per_s)
        done = t
        for k, service in enumerate(_chain(plan)):
            done = max(done, free[k]) + service
            free[k] = done
        total += done - t
    return total / count


def _closed_loop(plan: ServePlan, outstanding: int, window: int, count: int) -> tuple[float, float]:
    """Items a second and mean latency when a client keeps ``outstanding`` requests in flight (it sends the next
    when one is answered) and ``window`` of them may be in the pipeline (the rest wait at the coordinator)."""
    chain = _chain(plan)
    free = [0.0] * len(chain)
    inside: list[float] = []  # answer times of the requests in the pipeline
    answers: list[float] = []  # in order: a chain of FIFO servers answers in arrival order
    latencies = []
    for i in range(count):
        arrived = 0.0 if i < outstanding else answers[i - outstanding]
        while inside and inside[0] <= arrived:
            heapq.heappop(inside)
        start = arrived if len(inside) < window else heapq.heappop(inside)
        done = start
        for k, service in enumerate(chain):
            done = max(done, free[k]) + service
            free[k] = done
        heapq.heappush(inside, done)
        answers.append(done)
        latencies.append(done - arrived)
    half = count // 2  # steady state only
    rate = (count - 1 - half) / (answers[-1] - answers[half])
    return rate, sum(latencies[half:]) / (count - half)


def test_a_light_load_takes_the_unloaded_latency_and_is_served_whole() -> None:
    light = at_offered_load(PLAN, 0.001)
    assert light.throughput_per_s == 0.001 and light.latency_s == pytest.approx(PLAN.latency_s, rel=1e-4)
    assert not light.saturated


def test_at_or_above_capacity_the_plan_is_saturated_and_serves_its_capacity() -> None:
    for offered in (PLAN.throughput_per_s, 2 * PLAN.throughput_per_s):
        over = at_offered_load(PLAN, offered)
        assert over.saturated and over.latency_s is None
        assert over.throughput_per_s == PLAN.throughput_per_s and over.utilisation == 1.0
    with pytest.raises(ValueError, match="positive"):
        at_offered_load(PLAN, 0.0)


@pytest.mark.parametrize("utilisation", [0.3, 0.6, 0.85])
def test_the_open_loop_latency_bounds_a_simulation_of_the_same_chain_from_above_and_closely(utilisation: float) -> None:
    items_per_s = utilisation / PLAN.bottleneck_s
    predicted = at_offered_load(PLAN, items_per_s * MICRO_BATCH)
    simulated = _open_loop(PLAN, items_per_s, 40_000, seed=1)
    assert predicted.utilisation == pytest.approx(utilisation)
    assert predicted.latency_s is not None
    # The first queue is M/D/1 exactly; behind it arrivals are smoother, so the sum errs on the safe side.
    assert 0.85 * predicted.latency_s <= simulated <= 1.03 * predicted.latency_s, (simulated, predicted)


@pytest.mark.parametrize(("outstanding", "window"), [(1, 1), (2, 8), (16, 8), (40, 8), (3, 2)])
def test_the_closed_loop_prediction_is_what_a_simulated_client_with_requests_outstanding_gets(
        outstanding: int, window: int) -> None:
    predicted = at_outstanding(PLAN, outstanding, window)
    rate, latency = _closed_loop(PLAN, outstanding, window, 4_000)
    assert predicted.throughput_per_s == pytest.approx(rate * MICRO_BATCH, rel=0.02)
    assert predicted.latency_s == pytest.approx(latency, rel=0.02)
    with pytest.raises(ValueError):
        at_outstanding(PLAN, 0, window)


def test_a_running_job_s_load_is_open_below_capacity_and_closed_at_it() -> None:
    """What a running job predicts at the load it measures: below capacity the arrivals' queueing, whatever it holds;
    at capacity the requests it holds as a closed loop (at least one)."""
    below = PLAN.throughput_per_s / 2
    assert at_measured_load(PLAN, below, 30, 8) == at_offered_load(PLAN, below)
    at = PLAN.throughput_per_s * 1.5
    assert at_measured_load(PLAN, at, 16, 8) == at_outstanding(PLAN, 16, 8)
    assert at_measured_load(PLAN, at, 0, 8) == at_outstanding(PLAN, 1, 8)
