"""Plans of every parallelism over an HmpCluster: Galaxy's Algorithm 1 (with devices left out when they do not
pay), the Megatron-TP, SP and Local baselines on the same memory and latency model, and their comparison."""

from __future__ import annotations

from collections.abc import Sequence

from edgeswarm.errors import ProfileError
from edgeswarm.planning.hmp.algorithm import MemoryProblem, algorithm1, check_memory, equal_shares, equal_split
from edgeswarm.planning.hmp.latency import (
    Prediction,
    capacity,
    check_profiles,
    control_s,
    embeddings_s,
    logits_s,
    mesh_links,
    predict,
)
from edgeswarm.planning.hmp.shares import HmpShares, splits_head
from edgeswarm.planning.hmp.types import (
    BlockProfile,
    HmpCluster,
    HmpComparison,
    HmpMode,
    HmpOptions,
    HmpPlan,
    HmpPlanError,
    HmpVerdict,
)
from edgeswarm.values.text_model import TextModelConfig

MODES: tuple[HmpMode, ...] = ("galaxy", "megatron", "sp", "local")
# A device kept by pruning, or by ``auto`` choosing among the modes, must be predicted to save more than this fraction
# of a request. Two plans predicted within a few percent are a tie inside the model's error, and the model prices the
# larger one's ranks waiting for each other at the syncs lower than they measure (two mixed Nanos, 2026-12-01: the split
# 1.06x its prediction, the Nano-L alone 0.96x; predicted 1% apart, the Nano-L alone measured 9% faster).
PRUNE_MARGIN = 0.05


def reserved_bytes(cfg: TextModelConfig, seq_len: int) -> float:
    """R_d: what every device holds whatever its share (spec A8), in bytes: the embeddings (and an untied LM
    head), every norm, and the live activations of one layer (input, output and the widest intermediate,
    ~3 s max(h, f), plus the attention scores of every head, s^2 n_h)."""
    h, beta = cfg.hidden, cfg.dtype_bytes
    embed = cfg.tensor_bytes("embed.tokens", cfg.vocab * h)
    embed += ((cfg.max_positions + cfg.position_offset) * h * (cfg.family != "llama")
              + (cfg.type_vocab * h if cfg.family == "bert" else 0)) * beta
    head = cfg.tensor_bytes("lm_head.weight", cfg.vocab * h) if cfg.decoder and not cfg.tie_embeddings else 0.0
    norms = (cfg.layers * 2 + 1) * 2 * h
    acts = 3 * seq_len * max(h, cfg.ffn) + seq_len * seq_len * cfg.heads
    return float(embed + head + (norms + acts) * beta)


def kv_bytes_per_head(cfg: TextModelConfig, tokens: int) -> float:
    """The KV cache one query head brings over all layers for ``tokens`` tokens (its 1/group of a KV head)."""
    return cfg.layers * 2.0 * cfg.head_dim * tokens * cfg.dtype_bytes / cfg.group


def memory_problem(cfg: TextModelConfig, seq_len: int, profiles: Sequence[BlockProfile],
                   options: HmpOptions) -> MemoryProblem:
    """Algorithm 1's numbers for ``profiles``: the weights' footprints from the config, and unless
    ``options.paper`` the reserved bytes and the KV cache of ``max_tokens``."""
    return MemoryProblem(
        capacity=[capacity(p, cfg) for p in profiles],
        budget=[float(p.memory_budget_bytes) for p in profiles],
        layers=cfg.layers, heads=cfg.heads, columns=cfg.ffn, group=cfg.group,
        att_bytes=cfg.attention_bytes(), mlp_bytes=cfg.mlp_bytes(), column_granule=cfg.column_granule,
        head_extra=0.0 if options.paper else kv_bytes_per_head(cfg, options.max_tokens),
        reserved=None if options.paper else [reserved_bytes(cfg, seq_len)] * len(profiles),
        margin=float(options.margin_bytes))


