"""What a serve-pipeline plan delivers under load: its throughput and a request's latency when clients offer a
rate (open loop) or keep a number of requests outstanding (closed loop), from the plan's own stage times.

A plan prices each stage's forward and each link's transfer of one micro-batch, and they overlap (a stage computes
one item while the link carries the next), so the pipeline is a chain of servers: the link into stage 1, stage 1,
the link into stage 2, ... Its capacity is one micro-batch per bottleneck time; an unloaded request takes the
sum of the times (``ServePlan.latency_s``). A request is one micro-batch.

* Open loop, ``offered_per_s`` samples a second arriving at random (Poisson): each server is taken as an M/D/1
  queue (deterministic service, the plan's time), waiting rho t / (2 (1 - rho)) on average, where rho is its
  utilisation. For the first server that is exact; behind it arrivals are smoother than Poisson, so the sum is
  on the safe side. At or above capacity the queue grows without bound: the plan is *saturated* and serves its
  capacity.
* Closed loop, ``outstanding`` requests kept in flight (a client that sends the next when one is answered, as
  ``edgeswarm infer`` streams with its window), of which the coordinator lets ``window`` into the pipeline and
  queues the rest: throughput is min(in pipeline / unloaded latency, capacity) and, by Little's law, a request's
  latency is outstanding / throughput.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.planning.serve.types import ServePlan


class LoadPrediction(BaseModel):
    """A plan's prediction at one load. ``throughput_per_s`` samples served a second; ``latency_s`` seconds from a
    request's arrival at the coordinator to its answer, None when saturated (it grows without bound);
    ``utilisation`` of the bottleneck, 0 to 1."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    throughput_per_s: float = Field(ge=0)
    latency_s: float | None = Field(default=None, ge=0)
    utilisation: float = Field(ge=0, le=1)

    @property
    def saturated(self) -> bool:
        return self.latency_s is None


def _servers_s(plan: ServePlan) -> list[float]:
    """Seconds of one micro-batch on each server of the chain: each link into a stage, then the stage."""
    return [t for s in plan.stages for t in (s.transfer_in_s, s.compute_s) if t > 0]


def at_offered_load(plan: ServePlan, offered_per_s: float) -> LoadPrediction:
    """``plan`` with ``offered_per_s`` samples a second (> 0) arriving at random, in micro-batches of its size."""
    if not offered_per_s > 0 or not math.isfinite(offered_per_s):
        raise ValueError(f"an offered load is a positive number of samples a second, not {offered_per_s}")
    items_per_s = offered_per_s / plan.micro_batch_size
    utilisation = items_per_s * plan.bottleneck_s
    if utilisation >= 1.0:
        return LoadPrediction(throughput_per_s=plan.throughput_per_s, latency_s=None, utilisation=1.0)
    waits = 0.0
    for t in _servers_s(plan):
        rho = items_per_s * t
        waits += rho * t / (2.0 * (1.0 - rho))
    return LoadPrediction(throughput_per_s=offered_per_s, latency_s=plan.latency_s + waits, utilisation=utilisation)


def at_outstanding(plan: ServePlan, outstanding: int, window: int) -> LoadPrediction:
    """``plan`` with ``outstanding`` requests (>= 1) always in flight, at most ``window`` (>= 1) of them in the
    pipeline and the rest queued at the coordinator."""
    if outstanding < 1 or window < 1:
        raise ValueError(f"outstanding ({outstanding}) and window ({window}) are at least 1")
    inside = min(outstanding, window)
    unloaded = max(plan.latency_s, plan.bottleneck_s)
    items_per_s = min(inside / unloaded, 1.0 / plan.bottleneck_s)
    return LoadPrediction(throughput_per_s=items_per_s * plan.micro_batch_size, latency_s=outstanding / items_per_s,
                          utilisation=min(1.0, items_per_s * plan.bottleneck_s))


def at_measured_load(plan: ServePlan, offered_per_s: float, outstanding: int, window: int) -> LoadPrediction:
    """What ``plan`` predicts at the load a running job measures: ``offered_per_s`` samples a second arriving (> 0)
    and ``outstanding`` requests at the coordinator (in the pipeline or queued). Below capacity, the open loop's
    prediction; at or above it, the clients keeping it busy are taken as a closed loop of ``outstanding`` requests
    (at least one), ``window`` of them in the pipeline."""
    load = at_offered_load(plan, offered_per_s)
    return at_outstanding(plan, max(1, outstanding), window) if load.saturated else load
