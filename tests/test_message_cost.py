"""The planners count a fixed cost per message and per request (LinkProfile.message_s, request_s): pure, no broker."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgeswarm.planning.hpp.assemble import assemble_plan
from edgeswarm.planning.hpp.asteroid import plan_asteroid
from edgeswarm.planning.hpp.baselines import plan_dp, plan_pp
from edgeswarm.planning.hpp.costmodel import CostModel, allreduce_s
from edgeswarm.planning.hpp.oracle import exhaustive_search
from edgeswarm.planning.hpp.types import PlanOptions
from edgeswarm.planning.serve.costs import serve_costs
from edgeswarm.planning.serve.plan import Candidate, plan_serving, price, to_plan
from edgeswarm.planning.serve.types import ServeOptions
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
from edgeswarm.planning.vocabulary import MESSAGE_BYTES, message_counts, message_matrix, messages, request_seconds
from edgeswarm.profiling.gather import symmetric_links
from edgeswarm.values.profiles import ClusterProfile, LinkProfile

GIB = 2**30
MESSAGE_S = 0.004
REQUEST_S = 0.009
OPTIONS = PlanOptions(micro_batch_size=8, micro_batches=4)


def cluster(units: int = 6, devices: int = 4) -> ClusterProfile:
    return synthetic_cluster(units, [SyntheticDevice(f"d{i}", 1.0 + i / 2, 4 * GIB) for i in range(devices)],
                             step_s=1e-4)


def with_costs(profile: ClusterProfile, message_s: float = MESSAGE_S, request_s: float = REQUEST_S) -> ClusterProfile:
    links = [link.model_copy(update={"message_s": message_s, "request_s": request_s}) for link in profile.links]
    return profile.model_copy(update={"links": links})


def test_old_links_validate_and_price_as_before() -> None:
    old = LinkProfile.model_validate({"src": "a", "dst": "b", "bandwidth_bps": 1e6, "latency_s": 0.002})
    assert old.message_s == 0 and old.request_s == 0
    base = cluster()
    zero = with_costs(base, 0.0, 0.0)
    for planner in (plan_asteroid, plan_dp, plan_pp):
        assert planner(zero, OPTIONS) == planner(base, OPTIONS)


def test_message_counts_follow_the_chunking() -> None:
    assert messages(0) == 1 and messages(100) == 1 and messages(MESSAGE_BYTES) == 1
    assert messages(MESSAGE_BYTES + 1) == 2 and messages(5 * MESSAGE_BYTES) == 5
    assert message_counts(np.array([0, MESSAGE_BYTES, 3 * MESSAGE_BYTES + 1])).tolist() == [1.0, 1.0, 4.0]


def test_ring_allreduce_pays_one_message_per_step() -> None:
    w, g, bw = 1000.0, 3, 1e6
    assert allreduce_s(w, g, bw, MESSAGE_S) == pytest.approx(allreduce_s(w, g, bw) + 2 * (g - 1) * MESSAGE_S)
    assert allreduce_s(w, 1, bw, MESSAGE_S) == 0.0  # no group, no messages


def test_data_parallel_stage_counts_its_allreduce_messages() -> None:
    base, costly = plan_dp(cluster(), OPTIONS), plan_dp(with_costs(cluster()), OPTIONS)
    g = len(base.stages[0].devices)
    weights = CostModel(cluster(), OPTIONS).weight_bytes(0, base.units)
    steps = 2 * (g - 1) * messages(weights / g)
    assert costly.stages[0].allreduce_s == pytest.approx(base.stages[0].allreduce_s + steps * MESSAGE_S)
    # A RoundStart to each of the g devices and its answer, one after another.
    assert costly.round_overhead_s == pytest.approx(g * REQUEST_S)
    assert costly.round_latency_s == pytest.approx(base.round_latency_s + steps * MESSAGE_S + g * REQUEST_S)


def test_pipeline_comm_steps_count_their_messages_and_the_round_its_request() -> None:
    base, costly = plan_pp(cluster(), OPTIONS), plan_pp(with_costs(cluster()), OPTIONS)
    assert [s.devices for s in costly.stages] == [s.devices for s in base.stages]
    assert base.round_overhead_s == 0.0
    for old, new in zip(base.comm_steps, costly.comm_steps, strict=True):
        # One sender, one receiver: one message per micro-batch each way (plus any further 1 MiB chunk).
        assert new.messages == messages(new.bytes_per_microbatch)
        assert new.forward_s == pytest.approx(old.forward_s + new.messages * MESSAGE_S)
        assert new.backward_s == pytest.approx(old.backward_s + new.messages * MESSAGE_S)
    assert costly.round_overhead_s == pytest.approx(len(costly.devices) * REQUEST_S)
    assert costly.round_latency_s > base.round_latency_s + costly.round_overhead_s
    assert math.isclose(costly.throughput_sps, OPTIONS.global_batch / costly.round_latency_s)


def test_the_dp_search_and_the_exhaustive_oracle_price_messages_alike() -> None:
    profile = with_costs(cluster(units=5, devices=4), message_s=0.02)
    plan = plan_asteroid(profile, OPTIONS)
    _, best = exhaustive_search(CostModel(profile, OPTIONS))
    assert plan.round_latency_s == pytest.approx(best, rel=1e-9)


def test_a_costly_message_moves_the_plan_to_fewer_messages() -> None:
    # With messages far dearer than compute, the free-message plan's layout (priced with the dear messages) is worse
    # than what the planner picks once it counts them.
    profile = cluster(units=6, devices=4)
    dear_profile = with_costs(profile, message_s=0.05, request_s=0.0)
    free = plan_asteroid(profile, OPTIONS)
    dear = plan_asteroid(dear_profile, OPTIONS)
    cm = CostModel(dear_profile, OPTIONS)
    index = {d.node: i for i, d in enumerate(cm.devices)}
    layout = [(s.start, s.end, tuple(index[n] for n in s.devices)) for s in free.stages]
    repriced = assemble_plan(cm, layout, "hpp")
    assert dear.round_latency_s < repriced.round_latency_s
    assert [(s.start, s.end, s.devices) for s in dear.stages] != [(s.start, s.end, s.devices) for s in free.stages]


def test_serving_counts_a_message_per_micro_batch_at_every_boundary() -> None:
    profile = cluster(units=6, devices=3)
    layout = Candidate(((0, 2), (2, 4), (4, 6)), (0, 1, 2), "optimal")
    base = to_plan(serve_costs(profile, 4), price(serve_costs(profile, 4), layout))
    costs = serve_costs(with_costs(profile), 4)
    costly = to_plan(costs, price(costs, layout))
    for old, new in zip(base.stages[1:], costly.stages[1:], strict=True):
        assert new.transfer_in_s == pytest.approx(old.transfer_in_s + messages(new.input_bytes) * MESSAGE_S)
    assert costly.latency_s == pytest.approx(base.latency_s + 2 * MESSAGE_S)
    assert costly.bottleneck_s >= base.bottleneck_s
    # The exact search prices links the same way: with dear messages it keeps the model on fewer devices.
    dear = with_costs(profile, message_s=10.0)
    assert len(plan_serving(dear, ServeOptions(method="optimal", micro_batch_size=4)).stages) == 1


def test_message_costs_are_symmetric_and_gathered_from_the_quieter_direction() -> None:
    links = [LinkProfile(src="a", dst="b", bandwidth_bps=1e6, latency_s=0.01, message_s=0.005, request_s=0.003),
             LinkProfile(src="b", dst="a", bandwidth_bps=2e6, latency_s=0.02, message_s=0.040, request_s=0.002)]
    message = message_matrix(links, ["a", "b"])
    assert message[0, 1] == message[1, 0] == 0.040 and message[0, 0] == 0.0
    assert request_seconds(links, ["a", "b", "c"]).tolist() == [0.003, 0.002, 0.0]
    both = symmetric_links(links)
    assert [(lk.src, lk.dst) for lk in both] == [("a", "b"), ("b", "a")]
    for lk in both:
        assert (lk.bandwidth_bps, lk.latency_s, lk.message_s) == (1e6, 0.01, 0.005)
    # Each direction keeps its source's own request round trip; one measured way only serves both.
    assert [lk.request_s for lk in both] == [0.003, 0.002]
    assert [lk.request_s for lk in symmetric_links(links[:1])] == [0.003, 0.003]


def test_one_slow_link_does_not_set_the_round_overhead() -> None:
    # Each device's request round trip is the median over the links it measured: one timed while the host was busy
    # (0.1 s here) does not stand for the device.
    base = cluster(devices=4)
    links = [LinkProfile(src=a, dst=b, bandwidth_bps=12.5e6, message_s=0.0,
                         request_s=0.1 if (a, b) == ("d0", "d1") else 0.002)
             for a in ("d0", "d1", "d2", "d3") for b in ("d0", "d1", "d2", "d3") if a != b]
    plan = plan_dp(base.model_copy(update={"links": links}), OPTIONS)
    assert plan.round_overhead_s == pytest.approx(4 * 0.002)
