"""serve-hmp's side of the closed loop (planning.refit holds the fit and the rebalancer every kind shares): what a plan
predicts for each rank's own arithmetic in a prefill pass (``rank_compute_s``, the fit's denominator: the workers
report their measured ``compute_s`` with every result), the cluster with each device's block times scaled by its
fitted speed (``scaled_cluster``) and a running plan priced on it with its shares kept (``reprice``).

A rank's arithmetic in a pass is its MHA block at its heads, its MLP block at its columns and two connective blocks at
its rows (galaxy and sp: its slice of the rows; megatron and local: all of them; sp computes every head and column on
its slice, a slice of the rows paying each GEMM's one-row cost), per layer, its embeddings (sp: of its slice), and the
lm_head of the last row on the rank that answers for it (or its share of the vocabulary, where the head is split).
Galaxy's tiled GEMMs cost their tiles' calls (``latency.gemm_s``). The profile is of ``seq_len`` rows; a pass of other
length is priced in proportion (the deadline does the same), which the fit's median forgives for the prompts of a few
lengths a job sees.
"""

from __future__ import annotations

from edgeswarm.planning.hmp.algorithm import equal_split
from edgeswarm.planning.hmp.latency import con_s, mha_s, mlp_s, rank_embed_s, sp_blocks_s, tp_gemms_s
from edgeswarm.planning.hmp.plan import memory_problem, priced_plan
from edgeswarm.planning.hmp.types import BlockProfile, HmpCluster, HmpOptions, HmpPlan


def rank_compute_s(cluster: HmpCluster, plan: HmpPlan, tokens: int, *, logits: bool = True) -> dict[str, float]:
    """Each device of ``plan``: seconds of its own arithmetic in a prefill pass of ``tokens`` tokens, with its last
    row's logits or (a request generating no token) without, as ``cluster``'s block profiles price it. Raises
    KeyError when a device of the plan has no profile in ``cluster``."""
    cfg, s = cluster.model, cluster.seq_len
    by_node = {p.node: p for p in cluster.devices}
    devices = plan.devices
    d = len(devices)
    rows = equal_split(s, d)
    out: dict[str, float] = {}
    if not (logits and cfg.decoder):
        head = [0.0] * d
    elif plan.shares.splits_head:  # each rank its share of the vocabulary (``hmp.layer``)
        head = [(b - a) / cfg.vocab for a, b in plan.shares.vocab_bounds(cfg.vocab)]
    else:  # the rank holding the last row, all of it
        head = [1.0 if r == min(s, d) - 1 else 0.0 for r in range(d)]
    for r, node in enumerate(devices):
        p = by_node[node]
        heads, columns = plan.shares.heads[r], plan.shares.columns[r]
        if plan.mode == "sp":
            layer = sum(sp_blocks_s(cfg, p, s, rows[r])) + 2 * con_s(p, rows[r])
        elif plan.mode == "galaxy":
            layer = mha_s(p, heads) + mlp_s(p, columns) + 2 * con_s(p, rows[r])
            if plan.shares.overlap:  # each GEMM a call per row tile, each call reading the whole weight
                layer += sum(sum(tp_gemms_s(cfg, p, heads, columns, s, m)) for m in rows) \
                    - sum(tp_gemms_s(cfg, p, heads, columns, s, s))
        else:  # megatron and local: every rank runs the connective blocks on all rows
            layer = mha_s(p, heads) + mlp_s(p, columns) + 2 * con_s(p, s)
        out[node] = cfg.layers * layer + head[r] * p.head_s + rank_embed_s(plan.mode, p, rows[r], s)
    scale = tokens / s
    return {node: seconds * scale for node, seconds in out.items()}


def _scaled_profile(p: BlockProfile, f: float) -> BlockProfile:
    return p.model_copy(update={
        "mha_s": [t * f for t in p.mha_s], "mlp_s": [t * f for t in p.mlp_s], "con_s": [t * f for t in p.con_s],
        "mha_decode_s": [t * f for t in p.mha_decode_s], "mlp_decode_s": [t * f for t in p.mlp_decode_s],
        "mha_phases_s": [t * f for t in p.mha_phases_s], "mha_decode_phases_s": [t * f for t in p.mha_decode_phases_s],
        "head_s": p.head_s * f, "embed_s": p.embed_s * f})


def scaled_cluster(cluster: HmpCluster, scales: dict[str, float]) -> HmpCluster:
    """``cluster`` with every block time of each device multiplied by its scale (``scales`` keyed by node; 1 where
    none): the refitted profile the planner searches."""
    return cluster.model_copy(update={"devices": [
        _scaled_profile(p, scales[p.node]) if scales.get(p.node, 1.0) != 1.0 else p for p in cluster.devices]})


def reprice(plan: HmpPlan, cluster: HmpCluster, options: HmpOptions) -> HmpPlan:
    """``plan`` (its mode, devices, heads and columns, tiled or not) priced on ``cluster``: what the running plan
    takes if its devices compute as ``cluster`` says. Raises KeyError when a device of the plan has no profile in
    ``cluster``."""
    by_node = {p.node: p for p in cluster.devices}
    profiles = [by_node[node] for node in plan.devices]
    problem = memory_problem(cluster.model, cluster.seq_len, profiles, options)
    return priced_plan(cluster, plan.shares.mode, profiles, list(plan.shares.heads), list(plan.shares.columns),
                       problem, options, list(plan.left_out), overlap=plan.shares.overlap,
                       ).model_copy(update={"epoch": plan.epoch})
