"""What a serve-hmp job plans on: every device's block latencies for its model (from the tensor-shard-workers) and
the links between the devices (from the profilers, which measure them for every kind)."""

from __future__ import annotations

from edgeswarm.bus import Bus
from edgeswarm.coordination.fanout import fan_out
from edgeswarm.errors import JobError
from edgeswarm.hmp.spec import HmpSpec
from edgeswarm.messages.hmp import ShardProfileReply, ShardProfileRequest
from edgeswarm.planning.hmp.types import BlockProfile, HmpCluster
from edgeswarm.profiling.gather import profile_cluster
from edgeswarm.values.profiles import ClusterProfile, ModelSpec
from edgeswarm.values.text_model import TextModelConfig

# The profilers measure links while they profile a model; this one costs nothing to profile.
LINK_PROBE_MODEL = ModelSpec(name="mlp", config={"image_size": 4, "hidden": 8, "layers": 1})


def profile_shards(bus: Bus, spec: HmpSpec, nodes: list[str], service: str, *, timeout_s: float
                   ) -> tuple[ClusterProfile, dict[str, BlockProfile]]:
    """The links and memory budgets of ``nodes`` (a ClusterProfile from their profilers) and each node's block
    profile of ``spec``'s model at ``spec.seq_len`` tokens (from its ``service``). Raises JobError naming every node
    that did not answer, and why."""
    cluster = profile_cluster(bus, LINK_PROBE_MODEL, [1], nodes=nodes, timeout_s=timeout_s)
    request = ShardProfileRequest(model=spec.model, seq_len=spec.seq_len)
    fan = fan_out(bus, {n: request for n in nodes}, service, timeout_s=timeout_s)
    profiles = {n: r.profile for n, r in fan.replies.items() if isinstance(r, ShardProfileReply)}
    problems = [f"{n}: {getattr(r, 'detail', r)}" for n, r in [*fan.failures.items(), *fan.replies.items()]
                if n not in profiles]
    if problems:
        raise JobError(f"job {spec.name}: measuring {spec.model.name}'s blocks failed on " + "; ".join(problems))
    return cluster, profiles


def hmp_cluster(spec: HmpSpec, cfg: TextModelConfig, cluster: ClusterProfile,
                profiles: dict[str, BlockProfile]) -> HmpCluster:
    """The planner's input for ``cluster``'s devices: their block profiles, each with the memory budget the cluster
    profile gives it (the room beside the other jobs on the node when it was narrowed to that), and the links."""
    budgets = {d.device.node: d.device.memory_budget_bytes for d in cluster.devices}
    devices = [profiles[d.device.node].model_copy(update={"memory_budget_bytes": budgets[d.device.node]})
               for d in cluster.devices if d.device.node in profiles]
    return HmpCluster(model=cfg, model_name=spec.model.name, seq_len=spec.seq_len, devices=devices,
                      links=cluster.links)