def priced_plan(cluster: HmpCluster, mode: HmpMode, profiles: Sequence[BlockProfile], heads: list[int],
                columns: list[int], problem: MemoryProblem, options: HmpOptions, left_out: list[str], *,
                overlap: bool | None = None) -> HmpPlan:
    """The plan of ``mode`` over ``profiles`` (ring order, a subset of ``cluster``'s) with these head and column
    shares, and its prediction; ``problem`` is ``memory_problem`` over the same profiles. Galaxy's collectives are
    tiled with their GEMMs as ``overlap`` says, or where None, when ``options.overlap`` allows it and the model
    predicts the tiles faster (on short prompts a tile's GEMM costs nearly the whole GEMM's weight read)."""
    cfg = cluster.model

    def priced(tiled: bool) -> Prediction:
        return predict(cfg, cluster.seq_len, mode, profiles, heads, columns, cluster.links, overlap=tiled,
                       decode_cache=options.decode_cache, direct_syncs=options.direct_syncs)

    tiled = bool(overlap) and mode == "galaxy"
    pred = priced(tiled)
    if overlap is None and mode == "galaxy" and options.overlap and len(profiles) > 1:
        other = priced(True)
        if other.layer.total_s < pred.layer.total_s:
            pred, tiled = other, True
    totals = {k: getattr(pred.layer, k) * cfg.layers for k in ("total_s", "compute_s", "comm_s", "exposed_s")}
    embed = embeddings_s(mode, profiles, cluster.seq_len)
    totals["total_s"] += embed
    totals["compute_s"] += embed
    # The request's admission and its pass, each a round trip with the coordinator. On the local cluster (2026-12-02)
    # a request took 12-15 ms beyond its slowest rank's pass: 5.5 ms admitting it, 4-7 ms sending the pass and
    # collecting the results, the rest the coordinator's own work, which no profile measures.
    control = 2 * control_s(cluster.links, [p.node for p in profiles])
    for key in ("total_s", "comm_s", "exposed_s"):
        totals[key] += control
    # A decoder's logits of the prompt's last row, once a pass (split over the ranks where the shares split it).
    split = cfg.decoder and splits_head(mode, len(profiles), options.direct_syncs)
    mesh = mesh_links(cluster.links, [p.node for p in profiles]) if split else []
    head, head_net = logits_s(cfg, mode, profiles, columns, mesh, cluster.seq_len, options.direct_syncs)
    totals["total_s"] += head + head_net
    totals["compute_s"] += head
    totals["comm_s"] += head_net
    totals["exposed_s"] += head_net
    return HmpPlan(
        model_name=cluster.model_name, seq_len=cluster.seq_len,
        shares=HmpShares(mode=mode, devices=[p.node for p in profiles], heads=heads, columns=columns,
                         overlap=tiled, direct_syncs=options.direct_syncs),
        rows=equal_split(cluster.seq_len, len(profiles)) if mode in ("galaxy", "sp") else
        [cluster.seq_len] * len(profiles),
        capacity=list(problem.capacity),
        memory_bytes=[int(problem.memory(d, heads[d], columns[d])) for d in range(len(profiles))],
        memory_budget_bytes=[p.memory_budget_bytes for p in profiles],
        layer=pred.layer, model=pred.layer.model_copy(update=totals), comm=pred.comm, decode=pred.decode,
        logits_s=head + head_net, shift=options.shift, paper=options.paper, left_out=left_out)


def prefill_s(plan: HmpPlan, new_tokens: int) -> float:
    """The predicted seconds of the prefill of a request of ``new_tokens`` generated tokens on ``plan``: with its
    logits, which answer the first token, where it generates any."""
    return plan.model.total_s - (plan.logits_s if new_tokens <= 0 else 0.0)


def request_s(plan: HmpPlan, new_tokens: int) -> float:
    """A request of ``new_tokens`` generated tokens' predicted seconds on ``plan``: its prompt's prefill
    (``prefill_s``), then ``new_tokens`` - 1 decode steps at the plan's per-token prediction (an encoder's plan has
    none: its prefill)."""
    per_token = plan.decode.per_token_s if plan.decode is not None else 0.0
    return prefill_s(plan, new_tokens) + max(0, new_tokens - 1) * per_token


def _usable(cluster: HmpCluster, options: HmpOptions) -> list[BlockProfile]:
    unknown = sorted(set(options.exclude) - {p.node for p in cluster.devices})
    if unknown:
        raise ProfileError(f"cannot exclude {unknown}: no such devices (have {[p.node for p in cluster.devices]})")
    kept = [p for p in cluster.devices if p.node not in options.exclude]
    if not kept:
        raise HmpPlanError("every device is excluded: keep at least one")
    check_profiles(cluster.model, cluster.seq_len, kept)
    return kept


def _left_out(cluster: HmpCluster, used: Sequence[BlockProfile]) -> list[str]:
    names = {p.node for p in used}
    return [p.node for p in cluster.devices if p.node not in names]


def plan_galaxy(cluster: HmpCluster, options: HmpOptions) -> HmpPlan:
    """Galaxy's plan (Algorithm 1, spec 3.5-3.7). With ``options.prune``, also the plans without the slowest
    device, without the two slowest, ... and the one on the fewest devices whose predicted request time
    (``request_s``) is within PRUNE_MARGIN of the lowest wins (a device whose compute does not pay for its
    communication is left out). Raises HmpPlanError when nothing fits."""
    kept = _usable(cluster, options)
    cfg = cluster.model
    full = memory_problem(cfg, cluster.seq_len, kept, options)
    by_speed = sorted(range(len(kept)), key=lambda i: (-full.capacity[i], i))
    sizes = range(len(kept), 0, -1) if options.prune else [len(kept)]
    plans: list[HmpPlan] = []  # on fewer devices each
    first_error: HmpPlanError | None = None
    for n in sizes:
        chosen = sorted(by_speed[:n])  # keep the ring order of the cluster
        subset = [kept[i] for i in chosen]
        problem = memory_problem(cfg, cluster.seq_len, subset, options)
        try:
            heads, columns = algorithm1(problem, options.shift)
        except HmpPlanError as exc:
            first_error = first_error or exc
            break  # fewer devices hold less: no smaller subset fits either
        left = _left_out(cluster, subset)
        plans.append(priced_plan(cluster, "galaxy", subset, heads, columns, problem, options, left))
    if not plans:
        assert first_error is not None
        raise first_error
    return fewest_devices_within_margin(plans, options.new_tokens)


def fewest_devices_within_margin(plans: Sequence[HmpPlan], new_tokens: int) -> HmpPlan:
    """Of ``plans`` (at least one), the one on the fewest devices whose predicted request of ``new_tokens`` tokens
    (``request_s``) is within PRUNE_MARGIN of the lowest; among those on as few devices, the lowest. A device more
    must pay for itself by more than the model's error: inside it, the plan with less communication is the safer."""
    lowest = min(request_s(plan, new_tokens) for plan in plans)
    near = [plan for plan in plans if request_s(plan, new_tokens) <= lowest * (1 + PRUNE_MARGIN)]
    return min(near, key=lambda plan: (len(plan.devices), request_s(plan, new_tokens)))


def plan_megatron(cluster: HmpCluster, options: HmpOptions) -> HmpPlan:
    """Megatron-TP: equal heads (whole KV groups) and columns on every usable device; raises HmpPlanError
    naming the device over budget."""
    kept = _usable(cluster, options)
    problem = memory_problem(cluster.model, cluster.seq_len, kept, options)
    heads, columns = equal_shares(problem, len(kept))
    why = check_memory(problem, heads, columns, "Megatron-TP's equal split")
    if why:
        raise HmpPlanError(why + ": use galaxy, which shifts work off it")
    left = _left_out(cluster, kept)
    return priced_plan(cluster, "megatron", kept, heads, columns, problem, options, left)


def plan_sp(cluster: HmpCluster, options: HmpOptions) -> HmpPlan:
    """Sequence parallelism: every weight on every usable device; raises HmpPlanError naming the device over
    budget."""
    kept = _usable(cluster, options)
    cfg = cluster.model
    problem = memory_problem(cfg, cluster.seq_len, kept, options)
    heads, columns = [cfg.heads] * len(kept), [cfg.ffn] * len(kept)
    why = check_memory(problem, heads, columns, "SP's full copy of the model")
    if why:
        raise HmpPlanError(why + ": use galaxy or megatron, which shard the weights")
    left = _left_out(cluster, kept)
    return priced_plan(cluster, "sp", kept, heads, columns, problem, options, left)


def plan_local(cluster: HmpCluster, options: HmpOptions) -> HmpPlan:
    """The whole model on the fastest usable device that holds it; raises HmpPlanError when none does."""
    kept = _usable(cluster, options)
    cfg = cluster.model
    problem = memory_problem(cfg, cluster.seq_len, kept, options)
    fits = [i for i in range(len(kept)) if problem.memory(i, cfg.heads, cfg.ffn) <= problem.limit(i) + 1e-6]
    if not fits:
        need = problem.memory(0, cfg.heads, cfg.ffn)
        most = max(problem.limit(i) for i in range(len(kept)))
        raise HmpPlanError(f"no single device holds the model: it needs {need / 1e9:.2f} GB, the largest budget is "
                           f"{most / 1e9:.2f} GB; split it (galaxy)")
    best = max(fits, key=lambda i: (problem.capacity[i], -i))
    one = kept[best]
    single = memory_problem(cfg, cluster.seq_len, [one], options)
    left = _left_out(cluster, [one])
    return priced_plan(cluster, "local", [one], [cfg.heads], [cfg.ffn], single, options, left)


PLANNERS = {"galaxy": plan_galaxy, "megatron": plan_megatron, "sp": plan_sp, "local": plan_local}


def compare(cluster: HmpCluster, options: HmpOptions) -> HmpComparison:
    """Every parallelism's plan or the reason it does not fit, on the same cluster, memory and latency model."""
    verdicts = []
    for mode in MODES:
        try:
            verdicts.append(HmpVerdict(mode=mode, plan=PLANNERS[mode](cluster, options)))
        except HmpPlanError as exc:
            verdicts.append(HmpVerdict(mode=mode, reason=str(exc)[:4096]))
    return HmpComparison(verdicts=verdicts)


def plan_hmp(cluster: HmpCluster, options: HmpOptions) -> HmpPlan:
    """The plan of ``options.mode``; ``auto``: of the parallelisms that fit, the one on the fewest devices predicted
    within PRUNE_MARGIN of the lowest request time (``fewest_devices_within_margin``). Raises HmpPlanError (an
    InfeasiblePlanError) with what to change when nothing fits, ProfileError when the profiles do not cover the
    request."""
    if options.mode != "auto":
        return PLANNERS[options.mode](cluster, options)
    found = [v.plan for v in compare(cluster, options).verdicts if v.plan is not None]
    if not found:
        return plan_galaxy(cluster, options)  # raises with Galaxy's reason, the most telling
    return fewest_devices_within_margin(found, options.new_tokens)
